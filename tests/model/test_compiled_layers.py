"""torch.compile of the decoder layers (compilation_level 1-3): the compiled graphs give the
tokens and logprobs of the eager layers, on every step kind, and a second start takes its
graphs from inductor's cache on disk instead of compiling them again."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from tests.parity.test_tiny_models import _build

# Qwen3-Next's layers hold every kind of opaque module (attention, linear attention, routed
# experts) and the Python state a graph must not keep (its (1 + w) norms, the rotary angles);
# the cache test's model is a Llama-family one and the tensor-parallel test's a Qwen3-MoE.
# Every tiny family passes (docs/performance.md); these three keep the suite's time.
FAMILIES = ["qwen3-next"]


def _outputs(folder, prompts, **options):
    # 64 tokens a step: the long prompt spans chunks
    options = {"max_num_batched_tokens": 64, "dtype": "float32", **options}
    llm = LLM(str(folder), max_model_len=256, kv_cache_memory=16 << 20, **options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                logprobs=2), use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(
        o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]


def _same(got, expected):
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, expected):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


def _prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (150, 7, 30)]


@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_layers_give_the_eager_outputs(tmp_path, smollm_oracle_folder, name,
                                                monkeypatch):
    """Every step through the graphs (enforce_eager: no decode stack): chunked prefill, mixed
    steps, single-token and several-token decodes."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    prompts = _prompts()
    _, eager = _outputs(folder, prompts, enforce_eager=True)
    counters.clear()
    _, compiled = _outputs(folder, prompts, enforce_eager=True, compilation_level=3)
    _same(compiled, eager)
    # Each layer is one graph (two per kind of layer: steps of several tokens, and of one;
    # this model has two kinds), all made at load: none runs in pieces or falls back to the
    # eager layers after too many recompilations (which torch counts as a graph break), and
    # no step needed one of its own.
    assert counters["stats"]["unique_graphs"] == 4
    assert not counters["graph_break"]


def test_compiled_bfloat16_layers_give_the_eager_outputs_exactly(tmp_path, smollm_oracle_folder,
                                                                monkeypatch):
    """In bfloat16 the graphs round where the eager ops do: the same tokens and logprobs (a
    fused kernel rounding once had moved this model's logprobs by 0.016 and one token)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-moe")
    prompts = _prompts()
    _, eager = _outputs(folder, prompts, enforce_eager=True, dtype="bfloat16")
    _, compiled = _outputs(folder, prompts, enforce_eager=True, dtype="bfloat16",
                           compilation_level=3)
    assert compiled == eager


def test_a_second_start_takes_its_graphs_from_the_cache(tmp_path, smollm_oracle_folder,
                                                        monkeypatch):
    """The second engine's graphs are inductor's cached ones, and its outputs the first's
    (packed int4 weights)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-qk-norm")
    prompts = _prompts()
    options = dict(enforce_eager=True, quantization="int4", max_num_batched_tokens=256)
    _, eager = _outputs(folder, prompts, **options)
    counters.clear()
    _, first = _outputs(folder, prompts, compilation_level=1, **options)
    assert counters["inductor"]["fxgraph_cache_miss"] > 0
    counters.clear()
    _, second = _outputs(folder, prompts, compilation_level=1, **options)
    assert counters["inductor"]["fxgraph_cache_hit"] > 0
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
    _same(first, eager)
    _same(second, eager)


def test_compiled_layers_over_two_tensor_parallel_ranks(tmp_path, smollm_oracle_folder,
                                                        monkeypatch):
    """Each rank's row-parallel layers and experts sum their outputs inside their opaque ops:
    the outputs are the single process's eager ones."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-moe")
    prompts = _prompts()
    _, eager = _outputs(folder, prompts, enforce_eager=True)
    _, compiled = _outputs(folder, prompts, enforce_eager=True, compilation_level=3,
                           tensor_parallel_size=2)
    _same(compiled, eager)


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-next"])
def test_opaque_modules_fakes_match_their_outputs(tmp_path, smollm_oracle_folder, name,
                                                  monkeypatch):
    """What a graph is traced with for each opaque module's output (`empty_output`) has the
    shape and dtype its eager forward returns, in bfloat16 (DeepSeek's experts take float32
    router logits: a fake of their dtype made inductor write twice the bytes of the output)."""
    from octavo.model.layers.attention import PagedAttention
    from octavo.model.layers.gated_delta_net import GatedDeltaNet
    from octavo.model.layers.linear import Linear
    from octavo.model.layers.moe import FusedMoE

    seen = []
    for cls in (Linear, PagedAttention, FusedMoE, GatedDeltaNet):
        def recording(self, *inputs, _eager=cls.eager_forward):
            out = _eager(self, *inputs)
            fake = self.empty_output(*inputs)
            seen.append((type(self).__name__, fake.dtype, fake.shape, out.dtype, out.shape))
            return out
        monkeypatch.setattr(cls, "eager_forward", recording)
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    LLM(str(folder), dtype="bfloat16", max_model_len=256, kv_cache_memory=16 << 20,
        enforce_eager=True).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))
    kinds = {kind for kind, *_ in seen}
    assert kinds >= {"Linear", "PagedAttention" if name == "qwen3-next" else "FusedMoE"}
    wrong = [s for s in seen if s[1:3] != s[3:5]]
    assert not wrong, wrong[:3]
