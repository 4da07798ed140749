"""Speculative decoding with a draft model, and structured output with speculation, end to end on
tiny random Llamas (SmolLM2's tokenizer): greedy output equals plain decoding token for token,
batched, with chunked prefill, prefix caching, n > 1, logprobs, stop strings and preemption;
seeded sampling does not depend on the batch; a draft with another tokenizer is refused at
start-up; grammar + speculation (n-gram and draft model) equals grammar alone; the block pool
returns to idle."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from octavo import LLM, SamplingParams, StructuredOutputsParams
from tools.make_draft_model import truncate

KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, num_threads=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_oracle_folder):
    """The target (2 layers), a 1-layer draft cut from it (same embeddings and head), and an
    unrelated draft of other shapes (hidden 32, 1 KV head of 16, 1 layer)."""
    import transformers

    from tests.parity.test_tiny_models import _build

    root = tmp_path_factory.mktemp("spec-draft")
    target, _ = _build(root, smollm_oracle_folder, "llama-default")
    draft = truncate(target, root / "draft-1-layer", 1)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(1)
    other = root / "draft-other-shape"
    transformers.LlamaForCausalLM(config).save_pretrained(other, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / f, other / f)
    return target, draft, other


@pytest.fixture(scope="module")
def plain(tiny):
    return LLM(str(tiny[0]), max_num_batched_tokens=32, **KW)


def _prompts():
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(100, 49000, (20,), generator=gen).tolist()
    out = []
    for n in (9, 25, 6):
        base = torch.randint(100, 49000, (n,), generator=gen).tolist()
        out.append(base * 3)
    out.append(shared + torch.randint(100, 49000, (15,), generator=gen).tolist())
    out.append(shared + torch.randint(100, 49000, (4,), generator=gen).tolist())  # prefix hit
    return out


def _spec(folder, draft, k=3, **kw):
    return LLM(str(folder), speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": k},
        **{**KW, "max_num_batched_tokens": 32, **kw})


def _tokens(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params,
                                                                 use_tqdm=False)]


@pytest.mark.parametrize("which", ["same-model", "truncated", "other-shape"])
def test_greedy_equals_plain_decoding(tiny, plain, which):
    target, cut, other = tiny
    spec = _spec(target, {"same-model": target, "truncated": cut, "other-shape": other}[which])
    prompts = _prompts()
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, n=2, logprobs=2)
    outs, ref = spec.generate(prompts, greedy, use_tqdm=False), plain.generate(
        prompts, greedy, use_tqdm=False)
    for a, b in zip(outs, ref):
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids
            assert len(ca.logprobs) == len(ca.token_ids)
            for la, lb, t in zip(ca.logprobs, cb.logprobs, ca.token_ids):
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
    stats = spec.engine.client.stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_num_drafts > 0
    if which == "same-model":  # the draft is the target: every draft is accepted
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
        assert stats.spec_mean_acceptance_length > 3
    elif which == "truncated":
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    # Stop strings cut the output where plain decoding cuts it.
    text = ref[0].outputs[0].text
    stop = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[text[12:16]])
    assert [o.outputs[0].text for o in spec.generate(prompts[:1], stop, use_tqdm=False)] == [
        o.outputs[0].text for o in plain.generate(prompts[:1], stop, use_tqdm=False)]
    assert spec.engine.client.stats().kv_cache_usage == 0


def test_preemption_and_seeded_sampling(tiny, plain):
    target, cut, _ = tiny
    block = 2 * 16 * 2 * 16 * 4  # K and V, 16 tokens, 2 KV heads of 16, fp32: one layer
    spec = _spec(target, cut, k=4, kv_cache_memory=10 * 3 * block, max_model_len=128)
    assert spec.engine.client.core.num_blocks == 10  # target's 2 layers + the draft's 1
    prompts = _prompts()[:3]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert _tokens(spec, prompts, greedy) == _tokens(plain, prompts, greedy)
    stats = spec.engine.client.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
    # Seeded requests draw drafts and verification from (seed, position): the same tokens
    # alone and in a batch.
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    alone = _tokens(spec, prompts[1:2], seeded)
    batched = _tokens(spec, prompts, [SamplingParams(max_tokens=16, temperature=1.0)] + [seeded]
                      + [SamplingParams(max_tokens=16, temperature=0)])
    assert batched[1] == alone[0]
    assert spec.engine.client.stats().kv_cache_usage == 0


def test_sampled_drafts_from_the_target_itself_are_all_accepted(tiny):
    """With the target as its own draft, q equals p at every verified position (same sampling
    settings on the same logits), so min(1, p/q) = 1: every draft is accepted. A q kept for the
    wrong position or request would reject some."""
    target = tiny[0]
    spec = _spec(target, target, k=4)
    params = [SamplingParams(max_tokens=16, temperature=t, top_k=k, ignore_eos=True, n=2)
              for t, k in ((1.0, 0), (0.8, 50))]
    spec.generate(_prompts()[:2] * 2, params * 2, use_tqdm=False)
    stats = spec.engine.client.stats()
    assert stats.spec_draft_tokens > 40
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens


def test_a_draft_with_another_tokenizer_is_refused(tiny, tmp_path):
    target, cut, _ = tiny
    other = tmp_path / "other-vocab"
    shutil.copytree(cut, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two tokens' texts swapped
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="speculative_config.model .*different tokenizer"):
        _spec(target, other)
    small = tmp_path / "small-vocab"
    shutil.copytree(cut, small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 1000
    (small / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="speculative_config.model .*vocabulary of 1000"):
        _spec(target, small)
    with pytest.raises(ValueError, match="speculative_config.model"):
        _spec(target, tmp_path / "missing")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_grammar_with_speculation_equals_grammar_alone(tiny, plain, method):
    target = tiny[0]
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
             "prompt_lookup_min": 1} if method == "ngram" else
            {"method": "draft_model", "model": str(target), "num_speculative_tokens": 3})
    llm = LLM(str(target), speculative_config=spec, max_num_batched_tokens=32, **KW)
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"], "additionalProperties": False}
    prompts = _prompts()
    # A grammar the model's own greedy text already follows, so that unconstrained drafts (the
    # draft model's) pass it too: the literal text plain decoding writes for the last prompt.
    text = plain.generate(prompts[-1:], SamplingParams(max_tokens=10, temperature=0),
                          use_tqdm=False)[0].outputs[0].text
    assert text.isascii() and text.isprintable()
    literal = "".join("\\" + c if c in "\\.^$*+?()[]{}|/-" else c for c in text)
    grammars = [StructuredOutputsParams(regex="(ab|cd)+x"), StructuredOutputsParams(
        json=json.dumps(schema)), None, StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        StructuredOutputsParams(regex=literal)]
    params = [SamplingParams(max_tokens=24, temperature=0, structured_outputs=g)
              for g in grammars]
    core = llm.engine.client.core
    execute, extra_rows = core.executor.execute, []

    def spy(sched):  # bitmask rows beyond one per request: constrained requests' drafts
        if sched.grammar is not None:
            extra_rows.append(len(sched.grammar.req_ids) - len(set(sched.grammar.req_ids)))
        return execute(sched)

    core.executor.execute = spy
    got = _tokens(llm, prompts, params)
    assert sum(extra_rows) > 0
    assert got == _tokens(plain, prompts, params)
    stats = llm.engine.client.stats()
    assert stats.spec_accepted_tokens > 0
    assert stats.kv_cache_usage == 0


def test_layer_truncated_gguf_draft_on_smollm2(tmp_path, smollm_gguf, smollm_llm):
    """tools/make_draft_model.py on the real GGUF: 2 of 30 layers, quantization and tokenizer
    kept; as a draft it leaves greedy output unchanged. The draft is kept in the octavo cache,
    so that its tokenizer and prepared weights are cached for the next run too."""
    from octavo.arch_config import read_arch_config
    from octavo.model_source import cache_dir, resolve_model

    draft = cache_dir() / "drafts" / "smollm2-135m-instruct-2-layers.gguf"
    if not draft.is_file():
        draft.parent.mkdir(parents=True, exist_ok=True)
        truncate(smollm_gguf, tmp_path / draft.name, 2).replace(draft)
    arch = read_arch_config(resolve_model(str(draft)))
    assert (arch.num_layers, arch.vocab_size) == (2, 49152)
    assert draft.stat().st_size < smollm_gguf.stat().st_size / 2  # the embedding stays
    llm = LLM(str(smollm_gguf), dtype="float32", max_model_len=512, kv_cache_memory=32 << 20,
              speculative_config={"method": "draft_model", "model": str(draft),
                                  "num_speculative_tokens": 3})
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,"]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    assert _tokens(llm, prompts, greedy) == _tokens(smollm_llm, prompts, greedy)
    assert llm.engine.client.stats().spec_num_drafts > 0
