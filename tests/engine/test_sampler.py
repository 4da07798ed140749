"""Unit tests of the batched sampler (octavo.worker.sampler) and the SamplingBatch the InputBatch
builds for it. No model: random logits over a small vocabulary, expectations computed
independently in float64 numpy / plain Python."""
from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from octavo.core.contract import NewRequestData
from octavo.params import SamplingParams
from octavo.worker.input_batch import InputBatch
from octavo.worker.sampler import (Sampler, SamplingBatch, apply_penalties, gather_logprobs,
                                   truncate_top_k_top_p)

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- helpers

def make_batch(rows: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None,
               max_num_logprobs=None) -> SamplingBatch:
    """A SamplingBatch with per-row settings (scalars broadcast) and nothing else switched on."""
    def col(v, dtype):
        vals = list(v) if isinstance(v, (list, tuple)) else [v] * rows
        assert len(vals) == rows
        return torch.tensor(vals, dtype=dtype)

    temp = col(temperature, torch.float32)
    greedy = temp < 1e-5
    return SamplingBatch(
        temperature=temp, top_k=col(top_k, torch.int64), top_p=col(top_p, torch.float32),
        min_p=col(min_p, torch.float32), all_greedy=bool(greedy.all()), greedy=greedy,
        seeds=np.array(seeds if seeds is not None else [-1] * rows, np.int64),
        max_num_logprobs=max_num_logprobs)


