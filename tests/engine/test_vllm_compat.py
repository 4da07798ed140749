"""vLLM's documented offline examples, with only the imports changed (and the shared SmolLM2
engine in place of `LLM(model=...)`, to keep the suite fast)."""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams  # from vllm import LLM, SamplingParams
from octavo.inputs import TextPrompt, TokensPrompt  # from vllm.inputs import ...
from octavo.outputs import CompletionOutput, RequestOutput  # from vllm.outputs import ...
from octavo.sampling_params import BeamSearchParams  # from vllm.sampling_params import ...


def test_quickstart_generate(smollm_llm: LLM):
    prompts = ["Hello, my name is", "The president of the United States is",
               "The capital of France is", "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8)
    outputs = smollm_llm.generate(prompts, sampling_params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert isinstance(output, RequestOutput) and output.prompt == prompt
        assert isinstance(output.outputs[0], CompletionOutput) and output.outputs[0].text


def test_prompt_forms_give_the_same_greedy_tokens(smollm_llm: LLM):
    greedy = SamplingParams(temperature=0, max_tokens=8)
    text = "The capital of France is"
    ids = smollm_llm.get_tokenizer().encode(text)
    base = smollm_llm.generate(text, greedy, use_tqdm=False)[0].outputs[0].token_ids
    forms = [{"prompt": text}, TextPrompt(prompt=text, cache_salt="tenant-a"),
             {"prompt_token_ids": ids}, TokensPrompt(prompt_token_ids=ids), ids]
    for form in forms:
        out = smollm_llm.generate(form, greedy, use_tqdm=False)
        assert len(out) == 1 and out[0].outputs[0].token_ids == base, form
    mixed = smollm_llm.generate([text, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == [base, base]


@pytest.mark.parametrize("prompt, error, match", [
    ({"prompt": "hi", "prompt_token_ids": [1]}, ValueError, "exactly one"),
    ({"text": "hi"}, ValueError, "unknown prompt field"),
    ({"prompt": 5}, ValueError, "must be a string"),
    ({"prompt": "hi", "multi_modal_data": {"image": object()}}, NotImplementedError,
     "multi_modal_data"),
    ({"prompt_token_ids": []}, ValueError, "non-empty"),
])
def test_bad_prompt_dicts_name_the_problem(smollm_llm: LLM, prompt, error, match):
    with pytest.raises(error, match=match):
        smollm_llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    assert not smollm_llm.engine.has_unfinished_requests()


def test_beam_search_example(smollm_llm: LLM):
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    outputs = smollm_llm.beam_search([{"prompt": "Hello, my name is "}], params)
    assert len(outputs) == 1
    best = outputs[0].sequences[0]
    assert best.text.startswith("Hello, my name is")  # vLLM's text includes the prompt
    assert len(outputs[0].sequences) == 3
    scores = [s.cum_logprob for s in outputs[0].sequences]
    assert all(isinstance(s, float) and s <= 0 for s in scores)
    ids = smollm_llm.get_tokenizer().encode("Hello, my name is ")
    again = smollm_llm.beam_search(TokensPrompt(prompt_token_ids=ids), params)[0]
    assert [s.tokens for s in again.sequences] == [s.tokens for s in outputs[0].sequences]


def test_chat_example_with_vllm_keywords(smollm_llm: LLM):
    conversation = [{"role": "system", "content": "You are a helpful assistant"},
                    {"role": "user", "content": "Hello"},
                    {"role": "assistant", "content": "Hello! How can I assist you today?"},
                    {"role": "user", "content": "Write an essay about the importance of "
                                                "higher education."}]
    sampling_params = SamplingParams(temperature=0, max_tokens=8)
    outputs = smollm_llm.chat(conversation, sampling_params, use_tqdm=False)
    assert outputs[0].outputs[0].text
    prefill = [{"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "My favourite colour is"}]
    cont = smollm_llm.chat(prefill, sampling_params, use_tqdm=False,
                           add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt_token_ids[-3:] == smollm_llm.get_tokenizer().encode(
        " favourite colour is", add_special_tokens=False)[-3:]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    template = "{% for t in tools %}{{ t.function.name }} {% endfor %}{{ messages[0].content }}"
    with_tools = smollm_llm.chat([{"role": "user", "content": "hi"}], sampling_params,
                                 use_tqdm=False, chat_template=template, tools=tools,
                                 chat_template_kwargs={})
    text = smollm_llm.get_tokenizer().decode(with_tools[0].prompt_token_ids)
    assert text.startswith("get_weather hi")
