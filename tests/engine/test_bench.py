"""The bench tool: seeded workloads, the ShareGPT reader, llama.cpp's continuous batcher, the
concurrency sweep and its plot, --quantization and the memory figures."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from octavo.entrypoints.cli.bench_data import build_workload


def _args(**kw):
    base = dict(num_prompts=50, input_len=272, output_len=144, range_ratio=0.75,
                dataset="random", dataset_path=None, prefix_len=0, dataset_seed=0)
    return argparse.Namespace(**{**base, **kw})


def test_workloads_are_seeded_and_ranged():
    a = build_workload(_args(), 1000, {0, 1, 2})
    assert a == build_workload(_args(), 1000, {0, 1, 2})  # the same seed, the same requests
    assert a != build_workload(_args(dataset_seed=1), 1000, {0, 1, 2})
    ins, outs = [len(p) for p, _ in a], [n for _, n in a]
    assert 68 <= min(ins) and max(ins) <= 476 and len(set(ins)) > 10
    assert 36 <= min(outs) and max(outs) <= 252
    assert not {t for p, _ in a for t in p} & {0, 1, 2}  # no special tokens
    b = build_workload(_args(dataset="prefix", prefix_len=64, range_ratio=0.0), 1000, set())
    assert all(p[:64] == b[0][0][:64] and len(p) == 64 + 272 for p, _ in b)
    with pytest.raises(ValueError, match="--range-ratio"):
        build_workload(_args(range_ratio=1.5), 1000, set())


class _WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]


def test_sharegpt_pairs_first_turn_with_its_reply(tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"question {i} " + "w " * (4 + i)},
                                {"from": "gpt", "value": "answer " * (5 + i)}]}
             for i in range(6)]
    convs.append({"conversations": [{"from": "human", "value": "too short"},
                                    {"from": "gpt", "value": "answer " * 9}]})
    convs.append({"id": "no conversations"})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    args = _args(dataset="sharegpt", dataset_path=str(path), num_prompts=6)
    work = build_workload(args, 100, set(), _WordTokenizer())
    assert sorted(n for _, n in work) == [5, 6, 7, 8, 9, 10]  # reply lengths, in tokens
    assert all(len(p) == n + 1 for p, n in work)  # "question i" + (4 + i) words vs 5 + i
    assert work == build_workload(args, 100, set(), _WordTokenizer())
    with pytest.raises(ValueError, match="only 6 usable"):
        build_workload(_args(dataset="sharegpt", dataset_path=str(path), num_prompts=7), 100,
                       set(), _WordTokenizer())
    with pytest.raises(ValueError, match="--dataset-path"):
        build_workload(_args(dataset="sharegpt"), 100, set(), _WordTokenizer())


def test_llama_cpp_batcher_decodes_like_single_sequences(smollm_gguf):
    llama_cpp = pytest.importorskip("llama_cpp")
    from octavo.entrypoints.cli.bench_peers import LlamaCppBatcher

    prompts = [[504, 3458, 282, 4649, 314] * k for k in (1, 3, 2, 5, 4)]
    work = [(p, 6) for p in prompts]
    batcher = LlamaCppBatcher(str(smollm_gguf), 2, num_seqs=3, max_seq_len=64, batch_size=16)
    run = batcher.run(work)  # 5 requests through 3 sequences, prompts split across calls
    batcher.close()
    assert run.output_tokens == 30 and [len(t) for t in run.tokens] == [6] * 5
    single = llama_cpp.Llama(str(smollm_gguf), n_ctx=128, n_threads=2, verbose=False)
    for prompt, got in zip(prompts, run.tokens):
        want = []
        for tok in single.generate(prompt, temp=0.0, reset=True):
            want.append(tok)
            if len(want) == 2:
                break
        # llama.cpp's batched matmuls round differently, so near-ties may flip later on.
        assert got[:2] == want


def test_llama_cpp_calls_take_one_thread_of_their_own_only_where_asked():
    import threading

    from octavo.entrypoints.cli.bench_peers import LlamaCaller

    own = LlamaCaller(own_thread=True)
    seen = {own(threading.get_ident) for _ in range(3)}
    assert len(seen) == 1 and threading.get_ident() not in seen
    assert own(divmod, 7, 2) == (3, 1)
    with pytest.raises(ZeroDivisionError):
        own(divmod, 7, 0)
    assert LlamaCaller(own_thread=False)(threading.get_ident) == threading.get_ident()


def test_llama_cpp_takes_a_thread_of_its_own_only_with_amx_and_extra_buffers(monkeypatch):
    from octavo.entrypoints.cli import bench_peers

    for has_amx in (False, True):
        monkeypatch.setattr(bench_peers, "cpu_has_amx", lambda has=has_amx: has)
        assert (bench_peers.LlamaCaller.for_llama(no_repack=False)._thread is not None) == has_amx
        assert bench_peers.LlamaCaller.for_llama(no_repack=True)._thread is None


def test_llama_cpp_no_repack_turns_extra_buffers_off_while_open():
    pytest.importorskip("llama_cpp")
    import llama_cpp.llama as high_level

    from octavo.entrypoints.cli.bench_peers import llama_model_params

    assert high_level.llama_cpp.llama_model_default_params().use_extra_bufts
    with llama_model_params(no_repack=True):
        assert not high_level.llama_cpp.llama_model_default_params().use_extra_bufts
    assert high_level.llama_cpp.llama_model_default_params().use_extra_bufts
    with llama_model_params(no_repack=False):
        assert high_level.llama_cpp.llama_model_default_params().use_extra_bufts


def test_latency_beside_llama_cpp_alternates_without_a_crash(smollm_gguf, tmp_path):
    """octavo's bf16 prompts (oneDNN, AMX where the CPU has it) and llama.cpp's (its own AMX
    kernels) alternate in one process: on an AMX CPU, llama.cpp on the same thread died of SIGILL
    at its second prompt."""
    pytest.importorskip("llama_cpp")
    out = tmp_path / "latency.json"
    done = subprocess.run(
        [sys.executable, "-m", "octavo.entrypoints.cli.main", "--log-level", "warning", "bench",
         "latency", "--model", str(smollm_gguf), "--dtype", "bfloat16", "--max-model-len", "256",
         "--kv-cache-memory", "64MiB", "--input-len", "96", "--output-len", "3", "--num-iters",
         "2", "--backends", "octavo,llama.cpp", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert results["llama.cpp"]["decode_tokens_per_s"] > 0 < results["octavo"]["decode_tokens_per_s"]


def test_throughput_sweep_writes_json_and_plot(smollm_gguf, tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    done = subprocess.run(
        [sys.executable, "-m", "octavo.entrypoints.cli.main", "--log-level", "warning", "bench",
         "throughput", "--model", str(smollm_gguf), "--dtype", "float32", "--max-model-len",
         "256", "--kv-cache-memory", "64MiB", "--num-prompts", "4", "--input-len", "12",
         "--output-len", "3", "--repeats", "1", "--concurrency", "1,2", "--plot", str(png),
         "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [p["concurrency"] for p in report["sweep"]] == [1, 2]
    assert all(p["results"][0]["total_tokens_per_s"] > 0 for p in report["sweep"])
    assert report["sweep"][0]["results"][0]["peak_running_requests"] == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mem = report["memory"]  # the engine's: weights (SmolLM2 GGUF: its codes, about 94 MB), RSS, peak
    assert 80 < mem["weights_mb"] < 130 and mem["peak_rss_mb"] >= mem["rss_mb"] > 0


def test_latency_takes_quantization_and_reports_memory(smollm_gguf, tmp_path):
    """--quantization int4 on the GGUF: packed weights only, so the weights the latency table
    reports are well under bf16's (SmolLM2: dense bf16 about 270 MB)."""
    out = tmp_path / "latency.json"
    done = subprocess.run(
        [sys.executable, "-m", "octavo.entrypoints.cli.main", "--log-level", "warning", "bench",
         "latency", "--model", str(smollm_gguf), "--dtype", "bfloat16", "--quantization", "int4",
         "--max-model-len", "256", "--kv-cache-memory", "64MiB", "--input-len", "8",
         "--output-len", "3", "--num-iters", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "memory: weights" in done.stdout
    report = json.loads(out.read_text())
    assert report["results"]["octavo"]["decode_tokens_per_s"] > 0
    assert 50 < report["memory"]["weights_mb"] < 200, report["memory"]


def test_embed_beside_sentence_transformers_writes_json(tmp_path):
    pytest.importorskip("sentence_transformers")
    out = tmp_path / "embed.json"
    done = subprocess.run(
        [sys.executable, "-m", "octavo.entrypoints.cli.main", "--log-level", "warning", "bench",
         "embed", "--num-prompts", "6", "--min-len", "8", "--max-len", "20", "--repeats", "1",
         "--backends", "octavo,sentence-transformers", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["texts"] == 6 and 6 * 8 <= report["tokens"] <= 6 * 20
    assert all(r["texts_per_s"] > 0 for r in report["results"].values())
