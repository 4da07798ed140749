"""Pythonic tool calls (Llama 3.2 / 4 and others): the output begins with a Python list of calls
with keyword arguments, optionally between `<|python_start|>` and `<|python_end|>`:

    [get_weather(city="Paris", units="metric"), get_time(zone=None)]

Each call is parsed with `ast` and its arguments must be literals (strings, numbers, booleans,
None, lists, tuples and dicts of them; JSON's true/false/null are accepted too). Nothing is ever
evaluated. A call is sent whole once its closing parenthesis arrives.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Callable

from octavo.serving.tool_parsers.base import ToolParser

START_TAG = "<|python_start|>"
END_TAG = "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_JSON_NAMES = {"true": True, "false": False, "null": None}
_OPENERS = {"(": ")", "[": "]", "{": "}"}


def _literal(node: ast.expr) -> Any:
    """The JSON-compatible value of a literal expression; ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None
                                           or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k) if k is not None else None  # None key: a ** spread
            if not isinstance(key, str):
                raise ValueError("dict keys must be strings")
            out[key] = _literal(v)
        return out
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant)
            and isinstance(node.operand.value, (int, float))
            and not isinstance(node.operand.value, bool)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    raise ValueError(f"not a literal: {ast.dump(node)[:80]}")


def parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call such as `f(a=1, b="x")`, or None if it is not one."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        parts = []
        func = node.func
        while isinstance(func, ast.Attribute):
            parts.append(func.attr)
            func = func.value
        if not isinstance(func, ast.Name):
            return None
        parts.append(func.id)
        arguments = {}
        for kw in node.keywords:
            if kw.arg is None or kw.arg in arguments:  # **spread or a repeated keyword
                return None
            arguments[kw.arg] = _literal(kw.value)
        return ".".join(reversed(parts)), json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        # start | open (after <|python_start|>) | call (reading one) | separator | close | plain
        self._state = "start"
        self._depth = 0            # open brackets inside the call being read
        self._quote = ""           # the open string's quote: ' " ''' or """; "" outside strings
        self._quote_run = 0        # closing quote characters seen in a row
        self._escape = False
        self._call_start = 0       # where the call's text begins in self._raw

    def _advance(self, final: bool) -> bool:
        state = self._state
        if state == "call":
            return self._read(final)
        buf = self._buf
        if state == "plain":
            self._emit_content(buf)
            self._buf = ""
            return False
        stripped = self._buf = buf.lstrip()
        ws = buf[:len(buf) - len(stripped)]
        if state in ("separator", "close"):  # whitespace after a call is dropped
            if not stripped:
                return False
            if state == "close":
                if stripped.startswith(END_TAG):
                    self._buf = stripped[len(END_TAG):]
                elif END_TAG.startswith(stripped) and not final:
                    return False
                self._state = "plain"
            elif stripped[0] == ",":
                self._begin(",")
                self._buf = stripped[1:]
                self._state = "call"
                self._start_call()
            else:
                if stripped[0] == "]":
                    self._buf = stripped[1:]
                    self._state = "close"
                else:
                    self._state = "plain"
            return True
        if state == "start":
            self._emit_content(ws)  # pending until we know whether a call list follows
            if not stripped:
                return False
            if stripped.startswith(START_TAG):
                self._begin(START_TAG)
                self._buf = stripped[len(START_TAG):]
                self._state = "open"
            elif START_TAG.startswith(stripped) and not final:
                return False
            elif stripped[0] == "[":
                self._begin("[")
                self._buf = stripped[1:]
                self._state = "call"
                self._start_call()
            else:
                self._state = "plain"
            return True
        # open: whitespace, then the list
        self._raw += ws
        if stripped.startswith("["):
            self._raw += "["
            self._buf = stripped[1:]
            self._state = "call"
            self._start_call()
            return True
        if not stripped and not final:
            return False
        self._abandon()
        return True

    def _start_call(self) -> None:
        self._depth, self._quote, self._quote_run, self._escape = 0, "", 0, False
        self._call_start = -1  # set at the call's first non-space character

    def _read(self, final: bool) -> bool:
        """Read one call up to its closing parenthesis, then parse it."""
        buf = self._buf
        i = 0
        while i < len(buf):
            ch = buf[i]
            if self._quote:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == self._quote[0]:
                    self._quote_run += 1
                    if self._quote_run == len(self._quote):
                        self._quote, self._quote_run = "", 0
                else:
                    self._quote_run = 0
            elif self._call_start < 0:
                if not ch.isspace():
                    if not _NAME.match(ch):
                        return self._fail(buf, i)
                    self._call_start = len(self._raw) + i
            elif self._depth == 0:
                # Still in the name: letters, digits, _ and . until "(".
                if ch == "(":
                    self._depth = 1
                elif not (ch.isalnum() or ch in "_."):
                    return self._fail(buf, i + 1)
            elif ch in "'\"":
                # A triple quote needs the next two characters: wait for them.
                if len(buf) - i < 3 and not final:
                    break
                self._quote = ch * 3 if buf.startswith(ch * 3, i) else ch
                i += len(self._quote)
                continue
            elif ch in _OPENERS:
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    if ch != ")":
                        return self._fail(buf, i + 1)
                    return self._call_done(buf, i + 1)
            i += 1
        self._raw += buf[:i]
        self._buf = buf[i:]
        if final:
            return self._fail("", 0)
        return False

    def _call_done(self, buf: str, n: int) -> bool:
        self._raw += buf[:n]
        self._buf = buf[n:]
        parsed = parse_call(self._raw[self._call_start:])
        if parsed is None:
            self._abandon()
        else:
            self._complete(*parsed)
        return True

    def _fail(self, buf: str, n: int) -> bool:
        """Not a call: what was read (up to `n` characters of `buf` more) is content."""
        self._raw += buf[:n]
        self._buf = buf[n:]
        self._abandon()
        return True

    def _after_call(self) -> None:
        self._state = "separator"

    def _after_break(self) -> None:
        self._state = "plain"