def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def expected_distribution(logits_row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The truncated distribution, computed independently in float64.

    Order: temperature, top-k, top-p over the top-k distribution (the nucleus is the smallest
    prefix of the sorted distribution whose mass reaches top_p), then min-p (keep p >= min_p *
    p_max). Returns (dense probs [V], margin): margin is how far the closest decision was from its
    threshold, so a caller can make sure float32 rounding cannot flip it.
    """
    z = np.asarray(logits_row, np.float64) / temperature
    vocab = len(z)
    order = sorted(range(vocab), key=lambda i: -z[i])
    keep = order[:top_k] if top_k > 0 else order
    margin = math.inf
    if top_k > 0 and top_k < vocab:
        margin = min(margin, z[order[top_k - 1]] - z[order[top_k]])
    p = softmax64(z[keep])
    if top_p < 1.0:
        cum = 0.0
        size = len(keep)
        for m, pm in enumerate(p):
            cum += pm
            margin = min(margin, abs(cum - top_p))
            if cum >= top_p:
                size = m + 1
                break
        keep = keep[:size]
        p = softmax64(z[keep])
    if min_p > 0.0:
        thr = min_p * p.max()
        margin = min(margin, float(np.min(np.abs(p - thr))))
        keep = [t for t, pt in zip(keep, p) if pt >= thr]
        p = softmax64(z[keep])
    dense = np.zeros(vocab)
    dense[keep] = p
    return dense, margin


def logits_with_margin(gen: torch.Generator, vocab: int, scale: float, settings: dict,
                       min_margin: float = 3e-5) -> torch.Tensor:
    """Random logits for which no truncation decision sits within min_margin of its threshold."""
    for _ in range(100):
        row = torch.randn(vocab, generator=gen) * scale
        _, margin = expected_distribution(row.numpy(), **settings)
        if margin > min_margin:
            return row
    raise AssertionError("could not draw logits away from the thresholds")


def support(p: np.ndarray | torch.Tensor) -> set[int]:
    return set(np.flatnonzero(np.asarray(p) > 0).tolist())


def new_request(req_id: str, prompt: list[int], output: list[int] | None = None,
                eos_token_ids: list[int] | None = None, **params) -> NewRequestData:
    output = output or []
    return NewRequestData(req_id=req_id, token_ids=list(prompt) + list(output),
                          num_prompt_tokens=len(prompt),
                          sampling_params=SamplingParams(**params), block_ids=[],
                          num_computed_tokens=0,
                          eos_token_ids=[0] if eos_token_ids is None else eos_token_ids)


def input_batch(vocab: int, max_reqs: int = 8, max_len: int = 64) -> InputBatch:
    return InputBatch(max_num_reqs=max_reqs, max_model_len=max_len, block_size=16,
                      vocab_size=vocab)


def rows_of(b: InputBatch, req_ids: list[str]) -> np.ndarray:
    return np.array([b.row_of[r] for r in req_ids], np.int64)


class SpySampler(Sampler):
    """Records the logits the sampler hands to `probabilities` (after penalties, bias, bans)."""

    def probabilities(self, logits, batch):  # type: ignore[override]
        self.seen = logits.clone()
        return Sampler.probabilities(logits, batch)


# The truncation settings exercised row by row (mixed in one batch on purpose: a row that turns a
# filter off must not be touched by another row switching it on).
ROW_SETTINGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.5, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    dict(temperature=0.8, top_k=20, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=30, top_p=0.95, min_p=0.05),
    dict(temperature=2.0, top_k=1, top_p=1.0, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=0.3, min_p=0.2),
    dict(temperature=1.0, top_k=10**6, top_p=1.0, min_p=0.0),  # top_k above the vocab: off
    dict(temperature=0.5, top_k=0, top_p=0.99, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1e-6, min_p=0.0),  # only the most likely token
]


def build_rows(vocab: int, seed: int, scale: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.stack([logits_with_margin(gen, vocab, scale, s) for s in ROW_SETTINGS])
    batch = make_batch(len(ROW_SETTINGS), **{k: [s[k] for s in ROW_SETTINGS]
                                             for k in ROW_SETTINGS[0]})
    return logits, batch


# ----------------------------------------------------------------------------- truncation

@pytest.mark.parametrize("vocab,seed", [(50, 0), (257, 1), (1000, 2)])
def test_probabilities_truncate_exactly_and_renormalize(vocab, seed):
    logits, batch = build_rows(vocab, seed)
    probs = Sampler.probabilities(logits.clone(), batch)
    assert probs.shape == logits.shape
    for i, settings in enumerate(ROW_SETTINGS):
        want, _ = expected_distribution(logits[i].numpy(), **settings)
        got = probs[i].double().numpy()
        assert support(got) == support(want), (i, settings)
        assert got.sum() == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-4, err_msg=str(settings))


def test_filters_that_are_off_keep_the_full_support():
    """top_k=0, top_p=1, min_p=0 rows keep every token even when other rows truncate."""
    gen = torch.Generator().manual_seed(3)
    vocab = 1000
    logits = torch.randn(6, vocab, generator=gen) * 4  # a long tail of tiny probabilities
    batch = make_batch(6, top_k=[0, 3, 0, 0, 0, 0], top_p=[1.0, 1.0, 0.5, 1.0, 1.0, 1.0],
                       min_p=[0.0, 0.0, 0.0, 0.0, 0.2, 0.0])
    probs = Sampler.probabilities(logits.clone(), batch)
    for i in (0, 3, 5):
        assert support(probs[i]) == set(range(vocab))
        want = torch.softmax(logits[i].double(), -1)
        torch.testing.assert_close(probs[i].double(), want, atol=1e-6, rtol=1e-4)
    trunc = truncate_top_k_top_p(logits.clone(), batch.top_k, batch.top_p)
    for i in (0, 3, 4, 5):
        assert torch.equal(trunc[i], logits[i])


@pytest.mark.parametrize("vocab,seed", [(64, 10), (500, 11)])
def test_truncate_top_k_top_p_keeps_values_and_sets_the_rest_to_minus_inf(vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    cases = [(0, 1.0), (1, 1.0), (7, 1.0), (0, 0.6), (0, 0.05), (12, 0.75), (vocab, 0.9),
             (vocab + 5, 1.0)]
    rows = [logits_with_margin(gen, vocab, 1.5, dict(top_k=k, top_p=p)) for k, p in cases]
    logits = torch.stack(rows)
    top_k = torch.tensor([k for k, _ in cases])
    top_p = torch.tensor([p for _, p in cases], dtype=torch.float32)
    out = truncate_top_k_top_p(logits.clone(), top_k, top_p)
    for i, (k, p) in enumerate(cases):
        want, _ = expected_distribution(logits[i].numpy(), top_k=k, top_p=p)
        kept = torch.isfinite(out[i])
        assert set(torch.nonzero(kept).flatten().tolist()) == support(want), (k, p)
        assert torch.equal(out[i][kept], logits[i][kept])  # kept logits are untouched
        assert bool(torch.isneginf(out[i][~kept]).all())
        if k > 0:
            assert int(kept.sum()) <= k
        # renormalized: softmax of the truncated row is the independent distribution
        np.testing.assert_allclose(torch.softmax(out[i].double(), -1).numpy(), want,
                                   atol=1e-9, rtol=1e-6)


def test_top_p_nucleus_is_smallest_prefix_reaching_top_p_hand_example():
    # probabilities 0.5, 0.3, 0.15, 0.05 (already sorted, shuffled positions)
    p = np.array([0.15, 0.5, 0.05, 0.3])
    logits = torch.tensor(np.log(p), dtype=torch.float32).repeat(5, 1)
    batch = make_batch(5, top_p=[0.4, 0.45, 0.79, 0.81, 0.96])
    probs = Sampler.probabilities(logits, batch)
    expected_supports = [{1}, {1}, {1, 3}, {1, 3, 0}, {0, 1, 2, 3}]
    for i, want in enumerate(expected_supports):
        assert support(probs[i]) == want
        kept = sorted(want)
        np.testing.assert_allclose(probs[i, kept].double().numpy(), p[kept] / p[kept].sum(),
                                   rtol=1e-5)


def test_min_p_hand_example():
    p = np.array([0.4, 0.1, 0.3, 0.05, 0.15])
    logits = torch.tensor(np.log(p), dtype=torch.float32).repeat(3, 1)
    batch = make_batch(3, min_p=[0.3, 0.5, 0.9])
    probs = Sampler.probabilities(logits, batch)
    # thresholds: 0.12, 0.2, 0.36 (of p_max = 0.4)
    for i, want in enumerate([{0, 2, 4}, {0, 2}, {0}]):
        assert support(probs[i]) == want
        kept = sorted(want)
        np.testing.assert_allclose(probs[i, kept].double().numpy(), p[kept] / p[kept].sum(),
                                   rtol=1e-5)


def test_exact_thresholds_are_inclusive():
    """Uniform logits give exactly representable masses (0.25, 0.5, 0.75): the nucleus stops at
    the first prefix that *reaches* top_p, and min_p keeps p == min_p * p_max."""
    logits = torch.zeros(5, 4)
    batch = make_batch(5, top_p=[0.25, 0.5, 0.75, 0.7500001, 1.0])
    probs = Sampler.probabilities(logits.clone(), batch)
    assert [len(support(p)) for p in probs] == [1, 2, 3, 4, 4]
    for p in probs:
        kept = p[p > 0]
        assert torch.allclose(kept, torch.full_like(kept, 1.0 / len(kept)))
    # min_p = 1: only tokens tied with the maximum stay
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    probs = Sampler.probabilities(logits, make_batch(2, min_p=1.0))
    assert support(probs[0]) == {1, 2} and support(probs[1]) == {0, 1, 2, 3}
    assert torch.allclose(probs[0, [1, 2]], torch.tensor([0.5, 0.5]))


# ----------------------------------------------------------------------------- temperature

def test_temperature_scales_logits():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 100, generator=gen) * 3
    temps = [1.0, 0.5, 2.0, 0.05, 10.0]
    probs = Sampler.probabilities(logits.clone(), make_batch(5, temperature=temps))
    for i, t in enumerate(temps):
        want = softmax64(logits[i].double().numpy() / t)
        np.testing.assert_allclose(probs[i].double().numpy(), want, atol=1e-6, rtol=1e-4)
    # lower temperature sharpens: the top token's probability grows as T falls
    row = logits[0:1].repeat(4, 1)
    ts = [4.0, 1.0, 0.5, 0.1]
    p = Sampler.probabilities(row, make_batch(4, temperature=ts))
    top = int(logits[0].argmax())
    assert p[:, top].tolist() == sorted(p[:, top].tolist())


# ----------------------------------------------------------------------------- greedy

def test_greedy_rows_return_argmax():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 300, generator=gen)
    sampler = Sampler(0)
    tokens, top = sampler(logits.clone(), make_batch(8, temperature=0.0))
    assert top is None
    assert torch.equal(tokens, logits.argmax(-1))
    # greedy rows mixed with random rows, and with truncation settings that must not matter
    temps = [0.0, 1.0, 0.0, 1.5, 0.0, 0.7, 0.0, 1.0]
    batch = make_batch(8, temperature=temps, top_k=[3, 0, 1, 5, 0, 0, 50, 2],
                       top_p=[0.1, 0.9, 1.0, 0.5, 0.2, 1.0, 1.0, 0.3])
    assert not batch.all_greedy
    for seed in range(5):
        tokens, _ = Sampler(seed)(logits.clone(), batch)
        for i, t in enumerate(temps):
            if t == 0.0:
                assert int(tokens[i]) == int(logits[i].argmax())


def test_greedy_sampling_params_via_input_batch():
    vocab = 40
    b = input_batch(vocab)
    b.add(new_request("g", [1, 2, 3], temperature=0.0))
    b.add(new_request("r", [4, 5], temperature=1.0))
    sb = b.sampling_batch(rows_of(b, ["g"]), CPU)
    assert sb.all_greedy and sb.greedy is None and sb.temperature is None  # argmax alone
    sb = b.sampling_batch(rows_of(b, ["g", "r"]), CPU)
    assert not sb.all_greedy and sb.greedy.tolist() == [True, False]


def test_sampling_extras_counted_as_requests_join_and_leave():
    """The batch counts the running requests that use each extra; a step builds an extra only
    while some request uses it, and a request that leaves takes its counts with it."""
    b = input_batch(40)
    b.add(new_request("plain", [1, 2], temperature=0.0))
    b.add(new_request("rich", [3], [4], temperature=0.8, seed=7, logprobs=1, prompt_logprobs=0,
                      presence_penalty=0.5, logit_bias={5: 1.0}, logprob_token_ids=[6],
                      min_tokens=3))
    assert set(b.rows_using.values()) == {1}
    sb = b.sampling_batch(rows_of(b, ["plain", "rich"]), CPU)
    assert not sb.all_greedy and sb.seeds.tolist()[0] == -1 and sb.seeds[1] >= 0
    assert sb.max_num_logprobs == 1 and sb.presence is not None
    assert sb.bias_rows.tolist() == [1] and sb.listed_rows.tolist() == [1]
    assert sb.banned_rows is not None
    b.remove("rich")
    b.remove("rich")  # twice: counted once
    assert set(b.rows_using.values()) == {0}
    sb = b.sampling_batch(rows_of(b, ["plain"]), CPU)
    assert sb == SamplingBatch(all_greedy=True)

def test_top_k_one_is_deterministic():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(1, 80, generator=gen).repeat(500, 1)
    tokens, _ = Sampler(1)(logits.clone(), make_batch(500, top_k=1))
    assert bool((tokens == logits[0].argmax()).all())


# ----------------------------------------------------------------------------- frequencies

def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    keep = probs > 0
    exp = probs[keep] * n
    stat = float(((counts[keep] - exp) ** 2 / exp).sum())
    return stat, int(keep.sum()) - 1


def assert_frequencies_match(tokens: torch.Tensor, probs: np.ndarray) -> None:
    counts = np.bincount(tokens.numpy(), minlength=len(probs)).astype(np.float64)
    assert support(counts) <= support(probs), "drew a token outside the truncated support"
    stat, dof = chi_square(counts, probs)
    # loose: mean dof, sd sqrt(2 dof); a wrong distribution over 20000 draws is far beyond this
    assert stat < dof + 6 * math.sqrt(2 * max(dof, 1)) + 10, (stat, dof)
    # and every kept token with a sizeable expected count shows up
    n = counts.sum()
    assert all(counts[i] > 0 for i in np.flatnonzero(probs * n > 20))


@pytest.mark.parametrize("settings", [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05),
    dict(temperature=1.5, top_k=25, top_p=0.9, min_p=0.02),
])
def test_sampling_frequencies_match_truncated_distribution(settings):
    vocab, draws = 50, 20000
    gen = torch.Generator().manual_seed(7)
    row = logits_with_margin(gen, vocab, 1.5, settings)
    want, _ = expected_distribution(row.numpy(), **settings)
    batch = make_batch(draws, **settings)
    tokens, _ = Sampler(123)(row.repeat(draws, 1), batch)
    assert_frequencies_match(tokens, want)


def test_seeded_rows_sample_from_the_same_distribution():
    """Rows seeded with many different seeds, together, are distributed like unseeded draws."""
    vocab, draws = 30, 6000
    settings = dict(temperature=0.9, top_k=15, top_p=0.95, min_p=0.0)
    gen = torch.Generator().manual_seed(8)
    row = logits_with_margin(gen, vocab, 1.0, settings)
    want, _ = expected_distribution(row.numpy(), **settings)
    batch = make_batch(draws, seeds=[1000 + 7919 * i for i in range(draws)], **settings)
    tokens, _ = Sampler(0)(row.repeat(draws, 1), batch)
    assert_frequencies_match(tokens, want)


def test_unseeded_sampler_reproducible_from_its_own_seed():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(64, 100, generator=gen)
    a, _ = Sampler(42)(logits.clone(), make_batch(64))
    b, _ = Sampler(42)(logits.clone(), make_batch(64))
    c, _ = Sampler(43)(logits.clone(), make_batch(64))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# ----------------------------------------------------------------------------- seeds

def _step_logits(req_id: str, step: int, vocab: int) -> torch.Tensor:
    """Deterministic 'model output' for request req_id at output position step."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{req_id}/{step}".encode()))
    return torch.randn(vocab, generator=g) * 1.2


