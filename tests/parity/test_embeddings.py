"""Embeddings through the engine (`LLM.embed` / `LLM.encode`): a BERT encoder's pooled hidden
states equal sentence-transformers' on the real all-MiniLM-L6-v2 (cosine >= 0.9999 per sentence,
sentences in several languages from one token to the 512-token limit), and transformers' on tiny
random BERTs (1e-4 in float32, each pooling); what is refused is refused naming the field."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from octavo import LLM
from octavo.pooling_params import PoolingParams

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "Le chat dort sur le canapé depuis ce matin.",
    "Der Zug nach Berlin hat heute zwanzig Minuten Verspätung.",
    "El museo abre a las diez y cierra a las seis.",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "Python is a programming language that lets you work quickly.",
    "?",
    "ok",
]


def _texts() -> list[str]:
    """Over 100 inputs, short and long: the sentences, each pair of them, and longer ones made
    of them (past 512 tokens for the longest, which the 512-token limit then cuts:
    `truncate_prompt_tokens`)."""
    pairs = [f"{a} {b}" for a in SENTENCES for b in SENTENCES if a != b]
    long = [" ".join(SENTENCES[: i % len(SENTENCES) + 1] * (1 + i)) for i in range(8)]
    return SENTENCES + pairs + long


@pytest.fixture(scope="module")
def minilm_folder():
    from octavo.model_source import pull

    return pull("all-minilm-l6-v2")


def test_minilm_embeddings_equal_sentence_transformers(minilm_folder):
    st = pytest.importorskip("sentence_transformers")
    oracle = st.SentenceTransformer(str(minilm_folder), device="cpu")
    oracle.max_seq_length = 512
    texts = _texts()
    assert len(texts) > 100
    expected = oracle.encode(texts, convert_to_numpy=True, batch_size=16)
    llm = LLM("all-minilm-l6-v2", dtype="float32", max_num_batched_tokens=2048)
    try:
        tokenizer = llm.get_tokenizer()
        lengths = [len(tokenizer.encode(t)) for t in texts]
        assert min(lengths) <= 3 and max(lengths) > 512  # the range the limit cuts
        outs = llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
        assert [len(o.prompt_token_ids) for o in outs] == [min(n, 512) for n in lengths]
        got = np.array([o.outputs.embedding for o in outs])
        cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / \
            np.linalg.norm(expected, axis=1)
        assert cosine.min() >= 0.9999, cosine
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # Normalize module
        # token ids in, and the pooled vector without the normalization
        raw = llm.encode([tokenizer.encode(texts[0])], PoolingParams(normalize=False),
                         use_tqdm=False)[0].outputs.data
        assert np.allclose(raw / np.linalg.norm(raw), got[0], atol=1e-6)
    finally:
        llm.engine.shutdown()


def _tiny_bert(tmp_path, tokenizer_folder, pooling: str | None):
    folder, model = _tiny_encoder(tmp_path / f"bert-{pooling}", tokenizer_folder, "BertModel")
    if pooling is not None:
        write_pooling_modules(folder, pooling)
    return folder, model


def encoded_beside_transformers(folder, model, seed: int) -> list:
    """(LLM.encode's output, transformers' hidden states) of random prompts of mixed lengths
    (1, 7, 40 and 13 tokens) encoded in one call, for the tiny encoder in `folder`."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1000, 30000, (n,), generator=gen).tolist() for n in (1, 7, 40, 13)]
    llm = LLM(str(folder), dtype="float32")
    try:
        outs = llm.encode(prompts, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    with torch.inference_mode():
        return [(out, model(torch.tensor([p])).last_hidden_state[0])
                for p, out in zip(prompts, outs)]


def write_pooling_modules(folder, pooling: str, normalize: bool = False) -> None:
    """sentence-transformers' modules in `folder`: this pooling (mean, cls, last), and
    Normalize where asked."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_lasttoken": pooling == "last"}))


@pytest.mark.parametrize("pooling", ["mean", "cls", "last", None])
def test_tiny_bert_pools_as_transformers(tmp_path, minilm_folder, pooling):
    """Mixed lengths in one step (padded into one batch, the padding masked out); without
    sentence-transformers' files the pooling is [CLS], normalized."""
    folder, model = _tiny_bert(tmp_path, minilm_folder, pooling)
    for out, hidden in encoded_beside_transformers(folder, model, 1):
        kind = pooling or "cls"
        want = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[kind]
        if pooling is None:
            want = torch.nn.functional.normalize(want, dim=0)
        assert torch.allclose(torch.from_numpy(np.asarray(out.outputs.data)), want, atol=1e-4)


def test_what_embeddings_refuse(minilm_folder):
    llm = LLM("all-minilm-l6-v2", dtype="float32")
    try:
        with pytest.raises(ValueError, match="prompt must not be empty"):
            llm.embed([""])
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.embed(["word " * 600])
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed(["hello"], PoolingParams(dimensions=8))
        with pytest.raises(ValueError, match="task embed"):
            llm.generate(["hello"])
    finally:
        llm.engine.shutdown()


def test_a_generating_engine_also_embeds_in_the_same_steps(smollm_llm):
    """A causal LM of task generate serves embeddings too (its last token, normalized): a
    pooling request joins the steps of running generations, which give what they give alone,
    and its vector is the one it gets alone."""
    from octavo import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "def fib(n):"]
    alone = [o.outputs[0].token_ids for o in smollm_llm.generate(prompts, params,
                                                                 use_tqdm=False)]
    vector = smollm_llm.embed(["Once upon a time"], use_tqdm=False)[0].outputs.embedding
    engine = smollm_llm.engine
    engine.add_request("mix-g0", prompts[0], params)
    engine.add_request("mix-g1", prompts[1], params)
    engine.step()  # their prompts; then decodes, with the pooling request's prompt beside them
    engine.add_pooling_request("mix-e0", "Once upon a time", PoolingParams())
    done = {}
    while len(done) < 3:
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [done[f"mix-g{i}"].outputs[0].token_ids for i in range(2)] == alone
    assert np.allclose(done["mix-e0"].outputs.data, vector, atol=1e-4)


