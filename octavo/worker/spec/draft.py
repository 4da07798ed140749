"""The draft model of speculative decoding: a smaller model with the target's tokenizer, run in the
worker right after each target step to propose the next step's drafts.

Its KV layers share the target's blocks (one allocation holds both; the same block tables and
slots address them), so the core's block accounting is the target's plus a few lookahead slots.
Invariant: at the start of a step the draft's KV is valid wherever the target's is, positions
[0, num_computed). After the target step the draft runs over the same real tokens from there: the
scheduled ones that stay (a prefill chunk, or the last token and the accepted drafts) and the
token just sampled, in one pass over the batch (its last position's logits give draft 1), then
k - 1 single-token passes, each writing the previous draft's KV into the lookahead slots. A
rejected draft's KV is rewritten by the next step's first pass, as the target's is.

A draft model with linear-attention layers (Qwen3-Next) keeps a state per request, which a pass
moves for good, so the invariant is kept by a copy: each first pass saves the request's states
where its next step will start (after every token of the pass but the one just sampled) into the
request's resume slot, and the next first pass starts from there (or, at a request's first step
after a prefix hit, from the prefix-caching slot the target resumes from; the draft saves those
boundaries too). The k - 1 single-token passes move the states past that point; the copy makes
them harmless.

A request samples its drafts from the draft model's distribution q with its own temperature and
top-k / top-p / min-p (greedy: the argmax); q is kept for the verification, which needs q(d).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from octavo.core.contract import SchedulerOutput
from octavo.kernels.attention_backend import CPU_ATTN
from octavo.kernels.paged_attention import StepLayout, check_chunk, step_layout
from octavo.model.context import forward_context, step_context
from octavo.worker.input_batch import InputBatch
from octavo.worker.sampler import Sampler, SamplingBatch

_DRAFT_SALT = 0x5EED_D4AF  # draft noise is drawn apart from the target's at the same position


class DraftModel:
    def __init__(self, model: nn.Module, device: torch.device, num_speculative_tokens: int,
                 block_size: int, seed: int, sliding_window: int | None = None,
                 attention_chunk: int | None = None) -> None:
        self.model = model
        self.device = device
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.sliding_window, self.attention_chunk = sliding_window, attention_chunk
        check_chunk(attention_chunk, block_size)
        self.kv_caches: list[torch.Tensor] = []  # one per draft layer, on the target's blocks
        self.attention_backend = CPU_ATTN  # the target's (the worker sets it)
        self.sampler = Sampler(seed ^ _DRAFT_SALT, device)
        # request id -> (its drafts, q of each [num_drafts, V]); q only for random rows
        self.proposed: dict[str, tuple[list[int], torch.Tensor | None]] = {}
        # linear-attention layers: their checkpoint slots are prefix caching's, then one per
        # batch row from resume_slots (the worker sets it when it allocates them)
        self.state_layers = [m for m in model.modules() if hasattr(m, "restore_states")]
        self.resume_slots = 0

    def forget(self, req_id: str) -> None:
        self.proposed.pop(req_id, None)

    def draft_probs(self, req_id: str, drafts: list[int]) -> torch.Tensor | None:
        """q of each of `drafts` (a prefix of what was proposed for the request), or None when
        the request is greedy (or the drafts are not this model's)."""
        tokens, q = self.proposed.get(req_id, ((), None))
        if q is None or list(tokens[:len(drafts)]) != drafts:
            return None
        return q[:len(drafts)]

    def _forward(self, input_ids: np.ndarray, layout: StepLayout, tables: np.ndarray,
                 rows: np.ndarray, computed: np.ndarray,
                 state_saves: np.ndarray | None = None) -> torch.Tensor:
        context = step_context(layout, tables, self.block_size, self.kv_caches,
                               self.sliding_window, self.device,
                               attention_chunk=self.attention_chunk,
                               backend=self.attention_backend)
        context.batch_rows, context.num_computed = rows, computed
        context.state_saves = state_saves
        with forward_context(context):
            return self.model(torch.from_numpy(input_ids).to(self.device),
                              torch.from_numpy(layout.positions).to(self.device))

    @torch.inference_mode()
    def propose(self, b: InputBatch, req_ids: list[str], rows: np.ndarray, computed: np.ndarray,
                ends: np.ndarray, sampled: np.ndarray,
                sched: SchedulerOutput) -> dict[str, list[int]]:
        """Run the draft over positions [computed, ends) of each scheduled request (its real
        tokens of this step, including those just sampled: the runner writes them past the
        batch's counted tokens, and the next step's delta appends them) and propose up to k
        drafts for the requests that sampled (`sampled`: bool per request), within their
        allocated slots. rows: the requests' batch rows; sched: the step (its saved states).
        Returns request id -> drafts."""
        for req_id in req_ids:
            self.forget(req_id)
        slots = b.num_blocks[rows] * self.block_size
        resume = ends - sampled  # where each request's next step starts
        ends = np.minimum(ends, slots)  # the core allocates enough; never write past a table
        query_lens = ends - computed
        live = query_lens > 0
        if not live.any():
            return {}
        rows, computed, ends, sampled, slots, resume = (
            rows[live], computed[live], ends[live], sampled[live], slots[live], resume[live])
        ids = [r for r, keep in zip(req_ids, live) if keep]
        query_lens = query_lens[live]
        saves = self._resume_states(ids, rows, computed, resume - computed, query_lens, sched)
        # Draft 1 only where the pass reached the request's last token.
        sampled &= ends >= b.num_tokens[rows]
        layout = step_layout(query_lens, ends)
        hidden = self._forward(b.token_ids[rows[layout.req_of_token], layout.positions], layout,
                               b.block_table[rows], rows, computed, saves)
        starts = layout.starts
        sel = np.flatnonzero(sampled)
        if not len(sel):
            return {}
        rows, ends, slots, ids = rows[sel], ends[sel], slots[sel], [ids[i] for i in sel]
        logits = self.model.compute_logits(hidden[torch.from_numpy(starts[sel] + query_lens[sel]
                                                                   - 1)])
        batch = b.random_sampling(rows, self.device)
        keep_q = not batch.all_greedy
        tokens = np.zeros((len(rows), self.k), np.int64)
        counts = np.zeros(len(rows), np.int64)
        probs: list[torch.Tensor] = []  # step s: [active rows, V] (random rows only)
        active = np.arange(len(rows))
        for s in range(self.k):
            if s:  # feed draft s at position ends - 1 + s; it needs that slot
                active = active[ends[active] - 1 + s < slots[active]]
                if not len(active):
                    break
                pos = ends[active] - 1 + s
                hidden = self._forward(tokens[active, s - 1],
                                       step_layout(np.ones(len(active), np.int64), pos + 1),
                                       b.block_table[rows[active]], rows[active], pos)
                logits = self.model.compute_logits(hidden)
                batch = b.random_sampling(rows[active], self.device)
            out, q = self._sample(logits, batch, b, rows[active], ends[active] + s, keep_q)
            tokens[active, s] = out
            counts[active] += 1
            if q is not None:
                probs.append(torch.zeros(len(rows), q.shape[1], device=self.device)
                             .index_copy_(0, torch.from_numpy(active).to(self.device), q))
        q_all = torch.stack(probs, dim=1) if probs else None  # [R, steps, V]
        result = {}
        for i, req_id in enumerate(ids):
            drafts = tokens[i, :counts[i]].tolist()
            result[req_id] = drafts
            greedy = b.temperature[rows[i]] < 1e-5
            self.proposed[req_id] = (drafts, None if greedy or q_all is None
                                     else q_all[i, :counts[i]].clone())
        return result

    def _resume_states(self, ids: list[str], rows: np.ndarray, computed: np.ndarray,
                       keep: np.ndarray, query_lens: np.ndarray,
                       sched: SchedulerOutput) -> np.ndarray | None:
        """Before the first pass, with linear-attention layers: each request's states after its
        computed tokens put back in its row; the pass's state saves ([n, 3], as ForwardContext
        has them): the boundaries the core planned and, after the first `keep` tokens, the
        request's resume slot."""
        if not self.state_layers:
            return None
        saves, resumed = [], np.flatnonzero(computed)  # 0 computed: the layers start it empty
        slots = np.fromiter((sched.state_restores.get(ids[i], self.resume_slots + int(rows[i]))
                             for i in resumed), np.int64, len(resumed))
        for layer in self.state_layers if len(resumed) else ():
            layer.restore_states(rows[resumed], slots)
        for i, req_id in enumerate(ids):
            row = int(rows[i])
            if not 0 < keep[i] <= query_lens[i]:
                raise RuntimeError(f"the draft model's pass over {req_id!r} does not reach "
                                   f"where its next step starts")
            planned = [(t, slot) for t, slot in sched.state_saves.get(req_id, ())
                       if t <= query_lens[i]]
            saves += [(i, t, slot) for t, slot in
                      sorted([*planned, (int(keep[i]), self.resume_slots + row)])]
        return np.array(saves, np.int64)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, b: InputBatch,
                rows: np.ndarray, positions: np.ndarray, keep_q: bool
                ) -> tuple[np.ndarray, torch.Tensor | None]:
        """One draft token per row (the one for token position `positions`), and q
        ([rows, V]) when keep_q."""
        greedy_tokens = logits.argmax(dim=-1)
        if not keep_q:
            return greedy_tokens.cpu().numpy(), None
        q = Sampler.probabilities(logits, batch)
        seeds = b.row_seeds(rows, positions, _DRAFT_SALT)
        drawn = (q / self.sampler.exponential_noise(q, seeds)).argmax(dim=-1)
        return torch.where(batch.greedy, greedy_tokens, drawn).cpu().numpy(), q

