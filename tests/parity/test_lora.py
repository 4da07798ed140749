"""LoRA adapters against transformers + peft on the same base weights: random adapters of ranks
4, 8 and 16 made with peft at test time, mixed in one batch with base-model requests, on tiny
random models of several families (and on SmolLM2 in tests/parity/test_lora_smollm.py)."""
from __future__ import annotations

import copy

import pytest
import torch

from octavo import LLM, LoRARequest, SamplingParams
from tests.capture_guard import rerun_capture  # noqa: F401 (a fixture)
from tests.parity.test_tiny_models import _build

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, targets, rslora): every projection; two of them with rslora; every projection and
# the vocabulary layers
ADAPTERS = [(4, ALL, False), (8, ["q_proj", "v_proj"], True),
            (16, ALL + ["embed_tokens", "lm_head"], False)]
NEW_TOKENS = 6


def make_adapter(base: torch.nn.Module, rank: int, targets: list[str], rslora: bool,
                 seed: int, folder, dropout: float = 0.1, parameters: list[str] | None = None):
    """A peft LoRA adapter with random A and B (peft zeroes B by default), saved to `folder`;
    returns the peft model. On a mixture of experts, peft turns gate/up/down into pairs on
    transformers' stacked expert tensors (gate_up at twice the rank) where the model has no
    such modules, as it does with `parameters` (target_parameters); those take no dropout."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
        use_rslora=rslora, lora_dropout=dropout,  # dropout is off at inference
        target_parameters=parameters))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # deltas as large as the weights' spread, not larger
                p.mul_(0.05 if "embedding" in name else 0.5)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module", params=["llama-default", "qwen2-bias", "gemma3", "qwen3-moe"])
def family(request, tmp_path_factory, smollm_oracle_folder):
    return build_family(request.param, tmp_path_factory, smollm_oracle_folder)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, smollm_oracle_folder):
    return build_family("llama-default", tmp_path_factory, smollm_oracle_folder)


def build_family(name, tmp_path_factory, smollm_oracle_folder):
    """A tiny model, its adapters (on a mixture of experts, the first on every expert too, the
    last on attention only: its experts' gate_up pair would be of rank 32) and peft's greedy
    tokens and their logprobs for each (None: the base model) on three prompts."""
    tmp = tmp_path_factory.mktemp(name)
    folder, base = _build(tmp, smollm_oracle_folder, name)
    moe = name.startswith(("qwen3-moe", "qwen2-moe", "mixtral"))
    adapters = []
    for i, (rank, targets, rslora) in enumerate(ADAPTERS):
        path = tmp / f"adapter{i}"
        if moe and rank == 16:
            targets = [t for t in targets if t not in ("gate_proj", "up_proj", "down_proj")]
        adapters.append((LoRARequest(f"a{i}", i + 1, str(path)), make_adapter(
            base, rank, targets, rslora, 10 + i, path, 0.0 if moe else 0.1)))
    return (folder, [a for a, _ in adapters], *_expected(adapters, base))


def _expected(adapters, base):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (5, 40, 90)]
    expected = {}
    with torch.inference_mode():
        for lora, model in [(None, base)] + adapters:
            for j, p in enumerate(prompts):
                out = model.generate(input_ids=torch.tensor([p]), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, pad_token_id=0)[0]
                logits = model(input_ids=out[None]).logits[0, len(p) - 1:-1].float()
                lp = torch.log_softmax(logits, -1)
                tokens = out[len(p):]
                expected[(lora and lora.lora_int_id, j)] = (
                    tokens.tolist(), lp[torch.arange(len(tokens)), tokens])
    return prompts, expected


def _generate(llm, cases, prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    return llm.generate([prompts[j] for _, j in cases], params, use_tqdm=False,
                        lora_request=[lora for lora, _ in cases])


def _check(outs, cases, expected, atol: float = 1e-3):
    for out, (lora, j) in zip(outs, cases):
        tokens, logprobs = expected[(lora and lora.lora_int_id, j)]
        got = out.outputs[0]
        assert got.token_ids == tokens, (lora, j)
        ours = torch.tensor([lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)])
        assert torch.allclose(ours, logprobs, atol=atol), (lora, j, ours - logprobs)


@pytest.mark.parametrize("eager", [False, True], ids=["fused-stack", "eager"])
def test_mixed_adapters_match_peft(family, eager):
    """Every adapter and the base model in one batch, more adapters than slots (requests of
    the third wait for a slot), prompts in several chunks: each output equals peft's."""
    folder, adapters, prompts, expected = family
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=16,
              enforce_eager=eager)
    cases = [(lora, j) for j in range(len(prompts)) for lora in [None, *adapters]]
    _check(_generate(llm, cases, prompts), cases, expected)


