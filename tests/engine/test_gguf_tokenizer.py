"""A GGUF file's tokenizer built from its metadata (octavo/engine/gguf_tokenizer.py) is the tokenizer
transformers makes of the file (`AutoTokenizer.from_pretrained(folder, gguf_file=name)`): the same
tokenizer.json, the same ids and text on a varied corpus, the same special tokens.

The three catalog GGUFs, and tiny metadata-only GGUFs of the other tokenizer shapes octavo's
architectures meet: byte-level vocabularies under each split regex and tokenizer class, SentencePiece
vocabularies whose merges come from tied scores, Gemma's and Phi-3's variants, named tokens the
vocabulary lacks (transformers adds them at new ids), a kind only transformers builds (converted
and cached), and metadata that contradicts itself.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import pytest

from octavo.engine.gguf_tokenizer import NotBuiltDirectly, build_gguf_tokenizer
from octavo.engine.tokenizer import Tokenizer, load_tokenizer
from octavo.model_files import open_gguf
from octavo.model_source import ModelSource, pull

CATALOG = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma3-270m"]
CONVERSATION = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Write `x = 1` in Python.\n\nThanks 🙏"},
                {"role": "assistant", "content": "```python\nx = 1\n```"},
                {"role": "user", "content": "日本語で?"}]
CORPUS = [
    "", "Hello world, this is a test.", "The year 2024: 3.14159 and 1,000,000 items!",
    'def f(x):\n    return {"a": x ** 2}  # square\n\tif x:\n\t\tpass\n',
    "  leading", "trailing   ", "a    b\t\t c", "\n", "\n\n\n", " ", "   \n  \n ", "\r\n\r\nCRLF\r\n",
    "héllo naïve café Ĥ e\u0301", "日本語のテキスト、中文字符。한국어", "🌍🚀 👩‍👩‍👧 emoji ❤️",
    "\u2581marker\u2581 and \x00\x07 control \x7f", "It's they're we'll I'd CAPS'S",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "<bos><start_of_turn>user\nhi<end_of_turn>",
    "<think>step</think> <tool_call>{}</tool_call> <s>x</s><unk>", "a" * 300, "ab " * 100,
]


def _corpus(ref) -> list[str]:
    """CORPUS, the model's own special and added tokens written as text, and its chat template
    rendered for a conversation."""
    added = [t.content for _, t in sorted(ref.added_tokens_decoder.items())]
    texts = CORPUS + [" ".join(added[:8] + added[-8:]), "x".join(ref.all_special_tokens)]
    if ref.chat_template:
        texts.append(ref.apply_chat_template(CONVERSATION, tokenize=False))
        texts.append(ref.apply_chat_template(CONVERSATION[:2], tokenize=False,
                                             add_generation_prompt=True))
    return texts


def _assert_same(ours: Tokenizer, ref) -> None:
    """`ours` is `ref` (a transformers tokenizer): the same tokenizer.json and the same behaviour."""
    assert json.loads(ours.backend.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    assert ours.vocab_size == len(ref) and ours.get_vocab() == ref.get_vocab()
    named = {n: getattr(ref, n) for n in ref.SPECIAL_TOKENS_ATTRIBUTES if getattr(ref, n)}
    assert ours.special_tokens == named
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    special = {i for i, t in ref.added_tokens_decoder.items() if t.special}
    assert ours.all_special_ids == sorted(special | set(ref.all_special_ids))
    assert ours.chat_template == ref.chat_template
    for text in _corpus(ref):
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip), text


def _transformers(path: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("name", CATALOG)
def test_a_catalog_gguf_tokenizer_is_transformers_own(name, tmp_path, monkeypatch):
    # Not the oracle folder's saved tokenizer: reloading a folder, transformers gives Qwen2's
    # tokenizer an NFC normalizer that its GGUF conversion has not.
    from tests.oracle import one_metadata_parse

    path = pull(name)
    with one_metadata_parse():
        ref = _transformers(path)
    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    ours = load_tokenizer(ModelSource(name, path))
    assert not (tmp_path / "cache" / "tokenizers").exists(), "built directly: nothing converted"
    _assert_same(ours, ref)
    ref.save_pretrained(str(tmp_path / "converted"))  # what octavo read before: the same
    converted = Tokenizer.from_folder(tmp_path / "converted")
    assert ours.special_tokens == converted.special_tokens
    assert ours.all_special_ids == converted.all_special_ids
    for text in _corpus(ref):
        assert ours.encode(text) == converted.encode(text)


# --- tiny GGUFs ---------------------------------------------------------------------------------

def write_tokenizer_gguf(path: Path, arch: str, tok: dict) -> Path:
    """A GGUF of metadata only: enough of an architecture for transformers' config, and a
    tokenizer under llama.cpp's keys."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_layer_norm_eps(1e-5)
    w.add_tokenizer_model(tok["model"])
    for key, add in (("pre", w.add_tokenizer_pre), ("types", w.add_token_types),
                     ("scores", w.add_token_scores), ("merges", w.add_token_merges),
                     ("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                     ("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id),
                     ("add_bos", w.add_add_bos_token), ("add_eos", w.add_add_eos_token),
                     ("template", w.add_chat_template)):
        if key in tok:
            add(tok[key])
    w.add_token_list(tok["tokens"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _metadata(name: str) -> dict:
    return open_gguf(pull(name)).metadata


def _byte_level(name: str, skip: int, count: int) -> tuple[list[str], list[str]]:
    """`count` plain tokens of a catalog byte-level vocabulary, from `skip` on, and the merges
    among them (a merge's parts and result all kept)."""
    md = _metadata(name)
    tokens = md["tokenizer.ggml.tokens"][skip:skip + count]
    kept = set(tokens)
    merges = [m for m in md["tokenizer.ggml.merges"]
              if m.replace(" ", "") in kept and all(p in kept for p in m.split(" "))]
    return tokens, merges


def smollm_like(pre: str, count: int = 1500, **extra) -> dict:
    """`count` of SmolLM2's byte-level tokens behind Llama 3 style specials, a user-defined
    <think>, and a control token with a space (a llama.cpp mislabel transformers skips); it has
    no <|endoftext|>, which transformers' GPT2Tokenizer adds at a new id."""
    tokens, merges = _byte_level("smollm2-135m-instruct", 17, count)
    head = ["<|begin_of_text|>", "<|eot_id|>", "<think>", "</think>", "<bad ctrl>",
            "<|reserved_0|>"]
    return {"model": "gpt2", "pre": pre, "tokens": head + tokens, "merges": merges,
            "types": [3, 3, 4, 4, 3, 3] + [1] * len(tokens), "bos": 0, "eos": 1, **extra}


def _qwen_like(pre: str, **extra) -> dict:
    tokens, merges = _byte_level("qwen2.5-coder-0.5b-instruct", 0, 2000)
    tail = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<think>", "[PAD2006]"]
    md = _metadata("qwen2.5-coder-0.5b-instruct")
    return {"model": "gpt2", "pre": pre, "tokens": tokens + tail, "merges": merges,
            "types": [1] * len(tokens) + [3, 3, 3, 4, 4, 4, 5], "bos": 2000, "eos": 2002,
            "pad": 2000, "template": md["tokenizer.chat_template"], **extra}


def _sentencepiece(tied_scores: bool = True) -> dict:
    """A SentencePiece vocabulary: <unk> <s> </s>, a user-defined and a control token, the 256
    byte tokens, and Gemma's first plain pieces, scored in runs of five equal scores so that
    the merge ranking's tie-breaks decide."""
    md = _metadata("gemma3-270m")
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    plain = [t for t, k in zip(tokens[494:5000], types[494:5000]) if k == 1]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    head = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>", "<think>"]
    scores = [0.0] * (len(head) + 256) + [
        -float(i // 5) if tied_scores else -float(i) for i in range(len(plain))]
    return {"model": "llama", "tokens": head + byte_tokens + plain, "scores": scores,
            "types": [2, 3, 3, 3, 3, 4] + [6] * 256 + [1] * len(plain), "unk": 0, "bos": 1,
            "eos": 2}


def _gemma_like(drop_mask: bool) -> dict:
    """Gemma 3's own specials (its space tokens among them), bytes and first plain pieces; with
    `drop_mask`, no <mask>, which transformers' GemmaTokenizer adds at a new id."""
    md = _metadata("gemma3-270m")
    keep = [i for i in range(4000)
            if not (drop_mask and md["tokenizer.ggml.tokens"][i] == "<mask>")]

    def pick(key: str) -> list:
        return [md[f"tokenizer.ggml.{key}"][i] for i in keep]

    return {"model": "llama", "tokens": pick("tokens"), "scores": pick("scores"),
            "types": pick("token_type"), "bos": 2, "eos": 1, "unk": 3, "pad": 0, "add_bos": True,
            "add_eos": False}


def _with_merges(tok: dict) -> dict:
    """The same vocabulary with its merges stated in the file (in an order of their own; a
    merge of tokens with spaces cannot be written as "left right")."""
    from octavo.engine.gguf_tokenizer import merges_from_scores

    vocab = {t: i for i, t in enumerate(tok["tokens"])}
    merges = merges_from_scores(vocab, {t: float(len(t)) for t in vocab})
    return {**{k: v for k, v in tok.items() if k != "scores"},
            "merges": [f"{a} {b}" for a, b in merges if " " not in a + b]}


TINY = {
    "llama-llama3-split": lambda: ("llama", smollm_like("llama-bpe", add_bos=True)),
    "llama-tekken-split": lambda: ("llama", smollm_like("tekken", add_bos=False)),
    "llama-gpt4o-split": lambda: ("llama", smollm_like("gpt-4o", add_eos=True)),
    "gpt2-default-split": lambda: ("gpt2", {**smollm_like("gpt-2"), "types": None}),
    "gemma3-class-on-byte-level": lambda: ("gemma3", smollm_like("smollm")),
    "qwen3-qwen2-split": lambda: ("qwen3", _qwen_like("qwen2", add_bos=False)),
    "qwen2-qwen2-split": lambda: ("qwen2", _qwen_like("deepseek-r1-qwen")),
    "qwen2moe-qwen35-split": lambda: ("qwen2moe", _qwen_like("qwen35", add_eos=True)),
    "qwen3moe-no-split": lambda: ("qwen3moe", _qwen_like("default")),
    "llama-sentencepiece-tied-scores": lambda: ("llama", _sentencepiece()),
    "llama-sentencepiece-merges": lambda: ("llama", _with_merges(_sentencepiece())),
    "llama-sentencepiece-no-bos": lambda: ("llama", {**_sentencepiece(), "add_bos": False,
                                                     "add_eos": True}),
    "phi3-sentencepiece": lambda: ("phi3", _sentencepiece(tied_scores=False)),
    "gemma3-own-vocab": lambda: ("gemma3", _gemma_like(drop_mask=False)),
    "gemma2-without-mask": lambda: ("gemma2", _gemma_like(drop_mask=True)),
    "gemma3-merges": lambda: ("gemma3", _with_merges(_gemma_like(drop_mask=False))),
}


@pytest.mark.parametrize("case", sorted(TINY))
def test_a_tiny_gguf_tokenizer_is_transformers_own(case, tmp_path, monkeypatch):
    arch, tok = TINY[case]()
    if tok.get("types") is None:
        tok.pop("types", None)
    path = write_tokenizer_gguf(tmp_path / f"{case}.gguf", arch, tok)
    ref = _transformers(path)
    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    ours = load_tokenizer(ModelSource(case, path))
    assert not (tmp_path / "cache").exists()
    _assert_same(ours, ref)


def test_a_kind_not_built_directly_is_converted_by_transformers_and_cached(tmp_path, monkeypatch,
                                                                          caplog):
    """An architecture whose transformers tokenizer class is not checked here (StableLM's)."""
    path = write_tokenizer_gguf(tmp_path / "stablelm.gguf", "stablelm", smollm_like("smollm"))
    with pytest.raises(NotBuiltDirectly, match="stablelm"):
        build_gguf_tokenizer(open_gguf(path).metadata, str(path))
    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="octavo.engine.tokenizer"):
        ours = load_tokenizer(ModelSource("stablelm", path))
    (message,) = [r.getMessage() for r in caplog.records if "converting" in r.getMessage()]
    assert str(path) in message and "stablelm" in message
    (saved,) = (tmp_path / "cache" / "tokenizers").iterdir()
    assert saved.name.startswith("stablelm") and (saved / "tokenizer.json").is_file()
    _assert_same(ours, _transformers(path))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="octavo.engine.tokenizer"):
        again = load_tokenizer(ModelSource("stablelm", path))  # from the cache, not converted
    assert not [r for r in caplog.records if "converting" in r.getMessage()]
    assert again.encode(CORPUS[3]) == ours.encode(CORPUS[3])


@pytest.mark.parametrize("change, message", [
    ({"bos": 5000}, r"tokenizer\.ggml\.bos_token_id must be a token id in \[0, 1506\), got 5000"),
    ({"scores": [0.0] * 3, "model": "llama"}, r"tokenizer\.ggml\.scores has 3 entries for 1506"),
    ({"types": [1] * 7}, r"tokenizer\.ggml\.token_type has 7 entries for 1506"),
    ({"model": "llama", "merges": None}, r"needs tokenizer\.ggml\.merges or tokenizer\.ggml\.scores"),
])
def test_metadata_that_contradicts_itself_is_a_clear_error(change, message, tmp_path):
    tok = {**smollm_like("smollm"), **change}
    tok = {k: v for k, v in tok.items() if v is not None}
    path = write_tokenizer_gguf(tmp_path / "bad.gguf", "llama", tok)
    with pytest.raises(ValueError, match=message):
        load_tokenizer(ModelSource("bad", path))


def test_a_gguf_without_a_vocabulary_asks_for_a_tokenizer():
    with pytest.raises(ValueError, match="holds no tokenizer.*--tokenizer"):
        build_gguf_tokenizer({"general.architecture": "llama"}, "tiny.gguf")


def test_a_byte_level_vocabulary_without_merges_is_left_to_transformers():
    md = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2",
          "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(NotBuiltDirectly, match="without merges"):
        build_gguf_tokenizer(md, "tiny.gguf")
