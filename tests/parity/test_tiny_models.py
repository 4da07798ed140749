"""Architectures and RoPE variants with no real weights here: tiny random models built with
transformers, saved as safetensors, and compared logit for logit."""
from __future__ import annotations

import shutil

import pytest
import torch

from octavo import LLM, SamplingParams

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
# q width (4 x 32) differs from hidden; a query scalar other than head_dim; windows shorter than the
# 150-token prompt; local and global layers interleaved.
_GEMMA = dict(num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=32,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"])

_DEEPSEEK = dict(num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4,
                 moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                 n_shared_experts=1, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                 v_head_dim=24, pad_token_id=0)

_QWEN3_NEXT = dict(layer_types=["linear_attention", "full_attention"], head_dim=32,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   pad_token_id=0)
_LLAMA4 = dict(head_dim=16, intermediate_size=64, intermediate_size_mlp=96, no_rope_layers=[1, 0],
               moe_layers=[0], num_local_experts=4, num_experts_per_tok=2,
               attention_chunk_size=48, floor_scale=16, pad_token_id=0, rope_parameters={
                   "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64})

CASES = {
    "llama-default": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "linear-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "dynamic-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mistral-sliding-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 32}),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen3-qk-norm": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    # partial rotary (8 of 16 features); the 150-token prompt passes the original 64: long factors
    "phi3-longrope-partial": ("Phi3Config", "Phi3ForCausalLM", {
        "original_max_position_embeddings": 64, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.9, 2.5], "long_factor": [1.5, 2.8, 4.0, 7.0]}}),
    "phi3-longrope-short": ("Phi3Config", "Phi3ForCausalLM", {
        "original_max_position_embeddings": 512, "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.2, 3.0, 4.0],
            "long_factor": [9.0] * 8}}),
    "gpt-neox-parallel": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {
        "layer_norm_eps": 1e-5, "use_parallel_residual": True}),  # rotary on 4 of 16 features
    "gpt-neox-sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                            "partial_rotary_factor": 0.5},
        "use_parallel_residual": False, "tie_word_embeddings": True}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "n_inner": 96}),
    # several experts per token; Qwen2-MoE with a shared expert and a dense layer
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 6, "num_experts_per_tok": 3, "sliding_window": None}),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [1]}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "head_dim": 32,
        "norm_topk_prob": True}),
    "qwen3-moe-unnormalized": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "decoder_sparse_step": 2}),
    # o_proj and MLP biases (attention_bias covers o_proj in Llama; mlp_bias)
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True,
                                                          "mlp_bias": True}),
    # Llama's layers with multipliers: embeddings, residual branches, attention, logits
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0,
        "attention_multiplier": 0.1}),
    # norms after each sublayer only; q/k norms over all heads
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # LayerNorms with biases, a plain GELU MLP, biases everywhere, a window, tied embeddings
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": 32}),
    # one LayerNorm without bias for a parallel block, RoPE on adjacent pairs, logit scale
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}),
    "cohere-qk-norm": ("CohereConfig", "CohereForCausalLM", {"use_qk_norm": True}),
    # RoPE on adjacent pairs of half of each head, q/k/v bias without o bias; GLM-4's sandwich
    "glm": ("GlmConfig", "GlmForCausalLM", {"head_dim": 16, "num_key_value_heads": 1,
                                          "pad_token_id": 0}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 32, "pad_token_id": 0}),
    # YaRN: frequencies blended between interpolated and kept, cos/sin scaled
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}}),
    # sinks, alternating 32-token windows under the 150-token prompt, YaRN, biased experts with
    # the clamped SwiGLU (gate and up interleaved in the checkpoint), a biased router
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"], "pad_token_id": 0}),
    # latent attention (a compressed q, interleaved RoPE reordered at load, YaRN with mscale),
    # sigmoid routing within expert groups with a correction bias, a shared expert, a dense
    # first layer; V2: an uncompressed q, softmax routing limited to the best group
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_DEEPSEEK, "q_lora_rank": 48, "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 64}}),
    # more query heads over the one latent KV head than a kernel pass holds (64; V3 has 128)
    "deepseek-v3-80-heads": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_DEEPSEEK, "num_attention_heads": 80, "num_key_value_heads": 80, "q_lora_rank": 48,
        "n_group": 2, "topk_group": 1}),
    "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **_DEEPSEEK, "q_lora_rank": None, "topk_method": "group_limited_greedy", "n_group": 2,
        "topk_group": 1, "routed_scaling_factor": 1.5}),
    # a RoPE layer (adjacent pairs, llama3 scaling) with weightless q/k norms, attending within
    # 48-token chunks of the 150-token prompt, its experts' inputs scaled by the sigmoid routing
    # weights beside a shared expert; a dense layer without RoPE, its queries scaled by position
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", _LLAMA4),
    # a Gated DeltaNet layer (grouped value heads, a conv window, a state carried across the
    # 64-token prompt chunks) and a gated attention layer with (1 + w) norms, partial RoPE
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", _QWEN3_NEXT),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        **_GEMMA, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**_GEMMA, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
    "gemma3-scaled-global-rope": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **_GEMMA, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
}