def test_a_decoder_embeds_with_its_last_token(smollm_oracle_folder):
    """task embed on a causal LM (SmolLM2's folder, no sentence-transformers files): the last
    token's final hidden state, normalized (Qwen3-Embedding-style pooling), as transformers
    computes it; generation is refused on it."""
    import transformers

    prompts = ["The capital of France is", "def fibonacci(n):", "Hi"]
    llm = LLM(str(smollm_oracle_folder), dtype="float32", task="embed")
    try:
        outs = llm.embed(prompts, use_tqdm=False)
        with pytest.raises(ValueError, match="task embed"):
            llm.generate(prompts[:1])
    finally:
        llm.engine.shutdown()
    model = transformers.AutoModel.from_pretrained(smollm_oracle_folder, dtype=torch.float32)
    for out in outs:
        with torch.inference_mode():
            hidden = model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(hidden, dim=0)
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-4)


def _tiny_cross_encoder(tmp_path, tokenizer_folder, labels: int):
    return _tiny_encoder(tmp_path / f"cross-{labels}", tokenizer_folder,
                         "BertForSequenceClassification", num_labels=labels)


def _tiny_encoder(folder, tokenizer_folder, architecture: str, **config):
    """A tiny random BERT (or RoBERTa / XLM-R: their config's class) of `architecture` saved
    in `folder`, with all-MiniLM's tokenizer."""
    import transformers

    family = architecture.removesuffix("Model").removesuffix("ForSequenceClassification")
    cfg = getattr(transformers, f"{family}Config")(**{
        "vocab_size": 30522, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 96, "max_position_embeddings": 128,
        **config})
    torch.manual_seed(len(architecture) + config.get("num_labels", 0))
    model = getattr(transformers, architecture)(cfg).eval()
    _randomize(model)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return folder, model


