"""A tiny random Llama (SmolLM2's tokenizer copied in), shared by the executor tests."""
from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama(smollm_gguf, tmp_path_factory) -> Path:
    import torch
    import transformers

    from octavo.engine.tokenizer import load_tokenizer
    from octavo.model_source import ModelSource

    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so that outputs vary
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    folder = tmp_path_factory.mktemp("executor") / "tiny-llama"
    model.save_pretrained(folder, safe_serialization=True)
    tok = load_tokenizer(ModelSource("smollm", smollm_gguf))
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**tok.special_tokens, "chat_template": tok.chat_template}))
    return folder
