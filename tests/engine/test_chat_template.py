"""Chat templates render in Jinja2's immutable sandbox with the helpers real templates use:
raise_exception, strftime_now, tools, add_generation_prompt."""
from __future__ import annotations

import datetime

import pytest

from octavo.engine.tokenizer import Tokenizer
from octavo.serving.chat_template import render_chat

USER = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Wetter in einer Stadt, z. B. Zürich",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    USER,
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather?"}],
    [{"role": "user", "content": [{"type": "text", "text": "Part one. "},
                                  {"type": "text", "text": "Part two."}]}],
]


@pytest.fixture(scope="module")
def tok(smollm_oracle_folder):
    return Tokenizer.from_folder(smollm_oracle_folder)


@pytest.mark.parametrize("catalog", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_real_templates_render_as_transformers_does(catalog):
    from transformers import AutoTokenizer

    from tests.oracle import oracle_folder

    folder = oracle_folder(catalog)
    ours, ref = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    for messages in CONVERSATIONS:
        for kwargs in ({}, {"add_generation_prompt": False}, {"tools": TOOLS}):
            gen = kwargs.get("add_generation_prompt", True)
            extra = {"tools": kwargs["tools"]} if "tools" in kwargs else None
            flat = [{**m, "content": m["content"] if isinstance(m["content"], str)
                     else "".join(p["text"] for p in m["content"])} for m in messages]
            expected = ref.apply_chat_template(flat, tokenize=True, add_generation_prompt=gen,
                                               **({"tools": TOOLS} if extra else {}))
            if isinstance(expected, dict) or hasattr(expected, "input_ids"):
                expected = expected["input_ids"]
            assert render_chat(ours, messages, add_generation_prompt=gen,
                               template_kwargs=extra) == list(expected), (catalog, messages, kwargs)
    partial = USER + [{"role": "assistant", "content": "The answer is"}]
    expected = ref.apply_chat_template(partial, tokenize=True, add_generation_prompt=False,
                                       continue_final_message=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert render_chat(ours, partial, add_generation_prompt=False,
                       continue_final_message=True) == list(expected)


def _text(tok, template, messages=USER, **kwargs):
    return tok.decode(render_chat(tok, messages, template, **kwargs))


def test_raise_exception_is_a_clear_error(tok):
    template = ("{% if messages[0]['role'] != 'system' %}"
                "{{ raise_exception('system first') }}{% endif %}")
    with pytest.raises(ValueError, match="system first"):
        render_chat(tok, USER, template)


def test_strftime_now(tok):
    year = str(datetime.datetime.now().year)
    assert year in _text(tok, "{{ strftime_now('%Y') }}{{ messages[0]['content'] }}")


def test_tools_reach_the_template():
    from tests.oracle import oracle_folder

    qwen = Tokenizer.from_folder(oracle_folder("qwen2.5-coder-0.5b-instruct"))
    text = qwen.decode(render_chat(qwen, USER, template_kwargs={"tools": TOOLS}))
    assert "<tools>" in text and "get_weather" in text and "Zürich" in text
    assert "<tools>" not in qwen.decode(render_chat(qwen, USER))


def test_add_generation_prompt(tok):
    template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    assert _text(tok, template).endswith("[assistant]")
    assert _text(tok, template, add_generation_prompt=False).endswith("Hi")


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the sandbox forbids dunder access
    "{% set xs = [1] %}{{ xs.append(2) }}",  # immutable: no mutating methods
])
def test_the_sandbox_blocks_unsafe_templates(tok, template):
    with pytest.raises(ValueError, match="chat template failed"):
        render_chat(tok, USER, template)


def test_generation_blocks_and_loop_controls(tok):
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
                "{% generation %}<{{ m['content'] }}>{% endgeneration %}{% endfor %}")
    messages = [{"role": "system", "content": "S"}] + USER
    assert _text(tok, template, messages, add_generation_prompt=False) == "<Hi>"
