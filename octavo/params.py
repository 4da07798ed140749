"""User-facing value types: SamplingParams (with StructuredOutputsParams and ReasoningEndRule) and
BeamSearchParams in, RequestOutput / CompletionOutput / Logprob out."""
from __future__ import annotations

import enum
import json as _json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from octavo.param_checks import check_float as _check_float
from octavo.param_checks import check_int as _check_int
from octavo.param_checks import check_logprobs, check_token_fields

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class ReasoningEndRule:
    """Where a reasoning model's `<think>…</think>` section ends, from token ids alone (the core
    has no text). Valid where both tags are single tokens; `ReasoningParser.end_rule` in
    octavo/serving/reasoning.py builds it from a vocabulary.

    start_required: the reasoning section exists only if the output starts with the start tag
    (Qwen3); otherwise everything up to the end tag is reasoning (DeepSeek-R1, whose template may
    already have written the start tag).
    """
    start_id: int
    end_id: int
    start_required: bool

    def __post_init__(self) -> None:
        for name in ("start_id", "end_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"reasoning_end.{name} must be a token id >= 0, got {value!r}")
        if not isinstance(self.start_required, bool):
            raise ValueError(f"reasoning_end.start_required must be a bool, "
                             f"got {self.start_required!r}")

    def ended(self, output_ids: Sequence[int]) -> bool:
        """Whether the answer has begun after these output tokens."""
        if self.start_required:
            if not output_ids:
                return False
            if output_ids[0] != self.start_id:
                return True
        return self.end_id in output_ids

    def ended_in_prompt(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt itself closes the reasoning section: its last tag is the end tag
        (Qwen3's template with enable_thinking=false writes an empty `<think></think>`)."""
        for tok in reversed(prompt_ids):
            if tok == self.end_id:
                return True
            if tok == self.start_id:
                return False
        return False


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar: exactly one kind is given.

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object; regex: a
    regular expression the whole output matches; choice: exactly one of these strings; grammar:
    an EBNF grammar (GBNF style, start rule `root`); structural_tag: an xgrammar structural tag
    (dict or JSON text). disable_any_whitespace: JSON without free whitespace between tokens
    (compact separators), which keeps small models from drifting into endless blank lines.
    Checked here for shape; the grammar itself is parsed by the engine (a ValueError names it).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    # The grammar applies only once this rule says reasoning has ended (the tokens before are
    # free); None: from the first token. Not part of the grammar's key.
    reasoning_end: ReasoningEndRule | None = None

    def __post_init__(self) -> None:
        if isinstance(self.reasoning_end, dict):  # e.g. decoded from a message
            self.reasoning_end = ReasoningEndRule(**self.reasoning_end)
        if self.reasoning_end is not None and not isinstance(self.reasoning_end,
                                                             ReasoningEndRule):
            raise ValueError(f"structured_outputs.reasoning_end must be a ReasoningEndRule, "
                             f"got {type(self.reasoning_end).__name__}")
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, "
                                 f"got {getattr(self, name)!r}")
        given = [k for k in STRUCTURED_KINDS
                 if (self.json_object if k == "json_object" else getattr(self, k) is not None)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must give exactly one of "
                             f"{', '.join(STRUCTURED_KINDS)}; got "
                             f"{' and '.join(given) if given else 'none'}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = _json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.{name} is not valid JSON: {exc}") \
                        from None
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"structured_outputs.{name} must be a JSON object (a dict or "
                                 f"its JSON text), got {getattr(self, name)!r:.80}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r:.80}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of "
                                 f"strings, got {self.choice!r:.80}")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS
                    if (self.json_object if k == "json_object" else getattr(self, k) is not None))

    def key(self) -> tuple[str, str, bool]:
        """(kind, canonical spec text, disable_any_whitespace): equal keys compile to the same
        grammar, so compiled grammars are cached by it. JSON keeps its key order (it is the
        order properties are generated in)."""
        kind = self.kind
        if kind == "json_object":
            text = ""
        elif kind in ("json", "structural_tag"):
            value = getattr(self, kind)
            value = _json.loads(value) if isinstance(value, str) else value
            text = _json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        elif kind == "choice":
            text = _json.dumps(self.choice, ensure_ascii=False)
        else:
            text = getattr(self, kind)
        return kind, text, self.disable_any_whitespace

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        rule = self.reasoning_end
        if rule is not None:
            out["reasoning_end"] = {"start_id": rule.start_id, "end_id": rule.end_id,
                                    "start_required": rule.start_required}
        return out


