"""Expert parallelism on local processes (--enable-expert-parallel over two tensor-parallel
ranks, and over context-parallel ranks or data-parallel replicas whose tokens differ:
all-to-all): each rank holds whole
experts, its share of them, and the outputs equal transformers' on the
same weights (the tensor-parallel test's criterion: greedy tokens agree, or at the first
divergence each side's token is in the other's top 5; prompt logprobs within 1e-2 in
float32)."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM
from octavo.distributed.parallel_state import RankPlacement
from octavo.model.layers.moe import FusedMoE
from tests.distributed.test_sharded_loading import _load
from tests.distributed.test_tensor_parallel import (NEW, PROMPT_LEN, _check, _prompt,
                                                    _reference, _run)
from tests.parity.test_tiny_models import _build


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral", "qwen2-moe", "gpt-oss"])
def test_two_expert_parallel_ranks_match_transformers(tmp_path, smollm_oracle_folder, name):
    folder, ref = _build(tmp_path, smollm_oracle_folder, name)
    prompt = _prompt()
    expected = _reference(ref, prompt)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        outs = _run(llm, [prompt])
        # each rank's load: every computed token's top-k rows in every MoE layer, in all
        routed = llm.engine.client.stats().expert_tokens
        cfg = ref.config
        dense = getattr(cfg, "mlp_only_layers", None) or []
        top_k = cfg.num_experts_per_tok
        moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if i not in dense)
        assert len(routed) == 2 and min(routed) > 0
        assert sum(routed) == (PROMPT_LEN + NEW - 1) * top_k * moe_layers
        for out in outs + _run(llm, [prompt]):
            _check(out, prompt, *expected)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name, tp", [("qwen3-moe", 1), ("mixtral", 1), ("qwen3-moe", 2)])
def test_experts_dispatched_across_context_parallel_ranks(tmp_path, smollm_oracle_folder, name,
                                                          tp):
    """Prefill context parallelism over two ranks (each tp ranks) with expert parallelism: a
    step's tokens are split, so the ranks of the two halves send each row to its expert's rank
    and back (all-to-all); a step of decodes is not split: both compute it, each dispatching its
    own rows. Each rank holds num_experts / (2 tp) whole experts; the outputs equal
    transformers'; each rank's load is counted where computed."""
    folder, ref = _build(tmp_path, smollm_oracle_folder, name)
    prompt = _prompt(4)[:-1]  # 149 tokens: the last chunk, 21, splits 11 + 10 and a padding row
    expected = _reference(ref, prompt)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, tensor_parallel_size=tp, enable_expert_parallel=True,
              prefill_context_parallel_size=2)
    try:
        for out in _run(llm, [prompt]):
            _check(out, prompt, *expected)
        routed = llm.engine.client.stats().expert_tokens
        cfg = ref.config
        experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        assert len(routed) == 2 * tp and min(routed) > 0
        # every computed token's top-k rows in each layer, each on one rank: the prompt's split
        # chunks (the padding row sent nowhere), and the decodes, which both context-parallel
        # ranks compute (each its own routing, whose rows come back to it alone)
        assert sum(routed) == (len(prompt) + 2 * (NEW - 1)) * cfg.num_experts_per_tok * \
            cfg.num_hidden_layers
        assert experts % (2 * tp) == 0
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tp, cp, dp", [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2)])
def test_every_expert_lives_on_one_rank(tmp_path, smollm_oracle_folder, monkeypatch, tp, cp, dp):
    """Loaded in this process as each rank of tp x cp in each of dp replicas whose experts
    span them, every MoE layer holds whole experts (the full intermediate width), the ranks'
    experts partition the mixture's, and each equals the single-process load's."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-moe")
    whole, _ = _load(folder, RankPlacement(0), monkeypatch)
    layers = {n: m for n, m in whole.named_modules() if isinstance(m, FusedMoE)}
    held: dict[str, list[int]] = {n: [] for n in layers}
    for replica in range(dp):
        for rank in range(tp * cp):
            model, _ = _load(folder, RankPlacement(rank, tp_size=tp, expert_parallel=True,
                                                    cp_size=cp, dp_size=dp, dp_rank=replica),
                             monkeypatch)
            for name, moe in model.named_modules():
                if not isinstance(moe, FusedMoE):
                    continue
                full = layers[name]
                assert moe.w13.shape == (full.num_experts // (tp * cp * dp), *full.w13.shape[1:])
                for local in range(moe.num_local):
                    expert = moe.first_expert + local
                    held[name].append(expert)
                    assert torch.equal(moe.w13[local], full.w13[expert])
                    assert torch.equal(moe.w2[local], full.w2[expert])
    assert all(sorted(e) == list(range(layers[n].num_experts)) for n, e in held.items())


def test_experts_that_do_not_divide_are_refused(tmp_path, smollm_oracle_folder, monkeypatch):
    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-moe-unnormalized")  # 5 experts
    with pytest.raises(ValueError, match=r"num_experts \(5\) is not divisible"):
        _load(folder, RankPlacement(0, tp_size=2, expert_parallel=True), monkeypatch)


def test_expert_adapters_under_expert_parallelism(tmp_path_factory, smollm_oracle_folder):
    """A rank keeps the adapter pairs of the experts it holds: a mixed batch gives peft's
    outputs."""
    pytest.importorskip("peft")
    from tests.parity.test_lora import _check as check_lora
    from tests.parity.test_lora import _generate, build_family

    folder, adapters, prompts, expected = build_family("qwen3-moe", tmp_path_factory,
                                                       smollm_oracle_folder)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              tensor_parallel_size=2, enable_expert_parallel=True, enable_lora=True,
              max_loras=3, max_lora_rank=16)
    try:
        cases = [(lora, j) for j in (0, 2) for lora in [None, *adapters]]
        check_lora(_generate(llm, cases, prompts), cases, expected)
    finally:
        llm.engine.shutdown()


