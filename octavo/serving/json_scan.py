"""Incremental JSON syntax check, one character at a time.

Tool-call parsers stream a call's arguments while the model is still writing them. This scanner
says at each character whether the text so far can still begin one valid JSON value, and where
each member of the top-level object begins and ends, so a parser knows which span is the function
name and which is the arguments without parsing the growing buffer again at every delta.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

_WS = frozenset(" \t\n\r")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_DIGITS = frozenset("0123456789")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}

# What the scanner expects next.
_VALUE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _COMMA_OR_CLOSE = range(6)
_STRING, _ESCAPE, _UNICODE, _NUMBER, _LITERAL, _DONE, _ERROR = range(6, 13)

# Number states, after: "-" S, a leading zero Z, integer digits I, "." D, fraction digits F,
# "e" E, the exponent's sign G, exponent digits X. A number may end only in Z, I, F or X.
_NUMBER_ENDS = frozenset("ZIFX")


def _number_step(state: str, ch: str) -> str | None:
    """The number state after `ch`, or None if `ch` cannot continue the number."""
    digit = ch in _DIGITS
    if state == "" or state == "S":
        if ch == "-" and state == "":
            return "S"
        return "Z" if ch == "0" else "I" if digit else None
    if state in ("Z", "I"):
        if digit and state == "I":
            return "I"
        return "D" if ch == "." else "E" if ch in "eE" else None
    if state in ("D", "F"):
        if digit:
            return "F"
        return "E" if state == "F" and ch in "eE" else None
    if state == "E" and ch in "+-":
        return "G"
    return "X" if digit else None  # E, G, X


@dataclass(slots=True)
class Member:
    """A member of the top-level object: its key and its value's span in the scanned text."""
    key: str
    start: int               # index of the value's first character
    end: int | None = None   # index after the value's last character; None while it is open


class JsonScanner:
    """Checks that text is a prefix of one JSON value, a character at a time.

    `push` returns False, consuming nothing, for a character that cannot continue the value
    (`error` is then set) or that comes after the value is complete (`done`).
    """

    __slots__ = ("pos", "members", "member_changed", "done", "error", "_stack", "_expect", "_key",
                 "_pending_key", "_number", "_literal", "_hex")

    def __init__(self) -> None:
        self.pos = 0                       # characters consumed
        self.members: list[Member] = []    # the top-level object's members, in order
        self.member_changed = False        # set when a member begins or ends; the reader clears it
        self.done = False
        self.error = False
        self._stack: list[str] = []        # open containers, "{" or "["
        self._expect = _VALUE
        self._key: list[str] | None = None  # raw characters of the key being read
        self._pending_key = ""
        self._number = ""
        self._literal = ""
        self._hex = 0

    def push(self, ch: str) -> bool:
        expect = self._expect
        if expect == _STRING:
            if ch < " ":  # raw control characters are not allowed inside JSON strings
                return self._fail()
            if self._key is not None:
                self._key.append(ch)
            if ch == "\\":
                self._expect = _ESCAPE
            elif ch == '"':
                self._close_string()
        elif expect == _ESCAPE:
            if ch not in _ESCAPES:
                return self._fail()
            if self._key is not None:
                self._key.append(ch)
            self._expect, self._hex = (_UNICODE, 4) if ch == "u" else (_STRING, 0)
        elif expect == _UNICODE:
            if ch not in _HEX:
                return self._fail()
            if self._key is not None:
                self._key.append(ch)
            self._hex -= 1
            if self._hex == 0:
                self._expect = _STRING
        elif expect == _LITERAL:
            if ch != self._literal[0]:
                return self._fail()
            self._literal = self._literal[1:]
            if not self._literal:
                self._value_done(self.pos + 1)
        else:
            if expect == _NUMBER:
                state = _number_step(self._number, ch)
                if state is not None:
                    self._number = state
                    self.pos += 1
                    return True
                if self._number not in _NUMBER_ENDS:
                    return self._fail()
                self._value_done(self.pos)  # `ch` ended the number; it belongs to what follows
                expect = self._expect
            if expect in (_DONE, _ERROR):
                return False
            if ch in _WS:
                pass
            elif not self._structural(expect, ch):
                return self._fail()
        self.pos += 1
        return True

    def _structural(self, expect: int, ch: str) -> bool:
        """Handle `ch` between tokens; False if it is not allowed here."""
        if expect in (_VALUE, _VALUE_OR_CLOSE):
            if ch == "]" and expect == _VALUE_OR_CLOSE:
                return self._close("[")
            return self._start_value(ch)
        if expect in (_KEY_OR_CLOSE, _KEY):
            if ch == "}" and expect == _KEY_OR_CLOSE:
                return self._close("{")
            if ch != '"':
                return False
            self._key = ['"']
            self._expect = _STRING
            return True
        if expect == _COLON:
            if ch != ":":
                return False
            self._expect = _VALUE
            return True
        # _COMMA_OR_CLOSE
        if ch == ",":
            self._expect = _KEY if self._stack[-1] == "{" else _VALUE
            return True
        if ch in "}]":
            return self._close("{" if ch == "}" else "[")
        return False

    def _start_value(self, ch: str) -> bool:
        if ch == "{":
            expect = _KEY_OR_CLOSE
        elif ch == "[":
            expect = _VALUE_OR_CLOSE
        elif ch == '"':
            expect = _STRING
        elif ch == "-" or ch in _DIGITS:
            expect = _NUMBER
            self._number = _number_step("", ch) or ""
        elif ch in _LITERALS:
            expect = _LITERAL
            self._literal = _LITERALS[ch]
        else:
            return False
        if self._stack == ["{"]:
            self.members.append(Member(self._pending_key, self.pos))
            self.member_changed = True
        if ch in "{[":
            self._stack.append(ch)
        self._expect = expect
        return True

    def _close_string(self) -> None:
        if self._key is None:
            self._value_done(self.pos + 1)
            return
        # The scanner has checked the key's syntax, so json.loads cannot fail here.
        self._pending_key = json.loads("".join(self._key))
        self._key = None
        self._expect = _COLON

    def _close(self, opener: str) -> bool:
        if not self._stack or self._stack[-1] != opener:
            return False
        self._stack.pop()
        self._value_done(self.pos + 1)
        return True

    def _value_done(self, end: int) -> None:
        if not self._stack:
            self.done = True
            self._expect = _DONE
            return
        if self._stack == ["{"] and self.members and self.members[-1].end is None:
            self.members[-1].end = end
            self.member_changed = True
        self._expect = _COMMA_OR_CLOSE

    def _fail(self) -> bool:
        self.error = True
        self._expect = _ERROR
        return False