def _build(tmp_path, tokenizer_folder, name):
    import transformers

    config_cls, model_cls, extra = CASES[name]
    vocab = 49152  # the SmolLM2 tokenizer, copied in so the folder is a complete model
    base = {} if config_cls == "GPT2Config" else _COMMON  # GPT-2 has names of its own
    config = getattr(transformers, config_cls)(vocab_size=vocab, **{**base, **extra})
    torch.manual_seed(0)
    model = _randomized(getattr(transformers, model_cls)(config).eval())
    folder = tmp_path / name
    model.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / f, folder / f)
    return folder, model


def _randomized(model):
    with torch.no_grad():  # larger weights than the default init, so differences show
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            else:  # norms and biases too, so a norm read as w instead of 1 + w shows
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_model_matches_transformers(tmp_path, smollm_oracle_folder, name):
    folder, ref = _build(tmp_path, smollm_oracle_folder, name)
    prompt = torch.randint(100, 49000, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref_lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), -1)
        ref_tokens = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64)  # the prompt spans several chunks
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                prompt_logprobs=0), use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
    ref_prompt = ref_lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(ours, ref_prompt, atol=1e-4), (ours - ref_prompt).abs().max()
    assert out.outputs[0].token_ids == ref_tokens


def test_sliding_window_model_reuses_blocks_behind_the_window(tmp_path, smollm_oracle_folder):
    """Mistral with a 32-token window in a KV cache of 12 blocks of 16 tokens: three 150-token
    prompts need 30 blocks at once without freeing. The blocks behind each window are given back
    and reused by the others, and the output still matches transformers."""
    folder, ref = _build(tmp_path, smollm_oracle_folder, "mistral-sliding-window")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 49000, (150,), generator=gen).tolist() for _ in range(3)]
    with torch.inference_mode():
        expected = [ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    block_bytes = 2 * 16 * 2 * 16 * 4 * 2  # K and V, 16 tokens, 2 KV heads of 16, fp32, 2 layers
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=12 * block_bytes,
              max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.client.core.num_blocks == 12


def test_generation_config_sets_request_defaults(tmp_path, smollm_oracle_folder):
    """temperature 0 in generation_config.json makes a request without SamplingParams greedy."""
    import json

    folder, ref = _build(tmp_path, smollm_oracle_folder, "llama-default")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5}))
    prompt = list(range(200, 240))
    with torch.inference_mode():
        expected = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                                pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.0, 5)
    outs = [llm.generate([prompt], use_tqdm=False)[0] for _ in range(2)]
    got = outs[0].outputs[0].token_ids
    assert got == outs[1].outputs[0].token_ids == expected[:len(got)] and len(got) >= 1


def test_internlm3_runs_as_llama_with_its_bias_keys(tmp_path, smollm_oracle_folder, monkeypatch):
    """InternLM 3 (its modeling code is the checkpoint's own, not in transformers) is Llama with
    q/k/v biases set by `qkv_bias` and an o_proj bias by `bias`: a Llama with both biases,
    saved under InternLM 3's architecture and keys, gives Llama's logprobs and tokens."""
    import json

    monkeypatch.setitem(CASES, "internlm3", ("LlamaConfig", "LlamaForCausalLM",
                                             {"attention_bias": True}))
    folder, ref = _build(tmp_path, smollm_oracle_folder, "internlm3")
    config = json.loads((folder / "config.json").read_text())
    del config["attention_bias"]
    config.update(architectures=["InternLM3ForCausalLM"], model_type="internlm3",
                  qkv_bias=True, bias=True)
    (folder / "config.json").write_text(json.dumps(config))
    prompt = list(range(300, 340))
    with torch.inference_mode():
        ref_lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0, -1].float(), -1)
        expected = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected
    first = out.logprobs[0][expected[0]].logprob
    assert abs(first - ref_lp[expected[0]].item()) < 1e-4


