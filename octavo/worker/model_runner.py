"""The hot path: turn a SchedulerOutput into one forward pass over the mixed batch and sample.

Speculative decoding: a request's draft tokens are scheduled after its last token, so the same
forward pass computes them (a multi-token query over the existing context, like a prefill chunk);
the logits at every position of its span are sampled by the request's own pipeline, each position
after the drafts before it, and `spec.rejection.accept_drafts` keeps what is accepted. With a draft
model (`spec.draft`), the verification uses the draft's distribution of each draft, and after the
step the draft model proposes the next step's drafts, which go back in the output.

The batch's tokens come only from the SchedulerOutputs (a running request's delta carries the
tokens the core accepted from its previous step): what this rank samples goes back to the core
and nowhere else, so a rank that does not sample holds the same state. The tokens a step emits
are written past the counted ones only for the draft model, which runs over them right away.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from octavo.core.contract import GrammarBitmask, ModelOutput, SchedulerOutput, TopLogprobs
from octavo.kernels.attention_backend import CPU_ATTN
from octavo.kernels.context_parallel import ContextParallel
from octavo.kernels.paged_attention import StepLayout, check_chunk, step_layout
from octavo.model.context import ForwardContext, forward_context, step_context
from octavo.model.context_parallel import gather_rows, own_rows
from octavo.model.pipeline import is_last_stage
from octavo.model.pooler import pool_requests
from octavo.pooling_params import PoolingParams
from octavo.worker.decode_graphs import DecodeGraphs
from octavo.worker.input_batch import InputBatch
from octavo.worker.lora import LoRAManager, slots_of
from octavo.worker.sampler import Sampler, SamplingBatch, gather_logprobs
from octavo.worker.spec.draft import DraftModel
from octavo.worker.spec.rejection import accept_drafts
from octavo.worker.spec.verified_spans import VerifiedSpans


@dataclass
class SamplingEntries:
    """A step's sampling entries [E]: the InputBatch row each samples for, its place among the
    row's verified positions (0 for the first), its token in the step's hidden states, each
    sampling request's drafts, and the sampler's inputs."""

    rows: np.ndarray
    positions: np.ndarray
    token_idx: np.ndarray
    req_drafts: list[list[int]]
    batch: SamplingBatch


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, max_num_seqs: int,
                 max_model_len: int, block_size: int, vocab_size: int, seed: int,
                 sliding_window: int | None = None,
                 context_parallel: ContextParallel | None = None,
                 attention_chunk: int | None = None) -> None:
        """block_size: tokens of a core block (under decode context parallelism, a block on
        each rank of the group); sliding_window, attention_chunk: the model's local layers'
        (ArchConfig)."""
        self.model = model
        self.context_parallel = context_parallel
        self.device = device
        self.block_size = block_size
        self.sliding_window, self.attention_chunk = sliding_window, attention_chunk
        check_chunk(attention_chunk, block_size)
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, vocab_size, device)
        self.sampler = Sampler(seed, device)
        self.kv_caches: list[torch.Tensor] = []
        self.drafter: DraftModel | None = None  # draft-model speculative decoding
        # linear-attention layers: their states wait on verdicts, and resume from saved ones
        self.recurrent_layers = [m for m in model.modules() if hasattr(m, "restore_states")]
        self.verified_spans = VerifiedSpans(self.recurrent_layers)
        self.lora: LoRAManager | None = None  # with --enable-lora
        self.graphs: DecodeGraphs | None = None  # CUDA graphs of decode steps
        self.attention_backend = CPU_ATTN  # the worker's choice (kernels/attention_backend.py)
        self.pooling: dict[str, PoolingParams] = {}  # the pooling requests in the batch
        # a decoder's pooling request whose prompt runs in chunks: the hidden states and input
        # ids of its chunks so far, pooled with its last one
        self.pooling_chunks: dict[str, list[tuple[torch.Tensor, np.ndarray]]] = {}

    def update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.batch.remove(req_id)
            self.pooling.pop(req_id, None)
            self.pooling_chunks.pop(req_id, None)
            if self.drafter is not None:
                self.drafter.forget(req_id)
            self.verified_spans.forget(req_id)
        for new in sched.new_requests:
            self.batch.add(new)
            if new.pooling_params is not None:
                self.pooling[new.req_id] = new.pooling_params
            if new.lora_request is not None:
                self.lora.register(new.lora_request)
        self.batch.update(sched.cached_requests)
        self.verified_spans.settle(sched, self.batch)
        if sched.state_restores:  # requests resumed from a cached prefix
            rows = np.fromiter((self.batch.row_of[r] for r in sched.state_restores), np.int64)
            slots = np.fromiter(sched.state_restores.values(), np.int64)
            for layer in self.recurrent_layers:
                layer.restore_states(rows, slots)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.update_states(sched)
        b = self.batch
        req_ids = list(sched.num_scheduled_tokens)
        if not req_ids:
            return ModelOutput([], [])
        rows = np.fromiter((b.row_of[r] for r in req_ids), np.int64, len(req_ids))
        drafts = sched.spec_token_ids
        for req_id, tokens in drafts.items():  # a few short lists: the verification's inputs
            b.write_drafts(b.row_of[req_id], tokens)
        query_lens = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, len(req_ids))
        computed = b.num_computed[rows]
        layout = step_layout(query_lens, computed + query_lens)
        seq_lens, starts, ends = layout.seq_lens, layout.starts, layout.ends
        input_ids = b.token_ids[rows[layout.req_of_token], layout.positions]

        graph = self._decode_graph(sched, layout)
        if self.model.is_encoder or graph is not None:  # no plan: whole sequences; the graph's
            context = ForwardContext(None, [] if graph is None else self.kv_caches, layout=layout)
        else:
            context = step_context(layout, b.block_table[rows], self.block_size, self.kv_caches,
                                   self.sliding_window, self.device, self.context_parallel,
                                   self.attention_chunk, self.attention_backend)
        last_stage = is_last_stage()  # else its hidden states go on to the next stage
        sampling = seq_lens >= b.num_tokens[rows]
        pools = np.zeros(len(req_ids), bool)
        if self.pooling:  # pooled, not sampled: whole in this step
            pools = np.fromiter((r in self.pooling for r in req_ids), bool, len(req_ids))
            sampling &= ~pools
        sample_idx = np.flatnonzero(sampling) if last_stage else np.zeros(0, np.int64)
        # Everything the sampler takes is prepared before the forward pass: the pass streams
        # the weights through the caches, and the first numpy calls after it run cold.
        entries = self._entries(sched, req_ids, rows, ends, sample_idx) if len(sample_idx) else None
        context.batch_rows, context.num_computed = rows, computed
        if sched.state_saves:
            index = {r: i for i, r in enumerate(req_ids)}
            context.state_saves = np.array([(index[r], tokens, slot) for r, saves in
                                            sched.state_saves.items() for tokens, slot in saves],
                                           np.int64)
        if drafts and self.verified_spans.layers:  # only recurrent states wait on verdicts
            context.num_drafts = np.fromiter((len(drafts.get(r, ())) for r in req_ids), np.int64,
                                             len(req_ids))
            self.verified_spans.hold(req_ids, rows, computed, context.num_drafts)
        if b.rows_with_lora:
            context.lora = self.lora.step(b.lora_id[rows][layout.req_of_token])
        cp_step = context.context_parallel
        if graph is not None:  # the graph copies its inputs in itself
            hidden = self.graphs.run(graph, input_ids, layout.positions, b.block_table[rows],
                                     None if context.lora is None else context.lora.token_slot)
        else:
            input_ids_t = torch.from_numpy(input_ids).to(self.device)
            positions_t = torch.from_numpy(layout.positions).to(self.device)
            if cp_step is not None:  # with split tokens, this rank runs its share of them
                input_ids_t, positions_t = own_rows(cp_step, input_ids_t), own_rows(
                    cp_step, positions_t)
            with forward_context(context):
                hidden = self.model(input_ids_t, positions_t)
        if not last_stage:
            return ModelOutput(req_ids, [[] for _ in req_ids])
        if cp_step is not None:
            hidden = gather_rows(cp_step, hidden)

        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        num_emitted = np.zeros(len(req_ids), np.int64)
        logprobs: dict[str, TopLogprobs] = {}
        if entries is not None:
            n = len(sample_idx)
            # Plain decoding samples every token of the step: hidden is already the rows.
            rows_hidden = hidden
            if len(entries.token_idx) != len(hidden):
                rows_hidden = hidden.index_select(
                    0, torch.from_numpy(entries.token_idx).to(self.device))
            logits = self._logits(context, rows_hidden, b.lora_id[entries.rows])
            tokens, top = self.sampler(logits, entries.batch)
            tokens_np = tokens.cpu().numpy()
            emitted, emitted_idx = accept_drafts(tokens_np, entries.req_drafts)
            if self.drafter is not None:
                b.write_ahead(entries.rows[emitted_idx], entries.positions[emitted_idx],
                              tokens_np[emitted_idx])
                num_emitted[sample_idx] = [len(e) for e in emitted]
            if n == len(req_ids):
                sampled_lists = emitted
            else:
                for j, i in enumerate(sample_idx.tolist()):
                    sampled_lists[i] = emitted[j]
            if top is not None:
                offset = 0
                for j, i in enumerate(sample_idx.tolist()):
                    sel = emitted_idx[offset:offset + len(emitted[j])]
                    offset += len(emitted[j])
                    if b.num_logprobs[rows[i]] >= 0:
                        logprobs[req_ids[i]] = top.select(sel, int(b.num_logprobs[rows[i]]) + 1)
        prompt_logprobs = self._prompt_logprobs(req_ids, rows, computed, seq_lens, starts, hidden,
                                                context)
        pooled = self._pool(hidden, req_ids, np.flatnonzero(pools), starts, ends, input_ids,
                            seq_lens >= b.num_tokens[rows]) if pools.any() else {}
        proposed = {}
        if self.drafter is not None:
            # The draft runs over this step's real tokens: the whole chunk of a request that
            # did not sample, else up to and including the tokens it just emitted.
            ends = np.where(sampling, b.num_tokens[rows] + num_emitted, seq_lens)
            proposed = self.drafter.propose(b, req_ids, rows, computed, ends, sampling, sched)
        return ModelOutput(req_ids, sampled_lists, logprobs, prompt_logprobs, proposed,
                           pooled=pooled)

    @torch.inference_mode()
    def largest_step(self, kv_caches: list[torch.Tensor], num_tokens: int,
                     sample_rows: int) -> None:
        """The forward of one fresh request of `num_tokens` tokens over `kv_caches` (its blocks
        from 0), then the LM head and a log-softmax over `sample_rows` rows: the memory of the
        largest step (worker/memory.py profiles it). Recurrent states: batch row 0's."""
        layout = step_layout(np.array([num_tokens]), np.array([num_tokens]))
        tables = np.arange(-(-num_tokens // self.block_size), dtype=np.int64)[None]
        context = step_context(layout, tables, self.block_size, kv_caches, self.sliding_window,
                               self.device, self.context_parallel, self.attention_chunk,
                               self.attention_backend)
        context.batch_rows = context.num_computed = np.zeros(1, np.int64)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        if context.context_parallel is not None:
            input_ids = own_rows(context.context_parallel, input_ids)
            positions = own_rows(context.context_parallel, positions)
        with forward_context(context):
            hidden = self.model(input_ids, positions)
        if is_last_stage():
            logits = self.model.compute_logits(hidden[-sample_rows:])
            torch.log_softmax(logits.float(), -1)

    def _decode_graph(self, sched: SchedulerOutput, layout: StepLayout) -> tuple[int, int] | None:
        """The CUDA graph bucket that runs this step (worker/decode_graphs.py): a step of one
        new token per request, none of them with drafts or a state to save, whose graph is
        captured (else it is asked for, and the step runs eagerly)."""
        g = self.graphs
        if (g is None or layout.num_tokens != len(layout.query_lens) or sched.spec_token_ids
                or sched.state_saves):
            return None
        key = g.bucket(len(layout.query_lens), int(layout.seq_lens.max()))
        return key if key is not None and g.ready(key) else None

    def _pool(self, hidden: torch.Tensor, req_ids: list[str], which: np.ndarray,
              starts: np.ndarray, ends: np.ndarray, token_ids: np.ndarray,
              done: np.ndarray) -> dict[str, np.ndarray]:
        """The outputs of the pooling requests (`which` of req_ids) whose prompt this step
        ends (`done`), from their rows [starts, ends) of the step's hidden states, each as
        its task asks (model/pooler.py); the others' chunks are kept until their last."""
        for i in which[~done[which]]:
            self.pooling_chunks.setdefault(req_ids[i], []).append(
                (hidden[starts[i]:ends[i]].clone(), token_ids[starts[i]:ends[i]]))
        which = which[done[which]]
        if not len(which):
            return {}
        ids = [req_ids[i] for i in which]
        starts, ends = starts[which], ends[which]
        if any(r in self.pooling_chunks for r in ids):  # pool their rows joined up
            parts = [self.pooling_chunks.pop(r, []) + [(hidden[s:e], token_ids[s:e])]
                     for r, s, e in zip(ids, starts, ends)]
            hidden = torch.cat([h for part in parts for h, _ in part])
            token_ids = np.concatenate([t for part in parts for _, t in part])
            lengths = np.array([sum(len(t) for _, t in part) for part in parts])
            ends = np.cumsum(lengths)
            starts = ends - lengths
        outs = pool_requests(self.model, hidden, [self.pooling[r] for r in ids], starts, ends,
                             token_ids)
        return dict(zip(ids, outs))

    def _logits(self, context: ForwardContext, hidden: torch.Tensor,
                lora_of: np.ndarray) -> torch.Tensor:
        """The LM head over these rows, each with its adapter (lora_of: their ids)."""
        if context.lora is None:
            return self.model.compute_logits(hidden)
        context.lora.sample_slot = slots_of(lora_of, context.lora.slot_of).to(self.device)
        with forward_context(context):
            return self.model.compute_logits(hidden)

    def _entries(self, sched: SchedulerOutput, req_ids: list[str], rows: np.ndarray,
                 ends: np.ndarray, sample_idx: np.ndarray) -> SamplingEntries:
        """The step's sampling entries: one per verified position of the requests that sample
        (request i's last 1 + len(drafts) tokens), with their sampling inputs."""
        b, drafts, n = self.batch, sched.spec_token_ids, len(sample_idx)
        if drafts:
            req_drafts = [drafts.get(req_ids[i], []) for i in sample_idx]
            num_pos = np.fromiter((1 + len(d) for d in req_drafts), np.int64, n)
            first_entry = np.cumsum(num_pos) - num_pos
            entry_req = np.repeat(np.arange(n), num_pos)  # [E]
            entry_pos = np.arange(int(num_pos.sum())) - first_entry[entry_req]
            entry_rows = rows[sample_idx][entry_req]
            token_idx = (ends[sample_idx] - num_pos)[entry_req] + entry_pos
            lengths = b.num_tokens[entry_rows] + entry_pos
        else:  # plain decoding: one entry per request, at its last token
            req_drafts = [[]] * n
            first_entry, entry_pos = np.arange(n), np.zeros(n, np.int64)
            entry_rows, token_idx, lengths = rows[sample_idx], ends[sample_idx] - 1, None
        batch = b.sampling_batch(entry_rows, self.device, lengths)
        if sched.grammar is not None:  # one row per verified position
            self._add_grammar(batch, sched.grammar,
                              {req_ids[i]: int(e) for i, e in zip(sample_idx, first_entry)})
        if self.drafter is not None and not batch.all_greedy:
            self._add_draft_probs(batch, [req_ids[i] for i in sample_idx], req_drafts,
                                  first_entry)
        return SamplingEntries(entry_rows, entry_pos, token_idx, req_drafts, batch)

    def _add_draft_probs(self, batch: SamplingBatch, ids: list[str], drafts: list[list[int]],
                         first_entry: np.ndarray) -> None:
        """Point the sampler at the draft model's q for each verified draft it proposed (random
        rows; greedy rows and n-gram drafts need none)."""
        entries, tokens, probs = [], [], []
        for req_id, d, first in zip(ids, drafts, first_entry.tolist()):
            q = self.drafter.draft_probs(req_id, d) if d else None
            if q is not None:
                entries.extend(range(first, first + len(d)))
                tokens.extend(d)
                probs.append(q)
        if entries:
            batch.draft_rows = torch.tensor(entries, device=self.device)
            batch.draft_tokens = torch.tensor(tokens, device=self.device)
            batch.draft_probs = torch.cat(probs)

    def _add_grammar(self, batch: SamplingBatch, grammar: GrammarBitmask,
                     row_of: dict[str, int]) -> None:
        """Point the core's bitmask rows at the sampling entries: `row_of` gives each request's
        first (every constrained request in it samples this step: the core filled it for exactly
        those), and a request with drafts has its next rows at its next entries."""
        seen: dict[str, int] = {}
        entries = []
        for rid in grammar.req_ids:
            entries.append(row_of[rid] + seen.get(rid, 0))
            seen[rid] = seen.get(rid, 0) + 1
        batch.grammar_rows = torch.tensor(entries, device=self.device)
        batch.grammar_bitmask = torch.from_numpy(grammar.bitmask).to(self.device)

    def _prompt_logprobs(self, req_ids: list[str], rows: np.ndarray, computed: np.ndarray,
                         seq_lens: np.ndarray, starts: np.ndarray, hidden: torch.Tensor,
                         context: ForwardContext) -> dict[str, TopLogprobs]:
        """Logprobs of prompt tokens 1.. (position p's logits score token p + 1)."""
        b = self.batch
        out: dict[str, TopLogprobs] = {}
        if not b.rows_using["prompt_logprobs"]:
            return out
        for i in np.flatnonzero(b.num_prompt_logprobs[rows] >= 0).tolist():
            row = rows[i]
            last = min(int(seq_lens[i]), int(b.num_prompt_tokens[row]) - 1)
            first = int(computed[i])
            if last <= first:
                continue
            idx = torch.arange(first, last) - first + int(starts[i])
            logits = self._logits(context, hidden[idx], np.full(len(idx), b.lora_id[row]))
            targets = torch.from_numpy(b.token_ids[row, first + 1:last + 1]).to(self.device)
            out[req_ids[i]] = gather_logprobs(torch.log_softmax(logits, -1), targets,
                                              int(b.num_prompt_logprobs[row]))
        return out
