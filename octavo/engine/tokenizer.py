"""Load the tokenizer (and its chat template) of a model source.

Building a tokenizer from GGUF metadata takes seconds (6 s for SmolLM2), so the result is saved
once under `$OCTAVO_CACHE/tokenizers/` (keyed by the file's name, size and mtime) and loaded from
there on later starts.
"""
from __future__ import annotations

import logging
import shutil

from octavo.model_source import ModelSource, cache_dir

logger = logging.getLogger(__name__)


def load_tokenizer(source: ModelSource, override: str | None = None):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if override:
        tok = AutoTokenizer.from_pretrained(override)
    elif source.is_gguf:
        tok = _gguf_tokenizer(source)
    else:
        tok = AutoTokenizer.from_pretrained(str(source.path))
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"model: {source.name} has no fast tokenizer (tokenizer.json)")
    return tok


def _gguf_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    st = source.path.stat()
    saved = cache_dir() / "tokenizers" / f"{source.path.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (saved / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(saved))
    tok = AutoTokenizer.from_pretrained(str(source.folder), gguf_file=source.path.name)
    try:
        tmp = saved.with_name(saved.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(str(tmp))
        shutil.rmtree(saved, ignore_errors=True)
        tmp.rename(saved)
    except OSError as exc:  # a read-only cache only costs start-up time
        logger.warning("could not cache the GGUF tokenizer in %s: %s", saved, exc)
    return tok
