"""Reasoning parsers: whole outputs, streams split at every position (tags cut anywhere), random
splits, the reasoning-ended signal and the token-id rule."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.serving.reasoning import (REASONING_PARSERS, ReasoningEndRule, ReasoningParser,
                                      get_reasoning_parser)

# (text, deepseek_r1 (reasoning, content), qwen3 (reasoning, content))
CASES = [
    ("<think>\nThe user wants 2+2.\n</think>\n\n4", ("The user wants 2+2.", "4"),
     ("The user wants 2+2.", "4")),
    ("The template opened the tag.\n</think>\n\nParis.", ("The template opened the tag.", "Paris."),
     (None, "The template opened the tag.\n</think>\n\nParis.")),
    ("Just an answer.", ("Just an answer.", ""), (None, "Just an answer.")),
    ("  <think>a</think>b", ("a", "b"), ("a", "b")),
    ("<think></think>answer\n", ("", "answer\n"), ("", "answer\n")),
    ("<think>\n\n</think>\n\n", ("", ""), ("", "")),
    ("<think>cut off by max_tokens\n", ("cut off by max_tokens\n", ""),
     ("cut off by max_tokens\n", "")),
    ("<think>x < y and </thin k></think>z</think>", ("x < y and </thin k>", "z</think>"),
     ("x < y and </thin k>", "z</think>")),
    ("<thinking>no</thinking>", ("<thinking>no</thinking>", ""),
     (None, "<thinking>no</thinking>")),
    ("<thin", ("<thin", ""), (None, "<thin")),
    ("", ("", ""), (None, "")),
    ("\n\n", ("", ""), (None, "\n\n")),
    ("<think>a\n\nb  </think>  c\n\nd  ", ("a\n\nb", "c\n\nd  "), ("a\n\nb", "c\n\nd  ")),
]
PARAMS = [(name, text, want[i]) for text, *want in CASES
          for i, name in enumerate(("deepseek_r1", "qwen3"))]


def stream(cls: type[ReasoningParser], pieces: list[str]) -> tuple[str, str]:
    parser = cls()
    reasoning = content = ""
    for delta in [*(parser.feed(p) for p in pieces), parser.finish()]:
        assert not (content and delta.reasoning), "reasoning after content"
        reasoning += delta.reasoning
        content += delta.content
    return reasoning, content


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("name, text, want", PARAMS)
def test_whole_output(name, text, want):
    parsed = get_reasoning_parser(name).parse(text)
    assert (parsed.reasoning, parsed.content) == want


@pytest.mark.parametrize("name, text, want", PARAMS)
def test_every_split_point_gives_the_whole_result(name, text, want):
    cls = get_reasoning_parser(name)
    expected = (want[0] or "", want[1])
    for i in range(len(text) + 1):
        assert stream(cls, split_at(text, [i])) == expected, f"split at {i}"
        for j in range(i, len(text) + 1):
            assert stream(cls, split_at(text, [i, j])) == expected, f"split at {i}, {j}"
    assert stream(cls, list(text)) == expected


reasoning_text = st.text(alphabet="ab <>/\nthink", max_size=25).filter(lambda s: "think>" not in s)


THINK_PARSERS = sorted(n for n in REASONING_PARSERS if n != "openai_gptoss")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(THINK_PARSERS), st.booleans(), reasoning_text,
       st.booleans(), st.text(alphabet="ab <>/\nthink", max_size=25), st.data())
def test_random_outputs_and_splits(name, start_tag, reasoning, end_tag, content, data):
    text = ("<think>" if start_tag else "") + reasoning + ("</think>" + content if end_tag else "")
    cls = get_reasoning_parser(name)
    parsed = cls.parse(text)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert stream(cls, split_at(text, cuts)) == (parsed.reasoning or "", parsed.content)
    if get_reasoning_parser(name).start_required and not start_tag:
        assert parsed == type(parsed)(None, text)
    elif end_tag:
        assert (parsed.reasoning, parsed.content) == (reasoning.strip(), content.lstrip())
    else:
        assert parsed.content == "" and parsed.reasoning == reasoning.lstrip()


@pytest.mark.parametrize("name", THINK_PARSERS)
def test_reasoning_ended_turns_true_when_the_end_tag_is_complete(name):
    parser = get_reasoning_parser(name)()
    text = "<think>plan</think>answer"
    end = text.index("</think>") + len("</think>")
    for i, ch in enumerate(text):
        parser.feed(ch)
        assert parser.reasoning_ended == (i + 1 >= end), i


def test_qwen3_without_think_has_no_reasoning_once_the_first_text_decides():
    parser = get_reasoning_parser("qwen3")()
    assert parser.feed("  <th").content == "" and not parser.reasoning_ended
    assert parser.feed("is is text").content == "  <this is text"
    assert parser.reasoning_ended
    deepseek = get_reasoning_parser("deepseek_r1")()
    assert deepseek.feed("no tag yet").reasoning == "no tag yet" and not deepseek.reasoning_ended


def test_end_rule_from_token_ids():
    vocab = {"<think>": 7, "</think>": 8, "a": 1}
    r1 = get_reasoning_parser("deepseek_r1").end_rule(vocab)
    assert r1 == ReasoningEndRule(7, 8, start_required=False)
    assert not r1.ended([]) and not r1.ended([1, 1]) and r1.ended([1, 8, 1])
    q3 = get_reasoning_parser("qwen3").end_rule(vocab)
    assert not q3.ended([])             # the first token may still open reasoning
    assert q3.ended([1])                # it did not
    assert not q3.ended([7, 1]) and q3.ended([7, 1, 8, 1])
    assert get_reasoning_parser("qwen3").end_rule({"<think>": 7}) is None


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="reasoning_parser: unknown parser 'r2'; "
                                         "choose one of deepseek_r1, glm45, openai_gptoss, qwen3"):
        get_reasoning_parser("r2")


def test_feed_after_finish_is_an_error():
    parser = get_reasoning_parser("deepseek_r1")()
    parser.finish()
    with pytest.raises(ValueError, match="after finish"):
        parser.feed("x")


# ---- harmony (gpt-oss): channels, not tags ----

A_MSG = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris"}<|call|>')
HARMONY = [
    (A_MSG + "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
     ("The user wants the weather.", "It is 4.")),
    (A_MSG + CALL, ("The user wants the weather.", CALL)),
    ("<|channel|>commentary<|message|>Let me check.<|end|>" + CALL, (None, "Let me check." + CALL)),
    ("<|channel|>analysis<|message|>cut off by max_tokens", ("cut off by max_tokens", "")),
    ("<|channel|>final<|message|>no reasoning", (None, "no reasoning")),
    ("Not harmony at all <|channel|>", (None, "Not harmony at all <|channel|>")),
    ("<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b", ("a", "b")),
    ("<|channel|>bad header\n<|message|>x", (None, "<|channel|>bad header\n<|message|>x")),
    ("", (None, "")),
    # a header past the limit is no header, whether it arrives in pieces or whole
    ("<|channel|>final to=" + "x" * 300 + "<|message|>hi",
     (None, "<|channel|>final to=" + "x" * 300 + "<|message|>hi")),
]


@pytest.mark.parametrize("text, want", HARMONY)
def test_harmony_channels_split_reasoning_from_content_at_every_split(text, want):
    cls = get_reasoning_parser("openai_gptoss")
    parsed = cls.parse(text)
    assert (parsed.reasoning, parsed.content) == want
    expected = (want[0] or "", want[1])
    for i in range(len(text) + 1):
        parser, got = cls(), ["", ""]
        for delta in (parser.feed(text[:i]), parser.feed(text[i:]), parser.finish()):
            got[0] += delta.reasoning
            got[1] += delta.content
        assert tuple(got) == expected, f"split at {i}"


def test_harmony_reasoning_ends_when_a_non_analysis_message_begins():
    parser = get_reasoning_parser("openai_gptoss")()
    parser.feed(A_MSG)
    assert not parser.reasoning_ended
    parser.feed("<|start|>assistant<|channel|>final<|message|>")
    assert parser.reasoning_ended
    assert get_reasoning_parser("openai_gptoss").end_rule({"<|channel|>": 1}) is None