def test_prompt_logprobs_with_adapters(family):
    """Prompt logprobs are the adapter's (its LM head and every layer before it)."""
    folder, adapters, prompts, expected = family
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=3, max_lora_rank=16)
    lora = adapters[2]
    full = prompts[1] + expected[(lora.lora_int_id, 1)][0]
    out = llm.generate([full], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                       use_tqdm=False, lora_request=lora)[0]
    ours = torch.tensor([out.prompt_logprobs[p][full[p]].logprob
                         for p in range(len(prompts[1]), len(full))])
    assert torch.allclose(ours, expected[(lora.lora_int_id, 1)][1], atol=1e-3)


def test_adapters_evicted_and_reloaded_give_the_same_outputs(llama):
    """One slot and one adapter in host memory: each adapter in turn is loaded, evicted and
    loaded again; its outputs (and the prefix cache's hits on its own blocks) are unchanged."""
    folder, adapters, prompts, expected = llama
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16)
    manager = llm.engine.client.core.executor.worker.runner.lora
    for lora in [adapters[0], adapters[1], adapters[2], adapters[0], None, adapters[2]]:
        cases = [(lora, j) for j in range(len(prompts))]
        _check(_generate(llm, cases, prompts), cases, expected)
        assert len(manager.loaded) <= 1


def test_adapters_under_preemption(llama):
    """A KV cache too small for the batch: requests with adapters are preempted and recomputed,
    and still give peft's outputs."""
    folder, adapters, prompts, expected = llama
    block_bytes = 2 * 16 * 2 * 16 * 4 * 2  # K and V, 16 tokens, 2 KV heads of 16, fp32, 2 layers
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=14 * block_bytes,
              max_num_batched_tokens=32, enable_lora=True, max_loras=3, max_lora_rank=16)
    cases = [(lora, j) for lora in [*adapters, None] for j in (1, 2)]
    _check(_generate(llm, cases, prompts), cases, expected)
    assert llm.engine.client.core.scheduler.num_preemptions > 0


def test_int4_base_weights_take_the_same_deltas(llama):
    """Adapters over int4 base weights: a mixed batch gives each request what it gets alone
    (the delta is added to the quantized layer's output; tests/model/test_lora_layer.py checks
    the sum itself)."""
    folder, adapters, prompts, _ = llama
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              quantization="int4", enable_lora=True, max_loras=2, max_lora_rank=16)
    cases = [(lora, j) for j in range(len(prompts)) for lora in [None, *adapters]]
    mixed = _generate(llm, cases, prompts)
    for out, case in zip(mixed, cases):
        alone = _generate(llm, [case], prompts)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    base = [o.outputs[0].token_ids for o, (lora, _) in zip(mixed, cases) if lora is None]
    adapted = [o.outputs[0].token_ids for o, (lora, _) in zip(mixed, cases) if lora is not None]
    assert all(a not in base for a in adapted[:3])  # the adapters change what comes out


def test_two_ranks_shard_the_adapters(llama):
    """Tensor parallelism on two local processes: each rank holds its share of every A and B
    (and all of the embedding's and a vocabulary share of the LM head's), and a mixed batch
    still gives peft's outputs (logprobs within 1e-2: two ranks sum in another order)."""
    folder, adapters, prompts, expected = llama
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              tensor_parallel_size=2, enable_lora=True, max_loras=3, max_lora_rank=16)
    try:
        cases = [(lora, j) for j in (0, 2) for lora in [None, *adapters]]
        _check(_generate(llm, cases, prompts), cases, expected, atol=1e-2)
    finally:
        llm.engine.shutdown()