def test_latent_attention_caches_the_compressed_row_only(tmp_path, smollm_oracle_folder):
    """DeepSeek's KV cache holds kv_lora_rank + qk_rope_head_dim features a token and layer
    (48 here, where K and V of 4 heads of 40 and 24 features would be 256), one copy read as
    both K and V; with a cache small enough to preempt, and the prompt again from the prefix
    cache, the tokens stay transformers'."""
    folder, ref = _build(tmp_path, smollm_oracle_folder, "deepseek-v3")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(100, 49000, (70,), generator=gen).tolist() for _ in range(4)]
    with torch.inference_mode():
        expected = [ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    per_block = 3 * 16 * 48 * 4  # layers x tokens x features x float32
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=18 * per_block,
              max_num_batched_tokens=64)  # 4 x 82 tokens need 24 blocks at once: preempted
    try:
        worker = llm.engine.client.core.executor.worker
        assert worker.kv_bytes_per_block(16) == per_block
        cache = worker.runner.kv_caches[0]
        assert cache.shape[0] == 2 and cache[0].data_ptr() == cache[1].data_ptr()
        assert cache.untyped_storage().nbytes() == 18 * 16 * 48 * 4
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.engine.client.core.scheduler.num_preemptions > 0
        again = llm.generate(prompts[:1], params, use_tqdm=False)[0]
        assert again.num_cached_tokens >= 32 and again.outputs[0].token_ids == expected[0]
    finally:
        llm.engine.shutdown()


def test_llama4_chunked_attention_batched_preempted_and_cached(tmp_path, smollm_oracle_folder):
    """Llama 4's chunked layers in a batch of prompts whose chunks begin at different steps,
    with a cache small enough to preempt, and a prompt again from the prefix cache: the tokens
    stay transformers'. Decode steps run in the fused stack, reading the chunked plan."""
    folder, ref = _build(tmp_path, smollm_oracle_folder, "llama4")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (40, 95, 61, 130)]
    with torch.inference_mode():
        expected = [ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers x K and V x tokens x KV heads x size x float32
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=20 * per_block,
              max_num_batched_tokens=64)  # the prompts and outputs need 23 blocks at once
    try:
        model = llm.engine.client.core.executor.worker.runner.model
        assert model.model.decode_stack is not None
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert llm.engine.client.core.scheduler.num_preemptions > 0
        again = llm.generate(prompts[3:], params, use_tqdm=False)[0]
        assert again.num_cached_tokens >= 64 and again.outputs[0].token_ids == expected[3]
    finally:
        llm.engine.shutdown()


