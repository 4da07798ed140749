"""A fault in the real worker's step, caused by one request, aborts only that request: the others
in the same batch finish with the tokens they get without it (greedy, SmolLM2)."""
from __future__ import annotations

from octavo import SamplingParams

POISON_SEED = 4242  # the fault below fires for the request with this seed


def test_a_worker_fault_aborts_only_its_request(smollm_llm, monkeypatch):
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    clean = SamplingParams(max_tokens=12, temperature=0)
    expected = [o.outputs[0].token_ids for o in smollm_llm.generate(prompts, clean)]

    core = smollm_llm.engine.client.core
    real_execute = core.executor.execute
    calls = {"failed": 0}

    def execute(sched):
        requests = core.scheduler.requests
        for req_id in sched.num_scheduled_tokens:
            req = requests.get(req_id)
            if req is not None and req.sampling_params.seed == POISON_SEED \
                    and req.num_computed_tokens > 8:  # mid-prompt, not at its first chunk
                calls["failed"] += 1
                raise RuntimeError("a kernel fault caused by this request")
        return real_execute(sched)

    monkeypatch.setattr(core.executor, "execute", execute)
    poisoned = SamplingParams(max_tokens=12, temperature=0, seed=POISON_SEED)
    outs = smollm_llm.generate(["A poisoned prompt that is long enough to pass eight tokens"]
                               + prompts, [poisoned, clean, clean, clean])
    bad = outs[0].outputs[0]
    assert bad.finish_reason == "abort" and calls["failed"] >= 2  # together, then alone
    assert [o.outputs[0].token_ids for o in outs[1:]] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs[1:])
    monkeypatch.undo()
    after = smollm_llm.generate(prompts, clean)  # the engine is whole afterwards
    assert [o.outputs[0].token_ids for o in after] == expected
    assert core.scheduler.kv.pool.num_free_blocks == core.num_blocks
    batch = core.executor.worker.runner.batch  # no row is held by a request the core forgot
    assert set(batch.row_of) <= core.scheduler._finished_ids
