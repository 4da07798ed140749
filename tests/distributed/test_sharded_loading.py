"""A tensor-parallel rank reads only its share of each checkpoint matrix (lazy_tensor.py): loaded
in this process as rank r of 2 (the placement set by hand), its weights equal the slices of the
single-process load, no read from the file is as large as the tensor it comes from, and the two
ranks' reads add up to each tensor once; peak memory while loading stays below a full matrix."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from octavo.arch_config import read_arch_config
from octavo.distributed import parallel_state
from octavo.distributed.parallel_state import RankPlacement
from octavo.model.layers.embedding import Embedding, LMHead
from octavo.model.layers.linear import Linear
from octavo.model.loader import load_model
from octavo.model.loader.gguf_weights import gguf_tensor_types, iterate_gguf_weights
from octavo.model.loader.lazy_tensor import LazyTensor, recording_reads
from octavo.model_source import resolve_model
from tests.parity.test_tiny_models import _build


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A cache without prepared weights (a GGUF loads from its file, and its prepared weights are
    not written: 0.6 GB a load), sharing the models and the built kernels."""
    monkeypatch.setattr("octavo.model.loader.prepared_cache.save_prepared", lambda *a: None)
    home = Path(os.environ.get("OCTAVO_CACHE", Path.home() / ".cache" / "octavo"))
    cache = tmp_path / "cache"
    cache.mkdir()
    for part in ("models", "kernels"):
        if (home / part).exists():
            (cache / part).symlink_to(home / part)
    monkeypatch.setenv("OCTAVO_CACHE", str(cache))
    return cache


def _load(path, placement: RankPlacement, monkeypatch, **kwargs) -> tuple[torch.nn.Module,
                                                                          dict[str, int]]:
    """The model as `placement`'s rank, and the largest read of each checkpoint tensor."""
    monkeypatch.setattr(parallel_state, "_placement", placement)
    try:
        source = resolve_model(str(path))
        with recording_reads() as reads:
            model = load_model(source, read_arch_config(source), torch.float32,
                               torch.device("cpu"), 256, pack_gemm=False, **kwargs)
        return model, reads
    finally:
        monkeypatch.setattr(parallel_state, "_placement", RankPlacement(0))


def _dense(layer: torch.nn.Module) -> torch.Tensor:
    weights = getattr(layer, "weights", None)  # the typed weights object, where there is one
    return getattr(weights, "weight", None) if weights is not None else layer.weight


def _expected_linear(full: Linear, rank: Linear) -> torch.Tensor:
    """The rows of each packed slot and the columns this rank's layer keeps, cut from the
    single-process layer's weight."""
    w = _dense(full)
    if rank.input_span is not None:
        w = w.narrow(1, rank.input_span.start, rank.input_span.width)
    if rank.slot_spans is None:
        return w
    offsets = [sum(full.shards[:i]) for i in range(len(full.shards))]
    return torch.cat([w.narrow(0, offset + span.start, span.width)
                      for offset, span in zip(offsets, rank.slot_spans)])


def _assert_rank_holds_slices(full: torch.nn.Module, rank: torch.nn.Module, tp_rank: int) -> int:
    """Every weight of `rank` (tensor-parallel rank `tp_rank`) equals its slice of `full`'s;
    returns how many were compared."""
    full_modules = dict(full.named_modules())
    compared = 0
    for name, module in rank.named_modules():
        whole = full_modules[name]
        if isinstance(module, Linear):
            assert torch.equal(_dense(module), _expected_linear(whole, module)), name
            if module.bias is not None:
                assert module.bias.shape[0] == sum(module.shards)
            compared += 1
        elif isinstance(module, (Embedding, LMHead)):  # vocabulary rows
            w = _dense(module)
            first = tp_rank * w.shape[0]
            have = min(w.shape[0], module.vocab_size - first)
            assert torch.equal(w[:have], _dense(whole)[first:first + have]), name
            assert not w[have:].any()
            compared += 1
        elif not list(module.children()):  # norms: every rank holds them whole
            for p, q in zip(module.parameters(recurse=False), whole.parameters(recurse=False)):
                assert torch.equal(p, q), name
                compared += 1
    return compared


def _assert_reads_are_shares(whole: dict[str, int], ranks: list[dict[str, int]],
                             exact_sum: bool) -> None:
    """Each rank read every tensor it read in less than its whole size; with `exact_sum` the
    ranks' reads add up to each tensor once (nothing read twice, no block read past a cut)."""
    assert whole and all(ranks)
    for reads in ranks:
        assert set(reads) <= set(whole)
        for name, n in reads.items():
            assert n < whole[name], (name, n, whole[name])
        assert max(reads.values()) < max(whole.values())
    if exact_sum:
        for name, n in whole.items():
            assert sum(r.get(name, 0) for r in ranks) == n, name


