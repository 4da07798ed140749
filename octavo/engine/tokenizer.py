"""The model's tokenizer: a fast `tokenizers` tokenizer plus its special tokens and chat template.

octavo reads `tokenizer.json` with the `tokenizers` library directly: 0.1 s, where building the
same tokenizer through `transformers` takes 2 s of a server's start-up. A GGUF file's tokenizer
is built from the file's metadata the same way (gguf_tokenizer.py), as transformers would build
it. `transformers` converts only what neither covers (a GGUF tokenizer kind gguf_tokenizer.py
does not build, a folder with only a sentencepiece model), logged as such; the result is saved
once under `$OCTAVO_CACHE/tokenizers/` (keyed by the file's name, size and mtime) and read from
there on later starts.
"""
from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend
from tokenizers.processors import TemplateProcessing

from octavo.disk_cache import write_dir
from octavo.engine.gguf_tokenizer import NotBuiltDirectly, build_gguf_tokenizer
from octavo.model_files import check_gguf, open_gguf
from octavo.model_source import ModelSource, cache_dir

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                       "cls_token", "mask_token")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json",
                   "merges.txt"]

logger = logging.getLogger(__name__)


class Tokenizer:
    """Encode, decode, and what chat templates read (special tokens, the template itself)."""

    def __init__(self, backend: Backend, config: dict[str, Any],
                 chat_template: str | None) -> None:
        self.backend = backend
        # A tokenizer.json may carry the padding and truncation it was trained with
        # (all-MiniLM's pads every text to 128 tokens); transformers sets both per call, and a
        # request's tokens are its text's alone.
        backend.no_padding()
        backend.no_truncation()
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = config.get(name)
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                self.special_tokens[name] = value
        self.eos_token_id = self._id_of("eos_token")
        self.bos_token_id = self._id_of("bos_token")
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        if "add_bos_token" in config or "add_eos_token" in config:
            self._set_bos_eos(bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        config: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins
            if (folder / name).is_file():
                config.update(json.loads((folder / name).read_text()))
        return cls(Backend.from_file(str(folder / "tokenizer.json")), config,
                   _chat_template(folder, config))

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    def _set_bos_eos(self, add_bos: bool, add_eos: bool) -> None:
        """tokenizer_config's add_bos_token/add_eos_token decide the special tokens around a
        text, as transformers does, whatever tokenizer.json's post-processor says: each text of
        a pair gets its own."""
        around, special = {}, []
        for add, name, tok_id in ((add_bos, "bos_token", self.bos_token_id),
                                  (add_eos, "eos_token", self.eos_token_id)):
            if not add:
                continue
            if tok_id is None:
                raise ValueError(f"tokenizer: add_{name} is set but the model has no {name}")
            around[name] = self.special_tokens[name]
            special.append((around[name], tok_id))

        def wrapped(seq: str, type_id: int) -> str:
            bos, eos = around.get("bos_token"), around.get("eos_token")
            return " ".join([*([f"{bos}:{type_id}"] if bos else []), f"${seq}:{type_id}",
                             *([f"{eos}:{type_id}"] if eos else [])])

        self.backend.post_processor = TemplateProcessing(
            single=wrapped("A", 0), pair=f"{wrapped('A', 0)} {wrapped('B', 1)}",
            special_tokens=special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included."""
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named special tokens and of every added token marked special."""
        ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        ids.update(i for i in map(self._id_of, self.special_tokens) if i is not None)
        return sorted(ids)

    def encode(self, text: str, add_special_tokens: bool = True,
               max_tokens: int | None = None, pair: str | None = None) -> list[int]:
        """ValueError for text that is not Unicode text (a lone surrogate, as JSON's "\ud800"
        decodes to): the tokenizer's Rust side cannot take it. `pair`: a second text, encoded
        as the tokenizer's sentence pair. `max_tokens`: cut tokens from the end (of the longer
        text first, for a pair) so that, with the special tokens kept, at most that many remain
        (as transformers' truncation=True, max_length=...)."""
        try:
            if max_tokens is None:
                return self.backend.encode(text, pair, add_special_tokens=add_special_tokens).ids
            parts = [self.backend.encode(t, add_special_tokens=False)
                     for t in (text, pair) if t is not None]
            special = (self.backend.num_special_tokens_to_add(pair is not None)
                       if add_special_tokens else 0)
            lengths = [len(p.ids) for p in parts]
            while sum(lengths) > max(max_tokens - special, 0):  # the longer loses a token
                lengths[lengths.index(max(lengths))] -= 1
            for part, length in zip(parts, lengths):
                part.truncate(length)
            if not add_special_tokens:
                return [i for p in parts for i in p.ids]
            return self.backend.post_process(*parts).ids
        except (TypeError, ValueError, UnicodeError):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"the text holds a lone surrogate at character {exc.start} "
                                 f"(not valid Unicode)") from None
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up_spaces else text

    def batch_decode(self, batch: Sequence[Sequence[int]],
                     skip_special_tokens: bool = False) -> list[str]:
        texts = self.backend.decode_batch([list(ids) for ids in batch],
                                          skip_special_tokens=skip_special_tokens)
        return [_clean_up_spaces(t) for t in texts] if self._clean_up_spaces else texts

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The template from chat_template.jinja, chat_template.json or tokenizer_config.json (in the
    order transformers prefers them); of several named templates, the one named 'default'."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if (folder / "chat_template.json").is_file():
        template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _clean_up_spaces(text: str) -> str:
    """The old BERT/GPT-2 era clean-up some tokenizer configs still ask for."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                          (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                          (" 're", "'re")):
        text = text.replace(before, after)
    return text


def load_tokenizer(source: ModelSource, override: str | None = None) -> Tokenizer:
    if override:
        return _named_tokenizer(override)
    if source.is_gguf:
        return _from_gguf(source.path)
    if (source.path / "tokenizer.json").is_file():
        return Tokenizer.from_folder(source.path)
    return _converted(source.path, gguf=False)


def _named_tokenizer(name: str) -> Tokenizer:
    path = Path(name)
    if path.is_dir():
        return (Tokenizer.from_folder(path) if (path / "tokenizer.json").is_file()
                else _converted(path, gguf=False))
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(name, allow_patterns=TOKENIZER_FILES))
    except Exception as exc:  # no such repo, no network: the user's flag is wrong or unusable
        raise ValueError(f"tokenizer: {name!r} is neither a local folder nor a downloadable "
                         f"Hugging Face repository ({type(exc).__name__}: {exc})") from None
    return (Tokenizer.from_folder(folder) if (folder / "tokenizer.json").is_file()
            else _converted(folder, gguf=False))


def _from_gguf(path: Path) -> Tokenizer:
    try:
        built = build_gguf_tokenizer(open_gguf(path).metadata, str(path))
    except NotBuiltDirectly as exc:
        return _converted(path, gguf=True, why=f"its tokenizer ({exc}) is not built directly")
    return Tokenizer(built.backend, built.config, built.chat_template)


def _converted(path: Path, gguf: bool, why: str = "it has no tokenizer.json") -> Tokenizer:
    """The tokenizer transformers makes from a GGUF file or a slow tokenizer, converted once and
    cached as a folder with tokenizer.json."""
    marker = path if gguf else path / "tokenizer_config.json"
    st = marker.stat() if marker.exists() else path.stat()
    stem = path.stem if gguf else path.name
    saved = cache_dir() / "tokenizers" / f"{stem}-{st.st_size}-{st.st_mtime_ns}"
    if (saved / "tokenizer.json").is_file():
        return Tokenizer.from_folder(saved)
    if gguf:
        check_gguf(path)  # transformers' GGUF reader trusts the sizes a corrupt file states
    logger.info("tokenizer: converting %s with transformers, as %s (cached under %s)",
                path, why, saved.parent)
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if gguf:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        tok = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"model: {path} has no fast tokenizer (tokenizer.json) and transformers "
                         "could not convert one")
    # tokenizers' Rust writer reports a full disk or a read-only folder as a plain Exception, so
    # any error skips the cache; a real fault in save_pretrained raises again just below.
    if write_dir(saved, lambda tmp: tok.save_pretrained(str(tmp)), "the converted tokenizer",
                 errors=(Exception,)):
        return Tokenizer.from_folder(saved)
    with tempfile.TemporaryDirectory(prefix="octavo-tokenizer-") as tmp:  # read, then removed
        tok.save_pretrained(tmp)
        return Tokenizer.from_folder(Path(tmp))