def test_two_ranks_shard_expert_adapters(tmp_path_factory, smollm_oracle_folder):
    """Tensor parallelism on a mixture of experts: each rank holds its share of every expert's
    A and B (gate and up rows of B, down columns of A), and a mixed batch gives peft's
    outputs."""
    folder, adapters, prompts, expected = build_family("qwen3-moe", tmp_path_factory,
                                                       smollm_oracle_folder)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              tensor_parallel_size=2, enable_lora=True, max_loras=3, max_lora_rank=16)
    try:
        cases = [(lora, j) for j in (0, 2) for lora in [None, *adapters]]
        _check(_generate(llm, cases, prompts), cases, expected)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_quantized_checkpoints_take_adapters(tmp_path, smollm_oracle_folder, fmt):
    """A GPTQ or AWQ checkpoint (packed int4, served as it is) with an adapter: its prompt
    logprobs equal peft's over transformers on the dequantized weights, with the adapter."""
    from tests.model.test_quant_checkpoints import _build as build_quantized

    qc = ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True,
           "checkpoint_format": "gptq"} if fmt == "gptq" else
          {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
           "version": "gemm"})
    folder, ref = build_quantized(tmp_path, smollm_oracle_folder, fmt, qc, bits=4, group=32,
                                  sym=fmt == "gptq")
    adapted = make_adapter(ref, 8, ALL, False, 5, tmp_path / "adapter")
    prompt = torch.randint(100, 49000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        lp = torch.log_softmax(adapted(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    theirs = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=8 << 20,
              enable_lora=True, max_lora_rank=8)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False,
                       lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))[0]
    ours = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
    assert torch.allclose(ours, theirs, atol=1e-3), (ours - theirs).abs().max()


def test_ngram_speculation_with_adapters_is_exact(llama):
    """Drafts verified with each request's adapter: greedy outputs equal peft's."""
    folder, adapters, prompts, expected = llama
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=3, max_lora_rank=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    cases = [(lora, j) for j in range(len(prompts)) for lora in [None, *adapters]]
    _check(_generate(llm, cases, prompts), cases, expected)
    assert llm.engine.client.stats().spec_draft_tokens > 0