def _generate(context: list[tuple[str, dict]], target: str, steps: int, sampler_seed: int,
              vocab: int = 200, prompt_of=None, resume_after: int | None = None) -> list[int]:
    """Run `steps` sampling steps over a batch of requests and return target's tokens."""
    prompt_of = prompt_of or (lambda r: [3, 1, 4, 1, 5][: 2 + len(r) % 4])
    b = input_batch(vocab, max_reqs=8, max_len=64)
    sampler = Sampler(sampler_seed)
    for req_id, params in context:
        b.add(new_request(req_id, prompt_of(req_id), **params))
    order = [r for r, _ in context]
    out: list[int] = []
    for step in range(steps):
        if resume_after is not None and step == resume_after:
            # preempted and resumed: it comes back with its output so far in token_ids
            params = dict(context)[target]
            b.remove(target)
            b.add(new_request(target, prompt_of(target), out, **params))
        rows = rows_of(b, order)
        num_out = b.num_tokens[rows] - b.num_prompt_tokens[rows]
        logits = torch.stack([_step_logits(r, int(n), vocab) for r, n in zip(order, num_out)])
        tokens, _ = sampler(logits, b.sampling_batch(rows, CPU))
        b.append_tokens(rows, tokens.numpy())
        out.append(int(tokens[order.index(target)]))
    return out


