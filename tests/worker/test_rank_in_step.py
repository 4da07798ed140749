"""The core↔worker contract carries everything a rank needs to stay in step (issue 27): a running
request's delta brings the tokens the core accepted since the worker last saw it, and a new one
its own EOS ids. A second ModelRunner fed only the same SchedulerOutputs, whose sampler returns
junk, holds the same batch state and writes the same KV as the rank that samples, through
n-gram speculation with rejections, preemption, chunked prefill, penalties, min_tokens and prompt
logprobs; two requests with different EOS ids each have their own masked under min_tokens."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.core.request import Request
from octavo.worker.model_runner import ModelRunner

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
BLOCK = 16
# The tiny Llama's KV per block: k and v, 2 layers, 2 KV heads of 16, float32.
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smollm_oracle_folder):
    from tests.parity.test_tiny_models import _build

    folder, _ = _build(tmp_path_factory.mktemp("rank"), smollm_oracle_folder, "llama-default")
    return LLM(str(folder), dtype="float32", max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=32, block_size=BLOCK, kv_cache_memory=8 * BLOCK_BYTES,
               num_threads=1, speculative_config=SPEC)


class JunkSampler:
    """What a rank that does not sample would return: nothing of the model's."""

    def __call__(self, logits: torch.Tensor, batch) -> tuple[torch.Tensor, None]:
        return torch.full((logits.shape[0],), 7, dtype=torch.int64), None


def _row_state(runner: ModelRunner, req_id: str) -> tuple:
    b = runner.batch
    row = b.row_of[req_id]
    n = int(b.num_tokens[row])
    return (b.token_ids[row, :n].tolist(), int(b.num_prompt_tokens[row]),
            int(b.num_computed[row]), b.block_table[row, :b.num_blocks[row]].tolist(),
            sorted(b.eos[row]), b.params[row])


def test_a_rank_that_does_not_sample_stays_in_step(llm, monkeypatch):
    core = llm.engine.client.core
    runner = core.executor.worker.runner
    rank = ModelRunner(runner.model, runner.device, 4, 128, BLOCK, runner.batch.vocab_size,
                       seed=0)
    rank.kv_caches = [torch.zeros_like(c) for c in runner.kv_caches]
    rank.sampler = JunkSampler()
    real_execute = core.executor.execute
    seen = {"steps": 0, "multi_token_deltas": 0, "verifications": 0}
    problems: list[str] = []  # collected, not raised: the core would take a raise for a fault

    def execute(sched):
        out = real_execute(sched)
        rank.execute(sched)  # the same SchedulerOutput, its own (junk) samples
        step = seen["steps"]
        seen["steps"] += 1
        seen["multi_token_deltas"] += sum(len(c.new_token_ids) > 1 for c in sched.cached_requests)
        seen["verifications"] += len(sched.spec_token_ids)
        if set(rank.batch.row_of) != set(runner.batch.row_of):
            problems.append(f"step {step}: other requests held")
        for req_id in runner.batch.row_of & rank.batch.row_of.keys():
            if _row_state(rank, req_id) != _row_state(runner, req_id):
                problems.append(f"step {step}: {req_id}'s row differs")
        for req_id in sched.num_scheduled_tokens:  # both hold what the core holds
            if _row_state(runner, req_id)[0] != core.scheduler.requests[req_id].all_token_ids:
                problems.append(f"step {step}: {req_id}'s tokens are not the core's")
        if not all(torch.equal(a, b) for a, b in zip(rank.kv_caches, runner.kv_caches)):
            problems.append(f"step {step}: the KV differs")  # forwards over other inputs
        return out

    monkeypatch.setattr(core.executor, "execute", execute)
    gen = torch.Generator().manual_seed(11)
    prompts = [(torch.randint(100, 49000, (n,), generator=gen).tolist() * 3) for n in (9, 12, 7)]
    prompts.append(torch.randint(100, 49000, (40,), generator=gen).tolist())
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=5),
              SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=2, ignore_eos=True)]
    before = list(core.scheduler.spec_counts), core.scheduler.num_preemptions
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert problems == []
    drafts, accepted = (core.scheduler.spec_counts[i] - before[0][i] for i in (0, 1))
    assert accepted > 0 and drafts > accepted  # drafts were accepted, and rejected
    assert core.scheduler.num_preemptions > before[1]
    assert seen["multi_token_deltas"] > 0 and seen["verifications"] > 0
    assert [len(o.outputs[0].token_ids) for o in outs] == [30, 30, 30, 12]
    assert outs[3].prompt_logprobs is not None


def test_each_request_s_eos_ids_reach_the_worker(llm):
    """Both requests share a prompt whose two likeliest first tokens are x and y: with min_tokens
    the one whose EOS is x never emits x (so starts with y), the other never y (starts with x)."""
    prompt = list(range(300, 340))
    probe = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=2),
                         use_tqdm=False)[0].outputs[0].logprobs[0]
    x, y = sorted(probe, key=lambda t: probe[t].rank)[:2]
    core = llm.engine.client.core
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0)
    core.scheduler.add_request(Request("eos-x", list(prompt), params, frozenset({x}), 4))
    core.scheduler.add_request(Request("eos-y", list(prompt), params, frozenset({y}), 4))
    tokens: dict[str, list[int]] = {"eos-x": [], "eos-y": []}
    while core.scheduler.has_unfinished_requests():
        for o in core.step():
            tokens[o.req_id] += o.new_token_ids
    assert tokens["eos-x"][0] == y and x not in tokens["eos-x"]
    assert tokens["eos-y"][0] == x and y not in tokens["eos-y"]
    assert len(tokens["eos-x"]) == len(tokens["eos-y"]) == 4
