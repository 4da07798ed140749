"""What an engine's pooling requests may ask for and get (`Embeddings`), built once from the
model's config, its task and --pooler-config; and each request's PoolingParams checked against
it with every default filled in (`Embeddings.resolve`), so the worker reads no defaults."""
from __future__ import annotations

from dataclasses import dataclass, replace

from octavo.arch_config import ArchConfig
from octavo.pooling_params import PoolerConfig, PoolingParams

# The pooling task an engine's requests take by default, per engine task.
DEFAULT_POOLING_TASK = {"generate": "embed", "embed": "embed", "classify": "classify",
                        "score": "score", "reward": "reward"}


def resolve_task(task: str, arch: ArchConfig) -> str:
    """What the engine serves: `task`, or for auto, generate for a model with an LM head and
    embed for the others (encoders, classifiers); a task the model cannot serve is a
    ValueError naming it."""
    if task == "auto":
        return "generate" if arch.generates else "embed"
    if task == "generate" and not arch.generates:
        raise ValueError(f"task generate: {arch.architecture} has no LM head to generate with "
                         f"(an encoder or a classifier); use task embed (or auto)")
    check_head(task, arch.num_labels, arch.is_encoder, arch.architecture)
    return task


def check_head(task: str, labels: int, encoder: bool, model: str = "the model") -> None:
    """ValueError where a model of `labels` classifier outputs (0: none) cannot serve the
    pooling task `task`."""
    if task in ("classify", "score") and not labels:
        raise ValueError(f"task {task}: {model} has no classifier head (a "
                         f"*ForSequenceClassification architecture)")
    if task == "score" and labels != 1:
        raise ValueError(f"task score: {model}'s classifier has {labels} labels; a "
                         f"cross-encoder's score is its one label")
    if task == "reward" and encoder:
        raise ValueError(f"task reward: {model} is an encoder; per-token rewards come from a "
                         f"decoder's head (its LM head or a score head)")


def with_pooler_config(arch: ArchConfig, pooler: PoolerConfig) -> ArchConfig:
    """The model's config with --pooler-config's pooling of task embed, if it sets one."""
    kind = pooler.embed_pooling
    return arch if kind is None else replace(arch, pooling=kind)


@dataclass(frozen=True)
class Embeddings:
    """What an engine's pooling requests give: vectors of `width` features, cut short only where
    the model is `matryoshka`; with a classifier head of `labels` outputs (0: none) its
    probabilities; with an LM head (`lm_head`), rewards over a vocabulary of `vocab_size`. An
    `encoder`'s prompt is computed in one step of at most `step_tokens`. `task` is what a
    request asks for by default, `pooling` how task embed pools (mean, cls, last),
    `normalize` whether embeddings are scaled to unit length by default, and `step_tag_id`
    and `returned_token_ids` task reward's defaults."""

    width: int
    matryoshka: bool
    step_tokens: int
    labels: int = 0
    task: str = "embed"
    normalize: bool = True
    lm_head: bool = False
    encoder: bool = False
    vocab_size: int = 0
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None
    pooling: str = "last"

    @classmethod
    def of(cls, arch: ArchConfig, engine_task: str, pooler: PoolerConfig,
           step_tokens: int) -> Embeddings:
        normalize = arch.pooling_normalizes if pooler.normalize is None else pooler.normalize
        return cls(arch.hidden_size, arch.matryoshka, step_tokens, arch.num_labels,
                   DEFAULT_POOLING_TASK[engine_task], normalize, arch.generates,
                   arch.is_encoder, arch.vocab_size, pooler.step_tag_id,
                   pooler.returned_token_ids, arch.pooling_kind)

    def positions(self, params: PoolingParams) -> str:
        """What a resolved request reads of its prompt (octavo.pooling_params.POOLED_POSITIONS):
        an encoder's whole prompt at once; a decoder's last position (embeddings pooled from
        the last token; a decoder classifier's head, which reads it), or every position."""
        if self.encoder:
            return "whole"
        if (params.task == "embed" and self.pooling == "last") or \
                params.task in ("classify", "score"):
            return "last"
        return "every"

    def resolve(self, params: PoolingParams, pair: str | None) -> PoolingParams:
        """`params` with its task, normalization and reward positions decided (ValueError,
        naming the field, for what this model cannot give)."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got "
                             f"{type(params).__name__}")
        task = params.task or self.task
        check_head(task, self.labels, self.encoder)
        if (pair is not None) != (task == "score"):
            raise ValueError("task score takes a pair of texts (text_1, text_2), and only it")
        if params.dimensions is not None:
            if task not in ("embed", "token_embed"):
                raise ValueError(f"dimensions are for embeddings, not task {task}")
            if not self.matryoshka:
                raise ValueError("dimensions: the model's embeddings cannot be cut short (its "
                                 "config.json declares no is_matryoshka)")
            if params.dimensions > self.width:
                raise ValueError(f"dimensions must be <= {self.width} (the model's embedding "
                                 f"width), got {params.dimensions}")
        normalize = self.normalize if params.normalize is None else params.normalize
        if task != "reward":
            return replace(params, task=task, normalize=normalize)
        return self._reward(params)

    def _reward(self, params: PoolingParams) -> PoolingParams:
        step = params.step_tag_id if params.step_tag_id is not None else self.step_tag_id
        returned = params.returned_token_ids
        if returned is None and self.returned_token_ids is not None:
            returned = list(self.returned_token_ids)
        if self.labels:  # a score head: its probabilities at each position
            if params.returned_token_ids is not None:
                raise ValueError("returned_token_ids: the model's reward is its classifier "
                                 "head's, not an LM head's tokens")
            returned = None
        elif returned is None:
            raise ValueError("task reward on an LM head needs returned_token_ids: the tokens "
                             "whose probabilities it reads (e.g. the ids of '+' and '-')")
        for name, ids in (("step_tag_id", [step] if step is not None else []),
                          ("returned_token_ids", returned or [])):
            if any(t >= self.vocab_size for t in ids):
                raise ValueError(f"{name} must be token ids below the vocabulary size "
                                 f"({self.vocab_size}), got {ids}")
        return replace(params, task="reward", normalize=False, step_tag_id=step,
                       returned_token_ids=returned)