SEEDED = ("s", dict(seed=1234, temperature=1.0, max_tokens=64))


def test_seeded_request_reproduces_alone_and_in_any_batch():
    steps = 12
    alone = _generate([SEEDED], "s", steps, sampler_seed=0)
    assert len(set(alone)) > 3  # mixing with the position: not the same draw every step
    others = [
        ("u1", dict(temperature=1.0)),
        ("u2", dict(temperature=0.8, top_k=10, top_p=0.7)),
        ("s2", dict(seed=99, temperature=1.0)),
        ("g", dict(temperature=0.0)),
        ("p", dict(temperature=1.0, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.2, logit_bias={3: 5.0}, logprobs=2)),
    ]
    contexts = [
        [SEEDED] + others,
        others[:2] + [SEEDED] + others[2:],
        others + [SEEDED],
        [others[2], SEEDED],
    ]
    for i, ctx in enumerate(contexts):
        got = _generate(ctx, "s", steps, sampler_seed=100 + i)
        assert got == alone, i
    # preemption: resumed with its output so far, it continues the same way
    assert _generate([SEEDED] + others[:2], "s", steps, sampler_seed=7, resume_after=5) == alone


def test_same_seed_same_position_same_draw_and_different_seeds_differ():
    vocab = 500
    logits = torch.zeros(1, vocab)  # uniform: the draw is decided by the seeded noise alone
    b = input_batch(vocab)
    b.add(new_request("a", [1, 2], seed=5))
    b.add(new_request("b", [7, 8, 9], seed=5))  # other prompt, same seed
    b.add(new_request("c", [1, 2], [4, 4], seed=5))  # two outputs already
    b.add(new_request("d", [1, 2], seed=6))
    sb = b.sampling_batch(rows_of(b, ["a", "b", "c", "d"]), CPU)
    assert sb.seeds[0] == sb.seeds[1]
    assert len({sb.seeds[0], sb.seeds[2], sb.seeds[3]}) == 3
    tokens, _ = Sampler(0)(logits.repeat(4, 1), sb)
    assert tokens[0] == tokens[1]
    # b alone, in another row, with another global sampler seed
    b2 = input_batch(vocab)
    b2.add(new_request("x", [0], temperature=1.0))
    b2.add(new_request("b", [7, 8, 9], seed=5))
    t2, _ = Sampler(77)(logits.repeat(1, 1), b2.sampling_batch(rows_of(b2, ["b"]), CPU))
    assert int(t2[0]) == int(tokens[1])
    # different seeds over many requests: the draws are spread out, not all equal
    b3 = input_batch(vocab, max_reqs=40)
    for s in range(40):
        b3.add(new_request(f"r{s}", [1], seed=s))
    t3, _ = Sampler(0)(logits.repeat(40, 1),
                       b3.sampling_batch(rows_of(b3, [f"r{s}" for s in range(40)]), CPU))
    assert len(set(t3.tolist())) > 25


