"""`octavo bench serve` against the test server."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.e2e.conftest import API_KEY


def test_bench_serve_reports_latencies(server, tmp_path):
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "bench", "serve",
                           "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "4",
                           "--input-len", "16", "--output-len", "8", "--max-concurrency", "2",
                           "--slo-ttft", "1e9", "--slo-tpot", "0.001", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["output_tokens_per_s"] > 0
    assert report["ttft"]["p50_ms"] > 0 and report["tpot"]["p50_ms"] > 0
    # No request decodes a token in a microsecond: nothing meets that TPOT bound.
    assert report["goodput_requests_per_s"] == 0 and report["slo"]["tpot_ms"] == 0.001


def test_bench_serve_text_prompts(server, smollm_gguf, tmp_path):
    """Text prompts (for servers that take no token ids) run to max_tokens as well."""
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "bench", "serve",
                           "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "2",
                           "--input-len", "16", "--output-len", "5", "--tokenizer",
                           str(smollm_gguf), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 2 and report["output_tokens_per_s"] > 0
    assert report["tpot"]["p50_ms"] > 0


def test_bench_startup_times_a_fresh_server(smollm_gguf, tmp_path):
    out = tmp_path / "startup.json"
    done = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "bench", "startup",
                           "--model", str(smollm_gguf), "--repeats", "1",
                           "--server-args=--max-model-len 256 --kv-cache-memory 32MiB",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert 0 < report["results"]["octavo"]["launch_to_first_token_s"] < 120


def test_bench_startup_fails_fast_when_the_server_exits(smollm_gguf):
    done = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "bench", "startup",
                           "--model", str(smollm_gguf), "--repeats", "1",
                           "--server-args=--no-such-flag"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "exited with code 2" in done.stderr and "--no-such-flag" in done.stderr
