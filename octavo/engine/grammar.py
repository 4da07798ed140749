"""Structured-output grammars with xgrammar: the front end's up-front check, and the backend the
engine core compiles and matches with (it implements octavo.core.structured.GrammarBackend).

xgrammar (which imports torch) is imported on first use only, so an engine that never sees a
constrained request never loads it. A spec becomes an xgrammar `Grammar` from its key alone
(`StructuredOutputsParams.key()`), the same way on both sides: the front end parses it without
a tokenizer (milliseconds) to refuse a bad schema, regex or grammar with a message naming it;
the core compiles it against the tokenizer's vocabulary (the slow part) in its compile thread.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from octavo.params import StructuredOutputsParams

_WHAT = {"json": "a usable JSON schema", "json_object": "a JSON object grammar",
         "regex": "a valid regular expression", "choice": "a list of choices",
         "grammar": "a valid EBNF grammar", "structural_tag": "a valid xgrammar structural tag"}
# Bounds on a spec before xgrammar sees it: its compile time grows with both, and a request
# must not be able to hold the core's compile thread for long.
MAX_SPEC_CHARS = 256 << 10
MAX_SPEC_DEPTH = 64  # nesting of a JSON schema or structural tag (objects and arrays)
MAX_JSON_WHITESPACE = 16  # one run of free whitespace in JSON output (see _whitespace)
# xgrammar's errors start with "[12:00:00] /project/cpp/file.cc:123: "; the rest is the message.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _xgr():
    import xgrammar

    return xgrammar


def check_structured(spec: StructuredOutputsParams, field: str | None = None) -> None:
    """Refuse a spec whose grammar does not parse. `field` names it in the message (default
    `structured_outputs.<kind>`); raises ValueError."""
    try:
        key = spec.key()
        _check_bounds(key)
        _checked(key)
    except ValueError as exc:
        raise ValueError(f"{field or 'structured_outputs.' + spec.kind} is not "
                         f"{_WHAT[spec.kind]}: {exc}") from None


def _check_bounds(key: tuple[str, str, bool]) -> None:
    kind, text, _ = key
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"it is {len(text)} characters long; at most {MAX_SPEC_CHARS} are "
                         f"allowed")
    if kind in ("json", "structural_tag"):
        if _depth(json.loads(text)) > MAX_SPEC_DEPTH:
            raise ValueError(f"it nests more than {MAX_SPEC_DEPTH} levels deep (objects and "
                             f"arrays)")


def _depth(value: Any) -> int:
    """Nesting depth of decoded JSON, counted up to one past MAX_SPEC_DEPTH, without recursion
    (a deep value must not overflow the stack here)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_SPEC_DEPTH:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest


@functools.lru_cache(maxsize=512)
def _checked(key: tuple[str, str, bool]) -> None:
    build_grammar(key)


def build_grammar(key: tuple[str, str, bool]) -> Any:
    """The xgrammar Grammar of a spec key; ValueError with xgrammar's own message if invalid."""
    xgr = _xgr()
    kind, text, compact = key
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(text, any_whitespace=not compact,
                                                max_whitespace_cnt=_whitespace(compact))
        if kind == "json_object":  # any object: properties the schema does not forbid
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not compact,
                                                strict_mode=False,
                                                max_whitespace_cnt=_whitespace(compact))
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":  # JSON string literals are valid EBNF ones (same escapes)
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                         for c in json.loads(text)))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(text)
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(_structural_tag(json.loads(text)))
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(_LOCATION.sub("", str(exc)).strip() or type(exc).__name__) from None
    raise ValueError(f"unknown structured output kind {kind!r}")


def _whitespace(compact: bool) -> int | None:
    """Free whitespace between JSON tokens comes in runs of at most MAX_JSON_WHITESPACE
    characters: enough for pretty-printed nesting, and a sampled `{"ok":` cannot drift into
    newlines until max_tokens."""
    return None if compact else MAX_JSON_WHITESPACE


def _structural_tag(tag: dict[str, Any]) -> str:
    """xgrammar's structural tag format; vLLM's older {"structures": [{"begin", "schema",
    "end"}], "triggers": [...]} form becomes triggered tags in it."""
    if "structures" in tag:
        tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
                 "content": {"type": "json_schema", "json_schema": s.get("schema", {})}}
                for s in tag["structures"]]
        tag = {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags}}
    return json.dumps(tag)


class XgrammarBackend:
    """Compiles grammars for one tokenizer and makes matchers (octavo.core.structured's
    GrammarBackend). `tokenizer`: a transformers fast tokenizer, or octavo's own (its
    `tokenizers` backend is wrapped)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_threads: int = 2) -> None:
        xgr = _xgr()
        from transformers import PreTrainedTokenizerFast

        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        # The core keeps its own cache of compiled grammars (keyed, bounded): none here.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        grammar = build_grammar(spec.key())
        try:
            return self._compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise ValueError(_LOCATION.sub("", str(exc)).strip()) from None

    def matcher(self, compiled: Any) -> Any:
        return _xgr().GrammarMatcher(compiled)

    def memory_bytes(self, compiled: Any) -> int:
        return compiled.memory_size_bytes
