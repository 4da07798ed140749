"""A truncated or corrupt model file is a ValueError naming the file, raised in well under a second
with little memory, before anything large is allocated (octavo/model_files.py for GGUF, the
safetensors library's own checks for safetensors).

The bad GGUFs are SmolLM2's real file with bytes cut or patched: its header (1.8 MB) followed by
a sparse hole as long as the tensor data, so each copy costs 2 MB of disk and stays valid apart
from the patch. Each GGUF case runs in a forked child with a deadline, because the failure being
guarded against is gguf's reader looping on an absurd count until memory runs out.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

from octavo.arch_config import read_arch_config
from octavo.model_files import check_gguf, open_gguf
from octavo.model_source import ModelSource

HEADER = 2 << 20  # SmolLM2's metadata and tensor table end at 1,785,664 bytes


@pytest.fixture(scope="module")
def header(smollm_gguf) -> tuple[bytes, int]:
    with open(smollm_gguf, "rb") as f:
        return f.read(HEADER), smollm_gguf.stat().st_size


def _key_at(raw: bytes, key: str) -> int:
    """Offset just past a metadata key (its value type follows) or a tensor name."""
    at = raw.find(struct.pack("<Q", len(key)) + key.encode())
    assert at > 0, key
    return at + 8 + len(key)


def _write(path: Path, raw: bytes, size: int) -> Path:
    path.write_bytes(raw)
    os.truncate(path, size)  # the tensor data: a hole of zeros
    return path


def _patched(header, tmp_path, at: int, fmt: str, value: int) -> Path:
    raw, size = header
    raw = bytearray(raw)
    struct.pack_into(fmt, raw, at, value)
    return _write(tmp_path / "bad.gguf", bytes(raw), size)


def _in_child(conn, fn, arg) -> None:
    tracemalloc.start()
    try:
        fn(arg)
        result = None
    except Exception as exc:  # noqa: BLE001 (reported to the parent, which judges it)
        result = (type(exc).__name__, str(exc))
    conn.send((result, tracemalloc.get_traced_memory()[1]))
    conn.close()


def _failure(fn, arg, deadline: float = 30.0) -> tuple[str, str] | None:
    """fn(arg) in a forked child: its exception (type name, message), or None if it returned.
    Fails the test when it traces over 64 MB, or runs past a deadline that only a loop over an
    absurd count reaches (a timing bound here failed CI on a busy machine: the check is of work
    done, not of speed)."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_in_child, args=(child, fn, arg))
    proc.start()
    try:
        if not parent.poll(deadline):
            pytest.fail(f"{fn.__name__} ran for over {deadline} s on a bad file")
        result, peak = parent.recv()
    finally:
        proc.kill()
        proc.join()
    assert peak < 64 << 20, f"{fn.__name__} traced {peak >> 20} MB"
    return result


def _arch_config(path: Path) -> None:
    read_arch_config(ModelSource(path.name, path))


def _assert_invalid(path: Path, *words: str, fns=(check_gguf, open_gguf, _arch_config)) -> None:
    for fn in fns:
        result = _failure(fn, path)
        assert result is not None, f"{fn.__name__} accepted {path}"
        kind, message = result
        assert kind == "ValueError", (fn.__name__, kind, message)
        assert str(path) in message and "not a valid GGUF file" in message, message
        for word in words:
            assert word in message, message


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    # read_arch_config caches the configs it parses: the bad files' must stay out of the user's
    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))


def test_the_sparse_copy_itself_is_valid(header, tmp_path):
    """The control: without a patch the copy passes the check and parses, so each bad case
    below fails for its own patch."""
    path = _write(tmp_path / "good.gguf", *header)
    check_gguf(path)
    assert read_arch_config(ModelSource(path.name, path)).vocab_size == 49152


@pytest.mark.parametrize("keep, words", [
    (10, ["shorter than a GGUF header"]),
    (500_000, ["tokenizer.ggml.tokens", "past the end"]),  # inside the vocabulary
    (50 << 20, ["tensor", "past the end of the file"]),  # half of the tensor data
])
def test_truncated_gguf(smollm_gguf, tmp_path, keep, words):
    path = tmp_path / "cut.gguf"
    with open(smollm_gguf, "rb") as src:
        path.write_bytes(src.read(min(keep, HEADER)))
    os.truncate(path, keep)  # the data beyond the header is not read: a hole does as well
    _assert_invalid(path, *words)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "text.gguf"
    path.write_bytes(b"this is not a model file, only some text" * 10)
    _assert_invalid(path, "GGUF magic")


