"""The synchronous front end: resolve the model, validate and add requests, step, collect outputs."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from octavo.arch_config import ArchConfig, read_arch_config
from octavo.config import EngineConfig
from octavo.engine.client import InprocClient
from octavo.engine.replica_client import ReplicaClient
from octavo.engine.grammar import XgrammarBackend
from octavo.engine.outputs import OutputProcessor
from octavo.engine.pooling import Embeddings, resolve_task, with_pooler_config
from octavo.engine.processor import Processor, RequestLimits
from octavo.engine.tokenizer import load_tokenizer
from octavo.lora.registry import AdapterRegistry
from octavo.model_source import ModelSource, resolve_model
from octavo.params import LoRARequest, RequestOutput, SamplingParams
from octavo.pooling_params import PoolerConfig, PoolingParams

logger = logging.getLogger(__name__)


@dataclass
class ModelSetup:
    """What both front ends derive from the config before the core starts."""

    source: ModelSource
    arch: ArchConfig
    tokenizer: Any
    max_model_len: int
    eos_token_ids: frozenset[int]
    processor: Processor

    @classmethod
    def load(cls, config: EngineConfig, limits: RequestLimits | None = None) -> ModelSetup:
        start = time.perf_counter()
        source = resolve_model(config.model.model, config.model.revision)
        fetched = time.perf_counter()  # a catalog model's first use fetches it
        pooler = PoolerConfig.parse(config.model.pooler_config)
        arch = with_pooler_config(read_arch_config(source), pooler)
        resolved = time.perf_counter()
        tokenizer = load_tokenizer(source, config.model.tokenizer)
        spec = config.speculative
        if spec is not None and spec.method == "draft_model":
            check_draft_tokenizer(spec.model, arch, tokenizer)
        logger.info("start-up: model files %.1f s, config %.1f s, tokenizer %.1f s",
                    fetched - start, resolved - fetched, time.perf_counter() - resolved)
        max_model_len = config.model.max_model_len or arch.max_position_embeddings
        eos = set(arch.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        eos_ids = frozenset(eos)
        # Every model pools (a causal LM its last token by default); a pooling task only
        # refuses generation, which an encoder cannot do at all.
        task = resolve_task(config.model.task, arch)
        embeddings = Embeddings.of(arch, task, pooler, config.scheduler.max_num_batched_tokens)
        adapters = AdapterRegistry(arch, config.lora, config.model.model_impl)
        processor = Processor(tokenizer, max_model_len, arch.vocab_size, eos_ids, limits,
                              adapters, embeddings, generates=task == "generate")
        return cls(source, arch, tokenizer, max_model_len, eos_ids, processor)

    def adopt_max_model_len(self, max_model_len: int) -> None:
        """The context the core settled on (shorter than asked where the automatic KV cache
        could not hold a full-length request): requests are checked against it."""
        self.max_model_len = self.processor.max_model_len = max_model_len

    def core_args(self) -> tuple:
        return (self.source, self.arch, self.max_model_len, sorted(self.eos_token_ids))

    def grammar_backend(self) -> XgrammarBackend:
        """The structured-output backend for this tokenizer (built on first use, in the core's
        compile thread)."""
        return XgrammarBackend(self.tokenizer, self.arch.vocab_size, sorted(self.eos_token_ids))


def check_draft_tokenizer(name: str, arch: ArchConfig, tokenizer: Any) -> None:
    """A draft model must speak the target's tokens: the same vocabulary size and the same text
    for every token id; else ValueError naming speculative_config.model."""
    try:
        source = resolve_model(name)
        draft_arch = read_arch_config(source)
        draft_tok = load_tokenizer(source)
    except ValueError as exc:
        raise ValueError(f"speculative_config.model: {exc}") from None
    if draft_arch.vocab_size != arch.vocab_size:
        raise ValueError(f"speculative_config.model {name!r} has a vocabulary of "
                         f"{draft_arch.vocab_size} tokens, the target {arch.vocab_size}: a draft "
                         f"model must share the target's tokenizer")
    mine, theirs = tokenizer.get_vocab(), draft_tok.get_vocab()
    if mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(f"speculative_config.model {name!r} has a different tokenizer from the "
                         f"target's ({len(theirs)} vs {len(mine)} tokens; first differences: "
                         f"{diff}): a draft model must share the target's tokenizer")


class LLMEngine:
    def __init__(self, config: EngineConfig, limits: RequestLimits | None = None) -> None:
        self.config = config
        self.setup = ModelSetup.load(config, limits)
        self.source, self.arch = self.setup.source, self.setup.arch
        self.tokenizer = self.setup.tokenizer
        self.processor = self.setup.processor
        self.outputs = OutputProcessor(self.tokenizer)
        # One core in this process, or one process per data-parallel replica
        self.client = ReplicaClient(config, self.setup.core_args()) \
            if config.parallel.data_parallel_size > 1 else \
            InprocClient(config, *self.setup.core_args(),
                         grammar_backend=self.setup.grammar_backend)
        self.setup.adopt_max_model_len(self.client.max_model_len)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None,
                    max_logprobs: int | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate, tokenize and queue one request (n > 1 fans out into n core requests)."""
        if request_id in self.outputs.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prepared = self.processor.build(request_id, prompt, params, priority, cache_salt,
                                        max_logprobs, lora_request=lora_request)
        self.outputs.add_request(prepared)
        for req in prepared.core_requests:
            self.client.add_request(req)

    def add_pooling_request(self, request_id: str, prompt: str | Sequence[int],
                            params: PoolingParams, priority: int = 0,
                            pair: str | None = None) -> None:
        """Validate, tokenize and queue one pooling request (an embedding, a classification,
        or with `pair` a score)."""
        if request_id in self.outputs.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prepared = self.processor.build_pooling(request_id, prompt, params, priority, pair)
        self.outputs.add_request(prepared)
        self.client.add_request(prepared.core_requests[0])

    def abort_request(self, request_id: str) -> RequestOutput | None:
        children = self.outputs.child_ids(request_id)
        self.client.abort_requests(children)
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.outputs.has_unfinished()

    def step(self, delta: bool = False) -> list[RequestOutput]:
        """One engine step; returns the outputs of the requests that changed (with `delta`, each
        completion's text is only what this step added)."""
        changed, to_abort = self.outputs.process(self.client.step())
        if to_abort:
            self.client.abort_requests(to_abort)
        return [p.output(delta) for p in changed]

    def shutdown(self) -> None:
        self.client.shutdown()
