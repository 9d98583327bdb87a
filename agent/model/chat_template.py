"""A model's chat template: its Jinja text (the GGUF's `tokenizer.chat_template`, tokenizer_config.json's,
or the one agent/model/templates/ ships), compiled and rendered as transformers' `apply_chat_template`
does, so that a prompt here is the prompt the model was trained on: the same sandbox (templates
from the Hub are untrusted code), globals (`raise_exception`, `strftime_now`, `namespace` without
underscore names) and `tojson` filter (not HTML-escaped, with indent / separators / sort_keys), and
the same variables (`messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens,
and the request's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import re
import string
import threading
from collections.abc import Callable, Iterator, Mapping, Sized
from dataclasses import dataclass
from datetime import datetime
from functools import wraps

import jinja2
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.nodes import Concat
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What the server sets itself: a request's chat_template_kwargs may not override them.
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplateError(Exception):
    """The template refused the conversation (its raise_exception, or a failure rendering it)."""


class RenderBudgetError(ChatTemplateError):
    """The template ran past its render budget (RenderBudget): its text, not the request, is at
    fault, unless `output` (the prompt it writes is longer than the budget allows)."""

    def __init__(self, message: str, output: bool = False):
        super().__init__(message)
        self.output = output


@dataclass(frozen=True)
class RenderBudget:
    """What one render may cost. The sandbox bounds each range() but not a render: a template from a
    model file could loop 100000 x 100000 times or build 'x' * 10**10 and freeze or exhaust the
    server at its first chat. chars (and twice the characters the request's own messages, tools and
    variables hold, which its prompt may carry) bounds the prompt written and every string or list
    the template builds on the way (each `*`, `+`, `**`, `%`, `~` and each filter or method call is checked
    before it runs where its size shows in its arguments, and after); seconds bounds the render's
    time (the rendering thread is interrupted)."""

    chars: int = 4_000_000
    seconds: float = 2.0


# The integers a template computes with, in bits (a product of two, a power).
MAX_INT_BITS = 4096
MAX_JSON_SPACING = 64  # tojson's indent and separators
# The calls whose integer arguments are sizes: a width, a padding, a count of pieces.
SIZING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
SIZING_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice", "lipsum"})
_NUMBERS = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


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


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's `a ~ b` through the environment's checked join (compiled as a plain join otherwise,
    which no sandbox hook sees: a template doubling a string 33 times holds 8 GB)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The transformers sandbox, with each operation that can build a large value checked against
    the render's budget before it runs (from the sizes its arguments show: a repeat count, a width,
    a replacement's growth) and after (its result); integers a template computes with are bounded
    in bits, since a product or quotient of huge ones runs in one C call the watchdog cannot stop."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, chars: int, **options):
        super().__init__(**options)
        self.default_chars = chars
        self._render = threading.local()  # this thread's render: its room (ChatTemplate.render)

    @property
    def chars(self) -> int:
        return getattr(self._render, "chars", self.default_chars)

    @contextlib.contextmanager
    def room(self, chars: int) -> Iterator[None]:
        """The budget of the values this thread's render builds: the template's own plus room for
        the request's text, which its prompt holds (a long prompt, as `truncate` allows, is no fault
        of the template)."""
        self._render.chars = chars
        try:
            yield
        finally:
            del self._render.chars

    def check_size(self, value: object) -> object:
        if isinstance(value, (str, bytes, list, tuple, dict)):
            self.check_count(len(value))
        return value

    def check_count(self, items: int) -> None:
        if items > self.chars:
            raise RenderBudgetError(f"it builds a value of {items} items, past the budget of {self.chars}")

    def check_widths(self, args: tuple, kwargs: dict) -> None:
        """The widths, counts and paddings a sizing call asks for (center, indent, ljust, zfill ...)."""
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > self.chars:
                raise RenderBudgetError(f"it asks for a size of {value}, past the budget of {self.chars}")

    def check_percent(self, text: str, args: object) -> None:
        """A %-format's widths and precisions ('%999999999s'; '%*s' takes its width from args)."""
        for width, precision in _PERCENT_SPEC.findall(text):
            if "*" in (width, precision):
                self.check_widths(args if isinstance(args, tuple) else (args,), {})
            elif any(len(n) > 9 or int(n) > self.chars for n in (width, precision) if n):
                raise RenderBudgetError(f"a format names a width past the budget of {self.chars}")

    def check_braces(self, text: str, args: tuple, kwargs: dict) -> None:
        """A str.format's widths ('{:999999999}'; '{0:{1}}' takes its width from the arguments)."""
        for _, _, spec, _ in string.Formatter().parse(text):
            if not spec:
                continue
            if "{" in spec:
                numbers = (
                    int(v) if isinstance(v, str) and v.isdigit() else v for v in (*args, *kwargs.values())
                )
                self.check_widths(tuple(numbers), {})
            elif any(len(n) > 9 or int(n) > self.chars for n in _NUMBERS.findall(spec)):
                raise RenderBudgetError(f"a format names a width past the budget of {self.chars}")

    def check_replace(self, text: str, args: tuple) -> None:
        """str.replace's result: one copy of `new` at each match (at every position for '')."""
        if len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            matches = len(text) + 1 if args[0] == "" else text.count(args[0])
            if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
                matches = min(matches, args[2])
            self.check_count(len(text) + matches * len(args[1]))

    def check_join(self, separator: str, items: object) -> None:
        if isinstance(items, Sized) and isinstance(separator, str):
            self.check_count(len(separator) * len(items))
            if isinstance(items, (list, tuple, str)):
                self.check_count(sum(len(item) if isinstance(item, str) else 1 for item in items))

    def call_binop(self, context, operator: str, left, right):
        if operator == "*" and isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise RenderBudgetError(f"it multiplies integers past {MAX_INT_BITS} bits")
        elif operator == "*" and (isinstance(left, int) or isinstance(right, int)):
            items, times = (right, left) if isinstance(left, int) else (left, right)
            if isinstance(items, (str, bytes, list, tuple)) and isinstance(times, int):
                self.check_count(len(items) * times)
        if operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
            if abs(left) > 1 and right > 0 and right * math.log2(abs(left)) > MAX_INT_BITS:
                raise RenderBudgetError(f"it raises {left} to the power {right}")
        if operator == "+" and isinstance(left, (str, bytes, list, tuple)) and isinstance(right, type(left)):
            self.check_count(len(left) + len(right))
        if operator == "%" and isinstance(left, str):
            self.check_percent(left, right)
        return self.check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
        if isinstance(owner, (str, bytes)):
            __self.check_method(owner, name, args, kwargs)
        return __self.check_size(super().call(__context, __obj, *args, **kwargs))

    def check_method(self, owner: str | bytes, name: str, args: tuple, kwargs: dict) -> None:
        """A string method's result, before it runs, where its arguments make it grow."""
        if name in SIZING_METHODS:
            self.check_widths(args, kwargs)
        if not isinstance(owner, str):
            return
        if name in ("format", "format_map"):
            self.check_braces(owner, args, kwargs)
        elif name == "replace":
            self.check_replace(owner, args)
        elif name == "join" and args:
            self.check_join(owner, args[0])
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            self.check_count(len(owner) + owner.count("\t") * (tab if isinstance(tab, int) else 8))
        elif name == "translate" and args and isinstance(args[0], dict):
            longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
            self.check_count(len(owner) * longest)

    def bounded_join(self, values: tuple) -> str:
        self.check_count(sum(len(v) if isinstance(v, str) else len(str(v)) for v in values))
        return jinja2.runtime.str_join(values)

    def bounded_concat(self, values) -> str:
        """A block's or macro's output joined (Jinja's `concat`), checked first."""
        pieces = list(values)
        self.check_count(sum(map(len, pieces)))
        return "".join(pieces)

    def bounded_filter(self, name: str, filter_: Callable) -> Callable:
        value_at = 1 if hasattr(filter_, "jinja_pass_arg") else 0  # after the environment or context

        @wraps(filter_)  # keeps jinja_pass_arg: Jinja still passes what the filter takes
        def checked(*args, **kwargs):
            value, rest = args[value_at], args[value_at + 1 :]
            self.check_filter(name, value, rest, kwargs)
            return self.check_size(filter_(*args, **kwargs))

        return checked

    def check_filter(self, name: str, value: object, args: tuple, kwargs: dict) -> None:
        """A filter's result, before it runs, where its arguments make it grow."""
        if name in SIZING_FILTERS:
            self.check_widths(args, kwargs)
        if name == "format" and isinstance(value, str):
            self.check_percent(value, args)
        elif name == "join":
            self.check_join(args[0] if args else kwargs.get("d", ""), value)
        elif name == "replace" and isinstance(value, str):
            self.check_replace(value, args)
        elif name == "indent" and isinstance(value, str):
            width = args[0] if args else kwargs.get("width", 4)
            self.check_count(len(value) + (value.count("\n") + 1) * (width if isinstance(width, int) else 0))
        elif name == "sum" and not isinstance(
            kwargs.get("start", args[1] if len(args) > 1 else 0), (int, float)
        ):
            raise RenderBudgetError("it sums sequences (each step copies the whole sum)")
        elif name == "tojson":
            indent, separators = kwargs.get("indent"), kwargs.get("separators") or ()
            if (isinstance(indent, int) and indent > MAX_JSON_SPACING) or any(
                len(str(part)) > MAX_JSON_SPACING for part in separators
            ):
                raise RenderBudgetError(f"it spaces JSON past {MAX_JSON_SPACING} characters")