@pytest.mark.parametrize("where, fmt, value, words", [
    # a string length of 2**50 (general.architecture's value)
    ("general.architecture", "<Q", 1 << 50, ["general.architecture", "bytes"]),
    # the vocabulary's count (strings) and the token types' (int32) far beyond the file
    ("tokenizer.ggml.tokens", "<Q", 1 << 60, ["tokenizer.ggml.tokens", "claims"]),
    ("tokenizer.ggml.token_type", "<Q", 1 << 40, ["tokenizer.ggml.token_type", "claims"]),
    ("tensor count", "<Q", 1 << 40, ["tensors"]),
    ("metadata count", "<Q", 1 << 40, ["metadata entries"]),
    ("dimension count", "<I", 1000, ["token_embd.weight", "dimensions"]),
    ("first dimension", "<Q", 1 << 40, ["token_embd.weight", "past the end"]),
    ("tensor offset", "<Q", 1 << 62, ["token_embd.weight", "past the end"]),
    ("tensor type", "<I", 999, ["token_embd.weight", "unknown GGML type"]),
])
def test_absurd_gguf_metadata(header, tmp_path, where, fmt, value, words):
    raw = header[0]
    fixed = {"tensor count": 8, "metadata count": 16}
    if where in fixed:
        at = fixed[where]
    elif where.startswith("tokenizer."):
        at = _key_at(raw, where) + 4 + 4  # value type ARRAY, item type, then the count
    elif where == "general.architecture":
        at = _key_at(raw, where) + 4  # value type STRING, then the length
    else:  # the first tensor's entry: name, dimension count, dims, type, offset
        at = _key_at(raw, "token_embd.weight")
        at += {"dimension count": 0, "first dimension": 4, "tensor type": 4 + 16,
               "tensor offset": 4 + 16 + 4}[where]
    _assert_invalid(_patched(header, tmp_path, at, fmt, value), *words)


def test_a_start_on_a_truncated_gguf_names_the_file(smollm_gguf, tmp_path):
    """Through the offline API: the front end's config read stops the start."""
    from octavo import LLM

    path = tmp_path / "cut.gguf"
    with open(smollm_gguf, "rb") as src:
        path.write_bytes(src.read(HEADER))
    os.truncate(path, 60 << 20)
    with pytest.raises(ValueError, match="not a valid GGUF file") as err:
        LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    assert str(path) in str(err.value)


# --- safetensors --------------------------------------------------------------------------------

def _tiny_folder(tmp_path: Path) -> Path:
    """A one-layer llama folder as transformers saves it, with a real model.safetensors."""
    import transformers

    folder = tmp_path / "tiny"
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def _load(folder: Path) -> None:
    from octavo.model.loader import load_model

    source = ModelSource("tiny", folder)
    load_model(source, read_arch_config(source), torch.float32, torch.device("cpu"), 64)


def _corrupt(kind: str, raw: bytes) -> bytes:
    n = struct.unpack("<Q", raw[:8])[0]
    if kind == "truncated":
        return raw[:len(raw) - 100]
    if kind == "header length absurd":
        return struct.pack("<Q", 1 << 60) + raw[8:]
    if kind == "header length past the end":
        return struct.pack("<Q", len(raw)) + raw[8:]
    if kind == "header not JSON":
        return raw[:8] + b"\x00" * n + raw[8 + n:]
    assert kind == "offsets past the end"  # the last tensor moved 4 KB on, past the data
    header = json.loads(raw[8:8 + n])
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    header[last]["data_offsets"] = [o + 4096 for o in header[last]["data_offsets"]]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


@pytest.mark.parametrize("kind", ["truncated", "header length absurd",
                                  "header length past the end", "header not JSON",
                                  "offsets past the end"])
def test_corrupt_safetensors(tmp_path, kind):
    folder = _tiny_folder(tmp_path)
    _load(folder)  # the control: the file as written loads
    file = folder / "model.safetensors"
    file.write_bytes(_corrupt(kind, file.read_bytes()))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="not a valid safetensors file") as err:
            _load(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(file) in str(err.value)
    assert peak < 16 << 20
