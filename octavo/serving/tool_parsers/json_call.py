"""Readers for a tool call written as JSON, fed the model's text a piece at a time.

`JsonCall` reads a call object (`{"name": "f", "arguments": {...}}`, as Hermes, Llama 3 and
Mistral's older format write it); `JsonArguments` reads a bare arguments object whose function
name came before it (Mistral's `name[ARGS]{...}`). Both say when the call may be announced
(`committed`: the name is known and the arguments object has begun), how much of the arguments
text is known so far, and whether the call ended well (`DONE`) or not (`BROKEN`). Every decision
depends only on the text up to the current character, so any split of the text into deltas gives
the same result.
"""
from __future__ import annotations

import enum
import json

from octavo.serving.json_scan import JsonScanner, Member

NAME_KEY = "name"
ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 says "parameters", the others "arguments"
# Keys a call object may carry besides the name and arguments; any other key before the call is
# committed means the object is ordinary JSON output, not a call.
IGNORED_KEYS = ("type", "id")


class ReadState(enum.Enum):
    READING = "reading"
    DONE = "done"        # a valid call; `arguments()` is its JSON text
    BROKEN = "broken"    # not a call, or a call whose text cannot be completed


class JsonCall:
    """One call object: `{"name": "get_weather", "arguments": {"city": "Paris"}}`."""

    def __init__(self) -> None:
        self._parts: list[str] = []  # the characters consumed so far, joined only when needed
        self._length = 0
        self.state = ReadState.READING
        self.name: str | None = None
        self.committed = False
        self._scan = JsonScanner()
        self._args: Member | None = None

    def feed(self, text: str) -> int:
        """Consume characters of `text` until the object ends or breaks; returns how many.

        A character that comes after the object, or that broke it, is not consumed.
        """
        if self.state is not ReadState.READING:
            return 0
        scan = self._scan
        for i, ch in enumerate(text):
            if not scan.push(ch):
                self._keep(text[:i])
                self._end()
                return i
            if scan.done:
                self._keep(text[:i + 1])
                self._end()
                return i + 1
            if scan.member_changed:  # a member began or ended: look at it now, not later
                scan.member_changed = False
                self._check_members(self.text + text[:i + 1])
                if self.state is ReadState.BROKEN:
                    self._keep(text[:i + 1])
                    return i + 1
        self._keep(text)
        return len(text)

    @property
    def text(self) -> str:
        """Everything consumed so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _keep(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._length += len(text)

    def _slice(self, start: int, end: int) -> str:
        """text[start:end], read from the last parts (streaming asks for the newest text)."""
        out, pos = [], self._length
        for part in reversed(self._parts):
            first = pos - len(part)
            if first < end:
                out.append(part[max(start - first, 0):end - first])
            if first <= start:
                break
            pos = first
        return "".join(reversed(out))

    def finish(self) -> None:
        """The output ended here."""
        if self.state is ReadState.READING:
            self._end()

    def arguments_from(self, offset: int) -> str:
        """The arguments' JSON text known so far, from `offset` on (valid once committed)."""
        if self._args is None:
            return ""
        end = self._args.end if self._args.end is not None else self._length
        return self._slice(self._args.start + offset, end)

    def arguments(self) -> str | None:
        """The complete arguments as JSON text of an object, or None if they are not one."""
        a = self._args
        if a is None:
            return "{}"
        if a.end is None:
            return None
        raw = self.text[a.start:a.end]
        if raw.startswith("{"):
            return raw  # the scanner has checked it
        value = json.loads(raw)
        if value is None:
            return "{}"
        # Some models write the arguments as a string holding the JSON object.
        if isinstance(value, str):
            try:
                if isinstance(json.loads(value), dict):
                    return value
            except ValueError:
                pass
        return None

    def _check_members(self, text: str) -> None:
        for m in self._scan.members:
            if m.key in ARGUMENT_KEYS:
                if self._args is None:
                    self._args = m
            elif m.key == NAME_KEY:
                if self.name is None and m.end is not None:
                    name = json.loads(text[m.start:m.end])
                    if not isinstance(name, str) or not name.strip():
                        self.state = ReadState.BROKEN
                        return
                    self.name = name
            elif m.key not in IGNORED_KEYS and not self.committed:
                self.state = ReadState.BROKEN
                return
        if (not self.committed and self.name is not None and self._args is not None
                and text[self._args.start] == "{"):
            self.committed = True

    def _end(self) -> None:
        """The object closed, broke or was cut off; keep it if it is a complete call."""
        scan = self._scan
        # A call whose name and arguments are complete stands even if the object around them
        # is not closed properly: a missing final brace is a common slip.
        complete = scan.done or (self.name is not None and self._args is not None
                                 and self._args.end is not None)
        if complete and self.name is not None and self.arguments() is not None:
            self.state = ReadState.DONE
        else:
            self.state = ReadState.BROKEN


class JsonArguments:
    """A bare arguments object whose function name came before it: `{"city": "Paris"}`.

    It is committed from its first character, since the name is already known.
    """

    def __init__(self, name: str) -> None:
        self.text = ""
        self.state = ReadState.READING
        self.name = name
        self.committed = True
        self._scan = JsonScanner()

    def feed(self, text: str) -> int:
        if self.state is not ReadState.READING:
            return 0
        scan = self._scan
        for i, ch in enumerate(text):
            if not scan.push(ch) or scan.done:
                n = i + 1 if scan.done else i
                self.text += text[:n]
                self.state = ReadState.DONE if scan.done else ReadState.BROKEN
                return n
        self.text += text
        return len(text)

    def finish(self) -> None:
        if self.state is ReadState.READING:
            self.state = ReadState.BROKEN

    def arguments_from(self, offset: int) -> str:
        return self.text[offset:]

    def arguments(self) -> str | None:
        return self.text if self.state is ReadState.DONE else None
