"""The command line: generate, chat (stdin-driven), bench with --json, bad flags."""
from __future__ import annotations

import json
import subprocess
import sys

OCTAVO = [sys.executable, "-m", "octavo.entrypoints.cli.main", "--log-level", "warning"]
SMALL = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB"]


def _run(args, stdin=None, timeout=300):
    return subprocess.run(OCTAVO + args, input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def test_generate_matches_offline_api(smollm_gguf, smollm_llm):
    from octavo import SamplingParams

    done = _run(["generate", "--model", str(smollm_gguf), *SMALL, "--prompt",
                 "The capital of France is", "--max-tokens", "12", "--temperature", "0"])
    assert done.returncode == 0, done.stderr
    expected = smollm_llm.generate("The capital of France is",
                                   SamplingParams(max_tokens=12, temperature=0),
                                   use_tqdm=False)[0].outputs[0].text
    assert done.stdout == expected + "\n"


def test_chat_streams_replies_until_eof(smollm_gguf):
    done = _run(["chat", "--model", str(smollm_gguf), *SMALL, "--max-tokens", "16",
                 "--temperature", "0"], stdin="What is the capital of France?\n/reset\nHi\n")
    assert done.returncode == 0, done.stderr
    replies = [line for line in done.stdout.split("> ") if line.strip()]
    assert len(replies) == 2 and "Paris" in replies[0]


def test_bench_throughput_writes_json(smollm_gguf, tmp_path):
    out = tmp_path / "bench.json"
    done = _run(["bench", "throughput", "--model", str(smollm_gguf), *SMALL, "--num-prompts",
                 "4", "--input-len", "16", "--output-len", "4", "--repeats", "1",
                 "--json", str(out)])
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert row["backend"] == "octavo" and row["output_tokens_per_s"] > 0
    assert "requests/s" in done.stdout


def test_bad_flag_values_exit_with_a_clear_error(smollm_gguf):
    done = _run(["generate", "--model", str(smollm_gguf), *SMALL, "--prompt", "x",
                 "--temperature", "-1"])
    assert done.returncode == 2 and "temperature must be >= 0" in done.stderr
    done = _run(["generate", "--model", "/nope.gguf", "--prompt", "x"])
    assert done.returncode == 2 and "does not exist" in done.stderr


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    from gguf import GGUFWriter

    # A GGUF with only a header, naming an architecture octavo does not support.
    path = tmp_path / "tiny.gguf"
    w = GGUFWriter(str(path), "gpt-j-like")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    done = _run(["generate", "--model", str(path), "--prompt", "x"])
    assert done.returncode == 2 and "not supported yet" in done.stderr, done.stderr