def test_quantized_experts_on_expert_parallel_ranks(tmp_path, smollm_oracle_folder):
    """int4 at load on whole experts (one Linear per held expert and projection): against the
    single-process engine with the same quantization, whose experts are quantized alike."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, "mixtral")
    prompt = _prompt(2)
    kwargs = dict(dtype="float32", max_model_len=256, quantization="int4",
                  kv_cache_memory=16 << 20)
    single = LLM(str(folder), **kwargs)
    exp = _run(single, [prompt])[0]
    single.engine.shutdown()
    scored = torch.tensor([exp.prompt_logprobs[p][prompt[p]].logprob
                           for p in range(1, len(prompt))])
    llm = LLM(str(folder), tensor_parallel_size=2, enable_expert_parallel=True, **kwargs)
    try:
        ref = exp.outputs[0]
        _check(_run(llm, [prompt])[0], prompt, ref.token_ids, [list(d) for d in ref.logprobs],
               scored)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("name, tp", [("qwen3-moe", 1), ("mixtral", 1), ("qwen3-moe", 2)])
def test_experts_span_data_parallel_replicas(tmp_path, smollm_oracle_folder, name, tp):
    """Two replicas (a core process each, itself tp ranks) whose experts are partitioned over
    all their ranks: each
    replica's batch is its own, its rows go to their experts' replica and back, and a replica
    with nothing left (its one request done) runs empty steps while the other finishes. Every
    request's output equals transformers'; each replica reports the rows its own experts
    computed, the two adding up to every computed token's top-k rows in every layer."""
    folder, ref = _build(tmp_path, smollm_oracle_folder, name)
    prompts = [_prompt(1), _prompt(2)[:40], _prompt(3)[:90]]
    expected = [_reference(ref, p) for p in prompts]
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, data_parallel_size=2, enable_expert_parallel=True,
              tensor_parallel_size=tp)
    try:
        outs = _run(llm, prompts)
        for out, prompt, exp in zip(outs, prompts, expected):
            _check(out, prompt, *exp)
        replicas = llm.engine.client.replicas
        assert all(r.stats.prefix_cache_queries > 0 for r in replicas)  # both ran requests
        routed = llm.engine.client.stats().expert_tokens
        cfg = ref.config
        assert len(routed) == 2 * tp and min(routed) > 0
        assert sum(routed) == sum(len(p) + NEW - 1 for p in prompts) * \
            cfg.num_experts_per_tok * cfg.num_hidden_layers
        # one request alone: the other replica only lends its experts
        for out in _run(llm, prompts[:1]):
            _check(out, prompts[0], *expected[0])
    finally:
        llm.engine.shutdown()
    assert not any(r.process.is_alive() for r in replicas)
