"""Every architecture octavo loads from GGUF beyond Llama, Qwen and Gemma: tiny random models built
with transformers, written as GGUF in llama.cpp's layout (tests/model/gguf_convert.py), loaded by
octavo and compared with transformers on the same weights (prompt logprobs and greedy tokens).

Each case exercises what that layout changes: Phi-3's fused q/k/v and gate/up with longrope
factors as tensors and partial rotary; GPT-NeoX's regrouped q/k/v, biases and the
use_parallel_residual key; GPT-2's transposed Conv1D weights and learned positions; Mixtral as a
llama GGUF with stacked experts (and permuted q/k); Qwen2-MoE's shared expert (its gate stored as
a vector) and unnormalized top-k; Qwen3-MoE's renormalized top-k; Llama 3.1 RoPE scaling as
rope_freqs; Granite's scales as keys, OLMo 2's post-norms, StarCoder 2's LayerNorms and plain
MLP, Command R's per-head q/k norms and logit scale, GLM-4's packed gate_up and sandwich norms,
Llama 4's unpermuted q/k and split experts, DeepSeek's split kv_b and MLA lengths, gpt-oss's
MXFP4 experts.
"""
from __future__ import annotations

import pytest
import torch

from tests.model.gguf_convert import _tensors, write_gguf

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

_QWEN3_NEXT = dict(layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
                   head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   pad_token_id=0)

# name: (GGUF architecture, transformers config and model classes, config, octavo's architecture)
CASES = {
    "llama3-rope-freqs": ("llama", "LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}, "LlamaForCausalLM"),
    # the 100-token prompt passes the original 64 positions: the long factors
    "phi3-longrope-partial": ("phi3", "Phi3Config", "Phi3ForCausalLM", {
        "pad_token_id": 0, "original_max_position_embeddings": 64, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.9, 2.5], "long_factor": [1.5, 2.8, 4.0, 7.0]}},
        "Phi3ForCausalLM"),
    "gptneox-sequential": ("gptneox", "GPTNeoXConfig", "GPTNeoXForCausalLM", {
        "layer_norm_eps": 1e-5, "use_parallel_residual": False}, "GPTNeoXForCausalLM"),
    "gpt2": ("gpt2", "GPT2Config", "GPT2LMHeadModel", {
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}, "GPT2LMHeadModel"),
    "mixtral": ("llama", "MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
        "MixtralForCausalLM"),
    "qwen2moe-shared-expert": ("qwen2moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48}, "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 32,
        "norm_topk_prob": True}, "Qwen3MoeForCausalLM"),
    # four scales as granite.* keys, q/k permuted as llama's
    "granite": ("granite", "GraniteConfig", "GraniteForCausalLM", {
        "logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0,
        "attention_multiplier": 0.1}, "GraniteForCausalLM"),
    "olmo2": ("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {}, "Olmo2ForCausalLM"),
    "starcoder2": ("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", {},
                   "Starcoder2ForCausalLM"),
    # per-head q/k norms and the logit scale; pairwise RoPE kept as Hugging Face has it
    "command-r": ("command-r", "CohereConfig", "CohereForCausalLM", {
        "use_qk_norm": True, "logit_scale": 0.5}, "CohereForCausalLM"),
    # packed gate_up, post-norms, rope.dimension_count of half a head
    "glm4": ("glm4", "Glm4Config", "Glm4ForCausalLM", {"head_dim": 32, "pad_token_id": 0},
             "Glm4ForCausalLM"),
    # q/k not permuted (pairwise RoPE as Hugging Face has it), llama3 factors as rope_freqs,
    # dense and MoE layers interleaved (experts split from gate_up, a shared expert), a layer
    # without RoPE, q/k norms (16 experts); the chunk and temperature are llama.cpp's constants
    "llama4": ("llama4", "Llama4TextConfig", "Llama4ForCausalLM", {
        "num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 64,
        "intermediate_size_mlp": 96, "num_local_experts": 16, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2, "pad_token_id": 0, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}}, "Llama4ForCausalLM"),
    # the latent attention's kv_b split into k_b (transposed) and v_b, a compressed q, one KV
    # head of rank + rope in the keys, YaRN's mscale as its log multiplier, a dense first
    # layer, sigmoid routing in groups with the score correction as exp_probs_b
    "deepseek-v3": ("deepseek2", "DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "num_hidden_layers": 3, "num_key_value_heads": 4, "q_lora_rank": 48,
        "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "mscale": 0.707, "mscale_all_dim": 0.707,
                            "original_max_position_embeddings": 64}},
        "DeepseekV3ForCausalLM"),
    # a linear layer (its projection split into attn_qkv and attn_gate, A as -exp(A_log), the
    # conv squeezed) and a gated attention layer, norms as 1 + w, Qwen2-MoE's experts
    "qwen3-next": ("qwen3next", "Qwen3NextConfig", "Qwen3NextForCausalLM", _QWEN3_NEXT,
                   "Qwen3NextForCausalLM"),
}


@pytest.fixture(autouse=True)
def _prepared_weights_in_tmp(tmp_path, monkeypatch):
    """Keep the prepared-weights copies of these throwaway files out of the user's cache."""
    monkeypatch.setattr("octavo.model.loader.prepared_cache.cache_dir", lambda: tmp_path)


