"""How a mixture of experts routes a token: its router logits -> its top-k experts and their
weights. One description (`Routing`) for every family, computed here for the Python layers
(FusedMoE) and by the fused decode stack (csrc/stack_layer.h, `stack_route`) with the same ops
in the same order:

- scores: the softmax (Mixtral, Qwen, gpt-oss) or the sigmoid (DeepSeek V3, Llama 4) of the
  float32 logits;
- the choice: the top-k of the scores, or of the logits (Llama 4: a sigmoid saturates in float32
  where logits still differ), plus a learned correction bias that steers the choice but not the
  weights (DeepSeek V3);
- expert groups (DeepSeek): the choice limited to the `keep_groups` best of `groups` equal
  groups, a group scored by its best expert or by its best two (`group_score`);
- weights: the chosen scores, renormalized to sum to 1 where asked, times `scale` (DeepSeek's
  routed_scaling_factor)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCORINGS = ("softmax", "sigmoid")
CHOICES = ("scores", "logits")
GROUP_SCORES = ("max", "top2")


@dataclass(frozen=True, eq=False)
class Routing:
    top_k: int
    renormalize: bool = False
    scoring: str = "softmax"
    choose_by: str = "scores"
    scale: float = 1.0
    groups: int = 1
    keep_groups: int = 1
    group_score: str = "max"
    # float32 [experts], added to the scores for the choice alone (a router's parameter, filled
    # in place at load)
    correction: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name, value, allowed in (("scoring", self.scoring, SCORINGS),
                                     ("choose_by", self.choose_by, CHOICES),
                                     ("group_score", self.group_score, GROUP_SCORES)):
            if value not in allowed:
                raise ValueError(f"routing {name} {value!r}: one of {allowed}")
        if not 1 <= self.keep_groups <= self.groups:
            raise ValueError(f"topk_group ({self.keep_groups}) must be in [1, n_group "
                             f"({self.groups})]")
        if self.correction is not None and self.choose_by == "logits":
            raise ValueError("a correction bias steers a choice by scores")

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] -> (weights [T, top_k] float32, experts [T, top_k])."""
        floats = logits.float()
        scores = floats.sigmoid() if self.scoring == "sigmoid" else floats.softmax(-1)
        if self.choose_by == "logits":
            choice = logits
        else:
            choice = scores if self.correction is None else scores + self.correction
        if self.groups > 1:
            choice = self._best_groups(choice)
        experts = choice.topk(self.top_k, -1)[1]
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scale if self.scale != 1.0 else weights, experts

    def _best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with the experts outside the keep_groups best groups set to -inf."""
        t, e = choice.shape
        by_group = choice.view(t, self.groups, e // self.groups)
        score = (by_group.topk(2, -1)[0].sum(-1) if self.group_score == "top2"
                 else by_group.amax(-1))
        best = score.topk(self.keep_groups, -1)[1]
        kept = torch.zeros_like(score, dtype=torch.bool).scatter_(1, best, True)
        return choice.masked_fill(~kept.repeat_interleave(e // self.groups, 1), float("-inf"))
