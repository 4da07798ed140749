"""Speculative decoding over layers that keep a recurrent state per request (linear attention).

A verification step computes every drafted position from the state before the span, but a state
may only move past the tokens that are accepted: each such layer leaves it where it was and keeps
the span's inputs at the request's row (`accept_span`, model/layers/gated_delta_net.py; the fused
stack keeps them there too). How many tokens stay is what the core says next: the request's
computed count when it is next scheduled (the same on every rank, so no rank needs another's
sampling). A request that leaves the batch first (finished, aborted, preempted) is forgotten:
its row's span is overwritten by the next one.
"""
from __future__ import annotations

import numpy as np
from torch import nn

from octavo.core.contract import SchedulerOutput
from octavo.worker.input_batch import InputBatch


class VerifiedSpans:
    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers  # the model's linear-attention layers
        self.waiting: dict[str, tuple[int, int]] = {}  # request -> (row, computed before)

    def forget(self, req_id: str) -> None:
        self.waiting.pop(req_id, None)

    def settle(self, sched: SchedulerOutput, batch: InputBatch) -> None:
        """Before a step: move the states of its requests that wait on a verified span over
        the tokens the core kept of it."""
        for req_id in [r for r in self.waiting if r in sched.num_scheduled_tokens]:
            row, before = self.waiting.pop(req_id)
            for layer in self.layers:
                layer.accept_span(row, int(batch.num_computed[row]) - before)

    def hold(self, req_ids: list[str], rows: np.ndarray, computed: np.ndarray,
             num_drafts: np.ndarray) -> None:
        """With this step: the requests whose span ends in drafts wait on the core's verdict."""
        for i in np.flatnonzero(num_drafts).tolist():
            self.waiting[req_ids[i]] = (int(rows[i]), int(computed[i]))