class RequestOutputKind(enum.IntEnum):
    """What each output of a streamed request holds (vLLM's names): everything so far, only
    what is new since the last, or nothing until the final one."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request. Every field is validated on construction (`ValueError` names it)."""

    n: int = 1
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # top-k logprobs per output token (the sampled one is always added); -1: the whole
    # vocabulary, within the engine's max_logprobs
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # For AsyncLLM.generate (the offline LLM returns final outputs; the server streams deltas).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's token-level fields (checked in param_checks.py).
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never completed (with or without a leading space)
    detokenize: bool = True  # False: token ids only, no text
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: context
    spaces_between_special_tokens: bool = True  # False: adjacent special tokens kept unspaced
    logprob_token_ids: list[int] | None = None  # logprobs of exactly these tokens at each step
    extra_args: dict[str, Any] | None = None  # passed through untouched (custom sampling code)
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        _check_float("temperature", self.temperature, 0.0, None)
        _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1)
        if self.top_k == -1:
            self.top_k = 0
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63))  # int64, as vLLM and numpy take it
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, None)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logit_bias:
            bias = {}
            for tok, val in self.logit_bias.items():
                try:
                    tok_id = int(tok)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {tok!r}") from None
                if tok_id < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {tok!r}")
                _check_float(f"logit_bias[{tok_id}]", val, -100.0, 100.0)
                bias[tok_id] = float(val)
            self.logit_bias = bias
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        self.stop_strings = stop
        for t in self.stop_token_ids or []:
            _check_int("stop_token_ids", t, 0)
        self.stop_token_ids = list(self.stop_token_ids or [])
        check_logprobs("logprobs", self.logprobs)
        check_logprobs("prompt_logprobs", self.prompt_logprobs)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or "
                             f"FINAL_ONLY), got {self.output_kind!r:.80}") from None
        check_token_fields(self)
        if isinstance(self.structured_outputs, dict):  # e.g. decoded from a message
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            if self.min_tokens:
                raise ValueError(f"min_tokens must be 0 with structured_outputs (the grammar "
                                 f"decides where the output may end), got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def num_samples(self) -> int:
        """How many sequences are generated: best_of, or n."""
        return self.best_of if self.best_of is not None else self.n


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search (`LLM.beam_search`), with the semantics of transformers' `generate(num_beams=
    beam_width, do_sample=False)`: a finished beam's score is its cumulative logprob divided by
    (generated tokens, EOS included) ** length_penalty; early_stopping is True (stop once
    beam_width beams have finished), False (stop once no running beam can still beat the worst
    finished one, judged at the current length) or "never" (judged at max_tokens when
    length_penalty > 0). Every beam_width beam is returned, best first. temperature must be 0:
    beams are ranked by the model's raw logprobs."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_float("temperature", self.temperature, 0.0, 0.0)
        _check_float("length_penalty", self.length_penalty, None, None)
        if self.early_stopping not in (True, False, "never") or \
                not isinstance(self.early_stopping, (bool, str)):
            raise ValueError(f"early_stopping must be true, false or 'never', "
                             f"got {self.early_stopping!r}")


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position: token id -> Logprob, the sampled (or prompt) token first, then the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class BeamSearchSequence:
    """One beam of `LLM.beam_search`, as vLLM returns it: `tokens` and `text` include the
    prompt; `logprobs` has one entry per generated token (that step's candidates)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request, in vLLM's shape: `lora_name` names it (the OpenAI `model`
    field selects it by this name), `lora_int_id` (>= 1) identifies it in the engine, and
    `lora_path` is its directory (PEFT's adapter_config.json and adapter_model.safetensors).
    Two requests with the same id must name the same adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request.lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, "
                             f"got {self.lora_int_id!r:.80}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path of adapter {self.lora_name!r} must name "
                             f"its directory")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
