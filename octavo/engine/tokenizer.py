"""Load the tokenizer (and its chat template) of a model source."""
from __future__ import annotations

import logging

from octavo.model_source import ModelSource

logger = logging.getLogger(__name__)


def load_tokenizer(source: ModelSource, override: str | None = None):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if override:
        return AutoTokenizer.from_pretrained(override)
    if source.is_gguf:
        tok = AutoTokenizer.from_pretrained(str(source.folder), gguf_file=source.path.name)
    else:
        tok = AutoTokenizer.from_pretrained(str(source.path))
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"model: {source.name} has no fast tokenizer (tokenizer.json)")
    return tok