def test_safetensors_llama_rank_reads_and_holds_its_slices(tmp_path, smollm_oracle_folder,
                                                           monkeypatch):
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    full, whole = _load(folder, RankPlacement(0), monkeypatch)
    ranks = []
    for r in (0, 1):
        model, reads = _load(folder, RankPlacement(r, tp_size=2), monkeypatch)
        assert _assert_rank_holds_slices(full, model, r) > 10
        ranks.append(reads)
    # the untied LM head and the embedding are the largest matrices: half each
    _assert_reads_are_shares(whole, ranks, exact_sum=True)


def test_pairwise_rope_rows_are_reordered_within_each_ranks_heads(tmp_path,
                                                                  smollm_oracle_folder,
                                                                  monkeypatch):
    """GLM-4's q/k rows, reordered for rotate-half RoPE (a lazy index_select), are cut per rank
    like any others: each rank reads only its share and holds its slice of the whole model."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, "glm4")
    full, whole = _load(folder, RankPlacement(0), monkeypatch)
    ranks = []
    for r in (0, 1):
        model, reads = _load(folder, RankPlacement(r, tp_size=2), monkeypatch)
        assert _assert_rank_holds_slices(full, model, r) > 10
        ranks.append(reads)
    # a read is recorded at its largest: the packed gate_up's two parts are two reads a rank
    _assert_reads_are_shares(whole, ranks, exact_sum=False)


def test_norms_over_all_heads_refuse_tensor_parallelism(tmp_path, smollm_oracle_folder,
                                                        monkeypatch):
    folder, _ = _build(tmp_path, smollm_oracle_folder, "olmo2")
    with pytest.raises(NotImplementedError, match="Olmo2ForCausalLM under tensor parallelism"):
        _load(folder, RankPlacement(0, tp_size=2), monkeypatch)


def test_gguf_rank_reads_and_holds_its_slices(smollm_gguf, empty_cache, monkeypatch):
    """SmolLM2 (Q4_1 blocks, a Q8_0 embedding; q/k rows unpermuted per head, 3 KV heads split
    1 | 2), dequantized to float32 without decode copies."""
    full, whole = _load(smollm_gguf, RankPlacement(0), monkeypatch, decode_weights="none")
    ranks = []
    for r in (0, 1):
        model, reads = _load(smollm_gguf, RankPlacement(r, tp_size=2), monkeypatch,
                             decode_weights="none")
        assert _assert_rank_holds_slices(full, model, r) > 100
        ranks.append(reads)
    _assert_reads_are_shares(whole, ranks, exact_sum=True)


def test_another_pipeline_stage_tensors_are_never_read(smollm_gguf, empty_cache, monkeypatch):
    _, reads = _load(smollm_gguf, RankPlacement(1, pp_size=2), monkeypatch,
                     decode_weights="none")
    layers = read_arch_config(resolve_model(str(smollm_gguf))).num_layers
    first_stage = tuple(f"model.layers.{i}." for i in range(layers // 2))
    assert not [n for n in reads if n.startswith(first_stage)]
    assert f"model.layers.{layers - 1}.mlp.down_proj.weight" in reads


def _halves(t: torch.Tensor):
    """(dim, start, length) of either half of every dimension."""
    for dim in range(t.dim()):
        size = t.shape[dim]
        yield dim, 0, size // 2
        yield dim, size // 2, size - size // 2


def _hf_tensor(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A GGUF-loaded tensor's Hugging Face original (transformers now stacks MoE experts and
    names GPT-NeoX's head lm_head)."""
    name = name.replace("block_sparse_moe.", "mlp.").replace("embed_out.", "lm_head.")
    m = re.match(r"(.*\.experts)\.(\d+)\.(w1|w3|w2)\.weight$", name)
    if m is None:
        return state[name]
    if m[3] == "w2":
        return state[f"{m[1]}.down_proj"][int(m[2])]
    gate_up = state[f"{m[1]}.gate_up_proj"][int(m[2])]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if m[3] == "w1" else gate_up[half:]


@pytest.mark.parametrize("name", ["gpt2", "gptneox-sequential", "phi3-longrope-partial",
                                  "mixtral"])
