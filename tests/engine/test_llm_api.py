"""The offline LLM API on the real SmolLM2 model: outputs, stops, n > 1, seeds, chat, bad input."""
from __future__ import annotations

import pytest

from octavo import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def test_generate_strings_and_token_ids_agree(smollm_llm):
    ids = smollm_llm.tokenizer.encode("The capital of France is")
    a, b = smollm_llm.generate(["The capital of France is", ids], GREEDY, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.prompt == "The capital of France is" and b.prompt is None
    assert a.prompt_token_ids == ids
    assert "Paris" in a.outputs[0].text


def test_outputs_keep_input_order_and_several_params(smollm_llm):
    prompts = ["One", "Two three", "Four five six"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5, 7)]
    outs = smollm_llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 7]
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)


def test_incremental_text_equals_full_decode(smollm_llm):
    prompts = ["Écris une phrase en français sur le café:", "Write emoji and Chinese: 你好 🌍",
               "def add(a, b):\n    return"]
    outs = smollm_llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0),
                               use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        ids = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
        full = smollm_llm.tokenizer.decode(ids, skip_special_tokens=True)
        # A character cut in half by max_tokens is withheld, not shown as U+FFFD.
        assert c.text == full.rstrip("\ufffd")


def test_stop_strings_cut_the_text(smollm_llm):
    full = smollm_llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    stop = full.text[5:9]  # spans token boundaries in general
    cut = smollm_llm.generate("The capital of France is",
                              SamplingParams(max_tokens=24, temperature=0, stop=[stop]),
                              use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[:full.text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    kept = smollm_llm.generate("The capital of France is",
                               SamplingParams(max_tokens=24, temperature=0, stop=stop,
                                              include_stop_str_in_output=True),
                               use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_stop_token_ids_and_eos(smollm_llm):
    full = smollm_llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_tok = full.token_ids[3]
    out = smollm_llm.generate("The capital of France is",
                              SamplingParams(max_tokens=24, temperature=0,
                                             stop_token_ids=[stop_tok]),
                              use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[:full.token_ids.index(stop_tok) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    eos = smollm_llm.tokenizer.eos_token_id
    chat = smollm_llm.chat([{"role": "user", "content": "Say hi."}],
                           SamplingParams(max_tokens=200, temperature=0), use_tqdm=False)[0]
    c = chat.outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == eos and c.stop_reason is None
    assert "<|im_end|>" not in c.text
    ignored = smollm_llm.chat([{"role": "user", "content": "Say hi."}],
                              SamplingParams(max_tokens=len(c.token_ids) + 3, temperature=0,
                                             ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == len(c.token_ids) + 3


def test_min_tokens_delays_eos(smollm_llm):
    msgs = [{"role": "user", "content": "Say hi."}]
    short = smollm_llm.chat(msgs, SamplingParams(max_tokens=200, temperature=0),
                            use_tqdm=False)[0].outputs[0]
    longer = smollm_llm.chat(msgs, SamplingParams(max_tokens=200, temperature=0,
                                                  min_tokens=len(short.token_ids) + 5),
                             use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 5


def test_parallel_sampling_and_seeds(smollm_llm):
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7)
    a = smollm_llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    # The same seeded request inside a batch of unrelated requests samples the same tokens.
    batch = smollm_llm.generate(["Hello there", "Once upon a time", "def f():"],
                                [SamplingParams(max_tokens=12, temperature=0.8), params,
                                 SamplingParams(max_tokens=20, temperature=0)],
                                use_tqdm=False)
    assert [c.token_ids for c in batch[1].outputs] == [c.token_ids for c in a.outputs]


def test_logprobs_shape(smollm_llm):
    out = smollm_llm.generate("The capital of France is",
                              SamplingParams(max_tokens=5, temperature=0, logprobs=3),
                              use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(pos) <= 4
        assert all(lp.logprob <= 0 for lp in pos.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)), rel=1e-4)


def test_chat_template_override_and_many_conversations(smollm_llm):
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    convs = [[{"role": "user", "content": "The capital of France is"}],
             [{"role": "user", "content": "2 + 2 ="}]]
    outs = smollm_llm.chat(convs, GREEDY, chat_template=template, use_tqdm=False)
    assert len(outs) == 2
    assert outs[0].prompt_token_ids == smollm_llm.tokenizer.encode("The capital of France is\n")


def test_priority_is_accepted(smollm_llm):
    outs = smollm_llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[1, 0])
    assert all(o.finished for o in outs)


@pytest.mark.parametrize("prompt, params, field", [
    ("x " * 3000, GREEDY, "prompt"),
    ("hello", SamplingParams(max_tokens=2048), "max_tokens"),
    ("", GREEDY, "prompt"),
    ([10**7], GREEDY, "prompt token ids"),
    ([1.0, 2.0], GREEDY, "prompt token ids"),
    ("hello", SamplingParams(logit_bias={10**7: 1.0}), "logit_bias"),
    ("hello", SamplingParams(stop_token_ids=[10**7]), "stop_token_ids"),
    ("hello", SamplingParams(logprobs=100), "logprobs"),
])
def test_bad_input_raises_and_engine_keeps_serving(smollm_llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        smollm_llm.generate([prompt], params, use_tqdm=False)
    assert not smollm_llm.engine.has_unfinished_requests()
    assert smollm_llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_bad_input_in_a_batch_adds_nothing(smollm_llm):
    with pytest.raises(ValueError):
        smollm_llm.generate(["fine", "x " * 3000], GREEDY, use_tqdm=False)
    assert not smollm_llm.engine.has_unfinished_requests()
    assert smollm_llm.engine.client.stats().num_waiting == 0


def test_empty_prompt_list_returns_empty(smollm_llm):
    assert smollm_llm.generate([], GREEDY) == []
    assert smollm_llm.chat([]) == []


def test_abort_frees_blocks(smollm_llm):
    engine = smollm_llm.engine
    engine.add_request("abort-me", "Tell me a long story.", SamplingParams(max_tokens=100))
    engine.step()
    engine.step()
    assert engine.client.stats().kv_cache_usage > 0
    final = engine.abort_request("abort-me")
    assert final.outputs[0].finish_reason == "abort"
    engine.step()
    assert engine.client.stats().kv_cache_usage == 0
    assert not engine.has_unfinished_requests()


def test_parallel_samples_score_the_prompt_once(smollm_llm):
    ids = smollm_llm.tokenizer.encode("The capital of France is")
    out = smollm_llm.generate([ids], SamplingParams(n=3, max_tokens=3, prompt_logprobs=1,
                                                    temperature=1.0, seed=2), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(ids) and len(out.outputs) == 3
    assert all(ids[p] in out.prompt_logprobs[p] for p in range(1, len(ids)))


def test_numpy_token_ids_are_token_ids(smollm_llm):
    import numpy as np

    ids = smollm_llm.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=4, temperature=0)
    plain = smollm_llm.generate([ids], params, use_tqdm=False)[0]
    from_numpy = smollm_llm.generate([list(np.array(ids, np.int64))], params, use_tqdm=False)[0]
    assert from_numpy.outputs[0].token_ids == plain.outputs[0].token_ids
    assert all(type(t) is int for t in from_numpy.prompt_token_ids)


def test_a_process_that_exits_right_after_loading_exits_cleanly(smollm_gguf):
    """Work the worker defers past loading (packing weights for oneDNN: model/loader/
    gemm_packing.py) must not outlive it: a process that loads a model, generates one token and
    exits at once exits 0 (a packing thread still running at exit made it abort, code 134)."""
    import subprocess
    import sys

    code = ("import gc; from octavo import LLM, SamplingParams; "
            f"llm = LLM({str(smollm_gguf)!r}); "
            # the load paused the collector (startup_gc) and gave this process its setting back
            "assert gc.isenabled() and gc.get_freeze_count() == 0; "
            "llm.generate(['Hi'], SamplingParams(max_tokens=1), use_tqdm=False)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
