"""How to pool one request, and what pooling gives back (vLLM's names: `PoolingParams` as in
vllm.pooling_params; the outputs as vllm.outputs has them, re-exported from octavo.outputs).

A pooling request computes its prompt and returns its hidden states pooled instead of
generating. By task:
- embed: one vector, pooled as the model says (mean, cls, last; sentence-transformers' Pooling
  module where the folder has one, or --pooler-config), optionally cut to `dimensions`
  (Matryoshka models) and normalized to unit length;
- token_embed: one such vector per prompt token (pooling "all");
- classify, score: a classifier's probabilities (score: a cross-encoder's one label);
- reward: per-token values of a decoder's head (a process reward model), at every token or,
  with `step_tag_id`, at each step tag (pooling "step"): a classifier head's probabilities, or
  the LM head's probabilities over `returned_token_ids`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from octavo.param_checks import check_int as _check_int

if TYPE_CHECKING:  # `import octavo` stays light: the server's launcher imports it first
    import numpy as np

# embed: a vector; classify: a classifier's probabilities (softmax, or a sigmoid for one
# label); score: a cross-encoder's probability for a pair of texts; token_embed: a vector per
# token; reward: a decoder head's values per token (or per step tag)
POOLING_TASKS = ("embed", "classify", "score", "token_embed", "reward")


@dataclass
class PoolingParams:
    """Validated on construction (`ValueError` names the field)."""

    task: str | None = None  # what the pooled vector is for; None: the engine's task's
    dimensions: int | None = None  # keep the first this many features, then normalize
    normalize: bool | None = None  # to unit length; None: as the model's pooling says
    truncate_prompt_tokens: int | None = None  # keep the last this many prompt tokens
    # task reward: only the positions holding this token (a step tag); None: every token
    step_tag_id: int | None = None
    # task reward on an LM head: the tokens whose probabilities (a softmax over them) it gives
    returned_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got "
                             f"{self.task!r}")
        if self.dimensions is not None:
            _check_int("dimensions", self.dimensions, 1)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1)
        if self.step_tag_id is not None:
            _check_int("step_tag_id", self.step_tag_id, 0)
        if self.returned_token_ids is not None:
            if isinstance(self.returned_token_ids, (str, bytes)) or not self.returned_token_ids:
                raise ValueError(f"returned_token_ids must be a non-empty list of token ids, "
                                 f"got {self.returned_token_ids!r:.80}")
            for t in self.returned_token_ids:
                _check_int("returned_token_ids", t, 0)
            self.returned_token_ids = list(self.returned_token_ids)
        if self.task not in (None, "reward") and (self.step_tag_id is not None
                                                   or self.returned_token_ids is not None):
            raise ValueError(f"step_tag_id and returned_token_ids are for task reward, not "
                             f"{self.task}")


# What a pooling request reads of its prompt, which decides how the scheduler may run it:
# whole: a bidirectional encoder's, in one step and without a KV cache; last: a decoder's last
# position only, so its prompt is chunked like a prefill and a cached prefix may stand in for
# the rest; every: a decoder's every position, chunked, computed in full (no cache hits).
POOLED_POSITIONS = ("whole", "last", "every")


# --pooler-config's pooling types (vLLM's names): how task embed pools (MEAN, CLS, LAST), or
# where task reward reads (ALL: every token; STEP: the step tags, step_tag_id)
POOLING_TYPES = {"MEAN": "mean", "CLS": "cls", "LAST": "last", "ALL": "all", "STEP": "step"}


@dataclass(frozen=True)
class PoolerConfig:
    """An engine's pooling defaults (`--pooler-config` JSON, vLLM's keys), over what the
    model's folder says: the pooling of task embed, normalization, and the step tag and
    returned tokens of task reward."""

    pooling_type: str | None = None
    normalize: bool | None = None
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, value: str | dict | None) -> PoolerConfig:
        """From JSON text or a dict (ValueError naming pooler_config and the key)."""
        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"pooler_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"pooler_config must be a JSON object, got {value!r:.80}")
        unknown = sorted(set(value) - {"pooling_type", "normalize", "step_tag_id",
                                       "returned_token_ids"})
        if unknown:
            raise ValueError(f"pooler_config: unknown key {unknown[0]!r} (known: pooling_type, "
                             f"normalize, step_tag_id, returned_token_ids)")
        kind = value.get("pooling_type")
        if kind is not None and str(kind).upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {kind!r}")
        try:  # the same checks as a request's
            checked = PoolingParams(task="reward", normalize=value.get("normalize"),
                                    step_tag_id=value.get("step_tag_id"),
                                    returned_token_ids=value.get("returned_token_ids"))
        except ValueError as exc:
            raise ValueError(f"pooler_config.{exc}") from None
        kind = None if kind is None else str(kind).upper()
        if kind == "STEP" and checked.step_tag_id is None:
            raise ValueError("pooler_config: pooling_type STEP needs a step_tag_id")
        if kind == "ALL" and checked.step_tag_id is not None:
            raise ValueError("pooler_config: pooling_type ALL reads every token; a "
                             "step_tag_id is for STEP")
        returned = checked.returned_token_ids
        return cls(kind, checked.normalize, checked.step_tag_id,
                   None if returned is None else tuple(returned))

    @property
    def embed_pooling(self) -> str | None:
        """The pooling of task embed it sets (mean, cls, last), if any."""
        kind = POOLING_TYPES.get(self.pooling_type or "")
        return kind if kind in ("mean", "cls", "last") else None


@dataclass
class PoolingOutput:
    """A request's pooled vector (or, for tasks token_embed and reward, one per position)."""

    data: np.ndarray  # float32 [features], or [positions, features]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class _TaskRequestOutput:
    """A PoolingRequestOutput as one task reads it (`_outputs`: the vector -> its outputs)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput):
        return cls(out.request_id, cls._outputs(out.outputs.data), out.prompt_token_ids,
                   out.finished)


@dataclass
class EmbeddingRequestOutput(_TaskRequestOutput):
    outputs: EmbeddingOutput

    @staticmethod
    def _outputs(data: np.ndarray) -> EmbeddingOutput:
        return EmbeddingOutput(data.tolist())


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax over the labels (a sigmoid for one label)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(_TaskRequestOutput):
    outputs: ClassificationOutput

    @staticmethod
    def _outputs(data: np.ndarray) -> ClassificationOutput:
        return ClassificationOutput(data.tolist())


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput(_TaskRequestOutput):
    outputs: ScoringOutput

    @staticmethod
    def _outputs(data: np.ndarray) -> ScoringOutput:
        return ScoringOutput(float(data[0]))
