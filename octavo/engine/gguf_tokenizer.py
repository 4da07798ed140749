"""A GGUF file's tokenizer, built with the `tokenizers` library straight from the file's metadata.

A GGUF carries no tokenizer.json: its vocabulary, merges, scores, token types and special token ids
sit in the metadata under llama.cpp's keys. transformers (`AutoTokenizer.from_pretrained(folder,
gguf_file=name)`) turns them into a tokenizer in 5-13 s (its import, a second read of the file,
a merge table rebuilt in pure Python); this module makes the same tokenizer from the metadata
octavo has already read (`model_files.open_gguf`) in well under that, so nothing is converted or
cached. Same means the same tokenizer.json: model, normalizer, pre-tokenizer, decoder and added
tokens, added in the order transformers adds them (an id of a token the vocabulary lacks depends
on that order), and the same named special tokens and bos/eos rule. tests/engine/
test_gguf_tokenizer.py holds it to transformers' result.

Built here, as transformers builds them:
- `gpt2` (byte-level BPE): tokens outside GPT-2's byte alphabet respelled byte by byte, the file's
  merges, GPT-2's byte-level pre-tokenizer, or a split regex named by `tokenizer.ggml.pre`.
- `llama` (SentencePiece as BPE with byte fallback): the file's merges or, when it has none, the
  merges its scores imply; Gemma's files respell their space tokens and rank merges by position,
  Phi-3's put the prefix space in a normalizer.
Anything else (unigram `t5`, an architecture whose transformers tokenizer class is not in
`_CLASS_TOKENS`) raises `NotBuiltDirectly`, and the caller converts it with transformers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_SPIECE_SPACE = "\u2581"
# The named special tokens, in the order transformers adds them.
_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
          "mask_token")
_FILE_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
             "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}

# GGUF architecture -> the named tokens (beyond the file's four) that the tokenizer class
# transformers wraps that architecture's tokenizer in adds by default. Only architectures checked
# against transformers are listed; the rest are converted by transformers.
# (transformers has no GGUF support for gptneox, so there is nothing to check that against.)
_CLASS_TOKENS: dict[str, dict[str, str]] = {
    **{arch: {} for arch in ("llama", "phi3", "gpt2", "qwen2", "qwen3", "qwen2moe", "qwen3moe")},
    **{arch: {"mask_token": "<mask>"} for arch in ("gemma", "gemma2", "gemma3")},
}
_QWEN2_CLASS = ("qwen2", "qwen3", "qwen2moe", "qwen3moe")  # Qwen2Tokenizer re-adds its named tokens

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
                rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how text is split before the merges, for the names transformers knows
# (the others keep the base tokenizer's pre-tokenizer).
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


class NotBuiltDirectly(Exception):
    """A tokenizer this module does not build; the message says which and why."""


@dataclass(frozen=True)
class GGUFTokenizer:
    backend: Backend
    config: dict[str, Any]  # named special tokens, add_bos_token, add_eos_token
    chat_template: str | None


def build_gguf_tokenizer(metadata: dict[str, Any], where: str) -> GGUFTokenizer:
    """The tokenizer of a GGUF file's `metadata`; `where` (the file) names it in errors.
    ValueError for metadata that contradicts itself, NotBuiltDirectly for a kind not built here."""
    arch = metadata.get("general.architecture")
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"model: {where} holds no tokenizer (no tokenizer.ggml.tokens); "
                         "name one with --tokenizer")
    if arch not in _CLASS_TOKENS:
        raise NotBuiltDirectly(f"architecture {arch!r}")
    token_types = _list(metadata, "tokenizer.ggml.token_type", len(tokens), where)
    named = {name: _named_token(metadata, key, tokens, where)
             for name, key in _FILE_IDS.items()}
    if kind == "gpt2":
        backend = _byte_level(tokens, _merges_from_file(metadata, kind))
    elif kind == "llama" and arch in ("gemma", "gemma2", "gemma3"):
        backend = _gemma(tokens, metadata)
    elif kind == "llama":
        scores = _list(metadata, "tokenizer.ggml.scores", len(tokens), where)
        backend = _sentencepiece(tokens, metadata, scores, where)
        if arch == "phi3":  # its prefix space is a normalizer's, not Metaspace's
            backend.normalizer = normalizers.Sequence(
                [normalizers.Prepend(_SPIECE_SPACE), normalizers.Replace(" ", _SPIECE_SPACE)])
            backend.pre_tokenizer = None
    else:
        raise NotBuiltDirectly(f"tokenizer model {kind!r}")
    _add_file_tokens(backend, tokens, token_types, byte_level=kind == "gpt2")
    split = _SPLITS.get(metadata.get("tokenizer.ggml.pre"))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    config: dict[str, Any] = {n: t for n, t in named.items() if t is not None}
    for name, token in _CLASS_TOKENS[arch].items():
        config.setdefault(name, token)
    ordered = [config[n] for n in _NAMES if n in config]
    _add_named(backend, ordered)
    if arch in _QWEN2_CLASS:
        backend.add_tokens([AddedToken(t, special=True) for t in dict.fromkeys(ordered)])
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    config["add_bos_token"] = bool(add_bos) and "bos_token" in config
    config["add_eos_token"] = bool(add_eos) and "eos_token" in config
    template = metadata.get("tokenizer.chat_template")
    return GGUFTokenizer(backend, config, template if isinstance(template, str) else None)


def _list(metadata: dict[str, Any], key: str, length: int, where: str) -> list | None:
    values = metadata.get(key)
    if values is not None and not isinstance(values, list):
        raise ValueError(f"model: {where}: {key} must be an array, got {type(values).__name__}")
    if values is not None and len(values) != length:
        raise ValueError(f"model: {where}: {key} has {len(values)} entries for {length} tokens")
    return values


def _named_token(metadata: dict[str, Any], key: str, tokens: list[str], where: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
        raise ValueError(f"model: {where}: tokenizer.ggml.{key} must be a token id in "
                         f"[0, {len(tokens)}), got {token_id!r}")
    return tokens[token_id]


def _merges_from_file(metadata: dict[str, Any], kind: str) -> list[tuple[str, ...]]:
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise NotBuiltDirectly(f"a {kind!r} vocabulary without merges")
    return [tuple(m.split(" ")) for m in merges]


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the other
    bytes for the characters from U+0100 on, in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(256) if b not in spelling):
        spelling[b] = chr(256 + n)
    return spelling


def _byte_level(tokens: list[str], merges: list[tuple[str, ...]]) -> Backend:
    """GPT-2's byte-level BPE, as transformers' GPT2Tokenizer builds it."""
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = Backend(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    _add_named(backend, ["<|endoftext|>"])  # GPT2Tokenizer's unk, bos and eos
    return backend


def _sentencepiece(tokens: list[str], metadata: dict[str, Any], scores: list[float] | None,
                   where: str) -> Backend:
    """A SentencePiece BPE vocabulary, as transformers' LlamaTokenizer builds it."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = _merges_from_file(metadata, "llama")
    elif scores is None:
        raise ValueError(f"model: {where}: a SentencePiece vocabulary needs tokenizer.ggml.merges "
                         "or tokenizer.ggml.scores")
    else:
        merges = merges_from_scores(vocab, dict(zip(tokens, scores)))
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                          dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPIECE_SPACE,
                                                     prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0)])
    _add_named(backend, ["<s>", "</s>", "<unk>"])  # LlamaTokenizer's bos, eos and unk
    return backend