def _build(name: str):
    import transformers

    _, config_cls, model_cls, extra, _ = CASES[name]
    base = {} if config_cls == "GPT2Config" else _COMMON
    config = getattr(transformers, config_cls)(vocab_size=49152, **{**base, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # larger weights than the default init, so differences show
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:  # norms and biases too
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_architecture_matches_transformers(tmp_path, smollm_oracle_folder, name):
    arch, *_, architecture = CASES[name]
    model = _build(name)
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, arch, model)
    llm = _compare(path, model, smollm_oracle_folder)
    assert llm.engine.arch.architecture == architecture


def _compare(path, model, tokenizer_folder, **options):
    """Load the GGUF at `path` (with the engine `options`) and check its prompt logprobs and
    greedy tokens against `model`'s; returns the LLM."""
    from octavo import LLM, SamplingParams

    prompt = torch.randint(100, 49000, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        ref_tokens = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6,
                                    pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(path), tokenizer=str(tokenizer_folder), dtype="float32", max_model_len=256,
              kv_cache_memory=16 << 20, max_num_batched_tokens=48, **options)
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0,
                                                    ignore_eos=True, prompt_logprobs=0),
                           use_tqdm=False)[0]
        ours = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob
                             for p in range(1, len(prompt))])
        expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(ours, expected, atol=1e-4), (ours - expected).abs().max()
        assert out.outputs[0].token_ids == ref_tokens
    except BaseException:
        llm.engine.shutdown()  # rank processes too
        raise
    return llm


@pytest.mark.parametrize("arch, missing", [("qwen2moe", "qwen2moe.expert_count"),
                                           ("gpt2", "position_embd.weight")])
def test_missing_gguf_field_is_named(tmp_path, monkeypatch, arch, missing):
    import numpy as np
    from gguf import GGUFWriter

    from octavo.arch_config import read_arch_config
    from octavo.model_source import ModelSource

    monkeypatch.setattr("octavo.arch_config.cache_dir", lambda: tmp_path)
    path = tmp_path / f"{arch}.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=missing):
        read_arch_config(ModelSource(str(path), path))


def test_gpt_oss_gguf_keeps_its_mxfp4_experts(tmp_path, smollm_oracle_folder):
    """gpt-oss as llama.cpp writes it: experts in MXFP4 (gate and up apart, with biases), sinks
    as attn_sinks, YaRN and the window as keys. The experts keep their codes and scales (a
    microscaled weight, half a byte a weight), and the model equals transformers on the
    MXFP4-rounded weights."""
    import gguf
    import gguf.quants
    import transformers

    from octavo.model.quant.microscaled import MicroscaledPacked

    config = transformers.GptOssConfig(
        vocab_size=49152, **_COMMON, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
        sliding_window=32, layer_types=["sliding_attention", "full_attention"], pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    mx = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
        for layer in model.model.layers:  # the experts as MXFP4 rounds them, along their inputs
            for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                t = w.transpose(1, 2).contiguous().numpy()  # [E, out, in]
                back = gguf.quants.dequantize(gguf.quants.quantize(t, mx), mx)
                w.copy_(torch.from_numpy(back.reshape(t.shape)).transpose(1, 2))
    path = tmp_path / "gpt-oss.gguf"
    write_gguf(path, "gpt-oss", model, lambda name: mx if "_exps.weight" in name else None)
    llm = _compare(path, model, smollm_oracle_folder)
    experts = llm.engine.client.core.executor.worker.runner.model.model.layers[0].mlp.experts
    packed = experts.expert_linears[0][0].weights.packed
    assert isinstance(packed, MicroscaledPacked) and packed.codes.numel() * 2 == \
        packed.out_features * packed.in_features


def _qwen3_next_q8_0(path, split_qkvz: bool):
    """A Qwen3-Next GGUF at `path` with its matrices in Q8_0 but the routers (llama.cpp's
    quantizer keeps them float), and the transformers model on the Q8_0-rounded weights."""
    import gguf
    import gguf.quants

    q8 = gguf.GGMLQuantizationType.Q8_0
    model = _build("qwen3-next")
    with torch.no_grad():  # every matrix as Q8_0 rounds it, along its inputs
        for name, p in model.named_parameters():
            if p.dim() >= 2 and p.shape[-1] % 32 == 0 and "conv1d" not in name \
                    and "embed" not in name and "mlp.gate." not in name:
                t = p.reshape(-1, p.shape[-1]).numpy()
                back = gguf.quants.dequantize(gguf.quants.quantize(t, q8), q8)
                p.copy_(torch.from_numpy(back).reshape(p.shape))
    matrices = {n for n, t in _tensors("qwen3next", model, split_qkvz=split_qkvz).items()
                if n.startswith("blk.") and t.ndim >= 2 and t.shape[-1] % 32 == 0
                and "conv1d" not in n and "ffn_gate_inp." not in n}
    write_gguf(path, "qwen3next", model, split_qkvz=split_qkvz,
               qtypes=lambda n: q8 if n in matrices else None)
    return model


def test_qwen3_next_gguf_whole_projection_and_q8_0(tmp_path, smollm_oracle_folder):
    """Qwen3-Next as older converters wrote it (the linear layers' in_proj_qkvz whole, as
    ssm_in), in Q8_0: octavo keeps the codes and equals transformers on the rounded weights."""
    path = tmp_path / "qwen3-next.gguf"
    model = _qwen3_next_q8_0(path, split_qkvz=False)
    llm = _compare(path, model, smollm_oracle_folder)
    layer = llm.engine.client.core.executor.worker.runner.model.model.layers[0]
    assert not layer.linear_attn.qkvz_split
    assert layer.linear_attn.in_proj_qkvz.weights.packed is not None


def test_qwen3_next_split_projection_on_two_ranks(tmp_path, smollm_oracle_folder):
    """The split linear projection in Q8_0 (attn_qkv: q | k | v of all heads, one tensor over
    three slots; attn_gate), its codes cut to each tensor-parallel rank's heads slot by slot."""
    path = tmp_path / "qwen3-next.gguf"
    model = _qwen3_next_q8_0(path, split_qkvz=True)
    _compare(path, model, smollm_oracle_folder, tensor_parallel_size=2).engine.shutdown()