def test_seed_mixing_is_deterministic_and_positive():
    b = input_batch(10)
    b.add(new_request("a", [1], seed=-(2**63)))
    b.add(new_request("b", [1], seed=2**63 - 1))
    b.add(new_request("c", [1]))
    sb = b.sampling_batch(rows_of(b, ["a", "b", "c"]), CPU)
    assert sb.seeds[2] == -1  # unseeded
    for s in sb.seeds[:2]:
        assert 0 <= s < 2**63
        torch.Generator().manual_seed(int(s))  # a valid generator seed


# ----------------------------------------------------------------------------- penalties

def _expected_penalized(logits: np.ndarray, prompt: list[int], output: list[int],
                        rep: float, freq: float, pres: float) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    seen = set(prompt) | set(output)
    for tok in seen:
        out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
    for tok in set(output):
        count = output.count(tok)
        out[tok] -= freq * count
        out[tok] -= pres
    return out


PENALTY_REQS = [
    # req_id, prompt, output, params
    ("a", [1, 2, 3, 3], [3, 4, 4, 5], dict(repetition_penalty=1.3, frequency_penalty=0.5,
                                           presence_penalty=0.7)),
    ("b", [7], [8], dict()),  # no penalties: untouched even though others have some
    ("c", [10, 11, 12], [], dict(repetition_penalty=2.0, frequency_penalty=1.0,
                                 presence_penalty=1.0)),  # prompt only: only repetition applies
    ("d", [6, 6, 6], [6, 9, 9, 9], dict(frequency_penalty=-0.4)),
    ("e", [20, 21], [21, 22, 22], dict(presence_penalty=-1.5)),
    ("f", [25, 26], [26, 27, 27], dict(repetition_penalty=0.8)),
]


def test_penalties_change_logits_as_defined():
    vocab = 32
    b = input_batch(vocab)
    for req_id, prompt, output, params in PENALTY_REQS:
        b.add(new_request(req_id, prompt, output, **params))
    ids = [r[0] for r in PENALTY_REQS]
    rows = rows_of(b, ids)
    sb = b.sampling_batch(rows, CPU)
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(len(ids), vocab, generator=gen) * 3  # both signs
    # make sure penalized tokens cover positive and negative logits
    logits[0, 3], logits[0, 4], logits[0, 1] = 2.0, -1.5, -0.5
    logits[5, 26], logits[5, 27] = 1.0, -1.0
    got = apply_penalties(logits.clone(), sb)
    for i, (req_id, prompt, output, params) in enumerate(PENALTY_REQS):
        sp = SamplingParams(**params)
        want = _expected_penalized(logits[i].numpy(), prompt, output, sp.repetition_penalty,
                                   sp.frequency_penalty, sp.presence_penalty)
        np.testing.assert_allclose(got[i].double().numpy(), want, rtol=1e-6, atol=1e-6,
                                   err_msg=req_id)
    assert torch.equal(got[1], logits[1])
    # spot checks written out by hand
    assert got[0, 3].item() == pytest.approx(2.0 / 1.3 - 0.5 * 1 - 0.7)
    assert got[0, 4].item() == pytest.approx(-1.5 * 1.3 - 0.5 * 2 - 0.7)
    assert got[0, 1].item() == pytest.approx(-0.5 * 1.3)  # prompt only: repetition, no freq
    assert got[3, 6].item() == pytest.approx(logits[3, 6].item() + 0.4)  # 1 output occurrence
    assert got[3, 9].item() == pytest.approx(logits[3, 9].item() + 1.2)


def test_penalty_counts_ignore_stale_tokens_of_a_reused_row():
    vocab = 16
    b = input_batch(vocab, max_reqs=1, max_len=32)
    b.add(new_request("old", list(range(1, 15)), [15, 15, 14]))
    b.remove("old")
    b.add(new_request("new", [2], [3, 3], frequency_penalty=1.0, presence_penalty=0.5,
                      repetition_penalty=2.0))
    sb = b.sampling_batch(rows_of(b, ["new"]), CPU)
    want_counts = torch.zeros(1, vocab)
    want_counts[0, 3] = 2
    assert torch.equal(sb.output_counts, want_counts)
    assert set(torch.nonzero(sb.seen_mask[0]).flatten().tolist()) == {2, 3}
    # after a new token, counts follow
    b.append_tokens(rows_of(b, ["new"]), np.array([5]))
    sb = b.sampling_batch(rows_of(b, ["new"]), CPU)
    assert sb.output_counts[0, 5] == 1 and sb.output_counts[0, 3] == 2
    assert bool(sb.seen_mask[0, 5])


def test_persistent_penalty_counts_equal_a_rebuild_from_history():
    """Requests join, grow, leave and reuse rows and penalty slots, and some are sampled past
    their counted tokens (speculative drafts): the kept counts always equal counts rebuilt from
    each request's tokens."""
    vocab, rng = 24, np.random.default_rng(3)
    b = input_batch(vocab, max_reqs=6, max_len=64)
    live: dict[str, tuple[int, bool]] = {}  # req_id -> (prompt length, has penalties)
    for step in range(60):
        if len(live) < 6 and (not live or rng.random() < 0.4):
            req_id, prompt = f"r{step}", rng.integers(0, vocab, rng.integers(1, 6)).tolist()
            pen = bool(rng.random() < 0.7)
            b.add(new_request(req_id, prompt, rng.integers(0, vocab, rng.integers(0, 4)).tolist(),
                              **(dict(frequency_penalty=0.5, repetition_penalty=1.2) if pen
                                 else {})))
            live[req_id] = (len(prompt), pen)
        if len(live) > 1 and rng.random() < 0.3:
            gone = sorted(live)[rng.integers(len(live))]
            b.remove(gone)
            del live[gone]
        ids = sorted(live)
        rows = rows_of(b, ids)
        grow = rng.integers(0, 3, len(rows))
        b.append_tokens(np.repeat(rows, grow), rng.integers(0, vocab, int(grow.sum())))
        ahead = rng.integers(0, 3, len(rows))  # drafts written past the counted tokens
        for row, k in zip(rows, ahead):
            b.write_drafts(row, rng.integers(0, vocab, k).tolist())
        lengths = b.num_tokens[rows] + ahead
        sb = b.sampling_batch(rows, CPU, lengths)
        if not any(live[r][1] for r in ids):
            assert sb.output_counts is None
            continue
        for i, (req_id, row) in enumerate(zip(ids, rows)):
            prompt_len, pen = live[req_id]
            tokens = b.token_ids[row, :lengths[i]]
            want = np.bincount(tokens[prompt_len:], minlength=vocab) if pen else np.zeros(vocab)
            assert sb.output_counts[i].tolist() == want.tolist(), (step, req_id)
            seen = set(tokens.tolist()) if pen else set()
            assert set(torch.nonzero(sb.seen_mask[i]).flatten().tolist()) == seen, (step, req_id)


def test_no_penalties_means_no_penalty_tensors():
    b = input_batch(20)
    b.add(new_request("a", [1, 2], [3]))
    sb = b.sampling_batch(rows_of(b, ["a"]), CPU)
    assert sb.frequency is None and sb.repetition is None and sb.output_counts is None
    logits = torch.randn(1, 20)
    assert torch.equal(apply_penalties(logits.clone(), sb), logits)


def test_penalties_reach_the_sampled_distribution():
    """Through Sampler.__call__: a huge presence penalty removes every output token."""
    vocab = 20
    b = input_batch(vocab)
    b.add(new_request("a", [1], [2, 3, 4], presence_penalty=2.0, temperature=0.0))
    logits = torch.zeros(1, vocab)
    logits[0, 2:5] = 1.0  # output tokens lead by 1; presence 2 drops them below the rest
    tokens, _ = Sampler(0)(logits, b.sampling_batch(rows_of(b, ["a"]), CPU))
    assert int(tokens[0]) not in (2, 3, 4)


# ----------------------------------------------------------------------------- bias / min_tokens

def test_logit_bias_adds_to_logits():
    vocab = 30
    b = input_batch(vocab)
    b.add(new_request("a", [1], logit_bias={3: 5.0, 7: -2.5}))
    b.add(new_request("b", [1]))
    b.add(new_request("c", [1], logit_bias={"3": -100, 29: 100}))
    rows = rows_of(b, ["a", "b", "c"])
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(3, vocab, generator=gen)
    spy = SpySampler(0)
    tokens, _ = spy(logits.clone(), b.sampling_batch(rows, CPU))
    want = logits.clone()
    want[0, 3] += 5.0
    want[0, 7] -= 2.5
    want[2, 3] -= 100.0
    want[2, 29] += 100.0
    torch.testing.assert_close(spy.seen, want)
    assert int(tokens[2]) == 29  # +100 dominates


def test_logit_bias_greedy_picks_biased_token():
    vocab = 30
    b = input_batch(vocab)
    b.add(new_request("a", [1], temperature=0.0, logit_bias={11: 50.0}))
    b.add(new_request("b", [1], temperature=0.0, logit_bias={4: -100.0}))
    logits = torch.zeros(2, vocab)
    logits[:, 4] = 10.0
    logits[:, 5] = 9.0
    tokens, _ = Sampler(0)(logits, b.sampling_batch(rows_of(b, ["a", "b"]), CPU))
    assert tokens.tolist() == [11, 5]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_eos_and_stop_token_ids(ignore_eos):
    vocab, eos = 25, [2, 3]
    b = input_batch(vocab)
    params = dict(min_tokens=3, max_tokens=10, stop_token_ids=[7], ignore_eos=ignore_eos)
    b.add(new_request("m", [1, 4], eos_token_ids=eos, **params))
    b.add(new_request("free", [1, 4], eos_token_ids=eos, stop_token_ids=[8]))
    banned_ids = [7] if ignore_eos else [2, 3, 7]
    logits = torch.zeros(2, vocab)
    logits[:, banned_ids] = 20.0  # the banned tokens would otherwise win
    logits[:, 8] = 20.0
    rows = rows_of(b, ["m", "free"])
    for n_out in range(5):
        spy = SpySampler(n_out)
        tokens, _ = spy(logits.clone(), b.sampling_batch(rows, CPU))
        seen = spy.seen
        if n_out < 3:
            assert bool(torch.isneginf(seen[0, banned_ids]).all()), n_out
            assert int(tokens[0]) not in banned_ids
        else:
            assert bool(torch.isfinite(seen[0]).all()), n_out
        assert bool(torch.isfinite(seen[1]).all())  # the other row is never banned
        assert bool(torch.isfinite(seen[0, [i for i in range(vocab) if i not in banned_ids]]).all())
        b.append_tokens(rows, np.array([9, 9]))


def test_min_tokens_greedy():
    vocab = 12
    b = input_batch(vocab)
    b.add(new_request("m", [1], temperature=0.0, min_tokens=2, max_tokens=5))
    logits = torch.zeros(1, vocab)
    logits[0, 0] = 5.0  # eos is the argmax
    logits[0, 6] = 4.0
    rows = rows_of(b, ["m"])
    got = []
    for _ in range(3):
        tokens, _ = Sampler(0)(logits.clone(), b.sampling_batch(rows, CPU))
        got.append(int(tokens[0]))
        b.append_tokens(rows, tokens.numpy())
    assert got == [6, 6, 0]


# ----------------------------------------------------------------------------- logprobs

def test_gather_logprobs_normalized_ranks_and_ordering():
    vocab = 100
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(6, vocab, generator=gen) * 2
    lp = torch.log_softmax(logits, -1)
    assert torch.allclose(torch.logsumexp(lp, -1), torch.zeros(6), atol=1e-5)
    chosen = torch.tensor([int(logits[0].argmax()), 5, 17, int(logits[3].argmin()), 0, 99])
    top = gather_logprobs(lp, chosen, 5)
    assert top.token_ids.shape == (6, 6) and top.logprobs.shape == (6, 6)
    assert top.ranks.shape == (6,)
    np.testing.assert_array_equal(top.token_ids[:, 0], chosen.numpy())
    for i in range(6):
        row = lp[i].double().numpy()
        c = int(chosen[i])
        assert top.logprobs[i, 0] == pytest.approx(row[c], abs=1e-6)
        assert int(top.ranks[i]) == 1 + int((row > row[c]).sum())
        # top-k: the k largest, descending, with their own logprobs
        assert list(top.token_ids[i, 1:]) == list(np.argsort(-row, kind="stable")[:5])
        assert all(np.diff(top.logprobs[i, 1:]) <= 0)
        np.testing.assert_allclose(top.logprobs[i, 1:], row[top.token_ids[i, 1:]], atol=1e-6)
    assert int(top.ranks[0]) == 1
    assert int(top.ranks[3]) == vocab
    # k = 0: the chosen token only
    top0 = gather_logprobs(lp, chosen, 0)
    assert top0.token_ids.shape == (6, 1)
    np.testing.assert_array_equal(top0.ranks, top.ranks)
    # k = vocab: the whole row, which sums to one
    full = gather_logprobs(lp, chosen, vocab)
    np.testing.assert_allclose(np.logaddexp.reduce(full.logprobs[:, 1:].astype(np.float64), 1),
                               0.0, atol=1e-5)


def test_sampler_logprobs_are_of_the_raw_distribution():
    vocab = 60
    b = input_batch(vocab)
    b.add(new_request("a", [1, 2], [3], logprobs=3, temperature=0.5, top_k=5,
                      repetition_penalty=1.5, logit_bias={9: 3.0}))
    b.add(new_request("b", [1], temperature=0.0, logprobs=0))
    b.add(new_request("c", [1], temperature=1.0))
    rows = rows_of(b, ["a", "b", "c"])
    sb = b.sampling_batch(rows, CPU)
    assert sb.max_num_logprobs == 3
    gen = torch.Generator().manual_seed(14)
    logits = torch.randn(3, vocab, generator=gen) * 2
    tokens, top = Sampler(0)(logits.clone(), sb)
    assert top is not None and top.token_ids.shape == (3, 4)
    raw = torch.log_softmax(logits.double(), -1).numpy()
    np.testing.assert_array_equal(top.token_ids[:, 0], tokens.numpy())
    for i in range(3):
        np.testing.assert_allclose(top.logprobs[i], raw[i, top.token_ids[i]], atol=1e-5)
        assert list(top.token_ids[i, 1:]) == list(np.argsort(-raw[i])[:3])
        assert int(top.ranks[i]) == 1 + int((raw[i] > raw[i, int(tokens[i])] + 1e-7).sum())
    assert int(top.ranks[1]) == 1  # greedy row: the argmax
    # no row asking for logprobs: none computed
    b.remove("a"), b.remove("b")
    _, none = Sampler(0)(logits[2:].clone(), b.sampling_batch(rows_of(b, ["c"]), CPU))
    assert none is None


# ----------------------------------------------------------------------------- device

def test_sampling_batch_tensors_on_requested_device():
    """Every tensor in the SamplingBatch lives on the device given (meta stands in for a GPU)."""
    b = input_batch(40)
    b.add(new_request("a", [1, 2], [3], seed=1, repetition_penalty=1.2, logit_bias={5: 1.0},
                      min_tokens=2, stop_token_ids=[6]))
    b.add(new_request("b", [4], temperature=0.0))
    meta = torch.device("meta")
    sb = b.sampling_batch(rows_of(b, ["a", "b"]), meta)
    tensors = {k: v for k, v in vars(sb).items() if isinstance(v, torch.Tensor)}
    assert {"bias_rows", "bias_values", "banned_rows", "output_counts"} <= set(tensors)
    for name, t in tensors.items():
        assert t.device.type == "meta", name