def test_every_gguf_layout_reads_only_the_narrowed_region(tmp_path, empty_cache, name):
    """GPT-2's transposed Conv1D weights, GPT-NeoX's per-head qkv regrouping, Phi-3's packed qkv,
    Mixtral's q/k unpermuting and stacked experts: a float32 GGUF's lazy tensors, whole and
    narrowed to either half of any dimension, are the transformers model's tensors exactly, and a
    narrowed one reads less than the whole; a Q4_0 GGUF's dense weights and int4 codes, scales
    and offsets narrowed likewise are the whole ones' slices, and the codes give the weights."""
    from gguf import GGMLQuantizationType as Q

    from tests.model.gguf_convert import write_gguf
    from tests.model.test_gguf_archs import CASES
    from tests.model.test_gguf_archs import _build as build_model

    def q4(gguf_name: str):
        return Q.Q4_0 if gguf_name.startswith("blk.") and gguf_name.endswith(".weight") \
            and "norm" not in gguf_name and "ffn_gate_inp" not in gguf_name else None

    hf = build_model(name)
    state = hf.state_dict()
    lazies = 0
    for qtypes in (None, q4):
        path = tmp_path / f"{name}-{'f32' if qtypes is None else 'q4'}.gguf"
        write_gguf(path, CASES[name][0], hf, qtypes)
        cfg = read_arch_config(resolve_model(str(path)))
        codes = {n: "int4" for n, t in gguf_tensor_types(path, cfg).items() if t == Q.Q4_0}
        whole = {n: t.materialize() if isinstance(t, LazyTensor) else t
                 for n, t in iterate_gguf_weights(path, cfg, codes=codes)}
        for n, t in iterate_gguf_weights(path, cfg, codes=codes):
            if not isinstance(t, LazyTensor):
                assert t.dim() < 2, n
                continue
            lazies += 1
            for dim, start, length in _halves(t):
                with recording_reads() as reads:
                    got = t.narrow(dim, start, length).materialize()
                assert torch.equal(got, whole[n].narrow(dim, start, length)), (n, dim, start)
                assert sum(reads.values()) < t.numel(), (n, dim, reads)
            if qtypes is None:
                assert torch.equal(whole[n], _hf_tensor(state, n).float()), n
            elif n.endswith("gguf_q4"):
                stem = n.removesuffix("gguf_q4")
                q = whole[n].float().unflatten(-1, (-1, 32))
                dense = q * whole[stem + "gguf_q4_scale"][..., None] + \
                    whole[stem + "gguf_q4_low"][..., None]
                weight = whole[stem + "weight"]  # GPT-2's: [in, out], its codes [out, in]
                weight = weight.t() if name == "gpt2" else weight
                torch.testing.assert_close(dense.flatten(-2), weight)
            elif n.endswith(".weight") and n.removesuffix("weight") + "gguf_q4" in whole:
                hf_weight = _hf_tensor(state, n).float()
                assert (whole[n] - hf_weight).abs().max() < 0.2 * hf_weight.abs().max(), n
    assert lazies > 20


_RSS = """
import json, sys, torch
from octavo.arch_config import read_arch_config
from octavo.distributed import parallel_state
from octavo.distributed.parallel_state import RankPlacement
from octavo.model.loader import load_model
from octavo.model_files import open_gguf
from octavo.model_source import resolve_model
import gguf.quants, octavo.model.loader.gguf_weights, octavo.model.quant.gguf  # imported first

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssFile")}

source = resolve_model(sys.argv[1])
cfg = read_arch_config(source)
open_gguf(source.path)  # its metadata is read before: only the weights are measured
import octavo.model.loader.prepared_cache as prepared_cache
prepared_cache.save_prepared = lambda *a: None  # not kept: only loading is measured
parallel_state._placement = RankPlacement(int(sys.argv[2]), tp_size=int(sys.argv[3]))
before = status()
model = load_model(source, cfg, torch.float32, torch.device("cpu"), 256, decode_weights="none",
                   pack_gemm=False)
after = status()
kept = {id(p): p for p in model.parameters()}  # and the layers' typed weights (quant/weights.py)
kept.update({id(t): t for m in model.modules() if getattr(m, "weights", None) is not None
             for t in m.weights.tensors().values()})
params = sum(t.numel() * t.element_size() for t in kept.values())
print(json.dumps({"before": before, "after": after, "params": params}))
"""


def test_gguf_rank_peak_memory_stays_below_a_full_matrix(smollm_gguf, empty_cache):
    """Peak resident memory while a rank of 2 loads SmolLM2 in float32, less the file pages it
    mapped and the weights it keeps, is below the largest full matrix (the embedding, float32):
    no rank ever dequantizes a whole tensor."""
    cfg = read_arch_config(resolve_model(str(smollm_gguf)))
    largest = cfg.vocab_size * cfg.hidden_size * 4
    out = subprocess.run([sys.executable, "-c", _RSS, str(smollm_gguf), "0", "2"],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OCTAVO_CACHE": str(empty_cache)})
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    file_pages = m["after"]["RssFile"] - m["before"]["RssFile"]
    transient = m["after"]["VmHWM"] - m["before"]["VmRSS"] - file_pages - m["params"]
    assert transient < largest, (transient, largest, m)
