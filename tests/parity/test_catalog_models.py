"""Gemma 3 270M and Qwen2.5-Coder 0.5B (GGUF) against transformers on the same GGUF, by the
criterion in greedy.py, and a chat through LLM.chat.

Gemma 3 interleaves five sliding-window layers (window 512) with one global layer; the longest
prompt (about 560 tokens) runs past the window, and the small token budget below makes its
prefill cross the window boundary in chunks.
"""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from tests.parity.greedy import check_prompt_logprobs, check_single_and_batched, oracle_results

MODELS = ["gemma3-270m", "qwen2.5-coder-0.5b-instruct"]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    from octavo.model_source import pull
    from tests.oracle import oracle_folder

    name = request.param
    ids, results = oracle_results(oracle_folder(name))
    llm = LLM(str(pull(name)), dtype="float32", max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=256, kv_cache_memory=256 << 20)
    yield name, llm, ids, results
    llm.engine.shutdown()


def test_greedy_tokens_single_and_batched(model):
    _, llm, ids, results = model
    check_single_and_batched(llm, ids, results)


def test_prompt_logprobs(model):
    _, llm, ids, results = model
    check_prompt_logprobs(llm, ids, results)


def test_chat(model):
    name, llm, _, _ = model
    params = SamplingParams(max_tokens=24, temperature=0)
    question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    if name.startswith("gemma"):
        # The base model ships no chat template: a clear error, and Gemma's own turn format works.
        with pytest.raises(ValueError, match="no chat template"):
            llm.chat(question, params, use_tqdm=False)
        template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                    "{{ m['content'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n")
        out = llm.chat(question, params, use_tqdm=False, chat_template=template)[0]
        assert out.outputs[0].text.strip()
        completion = llm.generate("The capital of France is", params, use_tqdm=False)[0]
        assert "France" in completion.outputs[0].text or "Paris" in completion.outputs[0].text
    else:
        out = llm.chat(question, params, use_tqdm=False)[0]
        assert "Paris" in out.outputs[0].text, out.outputs[0].text
