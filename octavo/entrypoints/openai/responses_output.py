"""A response's output items, built from one choice's chat events (octavo/serving/chat_output.py),
and the Responses API stream events that build them.

An item opens when the kind of output changes (reasoning, message text, each function call) and
closes before the next opens: `response.output_item.added`, for text and reasoning a
`response.content_part.added`, the deltas, then the `.done` events carrying the whole text. The
non-streamed route runs the same machine and keeps only `items`, so both agree.
"""
from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from octavo.params import ReasoningEndRule
from octavo.serving.chat_output import ChatEvent, ReasoningText
from octavo.serving.tool_parsers import ContentDelta, ToolCallDelta


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """Chat events in, Responses API events out (without sequence numbers); `items` is the
    response's `output` so far."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._text = ""                           # its text, or its arguments

    def feed(self, events: list[ChatEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, ReasoningText):
                out += self._ensure("reasoning")
                out.append(self._delta("response.reasoning_text.delta", e.text))
            elif isinstance(e, ContentDelta):
                out += self._ensure("message")
                out.append({**self._delta("response.output_text.delta", e.text),
                            "logprobs": []})
            elif isinstance(e, ToolCallDelta):
                if e.id is not None:  # a new call: always a new item
                    out += self._close("completed")
                    out += self._start({"id": _item_id("fc"), "type": "function_call",
                                        "status": "in_progress", "call_id": e.id,
                                        "name": e.name, "arguments": ""})
                if e.arguments and self._kind == "function_call":
                    self._text += e.arguments
                    out.append({"type": "response.function_call_arguments.delta",
                                "item_id": self._open["id"], "output_index": self._index,
                                "delta": e.arguments})
        return out

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the last item with `status` (completed / incomplete); an output with no item
        at all gets an empty message."""
        out = [] if self.items else self._ensure("message")
        return out + self._close(status)

    def assistant_message(self) -> dict[str, Any]:
        """The output as the chat message a later turn's conversation holds (reasoning
        dropped)."""
        text = "".join(part["text"] for item in self.items if item["type"] == "message"
                       for part in item["content"])
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self.items if item["type"] == "function_call"]
        if calls:
            msg["tool_calls"] = calls
        return msg

    # ---- items ----

    @property
    def _kind(self) -> str | None:
        return self._open["type"] if self._open is not None else None

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _ensure(self, kind: str) -> list[dict[str, Any]]:
        if self._kind == kind:
            return []
        out = self._close("completed")
        if kind == "message":
            item = {"id": _item_id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
        else:
            item = {"id": _item_id("rs"), "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}
        out += self._start(item)
        out.append({"type": "response.content_part.added", "item_id": item["id"],
                    "output_index": self._index, "content_index": 0,
                    "part": self._part(kind, "")})
        return out

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open, self._text = item, ""
        return [{"type": "response.output_item.added", "output_index": self._index,
                 "item": dict(item)}]

    def _delta(self, kind: str, text: str) -> dict[str, Any]:
        self._text += text
        return {"type": kind, "item_id": self._open["id"], "output_index": self._index,
                "content_index": 0, "delta": text}

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == "message":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "reasoning_text", "text": text}

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        where = {"item_id": item["id"], "output_index": self._index}
        item["status"] = status
        if item["type"] == "function_call":
            item["arguments"] = self._text
            return [{"type": "response.function_call_arguments.done", **where,
                     "name": item["name"], "arguments": self._text},
                    {"type": "response.output_item.done", "output_index": self._index,
                     "item": item}]
        part = self._part(item["type"], self._text)
        item["content"] = [part]
        done = ("response.output_text.done" if item["type"] == "message"
                else "response.reasoning_text.done")
        text_done = {"type": done, **where, "content_index": 0, "text": self._text}
        if item["type"] == "message":
            text_done["logprobs"] = []
        return [text_done,
                {"type": "response.content_part.done", **where, "content_index": 0,
                 "part": dict(part)},
                {"type": "response.output_item.done", "output_index": self._index,
                 "item": item}]


def reasoning_token_count(rule: ReasoningEndRule | None, output_ids: Sequence[int]) -> int:
    """How many output tokens are reasoning, from the tags' token ids: up to and including the
    end tag (all of them while it has not come)."""
    if rule is None or (rule.start_required and (not output_ids
                                                 or output_ids[0] != rule.start_id)):
        return 0
    ids = list(output_ids)
    return ids.index(rule.end_id) + 1 if rule.end_id in ids else len(ids)


def usage(input_tokens: int, output_tokens: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": input_tokens + output_tokens}
