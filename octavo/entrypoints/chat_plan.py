"""What the chat APIs (chat completions, responses, messages) share: rendering the conversation
off the event loop (a request's own template only where the server trusts them), the model's
sampling defaults, the rule for function names, the check of a structured-output spec, and the
request-time step that checks the tools' schemas (when a grammar will be built from them) and
plans the output (octavo/serving/chat_output.py), with 400s naming the field."""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any

from pydantic import AfterValidator

from octavo.engine.grammar import check_structured
from octavo.entrypoints.http import APIError, ServerState
from octavo.params import SamplingParams, StructuredOutputsParams
from octavo.serving.chat_output import ChatPlan, ToolRequest, check_tool_schemas, plan_chat_output
from octavo.serving.chat_template import render_chat

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _check_function_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"must be 1 to 64 letters, digits, '_', '.' or '-', got {name!r:.80}")
    return name


FunctionName = Annotated[str, AfterValidator(_check_function_name)]


async def render_prompt(state: ServerState, messages: list[dict[str, Any]],
                        request_template: str | None, add_generation_prompt: bool,
                        continue_final_message: bool = False,
                        template_kwargs: dict[str, Any] | None = None,
                        add_special_tokens: bool = False) -> list[int]:
    """Prompt ids of a conversation, rendered in the front end's pool within its budget (a
    400 past it). A template in the request is Jinja code from the client: refused unless the
    server was started with --trust-request-chat-template."""
    if request_template is not None and not state.trust_request_chat_template:
        raise APIError(400, "a chat_template in the request needs a server started with "
                       "--trust-request-chat-template", "chat_template")
    return await state.engine.offload.run(
        "rendering the chat template", render_chat, state.engine.tokenizer, messages,
        request_template or state.chat_template, add_generation_prompt, continue_final_message,
        template_kwargs, state.render_limits, add_special_tokens)


def model_defaults(state: ServerState) -> SamplingParams:
    """The model's generation_config: it fills the sampling fields a request leaves unset."""
    return SamplingParams(**state.engine.setup.arch.sampling_defaults)


async def check_output_spec(state: ServerState, spec: StructuredOutputsParams | None,
                            field: str | None, param: str) -> None:
    """Compile `spec`'s grammar once to refuse a bad one with a 400 (`param`; `field` names the
    part in the message). In the front end's pool: the first check imports xgrammar, and a large
    spec takes a while to parse; neither may stall other streams."""
    if spec is None:
        return
    try:
        await state.engine.offload.run("checking the structured-output spec", check_structured,
                                       spec, field)
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None


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
            await state.engine.offload.run("checking the tools' schemas", check_tool_schemas,
                                           functions, schema_fields)
        except ValueError as exc:
            raise APIError(400, str(exc), "tools") from None
    try:
        return plan_chat_output(state.parsers, tools, structured, prompt_ids, new_id)
    except ValueError as exc:
        raise APIError(400, str(exc), "tool_choice") from None
