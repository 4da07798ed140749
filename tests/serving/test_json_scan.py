"""The incremental JSON scanner agrees with json.loads: every prefix of valid JSON is accepted,
the first bad character is refused, and member spans match the parsed object."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octavo.serving.json_scan import JsonScanner

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=4),
    max_leaves=12)
containers = st.lists(json_values, max_size=4) | st.dictionaries(st.text(max_size=5), json_values,
                                                                  max_size=4)


def scan(text: str) -> tuple[JsonScanner, int]:
    """The scanner after `text`, and how many characters it accepted."""
    s = JsonScanner()
    for i, ch in enumerate(text):
        if not s.push(ch):
            return s, i
    return s, len(text)


def loads_strict(text: str):
    def no_constants(name):
        raise ValueError(name)
    return json.loads(text, parse_constant=no_constants)


@settings(max_examples=150, deadline=None)
@given(containers, st.sampled_from([None, 2]), st.booleans())
def test_valid_json_is_accepted_and_members_are_spanned(value, indent, ascii_only):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    s, n = scan(text)
    assert n == len(text) and s.done and not s.error
    assert s.pos == len(text)
    if isinstance(value, dict):
        # Duplicate keys collapse in a dict, so compare member by member.
        assert [m.key for m in s.members] == list(value)
        for m in s.members:
            assert json.loads(text[m.start:m.end]) == value[m.key]
    # Nothing may follow the value.
    assert not s.push("x") and not s.error


@settings(max_examples=200, deadline=None)
@given(containers, st.data())
def test_a_mutated_document_is_refused_exactly_when_json_loads_refuses_it(value, data):
    text = json.dumps(value)
    i = data.draw(st.integers(0, len(text)))
    ch = data.draw(st.sampled_from(list('{}[]",:0-1.eE+tfnul \\x/\n')))
    mutated = text[:i] + ch + text[i + 1:] if data.draw(st.booleans()) else text[:i] + ch + text[i:]
    s, n = scan(mutated)
    try:
        loads_strict(mutated)
        valid = not mutated[-1].isspace()  # the scanner refuses anything after the value
    except ValueError:
        valid = False
    if valid:
        assert n == len(mutated) and s.done
    else:
        # Either a character was refused, or the text is an unfinished prefix.
        assert n < len(mutated) or not s.done
        if n < len(mutated) and not s.done:
            assert s.error


@pytest.mark.parametrize("text, bad_at", [
    ('{"a": 01}', 7),           # leading zero
    ('{"a": 1.}', 8),           # fraction without digits
    ('{"a": -}', 7),
    ('{"a": tru}', 9),
    ("{'a': 1}", 1),            # single quotes
    ('{"a" 1}', 5),
    ('{"a": 1,}', 8),           # trailing comma
    ('[1 2]', 3),
    ('{"a": "x\ny"}', 8),       # raw newline inside a string
    ('{"a": "\\q"}', 8),        # unknown escape
    ('{"a": "\\u12G4"}', 11),
    ('{"a": 1]', 7),            # mismatched close
    ('{"a": NaN}', 6),
])
def test_the_first_bad_character_is_refused(text, bad_at):
    s, n = scan(text)
    assert n == bad_at and s.error and not s.done


def test_a_top_level_number_ends_at_the_next_character():
    s, n = scan("12 ")
    assert s.done and n == 2


def test_open_members_have_no_end():
    s, _ = scan('{"name": "f", "arguments": {"a": [1, 2')
    assert [(m.key, m.end is None) for m in s.members] == [("name", False), ("arguments", True)]
    assert s.members[1].start == len('{"name": "f", "arguments": ')
