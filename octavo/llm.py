"""The offline API: `LLM(model).generate(prompts, params)`, `LLM.chat(messages)`,
`LLM.beam_search(prompts, params)`, and for a model of task embed `LLM.embed(prompts)` and
`LLM.encode(prompts)`, with vLLM's names, prompt forms and output shapes."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from octavo.config import DEFAULT_MODEL, EngineConfig
from octavo.engine import beam_search as beam
from octavo.engine.arg_utils import engine_config
from octavo.engine.llm_engine import LLMEngine
from octavo.engine.processor import MAX_LOGPROBS, RequestLimits
from octavo.inputs import PromptType, is_single_prompt
from octavo.params import (
    BeamSearchOutput, BeamSearchParams, LoRARequest, RequestOutput, SamplingParams)
from octavo.pooling_params import (
    ClassificationRequestOutput, EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput,
    ScoringRequestOutput)
from octavo.serving.chat_template import render_chat

Prompt = PromptType
Message = dict[str, Any]


class LLM:
    """An engine in this process. Keyword arguments are engine options (`max_num_seqs=8`, ...)."""

    def __init__(self, model: str = DEFAULT_MODEL, max_logprobs: int = MAX_LOGPROBS,
                 **engine_options: Any) -> None:
        """`engine_options`: octavo's options, or vLLM's names for them (see
        octavo.engine.arg_utils). max_logprobs: the most logprobs / prompt_logprobs one request
        may ask for (vLLM's option; -1: the whole vocabulary, which logprobs=-1 needs)."""
        limits = RequestLimits(max_logprobs=max_logprobs)
        self._start(engine_config(model, **engine_options), limits)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig, limits: RequestLimits | None = None) -> None:
        self.engine = LLMEngine(config, limits)
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (`encode`, `decode`, `get_vocab`, `chat_template`, ...)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json settings (temperature, top_p,
        top_k, min_p, repetition_penalty) in place of the built-in defaults."""
        return SamplingParams(**self.engine.arch.sampling_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for one prompt or many (strings, token-id lists, TextPrompt or TokensPrompt
        dicts); outputs in input order. `lora_request`: one adapter for every prompt, or one
        (or None, the base model) per prompt."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            return []
        params = sampling_params if sampling_params is not None else \
            self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            adapters = [lora_request] * len(prompts)
        else:
            adapters = list(lora_request)
            if len(adapters) != len(prompts):
                raise ValueError(f"lora_request has {len(adapters)} entries for "
                                 f"{len(prompts)} prompts")
        return self._run(prompts, list(params), list(priority or [0] * len(prompts)), use_tqdm,
                         adapters)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Generate replies to one conversation or many, through the model's chat template (or
        `chat_template`); `tools` reach the template as `tools`, as in vLLM."""
        if not messages:
            return []
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, chat_template, add_generation_prompt,
                                            chat_template_kwargs, continue_final_message, tools)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation: Sequence[Message], chat_template: str | None = None,
                            add_generation_prompt: bool = True,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs.setdefault("tools", tools)
        return render_chat(self.tokenizer, conversation, chat_template,
                           add_generation_prompt and not continue_final_message,
                           continue_final_message, kwargs)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search for one prompt or many (all searched together, one engine step per token):
        one BeamSearchOutput per prompt, in input order, as vLLM returns it: `sequences` are the
        beam_width best beams, best first, each with `tokens` and `text` that include the
        prompt, `cum_logprob` and per-token `logprobs` (the score they are ranked by is
        cum_logprob / generated tokens ** length_penalty). Equals transformers'
        `generate(num_beams=beam_width, do_sample=False)`."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        searches = [beam.start(self.engine, self.engine.next_request_id(), p, params,
                               cache_salt, lora_request) for p in prompts]
        beam.run(self.engine, searches)
        return [s.sequences(self.tokenizer) for s in searches]

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True
              ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`, a list of floats), in input order: its
        hidden states pooled as the model's pooling says (sentence-transformers' Pooling and
        Normalize modules where the folder has them). `truncate_prompt_tokens`: keep at most
        that many tokens (-1: the context length), a text's special tokens kept."""
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(
            prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm, pooling_task="embed")]

    def classify(self, prompts: Prompt | Sequence[Prompt], *,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True
                 ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (`outputs.probs`) from a *ForSequenceClassification
        model's head: a softmax over its labels, a sigmoid for one label."""
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(
            prompts, PoolingParams(task="classify"),
            truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True
              ) -> list[ScoringRequestOutput]:
        """A cross-encoder's score (`outputs.score`) of each pair: data_1[i] with data_2[i], or
        one data_1 with every data_2 (a query against documents), as vLLM pairs them."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValueError(f"data_1 has {len(first)} texts for the {len(second)} of data_2: "
                             f"give one, or as many")
        params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
        return [ScoringRequestOutput.from_base(o) for o in self._pool(
            first, [params] * len(first), use_tqdm, second)]

    def reward(self, prompts: Prompt | Sequence[Prompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True
               ) -> list[PoolingRequestOutput]:
        """A process reward model's values (`outputs.data`, [positions, values]): at every
        token, or at each step tag (`step_tag_id`), a decoder's score-head probabilities or its
        LM head's softmax over `returned_token_ids` (from the params or --pooler-config)."""
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, pooling_task="reward")

    def encode(self, prompts: Prompt | Sequence[Prompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """Each prompt pooled as its params' task asks (`pooling_task` sets it for all; by
        default the engine's: embed, classify, score or reward), as a numpy array
        (`outputs.data`): a vector, or one per position (token_embed, reward)."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        params = pooling_params if pooling_params is not None else PoolingParams()
        if isinstance(params, PoolingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"pooling_params has {len(params)} entries for {len(prompts)} "
                             f"prompts")
        if truncate_prompt_tokens is not None:
            params = [replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        if pooling_task is not None:
            params = [replace(p, task=pooling_task) for p in params]
        return self._pool(prompts, list(params), use_tqdm)

    def _pool(self, prompts: list[Prompt], params: list[PoolingParams], use_tqdm: bool,
              pairs: list[str] | None = None) -> list[PoolingRequestOutput]:
        """Queue a pooling request per prompt (each with its pair's second text, for scores)
        and collect their outputs in order; none is left queued where one is refused."""
        engine = self.engine
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                ids.append(engine.next_request_id())
                engine.add_pooling_request(ids[-1], prompt, p,
                                           pair=None if pairs is None else pairs[i])
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        return self._collect(ids, use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block. Refused (returns False) while requests run."""
        return self.engine.client.reset_prefix_cache()

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], priority: list[int],
             use_tqdm: bool, adapters: list[LoRARequest | None]) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, p, prio, lora in zip(prompts, params, priority, adapters):
                rid = engine.next_request_id()
                engine.add_request(rid, prompt, p, prio, lora_request=lora)
                ids.append(rid)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        return self._collect(ids, use_tqdm)

    def _collect(self, ids: list[str], use_tqdm: bool) -> list:
        """Step until every one of these requests has finished; their outputs in that order
        (every one aborted where stepping fails)."""
        engine = self.engine
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar:
                            bar.update(1)
        except BaseException:
            for rid in wanted - set(done):
                engine.abort_request(rid)
            raise
        finally:
            if bar:
                bar.close()
        return [done[rid] for rid in ids]
