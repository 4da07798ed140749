"""The synchronous front end: resolve the model, validate and add requests, step, collect outputs."""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from octavo.arch_config import read_arch_config
from octavo.config import EngineConfig
from octavo.engine.client import InprocClient
from octavo.engine.outputs import OutputProcessor
from octavo.engine.processor import Processor
from octavo.engine.tokenizer import load_tokenizer
from octavo.model_source import resolve_model
from octavo.params import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.source = resolve_model(config.model.model, config.model.revision)
        self.arch = read_arch_config(self.source)
        self.tokenizer = load_tokenizer(self.source, config.model.tokenizer)
        self.max_model_len = config.model.max_model_len or self.arch.max_position_embeddings
        eos = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.processor = Processor(self.tokenizer, self.max_model_len, self.arch.vocab_size,
                                   self.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer)
        self.client = InprocClient(config, self.source, self.arch, self.max_model_len,
                                   sorted(self.eos_token_ids))
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    priority: int = 0) -> None:
        """Validate, tokenize and queue one request (n > 1 fans out into n core requests)."""
        if request_id in self.outputs.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, prompt_ids = self.processor.tokenize(prompt)
        max_tokens = self.processor.validate(prompt_ids, params)
        children = [request_id] if params.n == 1 else [
            f"{request_id}#{i}" for i in range(params.n)]
        core_requests = [
            self.processor.make_request(cid, prompt_ids, self.processor.child_params(params, i),
                                        max_tokens, priority)
            for i, cid in enumerate(children)]
        self.outputs.add_request(request_id, text, prompt_ids, params, children)
        for req in core_requests:
            self.client.add_request(req)

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
