"""EngineCore.step() = schedule → grammar bitmask → execute → update; a step that raises is
attributed to a request, which is aborted, and the engine goes on (faults.py).

The core speaks the protocol (protocol.py) to whoever hosts it: requests come in as
`EngineCoreRequest`s and become the core's own `Request`s here; outputs and stats go out as
protocol structs. `create_engine_core` is how a host builds one (the in-process client and the
core process loop, octavo/engine/client.py and core_process.py, are its only callers)."""
from __future__ import annotations

import logging
import time
from collections import deque

from octavo.arch_config import ArchConfig
from octavo.config import EngineConfig
from octavo.core.contract import SchedulerOutput
from octavo.core.faults import StepFaults
from octavo.core.kv_budget import plan_kv
from octavo.core.kv_manager import KVCacheManager, cdiv
from octavo.core.ngram import NgramProposer
from octavo.core.protocol import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from octavo.core.request import Request
from octavo.core.scheduler import Scheduler
from octavo.core.state_checkpoints import StateCheckpoints
from octavo.core.structured import BackendFactory, StructuredOutputManager
from octavo.executor.base import Executor, PendingOutput
from octavo.model_source import ModelSource
from octavo.startup_gc import collector_paused

logger = logging.getLogger(__name__)

# How long an idle step waits for a grammar compile (all unfinished requests wait on one) before
# it returns, so that the caller's loop neither spins nor stops reading new requests for long.
GRAMMAR_WAIT_S = 0.01


