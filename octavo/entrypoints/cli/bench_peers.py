"""The engines octavo is measured against, each running a bench workload its own best way.

- `transformers`: static batches through `generate` (left-padded, in input order).
- `llama.cpp` (`llama-cpp-python`, same GGUF, same threads): continuous batching over its C API,
  the way llama.cpp's own server does it: `--llama-cpp-seqs` sequences share one unified KV
  cache; every `llama_decode` call carries one token for each decoding sequence plus prompt
  tokens of new sequences up to the batch size; a finished sequence's cells are freed and the
  next request takes its place.
Both decode greedily and generate exactly the requested number of tokens (EOS ignored).

llama.cpp's calls run on one thread of its own where it may use AMX (`LlamaCaller`).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from octavo.entrypoints.cli.bench_data import Workload


@dataclass
class Run:
    seconds: float
    output_tokens: int
    ttft: list[float] = field(default_factory=list)  # per request, where the backend reports it
    tokens: list[list[int]] = field(default_factory=list)  # per request, where kept


def load_transformers(llm):
    import torch
    from transformers import AutoModelForCausalLM

    from octavo.worker.worker import resolve_dtype

    source = llm.engine.source
    device = torch.device(llm.engine.config.device.device)  # octavo's: the same GPU, or CPU
    dtype, _ = resolve_dtype(llm.engine.config.model.dtype, device)
    if source.is_gguf:
        model = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.path.name,
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    return model.to(device).eval()


def time_transformers(model, work: Workload, batch_size: int) -> Run:
    """A batch runs to its longest output; only the tokens each request asked for count."""
    import torch

    produced = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), batch_size):
            chunk = work[i:i + batch_size]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(chunk):
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            longest = max(n for _, n in chunk)
            ids, mask = ids.to(model.device), mask.to(model.device)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                           min_new_tokens=longest, pad_token_id=0)
            produced += sum(n for _, n in chunk)
    return Run(time.perf_counter() - start, produced)


class LlamaCaller:
    """Makes every llama.cpp call of a bench: on one thread of its own while llama.cpp may use
    AMX (its extra buffer types), else on the calling thread.

    llama.cpp's AMX kernels configure the tile registers once per thread and count on them
    staying configured. oneDNN (torch's matmuls: octavo's and transformers' prompts) releases
    them after each of its AMX kernels, so on a shared thread llama.cpp's next matmul dies of
    SIGILL. Without its extra buffers (`--llama-cpp-no-repack`) llama.cpp runs no AMX code, and a
    thread of its own would hurt: a GCC build's OpenMP is torch's libgomp (the same soname), and
    two threads leading OpenMP teams on 2 cores made both engines about 3x slower (batch-1
    decode: octavo 198 -> 64 tok/s, llama.cpp 92 -> 32)."""

    def __init__(self, own_thread: bool) -> None:
        self._thread = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama.cpp")
                        if own_thread else None)

    @classmethod
    def for_llama(cls, no_repack: bool) -> LlamaCaller:
        """A thread of its own where llama.cpp's extra buffers may run AMX code: they are on and
        the CPU has AMX tiles. On an AMD EPYC (AVX-512, no AMX) the default GCC build on a
        thread of its own made octavo's batch-1 decode 152 -> 80 tok/s and llama.cpp's
        ~110 -> 66 (the same libgomp, two teams on 2 cores)."""
        return cls(own_thread=not no_repack and cpu_has_amx())

    def __call__(self, fn, *args, **kwargs):
        if self._thread is None:
            return fn(*args, **kwargs)
        return self._thread.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown()


def cpu_has_amx() -> bool:
    from octavo.platform import cpu_platform

    return cpu_platform().amx


NO_REPACK_HELP = ("llama.cpp without its extra buffer types (its --no-repack: "
                  "use_extra_bufts=False, no AMX or repacked weights); a llama-cpp-python built "
                  "by GCC 12 needs it on an AMX CPU, whose AMX code that compiler breaks")


@contextlib.contextmanager
def llama_model_params(no_repack: bool):
    """While open, the model parameters llama-cpp-python's `Llama` loads with have
    use_extra_bufts off where `no_repack` asks for it (`Llama` takes no such argument)."""
    import llama_cpp.llama as high_level

    module = high_level.llama_cpp
    original = module.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = False
        return p

    if no_repack:
        module.llama_model_default_params = params
    try:
        yield
    finally:
        module.llama_model_default_params = original


class LlamaCppBatcher:
    """One llama.cpp context with `num_seqs` sequences in a unified KV cache."""

    def __init__(self, gguf_path: str, threads: int | None, num_seqs: int, max_seq_len: int,
                 batch_size: int = 512, no_repack: bool = False) -> None:
        self.call = LlamaCaller.for_llama(no_repack)
        self.call(self._open, gguf_path, threads, num_seqs, max_seq_len, batch_size, no_repack)

    def _open(self, gguf_path: str, threads: int | None, num_seqs: int, max_seq_len: int,
              batch_size: int, no_repack: bool) -> None:
        try:
            import llama_cpp as lc
        except ImportError:
            raise ValueError("the llama.cpp backend needs `pip install llama-cpp-python`") from None
        self.lc = lc
        lc.llama_backend_init()
        _silence(lc)
        model_params = lc.llama_model_default_params()
        model_params.use_extra_bufts = not no_repack
        self.model = lc.llama_model_load_from_file(str(gguf_path).encode(), model_params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {gguf_path}")
        threads = threads or os.cpu_count() or 1
        params = lc.llama_context_default_params()
        params.n_ctx = num_seqs * max_seq_len
        params.n_batch = params.n_ubatch = batch_size
        params.n_seq_max = num_seqs
        params.kv_unified = True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise ValueError("llama.cpp could not create a context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.num_seqs, self.batch_size = num_seqs, batch_size
        self.batch = lc.llama_batch_init(batch_size, 0, 1)

    def close(self) -> None:
        self.call(self._close)
        self.call.shutdown()

    def _close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def run(self, work: Workload) -> Run:
        return self.call(self._run, work)

    def _run(self, work: Workload) -> Run:
        lc = self.lc
        lc.llama_memory_clear(self.memory, True)
        queue = deque(range(len(work)))
        free_seqs = list(range(self.num_seqs - 1, -1, -1))
        # per active sequence: [request index, prompt tokens fed, next token or None, produced]
        active: dict[int, list] = {}
        ttft: dict[int, float] = {}
        tokens: list[list[int]] = [[] for _ in work]
        produced = 0
        start = time.perf_counter()
        while queue or active:
            while queue and free_seqs:
                active[free_seqs.pop()] = [queue.popleft(), 0, None, 0]
            n, wants_logits = 0, []
            for seq, st in active.items():  # decodes first: one token each
                if st[2] is not None:
                    prompt = work[st[0]][0]
                    self._put(n, st[2], len(prompt) + st[3] - 1, seq, True)
                    wants_logits.append((n, seq))
                    n += 1
            for seq, st in active.items():  # then prompt chunks in the room left
                prompt = work[st[0]][0]
                if st[2] is None and n < self.batch_size:
                    take = min(len(prompt) - st[1], self.batch_size - n)
                    for i in range(take):
                        last = st[1] + i == len(prompt) - 1
                        self._put(n, prompt[st[1] + i], st[1] + i, seq, last)
                        if last:
                            wants_logits.append((n, seq))
                        n += 1
                    st[1] += take
            self.batch.n_tokens = n
            if lc.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            for index, seq in wants_logits:
                st = active[seq]
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, index),
                                               shape=(self.vocab,))
                st[2] = int(logits.argmax())
                tokens[st[0]].append(st[2])
                st[3] += 1
                ttft.setdefault(st[0], time.perf_counter() - start)
                if st[3] >= work[st[0]][1]:
                    produced += st[3]
                    lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
                    del active[seq]
                    free_seqs.append(seq)
        return Run(time.perf_counter() - start, produced, list(ttft.values()), tokens)

    def _put(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits


_LOG_CALLBACK = None


def _silence(lc) -> None:
    """llama.cpp logs every tensor at load; keep the bench output readable."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
