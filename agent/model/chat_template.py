"""A model's chat template: its Jinja text (the GGUF's `tokenizer.chat_template`, tokenizer_config.json's,
or the one agent/model/templates/ ships), compiled and rendered as transformers' `apply_chat_template`
does, so that a prompt here is the prompt the model was trained on: the same sandbox (templates
from the Hub are untrusted code), globals (`raise_exception`, `strftime_now`, `namespace` without
underscore names) and `tojson` filter (not HTML-escaped, with indent / separators / sort_keys), and
the same variables (`messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens,
and the request's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime

import jinja2
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What the server sets itself: a request's chat_template_kwargs may not override them.
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplateError(Exception):
    """The template refused the conversation (its raise_exception, or a failure rendering it)."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore-prefixed names (CPython's internals), as transformers'."""

    def __init__(*args, **kwargs):  # Jinja's signature trick: `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template may not store {name!r} (underscore names) on a namespace")


class ChatTemplate:
    def __init__(self, text: str):
        self.text = text
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _Namespace
        self._template = env.from_string(text)

    def render(
        self,
        messages: list[dict],
        *,
        bos_token: str,
        eos_token: str,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        kwargs: Mapping[str, object] | None = None,
    ) -> str:
        """The prompt; `kwargs` (checked by the caller: none of RESERVED) are more variables."""
        try:
            return self._template.render(
                **(kwargs or {}),
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
            )
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            # A template's own failure on what a request sent (a kwarg of the wrong type, a role it
            # does not know) is that request's fault, not the server's.
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc
