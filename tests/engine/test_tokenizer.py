"""The GGUF tokenizer cache gives the same tokenizer as building it from the GGUF."""
from __future__ import annotations

from octavo.engine.tokenizer import load_tokenizer
from octavo.model_source import ModelSource

TEXTS = ["Hello world, héllo 日本 🌍", "def f(x):\n    return x**2", "<|im_start|>user\nhi<|im_end|>"]


def test_cached_gguf_tokenizer_is_identical(smollm_gguf, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path))
    source = ModelSource("smollm", smollm_gguf)
    first = load_tokenizer(source)
    assert list((tmp_path / "tokenizers").iterdir()), "nothing was cached"
    second = load_tokenizer(source)
    ref = AutoTokenizer.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name)
    for text in TEXTS:
        assert first(text).input_ids == second(text).input_ids == ref(text).input_ids
    assert second.chat_template == ref.chat_template
    assert (second.eos_token_id, second.bos_token_id) == (ref.eos_token_id, ref.bos_token_id)
    assert second.all_special_ids == ref.all_special_ids
    ids = ref(TEXTS[0]).input_ids
    assert second.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
