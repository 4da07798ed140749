"""vLLM's token-level SamplingParams fields: validation (a ValueError naming the field), the
processor's model-bound checks, and their behaviour on the real small model offline."""
from __future__ import annotations

import math

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from octavo.engine.detokenizer import IncrementalDetokenizer
from octavo.engine.messages import encoder, input_decoder
from octavo.engine.processor import Processor, RequestLimits
from octavo.params import SamplingParams

GREEDY = dict(temperature=0.0, max_tokens=12)
PROMPT = "The capital of France is"

INVALID = [
    ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("allowed_token_ids", dict(allowed_token_ids=[-1])),
    ("allowed_token_ids", dict(allowed_token_ids=[1, "2"])),
    ("allowed_token_ids", dict(allowed_token_ids=5)),
    ("bad_words", dict(bad_words="Paris")),
    ("bad_words", dict(bad_words=[""])),
    ("bad_words", dict(bad_words=["  "])),
    ("bad_words", dict(bad_words=["ok", 3])),
    ("detokenize", dict(detokenize=0)),
    ("detokenize", dict(detokenize=False, stop=["x"])),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=0)),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=-2)),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=1.5)),
    ("truncate_prompt_tokens", dict(truncate_prompt_tokens=True)),
    ("spaces_between_special_tokens", dict(spaces_between_special_tokens="no")),
    ("logprobs", dict(logprobs=-2)),
    ("prompt_logprobs", dict(prompt_logprobs=-5)),
    ("logprob_token_ids", dict(logprob_token_ids=[])),
    ("logprob_token_ids", dict(logprob_token_ids=[-3])),
    ("logprob_token_ids", dict(logprob_token_ids=list(range(129)))),
    ("logprobs", dict(logprob_token_ids=[1, 2], logprobs=3)),
    ("extra_args", dict(extra_args=[1])),
    ("extra_args", dict(extra_args={1: "a"})),
    ("extra_args", dict(extra_args={"a": object()})),
    ("extra_args", dict(extra_args={"a": math.inf})),
    ("extra_args", dict(extra_args={"a": 2**64})),
]


