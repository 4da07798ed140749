"""octavo's tokenizer (tokenizer.json read by `tokenizers`, no transformers) encodes, decodes and
knows its special tokens and chat template exactly as transformers' tokenizer of the same model."""
from __future__ import annotations

import pytest

from octavo.engine.tokenizer import Tokenizer, load_tokenizer
from octavo.model_source import ModelSource

TEXTS = ["Hello world, héllo 日本 🌍", "def f(x):\n    return x**2",
         "<|im_start|>user\nhi<|im_end|>", "  leading spaces and trailing  ", "a" * 300]


def _same(ours: Tokenizer, ref) -> None:
    for text in TEXTS:
        ids = ref(text).input_ids
        assert ours.encode(text) == ids
        assert ours.encode(text, add_special_tokens=False) == ref(
            text, add_special_tokens=False).input_ids
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip)
    assert ours.chat_template == ref.chat_template
    assert (ours.eos_token_id, ours.bos_token_id) == (ref.eos_token_id, ref.bos_token_id)
    assert ours.special_tokens["eos_token"] == ref.eos_token
    assert set(ours.all_special_ids) >= set(ref.all_special_ids)


def test_gguf_tokenizer_is_built_without_a_cache_and_matches(smollm_gguf, smollm_oracle_folder,
                                                            tmp_path, monkeypatch):
    """Built from the file's metadata each start (tests/engine/test_gguf_tokenizer.py holds it to
    transformers' tokenizer in full): nothing is converted or cached. The reference is what
    transformers made of the same file, saved by the oracle."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path))
    ours = load_tokenizer(ModelSource("smollm", smollm_gguf))
    assert not (tmp_path / "tokenizers").exists()
    _same(ours, AutoTokenizer.from_pretrained(smollm_oracle_folder))


@pytest.mark.parametrize("catalog", ["qwen2.5-coder-0.5b-instruct", "gemma3-270m"])
def test_hf_folder_tokenizer_matches_transformers(catalog):
    from transformers import AutoTokenizer

    from tests.oracle import oracle_folder

    folder = oracle_folder(catalog)
    _same(load_tokenizer(ModelSource(catalog, folder)), AutoTokenizer.from_pretrained(folder))


def test_add_bos_token_in_the_config_wins(smollm_oracle_folder, tmp_path):
    import json
    import shutil

    for f in smollm_oracle_folder.iterdir():
        if f.name.startswith(("tokenizer", "special", "chat")):
            shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.encode("hi")[0] == tok.bos_token_id
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id


def test_unknown_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(ModelSource("x", tmp_path), override=str(tmp_path / "missing" / "x"))
