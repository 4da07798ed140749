"""OpenAI request bodies (pydantic), and their translation to SamplingParams.

Unknown fields are refused (extra="forbid"); fields OpenAI defines that octavo does not support
yet are accepted by the schema and then refused by name, never silently ignored.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from octavo.entrypoints.openai.tools import AssistantToolCall, ChatTool, ToolChoice
from octavo.params import BeamSearchParams, SamplingParams, StructuredOutputsParams

# Present and not null -> 400 naming the field.
UNSUPPORTED = {
    "functions": "the deprecated function calling (use tools)",
    "function_call": "the deprecated function calling (use tool_choice)",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning control",
    "web_search_options": "web search",
    "suffix": "suffix (fill-in-the-middle)",
    "guided_json": "vLLM's removed guided_* fields (use response_format or structured_outputs)",
    "guided_regex": "vLLM's removed guided_* fields",
    "guided_choice": "vLLM's removed guided_* fields",
    "guided_grammar": "vLLM's removed guided_* fields",
    "guided_decoding_backend": "vLLM's removed guided_* fields",
    "guided_whitespace_pattern": "vLLM's removed guided_* fields",
}


# Sampling and output fields beam search has no use for: a 400 naming them when set.
BEAM_REFUSED = ("stream", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop",
                "stop_token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "echo",
                "response_format", "structured_outputs", "tools", "allowed_token_ids",
                "bad_words", "logprob_token_ids", "truncate_prompt_tokens", "return_token_ids",
                "return_tokens_as_token_ids", "vllm_xargs")
MAX_REQUEST_ID = 256  # characters of a client's request_id


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag: xgrammar's {"format": {...}}, or vLLM's older structures + triggers
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    def to_params(self) -> tuple[StructuredOutputsParams | None, str]:
        """The constraint, and the field a problem with it is reported under."""
        if self.type == "text":
            return None, "response_format"
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("response_format.json_schema is required with type json_schema")
            if self.json_schema.json_schema is None:  # no schema: any JSON object
                return StructuredOutputsParams(json_object=True), "response_format"
            return (StructuredOutputsParams(json=self.json_schema.json_schema),
                    "response_format.json_schema.schema")
        if self.format is not None:
            tag: dict[str, Any] = {"type": "structural_tag", "format": self.format}
        elif self.structures is not None:
            tag = {"structures": self.structures, "triggers": self.triggers or []}
        else:
            raise ValueError("response_format of type structural_tag needs 'format' (or "
                             "'structures' and 'triggers')")
        return StructuredOutputsParams(structural_tag=tag), "response_format"


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # octavo / vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams fields
    # vLLM's token-level sampling fields (checked by SamplingParams)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprob_token_ids: list[int] | None = None  # needs logprobs; their logprobs at each step
    truncate_prompt_tokens: int | None = None  # the prompt's last k tokens; -1: the context
    spaces_between_special_tokens: bool = True
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    # vLLM's response extensions
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID)
    return_token_ids: bool | None = None  # prompt_token_ids and each choice's token_ids
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N"
    use_beam_search: bool = False  # beam width: best_of (completions) or n; returns n
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # OpenAI fields octavo does not support yet (refused by name when set)
    functions: Any = None
    function_call: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None

    @model_validator(mode="after")
    def _together(self) -> _Common:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def unsupported_fields(self) -> list[str]:
        return [name for name in UNSUPPORTED
                if name in self.model_fields_set and getattr(self, name, None) is not None]

    def structured_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """From `response_format` or octavo's `structured_outputs` (not both), with the field
        a grammar problem is reported under (None: `structured_outputs.<kind>`). Raises
        ValueError."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        if self.structured_outputs is None:
            return fmt.to_params() if fmt is not None else (None, "response_format")
        known = {f.name for f in fields(StructuredOutputsParams)} - {"reasoning_end"}
        for name in self.structured_outputs:
            if name not in known:
                raise ValueError(f"unknown parameter 'structured_outputs.{name}' (known: "
                                 f"{', '.join(sorted(known))})")
        return StructuredOutputsParams(**self.structured_outputs), None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        defaults: SamplingParams | None = None,
                        structured: StructuredOutputsParams | None = None,
                        skip_special_tokens: bool | None = None) -> SamplingParams:
        """`defaults` (the model's generation_config) fills the fields the request left unset;
        `skip_special_tokens` overrides the request's (a tool-call format may need them).
        With logprob_token_ids, logprobs is their count (vLLM needs logprobs set with them)."""
        defaults = defaults or SamplingParams()
        if self.logprob_token_ids is not None:
            if logprobs is None:
                raise ValueError("logprob_token_ids needs logprobs to be set")
            logprobs = None
        return SamplingParams(
            n=self.n, best_of=getattr(self, "best_of", None),
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=(defaults.repetition_penalty if self.repetition_penalty is None
                                else self.repetition_penalty),
            logit_bias=self.logit_bias, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=(self.skip_special_tokens if skip_special_tokens is None
                                 else skip_special_tokens), logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            structured_outputs=structured, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, logprob_token_ids=self.logprob_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            extra_args=self.vllm_xargs)

    def beam_params(self, max_tokens: int | None, max_model_len: int,
                    prompt_len: int) -> BeamSearchParams:
        """use_beam_search: the width is best_of (completions) or n; fields that beam search
        does not use are refused by name rather than ignored. Raises ValueError."""
        for name in BEAM_REFUSED:
            value = getattr(self, name, None)
            if name in self.model_fields_set and value not in (None, False, 0, 0.0, [], {}):
                raise ValueError(f"'{name}' cannot be used with use_beam_search")
        if getattr(self, "add_special_tokens", None) is False and \
                isinstance(self, CompletionRequest):
            raise ValueError("'add_special_tokens' cannot be false with use_beam_search")
        if self.temperature not in (None, 0, 0.0):
            raise ValueError(f"temperature must be 0 with use_beam_search, "
                             f"got {self.temperature}")
        width = getattr(self, "best_of", None) or self.n
        if width < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {width}")
        return BeamSearchParams(
            beam_width=width, max_tokens=max_tokens or max(max_model_len - prompt_len, 1),
            ignore_eos=self.ignore_eos, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 with echo: the prompt alone (with its logprobs), as vLLM
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # the tokenizer's BOS (and the like) on text prompts

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 with echo: one token is generated (and dropped) for the prompt's
        logprobs."""
        return self.echo and self.max_tokens == 0


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # other fields pass to the template as they are
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this is the result of

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message of role 'tool' needs tool_call_id")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to role 'assistant', not {self.role!r}")
        return self


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # the reply starts with the last message's content, if it is its role
    add_special_tokens: bool = False  # BOS (and the like) on top of what the template writes
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # accepted OpenAI bookkeeping fields with no effect on generation
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[Literal["text"]] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
