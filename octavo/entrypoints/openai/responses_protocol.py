"""The OpenAI Responses API request body (pydantic), and its translation into what the chat path
takes: template messages, tools and tool_choice in the chat shape, a StructuredOutputsParams and a
SamplingParams.

Unknown fields are refused (extra="forbid"); fields OpenAI defines that octavo cannot honour are
accepted by the schema and refused by name when set (`refuse_unsupported`), never ignored.
Input items: messages (content as a string or text parts), `function_call` and
`function_call_output` (the chat template's assistant `tool_calls` and `tool` messages), and
`reasoning` (dropped, as the chat APIs drop reasoning from the conversation).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from octavo.entrypoints.chat_plan import FunctionName
from octavo.entrypoints.http import APIError
from octavo.entrypoints.openai.tools import ChatTool, FunctionDefinition
from octavo.params import SamplingParams, StructuredOutputsParams

# Present and set -> 400 naming the field.
UNSUPPORTED = {
    "background": "background responses",
    "conversation": "conversations (use previous_response_id)",
    "prompt": "prompt templates",
    "top_logprobs": "logprobs in responses",
}
# `include` values octavo has something to return for: none. Encrypted reasoning is accepted
# (a stateless client asks for it) and never produced: reasoning items are not needed back.
_INCLUDE_ACCEPTED = ("reasoning.encrypted_content",)
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is always enforced where a grammar applies


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    """Accepted and not acted on: a model reasons as its chat template and the server's
    --reasoning-parser make it; octavo has no effort control."""
    model_config = ConfigDict(extra="forbid")
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None
    context: str | None = None
    mode: str | None = None


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool | None = None  # octavo never pads its events


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None      # an earlier output_text, sent back
    logprobs: list[Any] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class _MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class _FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class _FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class _ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="allow")  # dropped whole: its fields do not matter
    type: Literal["reasoning"]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None  # a bound on built-in tool calls: octavo has none
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # accepted OpenAI bookkeeping fields with no effect on generation
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    # octavo / vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    priority: int = 0
    cache_salt: str | None = None
    # OpenAI fields octavo does not support yet (refused by name when set)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _together(self) -> ResponsesRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def refuse_unsupported(self) -> None:
        """400 naming the first field set that octavo cannot honour, or a bad value."""
        for name, what in UNSUPPORTED.items():
            if getattr(self, name) not in (None, False, 0):
                raise APIError(400, f"'{name}' is not supported yet ({what})", name)
        if self.truncation == "auto":
            raise APIError(400, "truncation 'auto' is not supported yet: a conversation beyond "
                           "the context is refused, never cut", "truncation")
        for value in self.include or ():
            if value not in _INCLUDE_ACCEPTED:
                raise APIError(400, f"include {value!r:.80} is not supported yet", "include")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise APIError(400, "text.verbosity other than 'medium' is not supported yet",
                           "text.verbosity")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError(400, f"max_output_tokens must be >= 1, got "
                                f"{self.max_output_tokens}", "max_output_tokens")
        if isinstance(self.input, list) and not self.input:
            raise APIError(400, "input must not be empty", "input")
        self._check_metadata()

    def _check_metadata(self) -> None:
        meta = self.metadata or {}
        if len(meta) > _METADATA_PAIRS:
            raise APIError(400, f"metadata holds at most {_METADATA_PAIRS} pairs, got "
                                f"{len(meta)}", "metadata")
        for key, value in meta.items():
            if len(key) > _METADATA_KEY or len(value) > _METADATA_VALUE:
                raise APIError(400, f"metadata keys are at most {_METADATA_KEY} characters and "
                                    f"values at most {_METADATA_VALUE}; {key[:64]!r} is over",
                               "metadata")

    def chat_tools(self) -> list[ChatTool] | None:
        """The function tools in the chat shape (the tool step and the template read that)."""
        if self.tools is None:
            return None
        out = []
        for i, raw in enumerate(self.tools):
            kind = raw.get("type")
            if kind != "function":
                raise APIError(400, f"tools[{i}]: tools of type {kind!r:.40} are not supported "
                                    "(only 'function')", "tools")
            tool = _validate(FunctionTool, raw, f"tools[{i}]", "tools")
            out.append(ChatTool(type="function", function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters,
                strict=tool.strict)))
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        """tool_choice in the chat shape: `{"type": "function", "name"}` becomes
        `{"type": "function", "function": {"name"}}`; strings pass as they are."""
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if choice.get("type") != "function" or set(choice) != {"type", "name"} \
                or not isinstance(choice["name"], str):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or "
                                f'{{"type": "function", "name": ...}}, got {choice!r:.80}',
                           "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}

    def structured_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """From text.format, with the field a grammar problem is reported under."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None, None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), "text.format"
        if fmt.name is None or fmt.json_schema is None:
            raise APIError(400, "text.format of type json_schema needs 'name' and 'schema'",
                           "text.format")
        return StructuredOutputsParams(json=fmt.json_schema), "text.format.schema"

    def text_echo(self) -> dict[str, Any]:
        """The `text` of the response object."""
        fmt = self.text.format if self.text is not None else None
        shown = fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        return {"format": shown, "verbosity": "medium"}

    def sampling_params(self, defaults: SamplingParams,
                        structured: StructuredOutputsParams | None,
                        skip_special_tokens: bool) -> SamplingParams:
        """`defaults` (the model's generation_config) fills the fields the request left unset."""
        def pick(name: str):
            value = getattr(self, name)
            return getattr(defaults, name) if value is None else value

        return SamplingParams(
            temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
            min_p=pick("min_p"), repetition_penalty=pick("repetition_penalty"),
            seed=self.seed, stop=self.stop, max_tokens=self.max_output_tokens,
            skip_special_tokens=skip_special_tokens, structured_outputs=structured)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's input as chat messages (tool call arguments still JSON text; the chat
    route's `template_message` turns them into objects for the template)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        where = f"input[{i}]"
        kind = raw.get("type", "message" if "role" in raw else None)
        if kind == "message":
            item = _validate(_MessageItem, raw, where, "input")
            out.append({"role": item.role, "content": _text_of(item.content, where)})
        elif kind == "function_call":
            call = _validate(_FunctionCallItem, raw, where, "input")
            entry = {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}
            if out and out[-1]["role"] == "assistant":  # the same turn as its text
                out[-1].setdefault("tool_calls", []).append(entry)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [entry]})
        elif kind == "function_call_output":
            result = _validate(_FunctionCallOutputItem, raw, where, "input")
            out.append({"role": "tool", "tool_call_id": result.call_id,
                        "content": _text_of(result.output, f"{where}.output")})
        elif kind == "reasoning":
            _validate(_ReasoningItem, raw, where, "input")
        else:
            raise APIError(400, f"{where}: input items of type {kind!r:.40} are not supported "
                                "(message, function_call, function_call_output, reasoning)",
                           "input")
    return out


def _text_of(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, raw in enumerate(content):
        kind = raw.get("type")
        if kind not in ("input_text", "output_text", "refusal"):
            raise APIError(400, f"{where}.content[{j}]: content of type {kind!r:.40} is not "
                                "supported (text only: input_text, output_text, refusal)",
                           "input")
        part = _validate(_TextPart, raw, f"{where}.content[{j}]", "input")
        text = part.refusal if kind == "refusal" else part.text
        if text is None:
            field = "refusal" if kind == "refusal" else "text"
            raise APIError(400, f"{where}.content[{j}].{field} is required", "input")
        texts.append(text)
    return "".join(texts)


def _validate(model: type[BaseModel], raw: dict[str, Any], where: str, param: str):
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        at = ".".join(str(x) for x in err["loc"])
        name = f"{where}.{at}" if at else where
        if err["type"] == "extra_forbidden":
            message = f"unknown parameter '{name}'"
        elif err["type"] == "missing":
            message = f"'{name}' is required"
        else:
            message = f"'{name}': {err['msg']}"
        raise APIError(400, message, param) from None