@pytest.mark.parametrize("field,kwargs", INVALID,
                         ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_field_raises_value_error_naming_it(field, kwargs):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert field in str(info.value)


def test_valid_values_and_their_normal_forms():
    p = SamplingParams(allowed_token_ids=(5, 3, 5), bad_words=["a", "b", "a"], logprobs=-1,
                       prompt_logprobs=-1, truncate_prompt_tokens=-1, detokenize=False,
                       spaces_between_special_tokens=False, extra_args={"k": [1, {"x": None}]})
    assert p.allowed_token_ids == [5, 3] and p.bad_words == ["a", "b"]
    assert p.logprobs == -1 and p.truncate_prompt_tokens == -1
    assert SamplingParams(logprob_token_ids=[4, 9]).logprobs == 2  # vLLM's num_logprobs
    assert SamplingParams(logprob_token_ids=[4, 9], logprobs=2).logprobs == 2


def test_the_fields_cross_to_the_core_untouched(smollm_llm):
    params = SamplingParams(allowed_token_ids=[3, 4], bad_words=["hi"], detokenize=False,
                            truncate_prompt_tokens=2, spaces_between_special_tokens=False,
                            logprob_token_ids=[5], extra_args={"plugin": {"level": 2.5}})
    prepared = smollm_llm.engine.processor.build("r", "Hello there you", params)
    req = prepared.core_requests[0]
    assert req.bad_words_token_ids  # tokenized by the front end
    back = input_decoder.decode(encoder.encode(req))
    assert back.bad_words_token_ids == req.bad_words_token_ids
    for name in ("allowed_token_ids", "bad_words", "detokenize", "truncate_prompt_tokens",
                 "spaces_between_special_tokens", "logprob_token_ids", "extra_args"):
        assert getattr(back.sampling_params, name) == getattr(params, name), name


class _RecordingTokenizer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return [1] + [2 + len(w) for w in text.split()] if add_special_tokens else \
            [2 + len(w) for w in text.split()]


def test_processor_bounds_and_special_tokens():
    tok = _RecordingTokenizer()
    proc = Processor(tok, max_model_len=64, vocab_size=10, eos_token_ids=frozenset({0}),
                     limits=RequestLimits(max_logprobs=5))
    assert proc.build("a", "x yy", SamplingParams()).prompt_token_ids == [1, 3, 4]
    assert proc.build("b", "x yy", SamplingParams(), add_special_tokens=False
                      ).prompt_token_ids == [3, 4]
    with pytest.raises(ValueError, match="add_special_tokens"):
        proc.build("c", "x", SamplingParams(), add_special_tokens="no")
    for params, match in (
            (SamplingParams(allowed_token_ids=[10]), "allowed_token_ids"),
            (SamplingParams(logprob_token_ids=[3, 12]), "logprob_token_ids"),
            (SamplingParams(truncate_prompt_tokens=65), "truncate_prompt_tokens"),
            (SamplingParams(logprobs=-1), "logprobs=-1"),
            (SamplingParams(prompt_logprobs=-1), "prompt_logprobs=-1"),
            (SamplingParams(bad_words=["abcdefghij"]), "bad_words"),  # token id 12
            (SamplingParams(allowed_token_ids=[3], bad_words=["x"]), "bad_words ban every")):
        with pytest.raises(ValueError, match=match):
            proc.build("d", "x yy", params)
    # logprobs=-1 within a limit that allows the vocabulary (or -1: no cap)
    for limit in (10, -1):
        whole = Processor(tok, 64, 10, frozenset({0}), RequestLimits(max_logprobs=limit))
        req = whole.build("e", "x", SamplingParams(logprobs=-1, prompt_logprobs=-1))
        core = req.core_requests[0].sampling_params
        assert (core.logprobs, core.prompt_logprobs) == (10, 10)  # the worker gathers V
        assert req.params.logprobs == -1  # the caller's own params are left as they were
    with pytest.raises(ValueError, match="max_logprobs"):
        RequestLimits(max_logprobs=-2)


def test_bad_words_tokenized_with_and_without_a_leading_space(smollm_llm):
    proc = smollm_llm.engine.processor
    tok = smollm_llm.get_tokenizer()
    seqs = proc.bad_words_token_ids(SamplingParams(bad_words=["Paris", " Paris"]))
    assert tok.encode("Paris", False) in seqs and tok.encode(" Paris", False) in seqs
    assert len(seqs) == 2  # " Paris" is "Paris" with its space dropped: one word
    with pytest.raises(ValueError, match="at most 128"):
        proc.bad_words_token_ids(SamplingParams(bad_words=[f"w{i}" for i in range(129)]))


def test_allowed_token_ids_bound_every_generated_token(smollm_llm):
    tok = smollm_llm.get_tokenizer()
    allowed = set(tok.encode(" the cat sat on a mat.", False))
    free = smollm_llm.generate("Once upon a time, there was a little",
                               SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert not set(free.token_ids) <= allowed
    for params in (SamplingParams(**GREEDY, allowed_token_ids=sorted(allowed)),
                   SamplingParams(temperature=1.0, seed=7, max_tokens=12,
                                  allowed_token_ids=sorted(allowed))):
        out = smollm_llm.generate("Once upon a time, there was a little", params,
                                  use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 12 and set(out.token_ids) <= allowed


def test_bad_words_never_appear(smollm_llm):
    free = smollm_llm.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert "Paris" in free.text
    out = smollm_llm.generate(PROMPT, SamplingParams(**GREEDY, bad_words=["Paris"]),
                              use_tqdm=False)[0].outputs[0]
    assert "Paris" not in out.text and out.text


def test_truncate_prompt_tokens_is_the_truncated_prompt(smollm_llm):
    tok = smollm_llm.get_tokenizer()
    long = "Write about the sea and the sky. " * 4 + PROMPT
    ids = tok.encode(long)
    cut = smollm_llm.generate(long, SamplingParams(**GREEDY, truncate_prompt_tokens=6),
                              use_tqdm=False)[0]
    direct = smollm_llm.generate([ids[-6:]], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-6:]
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    whole = smollm_llm.generate(long, SamplingParams(**GREEDY, truncate_prompt_tokens=-1),
                                use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids  # -1: the context length, longer than the prompt
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        smollm_llm.generate(long, SamplingParams(truncate_prompt_tokens=4096), use_tqdm=False)


def test_detokenize_false_gives_token_ids_only(smollm_llm):
    text = smollm_llm.generate(PROMPT, SamplingParams(**GREEDY, logprobs=1),
                               use_tqdm=False)[0].outputs[0]
    ids = smollm_llm.generate(PROMPT, SamplingParams(**GREEDY, logprobs=1, detokenize=False),
                              use_tqdm=False)[0].outputs[0]
    assert text.text and ids.text == ""
    assert ids.token_ids == text.token_ids
    assert all(lp.decoded_token is None for pos in ids.logprobs for lp in pos.values())
    assert [{t: lp.logprob for t, lp in pos.items()} for pos in ids.logprobs] == \
        [{t: lp.logprob for t, lp in pos.items()} for pos in text.logprobs]


def test_logprobs_minus_one_needs_a_limit_of_the_vocabulary(smollm_llm):
    processor = smollm_llm.engine.processor
    vocab = processor.vocab_size
    with pytest.raises(ValueError, match="whole vocabulary"):
        smollm_llm.generate(PROMPT, SamplingParams(logprobs=-1, max_tokens=2), use_tqdm=False)
    was, processor.limits = processor.limits, RequestLimits(max_logprobs=vocab)
    try:
        out = smollm_llm.generate("Hi there", SamplingParams(temperature=0.0, max_tokens=2,
                                                             logprobs=-1, prompt_logprobs=-1),
                                  use_tqdm=False)[0]
    finally:
        processor.limits = was
    comp = out.outputs[0]
    assert len(comp.logprobs) == 2
    for pos, tok in zip(comp.logprobs, comp.token_ids):
        assert len(pos) == vocab and pos[tok].rank == 1  # greedy: the top token
        assert sorted(lp.rank for lp in pos.values()) == list(range(1, vocab + 1))
        assert abs(sum(math.exp(lp.logprob) for lp in pos.values()) - 1.0) < 1e-3
    assert out.prompt_logprobs[0] is None
    assert all(len(pos) == vocab for pos in out.prompt_logprobs[1:])


def test_logprob_token_ids_are_the_listed_tokens_at_each_step(smollm_llm):
    tok = smollm_llm.get_tokenizer()
    listed = [tok.encode(" Paris", False)[0], tok.encode(" is", False)[0], 42]
    base = SamplingParams(temperature=0.0, max_tokens=3, logprobs=20)
    top = smollm_llm.generate(PROMPT, base, use_tqdm=False)[0].outputs[0]
    out = smollm_llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3,
                                                     logprob_token_ids=listed),
                              use_tqdm=False)[0].outputs[0]
    assert out.token_ids == top.token_ids
    for pos, top_pos, chosen in zip(out.logprobs, top.logprobs, out.token_ids):
        assert set(pos) == set(listed) | {chosen}
        assert pos[chosen].logprob == pytest.approx(top_pos[chosen].logprob, abs=1e-5)
        for t in listed:  # a listed token in the top 20 has the same value and rank there
            if t in top_pos:
                assert pos[t].logprob == pytest.approx(top_pos[t].logprob, abs=1e-5)
                assert pos[t].rank == top_pos[t].rank
            else:
                assert pos[t].rank > 20


def test_extra_args_pass_through_generation(smollm_llm):
    out = smollm_llm.generate(PROMPT, SamplingParams(**GREEDY, extra_args={"x": [1, "y"]}),
                              use_tqdm=False)[0].outputs[0]
    free = smollm_llm.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids


class _WordPieceTokenizer:
    """A tokenizer whose decoder puts a space between tokens, special ones included."""

    def __init__(self) -> None:
        vocab = {"[UNK]": 0, "hello": 1, "[A]": 2, "[B]": 3}
        self.backend = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        self.backend.add_special_tokens(["[A]", "[B]"])
        self.backend.decoder = decoders.WordPiece()


@pytest.mark.parametrize("spaces,expected", [(True, " [A] [B] [A] hello"),
                                             (False, " [A][B][A] hello")])
def test_spaces_between_special_tokens(spaces, expected):
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    detok = IncrementalDetokenizer(_WordPieceTokenizer(), [1], params)
    detok.add_tokens([2, 3, 2, 1])
    assert detok.text == expected
    skipped = IncrementalDetokenizer(_WordPieceTokenizer(), [1], SamplingParams(
        spaces_between_special_tokens=spaces))
    skipped.add_tokens([2, 3, 2, 1])
    assert skipped.text == " hello"  # with special tokens skipped the flag changes nothing
