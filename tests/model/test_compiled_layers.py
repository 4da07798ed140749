"""Compiled decoder layers (compilation_level 1-3): the AOTInductor graphs give the tokens and
logprobs of the eager layers, on every step kind, a second start loads its graphs from the disk
instead of making them again, and a layer its kind's graph does not reproduce is refused."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.model import compiled
from octavo.worker import worker as worker_module
from tests.parity.test_tiny_models import _build

# Qwen3-Next's layers hold every kind of opaque module (attention, linear attention, routed
# experts) and the Python state a graph must not keep (its (1 + w) norms, the rotary angles);
# the cache test's model is a Llama-family one and the parallel tests' a Qwen3-MoE.
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


def _compiled_layers(llm):
    return llm.engine.client.core.executor.worker.runner.model.model.compiled_layers


def _same(got, expected):
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, expected):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4


def _prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (150, 7, 30)]


@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_layers_give_the_eager_outputs(tmp_path, smollm_oracle_folder, name):
    """Every step through the graphs (enforce_eager: no decode stack): chunked prefill, mixed
    steps, single-token and several-token decodes."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    prompts = _prompts()
    _, eager = _outputs(folder, prompts, enforce_eager=True)
    llm, got = _outputs(folder, prompts, enforce_eager=True, compilation_level=3)
    _same(got, eager)
    # One graph per kind of layer, for every token count (this model has two kinds: linear
    # attention and full attention layers).
    assert _compiled_layers(llm).kinds == 2


def test_compiled_bfloat16_layers_give_the_eager_outputs_exactly(tmp_path, smollm_oracle_folder):
    """In bfloat16 the graphs round where the eager ops do: the same tokens and logprobs (a
    fused kernel rounding once had moved this model's logprobs by 0.016 and one token)."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-moe")
    prompts = _prompts()
    _, eager = _outputs(folder, prompts, enforce_eager=True, dtype="bfloat16")
    _, compiled = _outputs(folder, prompts, enforce_eager=True, dtype="bfloat16",
                           compilation_level=3)
    assert compiled == eager


def test_a_second_start_loads_its_graphs_from_the_disk(tmp_path, smollm_oracle_folder,
                                                       monkeypatch):
    """The first engine makes its graph (a library and its table of opaque calls) under
    $OCTAVO_CACHE/compile (here a folder of the test's own), clearing what a killed process
    left half-made there; the second loads it, and its outputs are the first's (packed int4
    weights)."""
    monkeypatch.setattr(worker_module, "cache_dir", lambda: tmp_path / "cache")
    packages = tmp_path / "cache" / "compile" / compiled._code_key()
    kind = compiled._kind

    def kind_a_killed_process_was_making(*args):
        key = kind(*args)
        if not (packages / f"{key}.so").exists():
            (packages / f"{key}.killed{compiled._PARTIAL}").mkdir(parents=True, exist_ok=True)
            (packages / f"{key}.killed{compiled._PARTIAL}" / "graph.pt2").touch()
        return key

    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-qk-norm")
    prompts = _prompts()
    options = dict(enforce_eager=True, quantization="int4", max_num_batched_tokens=256)
    _, eager = _outputs(folder, prompts, **options)
    monkeypatch.setattr(compiled, "_kind", kind_a_killed_process_was_making)
    llm, first = _outputs(folder, prompts, compilation_level=1, **options)
    assert _compiled_layers(llm).made == 1
    files = [f.name for f in packages.iterdir() if f.suffix != ".lock"]
    assert sorted(f.rpartition(".")[2] for f in files) == ["json", "so"]  # nothing else
    llm, second = _outputs(folder, prompts, compilation_level=1, **options)
    assert _compiled_layers(llm).made == 0
    _same(first, eager)
    _same(second, eager)


def test_a_start_without_the_cpp_kernels_makes_graphs_of_its_own(tmp_path, smollm_oracle_folder,
                                                                 monkeypatch):
    """Whether octavo's C++ kernels are loaded decides what a layer's norms and rotary call
    (their ops, or torch's): a start without them does not load the graphs made with them,
    and its own give its eager layers' outputs."""
    monkeypatch.setattr(worker_module, "cache_dir", lambda: tmp_path / "cache")
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    prompts = _prompts()
    llm, _ = _outputs(folder, prompts, enforce_eager=True, compilation_level=3)
    assert _compiled_layers(llm).made == 1
    _, eager = _outputs(folder, prompts, enforce_eager=True, native_kernels="off")
    llm, got = _outputs(folder, prompts, enforce_eager=True, compilation_level=3,
                        native_kernels="off")
    assert _compiled_layers(llm).made == 1
    _same(got, eager)


def test_a_failed_compilation_leaves_no_file(tmp_path, smollm_oracle_folder, monkeypatch):
    """The compiler failing halfway through its package: the start fails with its error, and
    nothing is left that a later start could load."""
    monkeypatch.setattr(worker_module, "cache_dir", lambda: tmp_path / "cache")

    def failing(program, package_path):
        with open(package_path, "wb") as f:
            f.write(b"half a package")
        raise RuntimeError("the C++ compiler was killed")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", failing)
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    with pytest.raises(RuntimeError, match="the C\\+\\+ compiler was killed"):
        LLM(str(folder), dtype="float32", max_model_len=64, kv_cache_memory=8 << 20,
            enforce_eager=True, compilation_level=3)
    packages = tmp_path / "cache" / "compile" / compiled._code_key()
    assert [f.name for f in packages.iterdir() if f.suffix != ".lock"] == []


def test_a_layer_its_kinds_graph_does_not_reproduce_is_refused(tmp_path, smollm_oracle_folder,
                                                              monkeypatch):
    """Each layer is checked against its kind's graph at load: were a setting missing from the
    kind's key (here every layer is made one kind while layer 1 scales its residuals), the
    start fails naming the layer instead of running it wrongly."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    llm = LLM(str(folder), dtype="float32", max_model_len=64, kv_cache_memory=8 << 20,
              enforce_eager=True)
    worker = llm.engine.client.core.executor.worker
    model = worker.runner.model
    layer = model.model.layers[1]
    layer.residual_scale, layer._spec = 0.5, None
    monkeypatch.setattr(compiled, "_kind", lambda *args: "one-kind")
    with pytest.raises(RuntimeError, match="decoder layer 1 .* differs from its kind's graph"):
        compiled.compile_layers(model, 3, str(tmp_path / "cache" / "compile"),
                                worker.arch.hidden_size, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("parallel", [
    {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
    {"prefill_context_parallel_size": 2, "decode_context_parallel_size": 2}],
    ids=["tensor", "pipeline", "context"])
def test_compiled_layers_over_two_ranks(tmp_path, smollm_oracle_folder, parallel):
    """Each rank runs its layers' graphs: tensor-parallel layers and experts sum their outputs
    inside their opaque ops, a pipeline stage compiles its own layers, context-parallel
    attention exchanges its keys inside its op. The outputs are the single process's eager
    ones."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-moe")
    prompts = _prompts()
    _, eager = _outputs(folder, prompts, enforce_eager=True)
    _, compiled = _outputs(folder, prompts, enforce_eager=True, compilation_level=3, **parallel)
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