def _per_expert_layout(stacked, folder, experts: int, moe_width: int,
                       names: tuple[str, str, str]) -> None:
    """Rewrite a peft adapter on transformers' stacked experts into one pair per expert and
    projection (transformers 4's and vLLM's layout; `names`: gate, up, down, the block): the stacked
    gate_up pair's A serves gate and up, each with its rows of B; its alpha_pattern follows."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(stacked / "adapter_model.safetensors")
    out = {}  # the tiny models' hidden size is not the experts' width: A's input tells
    for key, a in tensors.items():
        if ".experts." not in key or "lora_A" not in key:
            if ".experts." not in key:
                out[key] = a
            continue
        b = tensors[key.replace("lora_A", "lora_B")]
        rank = a.shape[0] // experts
        a_of, b_of = a.reshape(experts, rank, -1), b.reshape(b.shape[0], rank, experts)
        block = key.split(".experts.")[0].replace(".mlp", f".{names[3]}")
        for e in range(experts):
            pairs = ([(names[0], b_of[:moe_width, :, e]), (names[1], b_of[moe_width:, :, e])]
                     if a.shape[1] != moe_width else [(names[2], b_of[:, :, e])])
            for proj, b_e in pairs:
                out[f"{block}.experts.{e}.{proj}.lora_A.weight"] = a_of[e].clone()
                out[f"{block}.experts.{e}.{proj}.lora_B.weight"] = b_e.contiguous()
    folder.mkdir()
    save_file(out, folder / "adapter_model.safetensors")
    config = json.loads((stacked / "adapter_config.json").read_text())
    alpha = config["alpha_pattern"].pop(r".*\.gate_up_proj", None)
    if alpha is not None:
        config["alpha_pattern"][rf"experts\.\d+\.({names[0]}|{names[1]})"] = alpha
    (folder / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name", ["qwen2-moe", "mixtral"])
def test_expert_adapters_in_either_layout(tmp_path, smollm_oracle_folder, name):
    """An adapter on every projection of a mixture (its experts, Qwen2-MoE's shared expert and
    dense layer; gate_up at the adapter's rank), in peft's stacked layout and rewritten one
    pair per expert, mixed in one batch with the base model: both equal peft's outputs."""
    folder, base = _build(tmp_path, smollm_oracle_folder, name)
    cfg = base.config
    names = ("w1", "w3", "w2", "block_sparse_moe") if name == "mixtral" else (
        "gate_proj", "up_proj", "down_proj", "mlp")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = make_adapter(base, 4, targets, False, 7, tmp_path / "stacked", 0.0,
                         ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    _per_expert_layout(tmp_path / "stacked", tmp_path / "per-expert", experts, width, names)
    stacked = LoRARequest("stacked", 1, str(tmp_path / "stacked"))
    per_expert = LoRARequest("per-expert", 2, str(tmp_path / "per-expert"))
    prompts, expected = _expected([(stacked, model)], base)
    for j in range(len(prompts)):
        expected[(2, j)] = expected[(1, j)]
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    cases = [(lora, j) for j in range(len(prompts)) for lora in [None, stacked, per_expert]]
    _check(_generate(llm, cases, prompts), cases, expected)


def test_phi3_fused_layers_take_adapters(tmp_path, smollm_oracle_folder):
    """Phi-3's checkpoint fuses q/k/v and gate/up: a pair on the fused layer (its A serving
    each packed projection) mixed with the base model gives peft's outputs."""
    folder, base = _build(tmp_path, smollm_oracle_folder, "phi3-longrope-short")
    lora = LoRARequest("phi", 1, str(tmp_path / "adapter"))
    model = make_adapter(base, 8, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], False,
                         3, tmp_path / "adapter")
    prompts, expected = _expected([(lora, model)], base)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              enable_lora=True, max_loras=1, max_lora_rank=8)
    cases = [(x, j) for j in range(len(prompts)) for x in [None, lora]]
    _check(_generate(llm, cases, prompts), cases, expected)


def test_architectures_without_an_adapter_layout_refuse_lora(tmp_path, smollm_oracle_folder):
    folder, _ = _build(tmp_path, smollm_oracle_folder, "gpt2")
    with pytest.raises(ValueError, match="not supported on GPT2LMHeadModel"):
        LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=8 << 20,
            enable_lora=True)


def test_compiled_layers_take_adapters(llama):
    """compilation_level 3 with every step through the graphs: each adapter's and the base
    model's outputs equal peft's, as the eager layers' do: adapters are chosen inside the
    linear layers' opaque ops, one graph serves them all."""
    folder, adapters, prompts, expected = llama
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=16,
              enforce_eager=True, compilation_level=3)
    assert llm.engine.client.core.executor.worker.runner.model.model.compiled_layers.kinds == 1
    cases = [(lora, j) for j in range(len(prompts)) for lora in [None, *adapters]]
    _check(_generate(llm, cases, prompts), cases, expected)


def test_decode_graphs_take_adapters(llama, rerun_capture):  # noqa: F811
    """CUDA graphs' decode steps (checked on the CPU with conftest's stand-in capture, which
    fails on any host read) with every adapter and the base model in one batch and more
    adapters than slots: each output equals peft's, every adapter through the same graphs."""
    folder, adapters, prompts, expected = llama
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=16,
              native_kernels="off", cudagraph_capture_sizes=[1, 2, 4, 8])
    graphs = llm.engine.client.core.executor.worker.runner.graphs
    adapted, run = [], graphs.run
    graphs.run = lambda *args: adapted.append(args[4] is not None and bool(
        (args[4] >= 0).any())) or run(*args)
    cases = [(lora, j) for j in range(len(prompts)) for lora in [None, *adapters]]
    _check(_generate(llm, cases, prompts), cases, expected)
    assert sum(adapted) >= 3 and graphs.replays == len(adapted)  # steps with adapters in them