class LockstepBroken(RuntimeError):
    """A replica in lockstep failed a step: the replicas' exchanges are out of step."""


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, max_model_len: int,
                 sliding_window: int | None = None,
                 grammar_backend: BackendFactory | None = None,
                 vocab_size: int | None = None, linear_attention: bool = False) -> None:
        """sliding_window: the model's window when every layer slides (blocks behind it are
        freed as requests advance), else None. linear_attention: the model has such layers
        (a prefix hit needs their saved states). grammar_backend: builds the structured-output
        backend on the first constrained request (None: such requests are refused).
        vocab_size: the model's, the width of token masks (None: allowed_token_ids and
        bad_words are refused)."""
        self.executor = executor
        # Batches started and not yet taken back, oldest first: (its schedule, its pending output).
        self.batches: deque[tuple[SchedulerOutput, PendingOutput]] = deque()
        self.batches_started = 0
        self.executions_failed = 0  # steps whose execution (not scheduling or update) raised
        block_size = config.core_block_size

        def tokens_needed(max_len: int) -> int:
            # A request must fit alone: all of it, or with every layer sliding, its window and
            # one step's chunk (older blocks are released as it advances).
            if sliding_window is None:
                return max_len
            chunk = config.scheduler.max_num_batched_tokens
            return min(max_len, sliding_window + chunk + 2 * block_size)

        on_gpu = config.device.device == "cuda"
        plan = plan_kv(config.cache.kv_cache_memory, config.kv_memory_fraction,
                       executor.kv_bytes_per_block(block_size), block_size, max_model_len,
                       tokens_needed, executor.available_memory(), fill=on_gpu)
        max_model_len = self.max_model_len = plan.max_model_len
        started = time.perf_counter()
        num_blocks = executor.init_kv_cache(plan.kv_cache_memory, block_size)
        logger.info("start-up: KV cache allocated in %.2f s", time.perf_counter() - started)
        need = tokens_needed(max_model_len)
        if num_blocks * block_size < need:
            raise ValueError(
                f"kv_cache_memory ({plan.kv_cache_memory} bytes) holds {num_blocks} blocks "
                f"= {num_blocks * block_size} tokens, fewer than the {need} one request may need "
                f"(max_model_len {max_model_len}); raise kv_cache_memory or lower max_model_len")
        if plan.available is not None:
            logger.info("memory plan: KV cache %.2f GiB of the %.2f GiB %s (%s)",
                        plan.kv_cache_memory / 2**30, plan.available / 2**30,
                        "the GPU's plan leaves it" if on_gpu else "available after the weights",
                        "as given" if config.cache.kv_cache_memory is not None else
                        "automatic: all of it" if on_gpu else
                        f"automatic: one full-length request, at least 1 GiB, at most "
                        f"{config.kv_memory_fraction:.0%} of what is available")
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens; max concurrency at %d tokens per request: "
                    "%.2fx", num_blocks, block_size, max_model_len,
                    num_blocks / cdiv(max_model_len, block_size))
        checkpoints = None
        if linear_attention and config.cache.enable_prefix_caching:
            checkpoints = StateCheckpoints(config.state_checkpoint_slots,
                                           config.state_checkpoint_interval)
            logger.info("prefix caching over linear-attention layers: their states are saved "
                        "every %d tokens, %d saved at most", checkpoints.interval,
                        checkpoints.num_slots)
        kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching,
                            sliding_window, checkpoints)
        self.structured = StructuredOutputManager(
            grammar_backend, compile_timeout_s=config.scheduler.grammar_compile_timeout,
            vocab_size=vocab_size)
        spec = config.speculative
        proposer = NgramProposer(spec) if spec is not None and spec.method == "ngram" else None
        lookahead = spec.num_speculative_tokens if spec is not None and proposer is None else 0
        max_loras = config.lora.max_loras if config.lora.enable_lora else 0
        self.scheduler = Scheduler(config.scheduler, kv, max_model_len, self.structured, proposer,
                                   lookahead, max_loras)
        self.faults = StepFaults(self.scheduler)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a front end's request as the core's own Request (ValueError: its id is in
        use). Its token lists are taken over, not copied: the sender never changes them."""
        self.scheduler.add_request(Request(
            request.req_id, request.prompt_token_ids, request.sampling_params,
            request.eos_token_ids, request.max_tokens, priority=request.priority,
            arrival_time=request.arrival_time, cache_salt=request.cache_salt,
            bad_words_token_ids=request.bad_words_token_ids,
            lora_request=request.lora_request, pooling_params=request.pooling_params,
            pooled_positions=request.pooled_positions))

    def abort_requests(self, req_ids: list[str]) -> list[str]:
        return self.scheduler.abort_requests(req_ids)

    def has_unfinished_requests(self) -> bool:
        """Also while a batch is in flight: its output must be taken back, even of requests
        aborted since."""
        return self.scheduler.has_unfinished_requests() or bool(self.batches)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule a batch and start it, then take the outputs of the oldest batch in flight.
        With one batch at a time (one pipeline stage) that is schedule, execute, update; with
        several (`max_concurrent_batches`), the next batch is scheduled from the requests not in
        flight while the earlier ones run, and a step returns without waiting while there is
        room for another batch and the oldest has not finished."""
        failed = self.scheduler.finish_failed_grammars() if self.structured.has_compiling() \
            else []
        started = False
        if len(self.batches) < self.executor.max_concurrent_batches:
            self.faults.before_schedule()
            sched = self.scheduler.schedule()
            if (sched.total_num_scheduled_tokens or sched.finished_req_ids
                    or sched.preempted_req_ids):
                executing = False
                try:
                    # The matchers are up to date with every token so far (a constrained
                    # request is in one batch at a time): fill its bitmask now (microseconds)
                    # so that the worker only applies it.
                    sched.grammar = self.structured.bitmask_for(sched, self.scheduler.requests)
                    executing = True
                    self.batches_started += 1
                    self.batches.append((sched, self.executor.execute_async(sched)))
                    started = True
                except Exception as exc:  # noqa: BLE001 - attributed to a request, or EngineFault
                    self.executions_failed += executing
                    self.scheduler.batch_landed(sched)
                    return failed + self.faults.failed(sched, exc)
        if not self.batches:
            if not failed and self.structured.has_compiling():
                self.structured.wait_for_compiles(GRAMMAR_WAIT_S)
            return failed  # nothing to run and nothing for the workers to drop
        sched, pending = self.batches[0]
        if started and len(self.batches) < self.executor.max_concurrent_batches \
                and not pending.done():
            return failed  # room for another batch while this one runs
        self.batches.popleft()
        executed = False
        try:
            output = pending.result()
            executed = True
            outputs = self.scheduler.update_from_output(sched, output)
        except Exception as exc:  # noqa: BLE001 - attributed to a request, or EngineFault
            self.executions_failed += not executed
            self.scheduler.batch_landed(sched)
            return failed + self.faults.failed(sched, exc)
        self.faults.succeeded(sched)
        return failed + outputs

    def step_in_lockstep(self) -> list[EngineCoreOutput]:
        """A step of a replica whose experts span the others' (distributed/lockstep.py): one
        batch per call, and an empty one where this replica has none to run, so that every
        replica's MoE layers take part in each other's exchanges. One batch in flight at a
        time (no pipeline stages).

        A step whose execution raised may have left the others' ranks waiting for rows from
        this one's in a layer it never reached: there is no telling which, so it ends this
        replica (LockstepBroken), and its host's death stops the others, instead of a request
        fault aborting one request while every replica waits."""
        started, failed = self.batches_started, self.executions_failed
        outputs = self.step() if self.has_unfinished_requests() else []
        if self.executions_failed != failed:
            raise LockstepBroken("a step failed in a replica whose experts span the others "
                                 "(its error is logged above): their exchanges cannot be "
                                 "matched up again, so the replicas stop")
        if self.batches_started == started:
            # the rows its experts computed for the others are its own ranks' load
            self.scheduler.count_expert_tokens(
                self.executor.execute(SchedulerOutput.empty()).expert_tokens)
        return outputs

    def do_idle_work(self) -> bool:
        """See Executor.do_idle_work: call only with no unfinished request."""
        return self.executor.do_idle_work()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; refused (False) while any request is unfinished."""
        if self.scheduler.has_unfinished_requests():
            return False
        return self.scheduler.kv.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def describe(self) -> str:
        """What the executor loaded (for the host's ready message and logs)."""
        return self.executor.describe()

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()


def import_model_side() -> None:
    """Import torch and the executor now: a core process does it while its front end is still
    loading the tokenizer (torch's import is most of a start)."""
    import octavo.executor.uniproc  # noqa: F401


def create_engine_core(config: EngineConfig, source: ModelSource, arch: ArchConfig,
                       max_model_len: int, eos_token_ids: list[int],
                       grammar_backend: BackendFactory | None = None) -> EngineCore:
    """The core's entry point for its hosts: build the executor (loading the model) and the
    core around it."""
    with collector_paused():  # torch's import and the load are a start (see startup_gc)
        executor = Executor.create(config, source, arch, max_model_len, eos_token_ids)
    window = arch.sliding_window if arch.all_layers_sliding else None
    return EngineCore(config, executor, max_model_len, window, grammar_backend,
                      arch.vocab_size, bool(arch.linear_layers))
