"""How to pool one request, and what pooling gives back (vLLM's names: `PoolingParams` as in
vllm.pooling_params; the outputs as vllm.outputs has them, re-exported from octavo.outputs).

A pooling request computes its prompt and returns its hidden states pooled into one vector (an
embedding) instead of generating: the model's pooling (mean, cls, last; sentence-transformers'
Pooling module where the folder has one), optionally truncated to `dimensions` (Matryoshka
models) and normalized to unit length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from octavo.param_checks import check_int as _check_int

if TYPE_CHECKING:  # `import octavo` stays light: the server's launcher imports it first
    import numpy as np

# embed: a vector; classify: a classifier's probabilities (softmax, or a sigmoid for one
# label); score: a cross-encoder's probability for a pair of texts
POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """Validated on construction (`ValueError` names the field)."""

    task: str | None = None  # what the pooled vector is for; None: the model's (embed)
    dimensions: int | None = None  # keep the first this many features, then normalize
    normalize: bool | None = None  # to unit length; None: as the model's pooling says
    truncate_prompt_tokens: int | None = None  # keep the last this many prompt tokens

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


@dataclass
class PoolingOutput:
    """A request's pooled vector."""

    data: np.ndarray  # float32 [features]


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
