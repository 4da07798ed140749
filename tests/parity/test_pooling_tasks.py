"""The pooling tasks beyond one vector, against transformers: token_embed (a vector per token:
pooling "all") on an encoder and a decoder; reward (a process reward model) from an LM head's
softmax over returned_token_ids at step tags (pooling "step") with --pooler-config's defaults,
and from a decoder's score head at every token; the engine tasks and what each refuses. A
decoder's pooling prompts longer than a step run in chunks, as prefills do, and one that reads
only its last position takes a cached prefix."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from octavo import LLM
from octavo.pooling_params import PoolingParams
from tests.parity.test_embeddings import (  # noqa: F401  (minilm_folder: a fixture)
    _tiny_encoder, minilm_folder, tiny_decoder, write_pooling_modules)

TAG = 30  # SmolLM2's ".": the step tag of these prompts


def _prompt(seed: int, length: int) -> list[int]:
    ids = torch.randint(200, 40000, (length,), generator=torch.Generator().manual_seed(seed))
    ids[5::7] = TAG
    return ids.tolist()


def test_a_decoder_rewards_steps_and_embeds_tokens_as_transformers(smollm_oracle_folder):
    import transformers

    prompts = [_prompt(1, 150), _prompt(2, 70)]  # chunks of at most 64 tokens
    llm = LLM(str(smollm_oracle_folder), dtype="float32", task="reward", max_model_len=512,
              max_num_batched_tokens=64,
              pooler_config={"pooling_type": "STEP", "step_tag_id": TAG,
                             "returned_token_ids": [648, 387]})
    try:
        steps = llm.reward(prompts, use_tqdm=False)
        last = [llm.embed(prompts[:1], use_tqdm=False)[0].outputs.embedding for _ in range(2)]
        kv = llm.engine.client.core.scheduler.kv
        hits = kv.prefix_hits  # the second took the first's blocks: it reads only its last
        other = llm.encode(prompts[:1], PoolingParams(task="reward", step_tag_id=None,
                                                      returned_token_ids=[1, 2, 3]),
                           use_tqdm=False)[0].outputs.data
        tokens = llm.encode(prompts, PoolingParams(task="token_embed", normalize=False),
                            use_tqdm=False)
        with pytest.raises(ValueError, match="task reward"):
            llm.generate(["hello"])
    finally:
        llm.engine.shutdown()
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm_oracle_folder,
                                                              dtype=torch.float32)
    for prompt, step, token in zip(prompts, steps, tokens):
        with torch.inference_mode():
            hidden = model.model(torch.tensor([prompt])).last_hidden_state[0]
            logits = model.lm_head(hidden)
        at = [i for i, t in enumerate(prompt) if t == TAG]
        assert step.outputs.data.shape == (len(at), 2)
        want = logits[at][:, [648, 387]].softmax(-1)
        assert np.allclose(step.outputs.data, want.numpy(), atol=1e-4)
        assert np.allclose(token.outputs.data, hidden.numpy(), atol=1e-3)
    want = torch.nn.functional.normalize(
        model.model(torch.tensor([prompts[0]])).last_hidden_state[0, -1], dim=0)
    assert hits >= 144 and np.allclose(last, [want.detach().numpy()] * 2, atol=1e-4)
    # the engine's step tag is a default: a request's own None keeps it
    assert other.shape == (len([t for t in prompts[0] if t == TAG]), 3)


def test_a_decoder_score_head_rewards_every_token(tmp_path, smollm_oracle_folder):
    folder, model = tiny_decoder(tmp_path / "qwen2-prm", smollm_oracle_folder,
                                 "Qwen2ForSequenceClassification", 4, num_labels=2)
    prompt = _prompt(3, 21)
    llm = LLM(str(folder), dtype="float32", task="reward")
    try:
        every = llm.reward([prompt], use_tqdm=False)[0].outputs.data
        steps = llm.reward([prompt], PoolingParams(task="reward", step_tag_id=TAG),
                           use_tqdm=False)[0].outputs.data
        with pytest.raises(ValueError, match="classifier head's"):
            llm.reward([prompt], PoolingParams(task="reward", returned_token_ids=[1]))
    finally:
        llm.engine.shutdown()
    with torch.inference_mode():
        want = model.score(model.model(torch.tensor([prompt])).last_hidden_state[0])
    want = want.softmax(-1).numpy()
    assert every.shape == (21, 2) and np.allclose(every, want, atol=1e-5)
    assert np.allclose(steps, want[[i for i, t in enumerate(prompt) if t == TAG]], atol=1e-5)


def test_an_encoder_embeds_each_token(tmp_path, minilm_folder):  # noqa: F811
    folder, model = _tiny_encoder(tmp_path / "bert-tokens", minilm_folder, "BertModel")
    prompts = [[101, 2023, 2003, 1037, 3231, 102], [101, 7592, 102]]
    llm = LLM(str(folder), dtype="float32")
    try:
        outs = llm.encode(prompts, pooling_task="token_embed", use_tqdm=False)
        with pytest.raises(ValueError, match="encoder"):
            llm.reward(prompts)
    finally:
        llm.engine.shutdown()
    llm = LLM(str(folder), dtype="float32",
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    try:
        means = llm.embed(prompts, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, out, mean in zip(prompts, outs, means):
        with torch.inference_mode():
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
        want = torch.nn.functional.normalize(hidden, dim=-1)  # the model's default: normalized
        assert out.outputs.data.shape == (len(prompt), 64)
        assert np.allclose(out.outputs.data, want.numpy(), atol=1e-4)
        # --pooler-config over the model's pooling ([CLS], normalized, without ST's files)
        assert np.allclose(mean.outputs.embedding, hidden.mean(0).numpy(), atol=1e-4)


def test_engine_tasks_and_what_they_refuse(tmp_path, minilm_folder):  # noqa: F811
    import json

    from octavo.arch_config import read_arch_config
    from octavo.engine.pooling import Embeddings, resolve_task
    from octavo.model_source import ModelSource
    from octavo.pooling_params import PoolerConfig

    folder, _ = _tiny_encoder(tmp_path / "bert-task", minilm_folder, "BertModel")
    arch = read_arch_config(ModelSource("x", folder))
    for task, words in [("classify", "no classifier head"), ("score", "no classifier head"),
                        ("reward", "encoder"), ("generate", "no LM head")]:
        with pytest.raises(ValueError, match=words):
            resolve_task(task, arch)
    assert resolve_task("auto", arch) == resolve_task("embed", arch) == "embed"
    lm = Embeddings(64, False, 512, lm_head=True, vocab_size=100)
    with pytest.raises(ValueError, match="needs returned_token_ids"):
        lm.resolve(PoolingParams(task="reward"), None)
    with pytest.raises(ValueError, match="below the vocabulary"):
        lm.resolve(PoolingParams(task="reward", returned_token_ids=[5, 100]), None)
    with pytest.raises(ValueError, match="dimensions are for embeddings"):
        Embeddings(64, True, 512, labels=2).resolve(PoolingParams(task="classify",
                                                                  dimensions=8), None)
    with pytest.raises(ValueError, match="for task reward"):
        PoolingParams(task="embed", step_tag_id=3)
    resolved = lm.resolve(PoolingParams(), None)
    assert (resolved.task, resolved.normalize) == ("embed", True)
    with pytest.raises(ValueError, match="pooler_config: pooling_type STEP needs"):
        LLM(str(folder), pooler_config=json.dumps({"pooling_type": "STEP"}))
    assert PoolerConfig.parse({"pooling_type": "mean"}).embed_pooling == "mean"


def test_a_qwen3_embedding_model_and_classifier_equal_transformers(tmp_path,
                                                                   smollm_oracle_folder):
    """Qwen3-Embedding's layout: a Qwen3ForCausalLM folder whose sentence-transformers files
    pool the last token and normalize; and Qwen3ForSequenceClassification's classes."""
    import transformers

    texts = ["Instruct: find the capital\nQuery: the capital of France", "def fib(n):"]
    tok = transformers.AutoTokenizer.from_pretrained(smollm_oracle_folder)
    results = {}
    for arch, extra in (("Qwen3ForCausalLM", {}), ("Qwen3ForSequenceClassification",
                                                   {"num_labels": 3})):
        folder, model = tiny_decoder(tmp_path / arch, smollm_oracle_folder, arch, 5,
                                     head_dim=16, **extra)
        write_pooling_modules(folder, "last", normalize=True)
        llm = LLM(str(folder), dtype="float32", task="embed")
        try:
            results[arch] = (model, llm.encode(texts, use_tqdm=False) if not extra
                             else llm.classify(texts, use_tqdm=False))
        finally:
            llm.engine.shutdown()
    model, outs = results["Qwen3ForCausalLM"]
    for text, out in zip(texts, outs):
        with torch.inference_mode():
            hidden = model.model(**tok(text, return_tensors="pt")).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(hidden, dim=0)
        assert np.allclose(out.outputs.data, want.numpy(), atol=1e-5)
    model, outs = results["Qwen3ForSequenceClassification"]
    for text, out in zip(texts, outs):
        with torch.inference_mode():
            want = model(**tok(text, return_tensors="pt")).logits[0].softmax(-1)
        assert np.allclose(out.outputs.probs, want.numpy(), atol=1e-5)