def test_cross_encoder_scores_and_classes_equal_transformers(tmp_path, minilm_folder):
    """A tiny random BertForSequenceClassification: LLM.score over sentence pairs (the second
    text of token type 1) and LLM.classify over single texts give transformers' sigmoid and
    softmax of the logits; a score needs a one-label head."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(minilm_folder)
    query = "what is the capital of france"
    docs = ["paris is the capital of france", "the cat sat on the mat",
            "berlin is the capital of germany and its largest city"]
    folder, model = _tiny_cross_encoder(tmp_path, minilm_folder, 1)
    llm = LLM(str(folder), dtype="float32")
    try:
        scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
        with pytest.raises(ValueError, match="pair"):
            llm.encode(["a"], PoolingParams(task="score"))
    finally:
        llm.engine.shutdown()
    with torch.inference_mode():
        want = model(**tok([query] * 3, docs, padding=True, return_tensors="pt")).logits
    assert np.allclose(scores, want.sigmoid()[:, 0].numpy(), atol=1e-5)

    folder, model = _tiny_cross_encoder(tmp_path, minilm_folder, 3)
    llm = LLM(str(folder), dtype="float32")
    try:
        probs = np.array([o.outputs.probs for o in llm.classify(docs, use_tqdm=False)])
        with pytest.raises(ValueError, match="one label"):
            llm.score(query, docs)
    finally:
        llm.engine.shutdown()
    with torch.inference_mode():
        want = model(**tok(docs, padding=True, return_tensors="pt")).logits.softmax(-1)
    assert np.allclose(probs, want.numpy(), atol=1e-5)


def test_xlm_roberta_embeds_and_classifies_as_transformers(tmp_path, minilm_folder):
    """XLM-R (RoBERTa's layout: positions from the padding id + 1, one token type, a
    classification head without BERT's pooler): pooled [CLS] states and class probabilities
    equal transformers'; its context is the position table less the padding offset."""
    import transformers

    texts = ["a small test", "paris is the capital of france and its largest city"]
    tok = transformers.AutoTokenizer.from_pretrained(minilm_folder)
    folder, model = _tiny_encoder(tmp_path / "xlmr", minilm_folder, "XLMRobertaModel",
                                  type_vocab_size=1, max_position_embeddings=130)
    llm = LLM(str(folder), dtype="float32")
    try:
        assert llm.engine.setup.max_model_len == 128
        got = np.array([o.outputs.data for o in llm.encode(texts, use_tqdm=False)])
    finally:
        llm.engine.shutdown()
    with torch.inference_mode():
        hidden = model(**tok(texts, padding=True, return_tensors="pt")).last_hidden_state
    want = torch.nn.functional.normalize(hidden[:, 0], dim=-1)
    assert np.allclose(got, want.numpy(), atol=1e-5)

    folder, model = _tiny_encoder(tmp_path / "xlmr-cls", minilm_folder,
                                  "XLMRobertaForSequenceClassification", num_labels=2,
                                  type_vocab_size=1, max_position_embeddings=130)
    llm = LLM(str(folder), dtype="float32")
    try:
        probs = np.array([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)])
    finally:
        llm.engine.shutdown()
    with torch.inference_mode():
        want = model(**tok(texts, padding=True, return_tensors="pt")).logits.softmax(-1)
    assert np.allclose(probs, want.numpy(), atol=1e-5)


def test_a_decoder_classifier_classifies_and_scores_as_transformers(tmp_path,
                                                                    smollm_oracle_folder):
    """Qwen2ForSequenceClassification (a score head over the last token, no LM head): class
    probabilities equal transformers'; it runs task embed (auto), and refuses generation."""
    folder, model = tiny_decoder(tmp_path / "qwen2-cls", smollm_oracle_folder,
                                 "Qwen2ForSequenceClassification", 3, num_labels=3)
    texts = ["The capital of France is", "def fib(n):", "I loved this film"]
    llm = LLM(str(folder), dtype="float32")
    try:
        outs = llm.classify(texts, use_tqdm=False)
        with pytest.raises(ValueError, match="task embed"):
            llm.generate(texts[:1])
    finally:
        llm.engine.shutdown()
    for out in outs:
        with torch.inference_mode():
            want = model(torch.tensor([out.prompt_token_ids])).logits[0].softmax(-1)
        assert np.allclose(out.outputs.probs, want.numpy(), atol=1e-5)


def tiny_decoder(folder, tokenizer_folder, architecture: str, seed: int, **config):
    """A tiny random decoder of `architecture` (Qwen2 or Qwen3's) saved in `folder`, with
    SmolLM2's tokenizer."""
    import transformers

    family = "Qwen3" if architecture.startswith("Qwen3") else "Qwen2"
    cfg = getattr(transformers, f"{family}Config")(**{
        "vocab_size": 49152, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "max_position_embeddings": 256, "pad_token_id": 0, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(cfg).eval()
    _randomize(model)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    return folder, model


def _randomize(model) -> None:
    """Larger weights than the default init (and norms, biases moved), so differences show."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
