"""What both chat APIs share about tools: the rule for function names, and the request-time
step that checks the tools' schemas (when a grammar will be built from them) and plans the
output (octavo/serving/chat_output.py), with 400s naming the field."""
from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from typing import Annotated

from pydantic import AfterValidator

from octavo.entrypoints.http import APIError, ServerState
from octavo.params import StructuredOutputsParams
from octavo.serving.chat_output import ChatPlan, ToolRequest, check_tool_schemas, plan_chat_output

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _check_function_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"must be 1 to 64 letters, digits, '_', '.' or '-', got {name!r:.80}")
    return name


FunctionName = Annotated[str, AfterValidator(_check_function_name)]


async def plan_output(state: ServerState, tools: ToolRequest | None,
                      schema_fields: Sequence[str], structured: StructuredOutputsParams | None,
                      prompt_ids: Sequence[int], new_id: Callable[[], str] | None = None
                      ) -> ChatPlan:
    """`schema_fields` names each tool's parameter schema in error messages. The schema check
    runs in a thread: the first one imports xgrammar, which must not stall other streams."""
    if tools is not None and tools.mode in ("required", "named"):
        functions = tools.functions
        if tools.mode == "named":
            at = [i for i, f in enumerate(functions) if f.name == tools.name]
            functions = tuple(functions[i] for i in at)
            schema_fields = [schema_fields[i] for i in at]
        try:
            await asyncio.to_thread(check_tool_schemas, functions, schema_fields)
        except ValueError as exc:
            raise APIError(400, str(exc), "tools") from None
    try:
        return plan_chat_output(state.parsers, tools, structured, prompt_ids, new_id)
    except ValueError as exc:
        raise APIError(400, str(exc), "tool_choice") from None
