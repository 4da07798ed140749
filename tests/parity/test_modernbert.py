"""ModernBERT against transformers on tiny random models: an embedding model's pooled states
(mixed lengths in one step, past its local layers' window) and a cross-encoder's scores and
class probabilities (its head over [CLS], or over the tokens' mean)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from octavo import LLM
from tests.parity.test_embeddings import (  # noqa: F401  (minilm_folder: a fixture)
    _tiny_encoder, encoded_beside_transformers, minilm_folder, write_pooling_modules)

# 3 layers, the first and last global; the middle one sees 4 tokens on either side
SHAPE = {"num_hidden_layers": 3, "global_attn_every_n_layers": 2, "local_attention": 8,
         "max_position_embeddings": 256, "pad_token_id": 0, "cls_token_id": 101,
         "sep_token_id": 102, "bos_token_id": 101, "eos_token_id": 102,
         "global_rope_theta": 1000.0, "local_rope_theta": 50.0, "norm_bias": True}


def test_modernbert_embeds_as_transformers(tmp_path, minilm_folder):  # noqa: F811
    folder, model = _tiny_encoder(tmp_path / "modernbert", minilm_folder, "ModernBertModel",
                                  **SHAPE)
    write_pooling_modules(folder, "mean")
    for out, hidden in encoded_beside_transformers(folder, model, 2):
        assert np.allclose(out.outputs.data, hidden.mean(0).numpy(), atol=1e-4)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_cross_encoder_scores_and_classifies_as_transformers(tmp_path, minilm_folder,  # noqa: F811
                                                                        pooling):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(minilm_folder)
    query = "what is the capital of france"
    docs = ["paris is the capital of france", "the cat sat on the mat",
            "berlin is the capital of germany and its largest city, on the spree river"]
    folder, model = _tiny_encoder(tmp_path / f"mb-score-{pooling}", minilm_folder,
                                  "ModernBertForSequenceClassification", num_labels=1,
                                  classifier_pooling=pooling, **SHAPE)
    llm = LLM(str(folder), dtype="float32")
    try:
        scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    with torch.inference_mode():
        want = model(**tok([query] * 3, docs, padding=True, return_tensors="pt")).logits
    assert np.allclose(scores, want.sigmoid()[:, 0].numpy(), atol=1e-5)

    folder, model = _tiny_encoder(tmp_path / f"mb-cls-{pooling}", minilm_folder,
                                  "ModernBertForSequenceClassification", num_labels=3,
                                  classifier_pooling=pooling, **SHAPE)
    llm = LLM(str(folder), dtype="float32")
    try:
        probs = np.array([o.outputs.probs for o in llm.classify(docs, use_tqdm=False)])
    finally:
        llm.engine.shutdown()
    with torch.inference_mode():
        want = model(**tok(docs, padding=True, return_tensors="pt")).logits.softmax(-1)
    assert np.allclose(probs, want.numpy(), atol=1e-5)


def test_a_modernbert_config_from_before_transformers_5(tmp_path):
    """ModernBERT's released configs name the RoPE bases and the local layers as
    global_rope_theta, local_rope_theta, global_attn_every_n_layers and local_attention."""
    from octavo.arch_config import SLIDING, read_arch_config
    from octavo.model_source import ModelSource

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["ModernBertModel"], "vocab_size": 50368, "hidden_size": 768,
        "num_attention_heads": 12, "num_hidden_layers": 4, "intermediate_size": 1152,
        "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "norm_eps": 1e-5,
        "global_attn_every_n_layers": 3, "local_attention": 128,
        "max_position_embeddings": 8192}))
    arch = read_arch_config(ModelSource("x", tmp_path))
    assert (arch.rope_theta, arch.rope_local_theta, arch.rms_norm_eps) == (160000, 10000, 1e-5)
    assert [arch.layer_window(i) for i in range(4)] == [None, 64, 64, None]
    assert arch.layer_types[1] == SLIDING and arch.is_encoder and not arch.generates
