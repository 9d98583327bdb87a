"""Real models' chat templates (chat_templates/README.md says where from; Phi-3's and Qwen2's from
llama.cpp's vocabulary suite GGUFs) rendered by agent/model/chat_template.py and by transformers'
own renderer (`render_jinja_template`, what `apply_chat_template` calls): the prompts must be equal,
tools, tool calls and results, and `chat_template_kwargs` (Qwen3's enable_thinking) included."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from agent.model.chat_template import ChatTemplate, ChatTemplateError, RenderBudget, RenderBudgetError
from agent.model.tokenizer import TextTokenizer, TokenizerError, load_tokenizer
from tiny_models import CHATML
from tools.fetch_vocab_suite import DEFAULT_DEST

TEMPLATES = Path(__file__).parent / "chat_templates"
LLAMA31 = "meta-llama-Llama-3.1-8B-Instruct.jinja"
LLAMA32 = "meta-llama-Llama-3.2-3B-Instruct.jinja"
QWEN25 = "Qwen-Qwen2.5-7B-Instruct.jinja"
QWEN3 = "Qwen-Qwen3-0.6B.jinja"
PHI35 = "microsoft-Phi-3.5-mini-instruct.jinja"
R1 = "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"
SMOLLM3 = "HuggingFaceTB-SmolLM3-3B.jinja"
QWEN35 = "Qwen-Qwen3.5-4B.jinja"
SPECIALS = {
    LLAMA31: ("<|begin_of_text|>", "<|eot_id|>"),
    LLAMA32: ("<|begin_of_text|>", "<|eot_id|>"),
    QWEN25: ("", "<|im_end|>"),
    QWEN3: ("", "<|im_end|>"),
    PHI35: ("<s>", "<|endoftext|>"),
    R1: ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    SMOLLM3: ("", "<|im_end|>"),
    QWEN35: ("", "<|im_end|>"),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "ville <b>&</b> 'quoted'"}},
            "required": ["city"],
        },
    },
}
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi, café?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "And now?"},
]
# Tool calls' arguments as objects: what the server hands a template that takes tools.
CALLS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "id": "call_1",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
]


def both(name: str, messages: list[dict], tools=None, **kwargs) -> tuple[str, str]:
    """(ours, transformers') prompt of this template for the conversation."""
    text = (TEMPLATES / name).read_text(encoding="utf-8")
    bos, eos = SPECIALS[name]
    ours = ChatTemplate(text).render(messages, bos_token=bos, eos_token=eos, tools=tools, kwargs=kwargs)
    reference, _ = render_jinja_template(
        [messages],
        tools=tools,
        chat_template=text,
        add_generation_prompt=True,
        bos_token=bos,
        eos_token=eos,
        **kwargs,
    )
    return ours, reference[0]


@pytest.mark.parametrize("name", list(SPECIALS))
def test_a_plain_chat_renders_as_transformers_renders_it(name):
    ours, reference = both(name, CHAT)
    assert ours == reference
    assert "And now?" in ours


@pytest.mark.parametrize("name", [LLAMA31, LLAMA32, QWEN25, QWEN3])
def test_tools_calls_and_results_render_as_transformers_renders_them(name):
    ours, reference = both(name, CALLS, tools=[WEATHER])
    assert ours == reference
    # tojson is transformers' (no HTML escaping), so the description is the client's text
    assert "ville <b>&</b> 'quoted'" in ours and '"Paris"' in ours


def test_qwen3_enable_thinking_reaches_the_template():
    on, reference_on = both(QWEN3, CHAT)
    off, reference_off = both(QWEN3, CHAT, enable_thinking=False)
    assert (on, off) == (reference_on, reference_off)
    assert off == on + "<think>\n\n</think>\n\n"  # thinking off: an empty think block is the answer's start


def test_qwen35_opens_the_think_block_unless_enable_thinking_is_false():
    """Qwen3.5's generation prompt opens <think> (the answer starts inside it: the server reads
    reasoning up to </think>), or with enable_thinking false writes an empty one; its history's tool
    calls are XML (<function=...><parameter=...>)."""
    from server.reasoning import THINK, opens_inside, tags_of

    on, reference_on = both(QWEN35, CHAT)
    off, reference_off = both(QWEN35, CHAT, enable_thinking=False)
    assert (on, off) == (reference_on, reference_off)
    assert on.endswith("<|im_start|>assistant\n<think>\n") and off.endswith("<think>\n\n</think>\n\n")
    assert tags_of((TEMPLATES / QWEN35).read_text(encoding="utf-8"), "auto") is THINK
    assert opens_inside(on[-40:]) and not opens_inside(off[-40:])
    calls, reference_calls = both(QWEN35, CALLS, tools=[WEATHER])
    assert calls == reference_calls
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in calls
    assert "ville <b>&</b> 'quoted'" in calls


def test_smollm3_thinks_unless_enable_thinking_or_its_system_prompt_says_no():
    """SmolLM3's switch: thinking by default (the model opens <think> itself), off by
    chat_template_kwargs' enable_thinking false or a system prompt's /no_think (an empty think block
    starts the answer); the server reads its answers for think blocks, the answer outside one."""
    from server.reasoning import THINK, opens_inside, tags_of

    on, reference_on = both(SMOLLM3, CHAT)
    off, reference_off = both(SMOLLM3, CHAT, enable_thinking=False)
    flagged, reference_flagged = both(
        SMOLLM3, [{"role": "system", "content": "You are terse. /no_think"}, *CHAT[1:]]
    )
    assert (on, off, flagged) == (reference_on, reference_off, reference_flagged)
    assert on.endswith("<|im_start|>assistant\n") and "/think" in on
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n") and "/no_think" in off
    assert flagged.endswith("<think>\n\n</think>\n") and "You are terse." in flagged
    assert tags_of((TEMPLATES / SMOLLM3).read_text(encoding="utf-8"), "auto") is THINK
    assert not opens_inside(on[-40:]) and not opens_inside(off[-40:])


def test_the_r1_distill_prompt_opens_the_think_block():
    ours, reference = both(R1, CHAT)
    assert ours == reference and ours.endswith("<｜Assistant｜><think>\n")


def test_raise_exception_is_a_chat_template_error():
    template = ChatTemplate("{{ raise_exception('no system role here') }}")
    with pytest.raises(ChatTemplateError, match="no system role here"):
        template.render(CHAT, bos_token="", eos_token="")


def test_the_sandbox_refuses_python_internals():
    escapes = [
        "{{ messages.__class__.__mro__ }}",
        "{% set ns = namespace(_x=1) %}{{ ns._x }}",
        "{{ ''.__class__.__subclasses__() }}",
    ]
    for text in escapes:
        with pytest.raises(ChatTemplateError):
            ChatTemplate(text).render(CHAT, bos_token="", eos_token="")


@pytest.mark.parametrize("vocabulary", ["phi-3", "qwen2"])
def test_a_gguf_template_renders_as_transformers_renders_it(vocabulary):
    """The template the GGUF file carries, with its own BOS and EOS tokens, through load_tokenizer."""
    path = DEFAULT_DEST / f"ggml-vocab-{vocabulary}.gguf"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make setup-dev` (make test does it first)")
    tokenizer = load_tokenizer(path)
    assert tokenizer.chat_template
    ours = tokenizer.apply_chat_template(CHAT)
    reference, _ = render_jinja_template(
        [CHAT],
        chat_template=tokenizer.chat_template,
        add_generation_prompt=True,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )
    assert ours == reference[0]


def test_a_kwarg_of_the_wrong_type_is_a_tokenizer_error(tiny_llama_dir):
    """A request's kwargs that the template chokes on are the request's error (400), not a 500."""
    base = load_tokenizer(tiny_llama_dir)
    tokenizer = TextTokenizer(base.tokenizer, "{{ messages[0]['content'] + limit }}", None, None, ())
    with pytest.raises(TokenizerError, match="TypeError"):
        tokenizer.apply_chat_template(CHAT, kwargs={"limit": 3})


BUDGET = RenderBudget(chars=100_000, seconds=1.0)
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "text",
    [
        "{{ 'x' * 10**10 }}",  # one C call: refused before it runs
        "{{ ([0] * 10**10)|length }}",
        "{{ 2 ** 100000 }}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "{{ 'x'|center(10**10) }}",
        "{{ 'x'.ljust(10**10) }}",
        "{{ 'a\nb'|indent(10**10) }}",
        "{{ '%999999999999s' % 'x' }}",
        "{{ '{:999999999999}'.format('x') }}",
        "{{ '%999999999999s'|format('x') }}",
        "{{ range(100000)|join('x' * 1000) }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        # one C call each, past the watchdog's reach or building far past the budget before a check
        "{% set ns = namespace(x=3**2000) %}{% for i in range(12) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "{{ ([[1]] * 100000)|sum(start=[])|length }}",
        "{% set s = 'x' * 10000 %}{{ s.replace('', s) }}",
        "{% set s = 'x' * 10000 %}{{ s|replace('', s) }}",
        "{% set s = 'x' * 10000 %}{{ s.join(s) }}",
        "{% set s = 'x' * 10000 %}{{ ([s] * 10000)|join }}",
        "{% set s = 'x' * 10000 %}{{ s.translate({120: s}) }}",
        "{{ ('\t' * 10000).expandtabs(10000) }}",
        "{{ ('\n' * 10000)|indent(10000, blank=true) }}",
        "{{ [[[]]] * 10|tojson(indent=10000) }}",
        "{{ '%*s' % (100000000, 'x') }}",
        "{{ '{0:{1}}'.format('x', '100000000') }}",
        "{% set s = 'x' * 10000 %}{{ '' ~ [s] * 10000 }}",
        "{% set s = 'x' * 20000 %}{% set b %}{% for i in range(10000) %}{{ s }}{% endfor %}{% endset %}",
        "{{ ('x'.encode() * 100000000)|length }}",
    ],
)
def test_a_template_building_past_its_budget_is_stopped(text):
    with pytest.raises(RenderBudgetError) as refused:
        ChatTemplate(text, BUDGET).render(HI, bos_token="", eos_token="")
    assert not refused.value.output


def test_a_template_looping_past_its_time_is_interrupted_and_the_thread_goes_on():
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    started = time.perf_counter()
    with pytest.raises(RenderBudgetError, match="ran past 1 s"):
        ChatTemplate(loop, BUDGET).render(HI, bos_token="", eos_token="")
    assert time.perf_counter() - started < 10
    time.sleep(0.05)  # a late interrupt would land here, in this thread
    assert ChatTemplate("{{ messages[0].content }}", BUDGET).render(HI, bos_token="", eos_token="") == "hi"


def test_a_template_writing_past_the_longest_prompt_is_stopped_as_output():
    writes = "{% for i in range(100000) %}{% for j in range(100000) %}xx{% endfor %}{% endfor %}"
    with pytest.raises(RenderBudgetError) as refused:
        ChatTemplate(writes, BUDGET).render(HI, bos_token="", eos_token="", max_chars=5000)
    assert refused.value.output and "5000" in str(refused.value)


def test_the_budget_leaves_ordinary_arithmetic_and_formatting_alone():
    text = "{{ '%5d'|format(3) }}|{{ 'ab'.center(6) }}|{{ 'x' ~ 'y' }}|{{ 2 ** 10 }}|{{ '-' * 3 }}"
    text += "|{{ [1] + [2] }}"
    rendered = ChatTemplate(text, BUDGET).render(HI, bos_token="", eos_token="")
    assert rendered == "    3|  ab  |xy|1024|---|[1, 2]"


@pytest.mark.parametrize(
    "text, content, rendered",
    [
        ("{{ messages[0].content.strip() }}", "My phone is 4155550123", "My phone is 4155550123"),
        ("{{ messages[0].content.lower() }}", "Tokens 4096000 MAX", "tokens 4096000 max"),
        ("{{ '{}'.format(messages[0].content) }}", "12345678901", "12345678901"),
        ("{{ 'n=%d'|format(12345678901) }}", "", "n=12345678901"),
        ("{{ {'a': 1}.get('missing', 5000000) }}", "", "5000000"),
        ("{{ 'build 20240726'.strip() }}|{{ '%s 20240726'|format('v') }}", "", "build 20240726|v 20240726"),
        ("{{ 'a,b,c'.split(',', 1) }}|{{ 'aaa'.replace('a', 'b', 2) }}", "", "['a', 'b,c']|bba"),
        ("{% set b %}{{ messages[0].content }}!{% endset %}{{ b }}", "hi", "hi!"),
        ("{{ [1, 2]|sum }}|{{ [[1], [2]]|tojson(indent=2) }}", "", "3|" + json.dumps([[1], [2]], indent=2)),
    ],
)
def test_ordinary_content_and_arithmetic_render_as_ever(text, content, rendered):
    """Message content with long numbers, big integers as values, formats of them: no budget applies."""
    messages = [{"role": "user", "content": content}]
    assert ChatTemplate(text).render(messages, bos_token="", eos_token="") == rendered


def test_a_prompt_longer_than_the_budget_renders_when_the_request_brought_it():
    """The budget is the template's: a request's own long text (a `truncate`d native prompt) is room."""
    long = [{"role": "user", "content": "word " * 1000}]
    small = RenderBudget(chars=1000, seconds=1.0)
    assert ChatTemplate(CHATML, small).render(long, bos_token="", eos_token="").count("word") == 1000
    with pytest.raises(RenderBudgetError):  # the template's own growth past it is still refused
        ChatTemplate("{{ messages[0].content * 3 }}", small).render(long, bos_token="", eos_token="")