def _gemma(tokens: list[str], metadata: dict[str, Any]) -> Backend:
    """Gemma's SentencePiece vocabulary, as transformers' GemmaTokenizer builds it: a token of
    spaces is stored as spaces but looked up as U+2581s, and a file without merges ranks them by
    the position of the merged token (Gemma's scores do not follow its merge order)."""
    tokens = [_SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = _merges_from_file(metadata, "llama")
    else:
        merges = merges_from_scores(vocab, {t: -i for i, t in enumerate(tokens)})
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>",
                          dropout=None, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous",
                                                 invert=False)
    backend.decoder = decoders.Sequence([
        decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
    _add_named(backend, ["<bos>", "<eos>", "<unk>", "<pad>", "<mask>"])  # GemmaTokenizer's
    return backend


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies, ranked as transformers' generate_merges
    ranks them: every split of a token into two tokens, best score first, then the longer left
    part, then the longer right part, ties in the order `scores` lists the tokens.

    A Python loop over each token's split points (0.9 s for Gemma's 262k tokens) and one numpy
    sort; transformers' version sorts Python tuples with a key function twice over."""
    lefts: list[str] = []
    rights: list[str] = []
    owners: list[int] = []
    for k, token in enumerate(scores):
        for i in range(1, len(token)):
            left = token[:i]
            if left in vocab:
                right = token[i:]
                if right in vocab:
                    lefts.append(left)
                    rights.append(right)
                    owners.append(k)
    if not lefts:
        return []
    score = np.fromiter(scores.values(), np.float64, len(scores))[np.array(owners)]
    left_len = np.fromiter(map(len, lefts), np.int64, len(lefts))
    right_len = np.fromiter(map(len, rights), np.int64, len(rights))
    order = np.lexsort((-right_len, -left_len, -score))  # stable: ties keep the listed order
    return [(lefts[j], rights[j]) for j in order.tolist()]


def _add_file_tokens(backend: Backend, tokens: list[str], token_types: list[int] | None,
                     byte_level: bool) -> None:
    """The file's control tokens as special added tokens and its user-defined ones (`<think>`)
    as plain added tokens, so that text never cuts them. A byte-level vocabulary spells every
    real token in the byte alphabet; a control token spelled otherwise is a mislabel, skipped."""
    if not token_types:
        return
    alphabet = set(_byte_alphabet().values()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types)
               if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    # only a token the vocabulary spells as stored (Gemma respells its space tokens)
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, token_types)
            if kind == _USER_DEFINED and backend.token_to_id(t) is not None]
    if user:
        backend.add_tokens(user)


def _add_named(backend: Backend, names: list[str]) -> None:
    """Named special tokens not yet added tokens become special ones (at a new id when the
    vocabulary lacks them), as a transformers tokenizer class registers its defaults."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    new = [AddedToken(t, special=True) for t in dict.fromkeys(names) if t not in added]
    if new:
        backend.add_tokens(new)