class ChatTemplate:
    def __init__(self, text: str, budget: RenderBudget = RenderBudget()):
        self.text, self.budget = text, budget
        env = _BoundedSandbox(
            budget.chars, trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.concat = env.bounded_concat  # type: ignore[method-assign]  # blocks', macros' and `set` blocks' output
        env.filters["tojson"] = _tojson
        env.filters = {name: env.bounded_filter(name, f) for name, f in env.filters.items()}
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _Namespace
        self._env, self._template = env, env.from_string(text)

    def render(
        self,
        messages: list[dict],
        *,
        bos_token: str,
        eos_token: str,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        kwargs: Mapping[str, object] | None = None,
        max_chars: int | None = None,
    ) -> str:
        """The prompt; `kwargs` (checked by the caller: none of RESERVED) are more variables.
        Within the budget, the prompt at most `max_chars` too: RenderBudgetError past either."""
        room = self.budget.chars + 2 * _text_size((messages, tools, kwargs))
        most = room if max_chars is None else min(room, max_chars)
        variables = dict(
            **(kwargs or {}),
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
        try:
            with self._env.room(room):
                return _within_seconds(self.budget.seconds, lambda: self._written(variables, most))
        except RenderBudgetError:
            raise
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            # A template's own failure on what a request sent (a kwarg of the wrong type, a role it
            # does not know) is that request's fault, not the server's.
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc
        except (RecursionError, MemoryError) as exc:
            raise RenderBudgetError(f"{type(exc).__name__} while rendering") from exc

    def _written(self, variables: dict, max_chars: int) -> str:
        """The output a piece at a time, counted: a loop that writes without end stops at the bound."""
        pieces, written = [], 0
        for piece in self._template.generate(**variables):
            written += len(piece)
            if written > max_chars:
                raise RenderBudgetError(
                    f"the prompt it writes is longer than {max_chars} characters", output=True
                )
            pieces.append(piece)
        return "".join(pieces)


def _text_size(value: object) -> int:
    """The characters of the strings a request's messages, tools and variables hold."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_text_size(k) + _text_size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(map(_text_size, value))
    return 0


class _RenderTimeout(BaseException):
    """Raised inside the rendering thread when its time is up (a BaseException: a template's own
    error handling, which catches Exception, cannot swallow it)."""


def _within_seconds(seconds: float, render: Callable[[], str]) -> str:
    """render() in this thread, interrupted after `seconds`: a watchdog raises _RenderTimeout in
    it (CPython's PyThreadState_SetAsyncExc, delivered between bytecodes: a template's loops are
    Python code; one long C call is bounded by the size checks instead). The lock orders the
    watchdog's raise before the cancel that clears it, so it never lands after this returns."""
    thread, lock = threading.get_ident(), threading.Lock()
    fired: list[bool] = []  # True: the watchdog raised; False: the render is over

    def interrupt() -> None:
        with lock:
            if not fired:
                fired.append(True)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(thread), ctypes.py_object(_RenderTimeout)
                )

    watchdog = threading.Timer(seconds, interrupt)
    try:
        try:
            watchdog.start()  # inside: a watchdog that fires before start() returns raises in it
            return render()
        finally:
            watchdog.cancel()
            with lock:
                if fired:  # raised but perhaps not yet delivered: withdraw it
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)
                fired.append(False)  # done: a late watchdog raises nothing
    except _RenderTimeout:
        raise RenderBudgetError(f"it ran past {seconds:g} s") from None
