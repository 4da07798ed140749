"""The transformers backend (--model-impl): architectures octavo has no native file for, run by
transformers' own modeling code with octavo's paged attention, against transformers itself on
tiny random models: prompt logprobs (1e-4 in float32) and greedy tokens, with the prompt in
chunks, batched with a second request, and again from the prefix cache; a native architecture
through the backend equals its native file, also under preemption; and the refusals."""
from __future__ import annotations

import shutil

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.model.registry import model_class

_COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)

# config class, model class, config fields: each with what sets it apart
CASES = {
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {  # OLMo 2's layers with windows
        "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {  # LayerNorm1P, squared ReLU
        "partial_rotary_factor": 0.5}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),  # a plain ReLU-squared MLP
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", {"head_dim": 16}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {  # windows; global layers without RoPE
        "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}),  # layers without RoPE
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {  # a window shorter than the prompt
        "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 16}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {"head_dim": 16}),
}


def tiny_model(folder, tokenizer_folder, config_cls: str, model_cls: str, **config):
    import transformers

    cfg = getattr(transformers, config_cls)(**{**_COMMON, **config})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # larger weights than the default init, so differences show
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return model


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (150, 37)]


def _reference(model, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        tokens = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    return logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], tokens


PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)


def _ours(out, prompt: list[int]) -> torch.Tensor:
    return torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])


@pytest.mark.parametrize("name", list(CASES))
def test_backend_matches_transformers(tmp_path, smollm_oracle_folder, name):
    config_cls, model_cls, extra = CASES[name]
    assert model_class(model_cls).__name__ == "TransformersForCausalLM"  # no native file
    model = tiny_model(tmp_path / name, smollm_oracle_folder, config_cls, model_cls, **extra)
    prompts = _prompts()
    llm = LLM(str(tmp_path / name), dtype="float32", max_model_len=256,
              kv_cache_memory=16 << 20, max_num_batched_tokens=64)  # the prompt in chunks
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": prompts[0]}],
                             SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(prompts, outs):
        want_lp, want_tokens = _reference(model, prompt)
        got_lp = _ours(out, prompt)
        assert torch.allclose(got_lp, want_lp, atol=1e-4), (got_lp - want_lp).abs().max()
        assert out.outputs[0].token_ids == want_tokens
    assert again.num_cached_tokens >= 144 and again.outputs[0].token_ids == \
        outs[0].outputs[0].token_ids


def test_a_native_architecture_through_the_backend_equals_its_file(tmp_path,
                                                                   smollm_oracle_folder):
    """Llama by --model-impl transformers and by octavo's own file: the same logprobs and
    tokens, with a KV cache small enough that the batch is preempted and recomputed."""
    tiny_model(tmp_path / "llama", smollm_oracle_folder, "LlamaConfig", "LlamaForCausalLM")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 49000, (90,), generator=gen).tolist() for _ in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    results = {}
    for impl in ("octavo", "transformers"):
        # 24 blocks of 8 KiB (2 layers x K and V x 2 heads x 16 features x 16 tokens x 4
        # bytes): six 90-token prompts growing to 114 tokens need 48 at once
        llm = LLM(str(tmp_path / "llama"), dtype="float32", max_model_len=256,
                  kv_cache_memory=24 * 8192, max_num_batched_tokens=64, model_impl=impl)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            results[impl] = ([o.outputs[0].token_ids for o in outs],
                             [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]
                              for o in outs],
                             llm.engine.client.core.scheduler.num_preemptions)
        finally:
            llm.engine.shutdown()
    native, backend = results["octavo"], results["transformers"]
    assert backend[0] == native[0] and backend[2] > 0
    assert torch.allclose(torch.tensor(backend[1]), torch.tensor(native[1]), atol=1e-4)


def test_backend_architectures_are_those_whose_code_takes_octavo_attention(monkeypatch):
    from octavo.model import registry

    monkeypatch.setattr(registry, "causal_lm_architectures", lambda: {
        "Olmo3ForCausalLM", "FalconForCausalLM", "LlamaForCausalLM", "NoSuchForCausalLM"})
    # Falcon's code takes no external attention; Llama has a native file
    assert registry.backend_architectures() == ["Olmo3ForCausalLM"]


def test_what_the_backend_refuses(tmp_path, smollm_oracle_folder):
    tiny_model(tmp_path / "olmo3", smollm_oracle_folder, "Olmo3Config", "Olmo3ForCausalLM")
    with pytest.raises(ValueError, match="LoRA adapters are not supported on Olmo3"):
        LLM(str(tmp_path / "olmo3"), enable_lora=True)
    with pytest.raises(NotImplementedError, match="cannot take an external attention"):
        model_class("FalconForCausalLM")
    with pytest.raises(NotImplementedError, match="no native file in octavo"):
        model_class("Olmo3ForCausalLM", "octavo")
    with pytest.raises(NotImplementedError, match="not a decoder-only"):
        model_class("BertForMaskedLM", "transformers")
    assert model_class("LlamaForCausalLM", "transformers").__name__ == "TransformersForCausalLM"
