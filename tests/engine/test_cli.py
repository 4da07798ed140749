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


def test_models_lists_architectures_without_torch():
    done = _run(["models", "--json"], timeout=60)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["architectures"]
    assert rows["Gemma3ForCausalLM"] == ["gemma3"] and rows["Qwen2ForCausalLM"] == ["qwen2"]
    assert "LlamaForCausalLM" in rows and "llama" in rows["LlamaForCausalLM"]
    assert rows["MixtralForCausalLM"] == ["llama (with experts)"]
    table = _run(["models"], timeout=60).stdout
    assert "Gemma2ForCausalLM" in table and "gemma2" in table
    code = ("import sys; from octavo.entrypoints.cli.main import main; main(['models']); "
            "assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_unsupported_hf_architecture_names_the_supported_ones(tmp_path):
    from octavo import LLM

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["FancyNewForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "num_attention_heads": 2, "num_hidden_layers": 1}))
    (folder / "model.safetensors").write_bytes(b"")
    import shutil

    from tests.oracle import oracle_folder
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(oracle_folder("smollm2-135m-instruct") / f, folder / f)
    try:
        LLM(str(folder), dtype="float32", kv_cache_memory=1 << 20, max_model_len=64)
    except NotImplementedError as exc:
        assert "FancyNewForCausalLM" in str(exc) and "Gemma3ForCausalLM" in str(exc)
    else:
        raise AssertionError("an unsupported architecture loaded")


def test_config_missing_a_key_is_a_clear_error(tmp_path):
    import pytest

    from octavo.arch_config import read_arch_config
    from octavo.model_source import ModelSource

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "num_attention_heads": 2,
        "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="lacks 'hidden_size'"):
        read_arch_config(ModelSource("x", tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "num_attention_heads": 2,
        "hidden_size": 32, "num_hidden_layers": 2, "layer_types": ["sliding_attention"]}))
    with pytest.raises(ValueError, match="layer_types must list"):
        read_arch_config(ModelSource("x", tmp_path))


def test_serve_steps_are_smaller_than_offline_ones():
    """The server's default step budget is 512 tokens (first tokens of a burst come sooner), the
    offline engine's 2048; a flag still overrides it."""
    import argparse

    from octavo.config import EngineConfig
    from octavo.entrypoints.cli import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    budget = lambda *a: EngineConfig.from_cli(  # noqa: E731
        parser.parse_args(["serve", *a])).scheduler.max_num_batched_tokens
    assert budget() == 512
    assert budget("--max-num-batched-tokens", "4096") == 4096
    assert EngineConfig().scheduler.max_num_batched_tokens == 2048


def test_the_command_imports_only_the_chosen_subcommand():
    """`octavo serve` does not import the bench tools (their numpy and peers cost start-up time,
    twice: the core process imports the command's module as its main)."""
    code = ("import sys; from octavo.entrypoints.cli.main import _chosen_command as c; "
            "assert c(['--log-level', 'debug', 'serve', 'x']) == 'serve'; "
            "assert c(['chat']) == 'generate' and c(['--help']) is None and c(['foo']) is None; "
            "import octavo.entrypoints.cli.main; "
            "assert 'octavo.entrypoints.cli.bench' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_core_forks_only_from_a_process_without_torch_or_threads():
    """`octavo serve` launches the core before anything imports torch or starts a thread, and
    then forks it; a process with torch (this one) or a second thread spawns instead."""
    import torch  # noqa: F401

    from octavo.engine.core_launch import _start_method

    assert _start_method() == "spawn"
    code = ("import sys, threading; from octavo.engine.core_launch import _start_method as m; "
            "first = m(); t = threading.Thread(target=threading.Event().wait, args=(5,), "
            "daemon=True); t.start(); print(first, m())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == (["fork", "spawn"] if sys.platform == "linux"
                                   else ["spawn", "spawn"])


def test_serve_launches_the_core_before_its_heavy_imports():
    """What `octavo serve` imports before it forks the core is on every start's critical path:
    no torch, numpy, asyncio (0.025 s) or web stack."""
    code = ("import sys; import octavo.entrypoints.cli.main, octavo.entrypoints.cli.serve, "
            "octavo.engine.core_launch; print(sorted(m for m in ('asyncio', 'torch', 'numpy', "
            "'uvicorn', 'fastapi', 'zmq') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_serve_warns_beyond_loopback_and_the_host_allow_list_rule():
    from octavo.entrypoints.cli.serve import _loopback
    from octavo.entrypoints.guard import LOOPBACK_HOSTS, default_allowed_hosts

    assert _loopback("127.0.0.1") and _loopback("localhost") and _loopback("::1")
    assert not _loopback("0.0.0.0") and not _loopback("10.1.2.3") and not _loopback("myhost")
    assert default_allowed_hosts("127.0.0.1", None, None) == LOOPBACK_HOSTS
    assert default_allowed_hosts("0.0.0.0", "key", None) is None  # a key: any Host
    assert default_allowed_hosts("0.0.0.0", "key", ["api.example"]) == \
        LOOPBACK_HOSTS | {"api.example"}
    assert default_allowed_hosts("127.0.0.1", None, ["*"]) is None


def test_serve_takes_vllms_optimization_level_flag():
    import argparse

    from octavo.config import EngineConfig
    from octavo.entrypoints.cli import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    level = lambda *a: EngineConfig.from_cli(  # noqa: E731
        parser.parse_args(["serve", *a])).device.compilation_level
    assert level() == 0
    assert level("-O3") == 3
    assert level("--compilation-level", "1") == 1