def test_llama4_conditional_generation_checkpoint_runs_its_text_model(tmp_path,
                                                                      smollm_oracle_folder):
    """A Llama4ForConditionalGeneration checkpoint (text_config, weights under language_model.,
    a vision tower) runs as its text model: transformers' greedy tokens."""
    import transformers

    text = {**_COMMON, **_LLAMA4, "vocab_size": 49152, "num_experts_per_tok": 1}
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=64,
                  projector_input_dim=64, projector_output_dim=64)
    torch.manual_seed(0)
    ref = _randomized(transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text, vision_config=vision)).eval())
    folder = tmp_path / "llama4-vl"
    ref.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_oracle_folder / f, folder / f)
    prompt = list(range(300, 400))
    with torch.inference_mode():
        expected = ref.generate(input_ids=torch.tensor([prompt]), do_sample=False,
                                max_new_tokens=8, pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected


def test_qwen3_next_states_follow_their_requests(tmp_path, smollm_oracle_folder):
    """Linear-attention states live at each request's batch row. Requests of random lengths,
    four rows for eight of them, a KV cache small enough to preempt, two aborted (one mid-
    prompt, one mid-output): every request that finishes gives transformers' tokens (rows
    taken over by later requests, and preempted requests started over, begin from an empty
    state), no row stays held, and the states' memory comes out of the KV cache's. Prefix
    caching is off (with it, test_hybrid_prefix_cache.py)."""
    folder, ref = _build(tmp_path, smollm_oracle_folder, "qwen3-next")
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(100, 49000, (int(n),), generator=gen).tolist()
               for n in torch.randint(20, 140, (8,), generator=gen)]
    with torch.inference_mode():
        expected = [ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    states = 4 * (128 * 3 * 4 + 4 * 16 * 16 * 4)  # rows x (conv window + state), float32
    per_block = 2 * 16 * 2 * 32 * 4  # the attention layer's K and V of 16 tokens
    llm = LLM(str(folder), dtype="float32", max_model_len=256, max_num_seqs=4,
              kv_cache_memory=states + 16 * per_block, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    try:
        core = llm.engine.client.core
        assert core.num_blocks == 16 and not core.scheduler.kv.enable_caching
        # "1" with its prompt only begun
        finished = _drive(llm, prompts, 12, aborts={1: "1", 6: "6"})
        assert core.scheduler.num_preemptions > 0
        for i, tokens in expected_pairs(finished, expected):
            assert tokens == expected[i], i
        assert len(finished) >= 6
        # the worker hears of the last finished request with the next step: then only that
        # step's request holds a row
        llm.generate([prompts[0][:5]], SamplingParams(max_tokens=1), use_tqdm=False)
        assert len(core.executor.worker.runner.batch.row_of) <= 1
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["stack", "layers"])
def test_qwen3_next_states_move_over_accepted_drafts_only(tmp_path, smollm_oracle_folder,
                                                         monkeypatch, enforce_eager):
    """Speculation over linear-attention layers: each verified span is computed from the state
    before it, and the state moves over the tokens the core keeps. A random model's greedy
    tokens never repeat, so the n-gram proposer is replaced by one that proposes transformers'
    next tokens with the first or second of them made wrong at some steps: drafts are then
    accepted whole, in part and not at all, and every request gives transformers' greedy
    tokens, batched, rows reused, one aborted while its span waits on the verdict; in the fused
    stack every step (the Python layers never run), or layer by layer (a draft model with
    linear-attention layers: test_hybrid_draft.py)."""
    from octavo.model.layers.gated_delta_net import GatedDeltaNet

    layered = [0]
    forward = GatedDeltaNet.forward

    def counted(self, *args):
        layered[0] += 1
        return forward(self, *args)

    monkeypatch.setattr(GatedDeltaNet, "forward", counted)
    folder, ref = _build(tmp_path, smollm_oracle_folder, "qwen3-next")
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(100, 49000, (int(n),), generator=gen).tolist()
               for n in torch.randint(5, 40, (6,), generator=gen)]
    with torch.inference_mode():
        expected = [ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]

    def propose(token_ids, max_drafts):
        tokens = list(token_ids)
        i = next(i for i, p in enumerate(prompts) if tokens[:len(p)] == p)
        done = len(tokens) - len(prompts[i])
        drafts = expected[i][done:done + min(3, max_drafts)]
        wrong = done % 3 - 1  # 0: the first draft, 1: the second, -1: none
        if 0 <= wrong < len(drafts):
            drafts[wrong] += 1
        return drafts

    llm = LLM(str(folder), dtype="float32", max_model_len=256, max_num_seqs=3,
              kv_cache_memory=16 << 20, enforce_eager=enforce_eager,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        scheduler = llm.engine.client.core.scheduler
        scheduler.proposer.propose = propose
        finished = _drive(llm, prompts, 16, aborts={4: "2"})
        for i, tokens in expected_pairs(finished, expected):
            assert tokens == expected[i], i
        assert len(finished) >= 5
        drafted, accepted, _ = scheduler.spec_counts
        assert 0 < accepted < drafted, (accepted, drafted)
        assert (layered[0] > 0) == enforce_eager, layered[0]
    finally:
        llm.engine.shutdown()


def _drive(llm, prompts, max_tokens, aborts):
    """Run `prompts` greedily through the engine step by step, aborting request aborts[n]
    after step n; the finished requests' tokens by request id."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps in aborts:
            engine.abort_request(aborts[steps])
    return finished


def expected_pairs(finished, expected):
    """(index, tokens) of each finished request that was not aborted."""
    return [(int(k), v) for k, v in finished.items() if len(v) == len(expected[int(k)])]


def test_an_attention_chunk_that_splits_a_block_is_refused_at_start(tmp_path,
                                                                     smollm_oracle_folder):
    import json

    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama4")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_chunk_size": 40}))
    with pytest.raises(NotImplementedError, match="attention_chunk_size 40 .*block size 16"):
        LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
