"""Prometheus metrics (prefix `octavo:`) and the periodic stats line.

Request metrics are observed by the front end; scheduler gauges come from the core's stats,
which travel with every step's outputs.
"""
from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest)

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        # process_cpu_seconds_total and the like, of the front-end process (as vLLM exposes)
        ProcessCollector(registry=r)
        self.prompt_tokens = Counter("octavo:prompt_tokens", "Prompt tokens computed",
                                     registry=r)
        self.generation_tokens = Counter("octavo:generation_tokens", "Generated tokens",
                                         registry=r)
        self.request_success = Counter("octavo:request_success", "Finished requests",
                                       ["finished_reason"], registry=r)
        self.rejections = Counter("octavo:requests_rejected",
                                  "Requests refused at admission (429; 400 for one that "
                                  "could never fit)", registry=r)
        self.aborts = Counter("octavo:requests_aborted",
                              "Requests aborted before they finished (client gone)", registry=r)
        # received = finished + aborted + rejected, once nothing is in flight
        self.received = Counter("octavo:requests_received",
                                "Requests handed to the engine for admission", registry=r)
        self.finished_requests = Counter("octavo:requests_finished",
                                         "Requests that finished (all their samples)",
                                         registry=r)
        self.in_flight = Gauge("octavo:frontend_requests_in_flight",
                               "Requests admitted and not yet finished or aborted", registry=r)
        self.queued_sequences = Gauge("octavo:frontend_queued_sequences",
                                      "Sequences admitted that have no token yet", registry=r)
        self.queued_tokens = Gauge("octavo:frontend_queued_prompt_tokens",
                                   "Prompt tokens of those sequences", registry=r)
        self.loop_tasks = Gauge("octavo:frontend_asyncio_tasks",
                                "Tasks alive on the front end's event loop", registry=r)
        self.preemptions = Counter("octavo:num_preemptions", "Preempted requests", ["engine"],
                                   registry=r)
        self.lora_requests = Counter("octavo:lora_requests", "Finished requests per LoRA adapter",
                                     ["lora_name"], registry=r)
        self.lora_prompt_tokens = Counter("octavo:lora_prompt_tokens",
                                          "Prompt tokens computed per LoRA adapter",
                                          ["lora_name"], registry=r)
        self.lora_generation_tokens = Counter("octavo:lora_generation_tokens",
                                              "Generated tokens per LoRA adapter",
                                              ["lora_name"], registry=r)
        self.prefix_queries = Counter("octavo:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", ["engine"],
                                      registry=r)
        self.prefix_hits = Counter("octavo:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache", ["engine"],
                                   registry=r)
        self.spec_drafts = Counter("octavo:spec_decode_num_draft_tokens",
                                   "Speculative draft tokens proposed and verified", registry=r)
        self.spec_accepted = Counter("octavo:spec_decode_num_accepted_tokens",
                                     "Speculative draft tokens accepted", registry=r)
        self.spec_verifications = Counter(
            "octavo:spec_decode_num_drafts",
            "Verifications of drafts (mean acceptance length = 1 + accepted / this)", registry=r)
        self.expert_tokens = Counter("octavo:expert_parallel_routed_tokens",
                                     "Token rows routed to each expert-parallel rank's experts "
                                     "(summed over MoE layers): the ranks' load balance",
                                     ["rank"], registry=r)
        self.ttft = Histogram("octavo:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("octavo:time_per_output_token_seconds",
                              "Time per output token after the first", buckets=_TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("octavo:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("octavo:request_queue_time_seconds",
                                    "Time from arrival to first scheduling",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        # Per engine core (data parallelism: one per replica; "0" without it)
        self.running = Gauge("octavo:num_requests_running", "Requests running", ["engine"],
                             registry=r)
        self.waiting = Gauge("octavo:num_requests_waiting", "Requests waiting", ["engine"],
                             registry=r)
        self.kv_usage = Gauge("octavo:kv_cache_usage_perc", "Fraction of KV blocks in use",
                              ["engine"], registry=r)
        self.engine_up = Gauge("octavo:engine_core_up", "1 while the engine core serves",
                               ["engine"], registry=r)
        self._per_engine = (self.running, self.waiting, self.kv_usage, self.preemptions,
                            self.prefix_queries, self.prefix_hits)
        self._seen: dict[int, tuple] = {}  # each core's cumulative counters, last observed
        self._prefix_total = [0, 0]  # prefix-cache queries and hits over every core
        self._prefix_at_last_log = (0, 0)
        self._tokens_at_last_log = (0.0, 0.0)
        self._last_log = time.monotonic()

    def watch_replicas(self, count: int, alive) -> None:
        """engine_core_up read from alive(i) for each of `count` cores at each scrape; every
        core's series present from the start, at zero."""
        for i in range(count):
            self.engine_up.labels(engine=str(i)).set_function(lambda i=i: float(alive(i)))
            for metric in self._per_engine:
                metric.labels(engine=str(i))

    def observe_stats(self, stats, engine: int = 0) -> None:
        """Core `engine`'s stats: its gauges set, and the counters advanced by what its
        cumulative counts grew since its last stats (the core's counters are cumulative;
        Prometheus counters take the increments)."""
        label = str(engine)
        self.running.labels(engine=label).set(stats.num_running)
        self.waiting.labels(engine=label).set(stats.num_waiting)
        self.kv_usage.labels(engine=label).set(stats.kv_cache_usage)
        now = (stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits,
               stats.spec_draft_tokens, stats.spec_accepted_tokens, stats.spec_num_drafts)
        seen = self._seen.get(engine, (0,) * len(now) + ((),))
        grew = [max(0, a - b) for a, b in zip(now, seen)]
        counters = (self.preemptions.labels(engine=label),
                    self.prefix_queries.labels(engine=label),
                    self.prefix_hits.labels(engine=label), self.spec_drafts,
                    self.spec_accepted, self.spec_verifications)
        for counter, step in zip(counters, grew):
            if step:
                counter.inc(step)
        self._prefix_total[0] += grew[1]
        self._prefix_total[1] += grew[2]
        experts_seen = seen[-1]
        for rank, routed in enumerate(stats.expert_tokens):
            before = experts_seen[rank] if rank < len(experts_seen) else 0
            if routed > before:
                self.expert_tokens.labels(rank=str(rank)).inc(routed - before)
        self._seen[engine] = (*now, tuple(stats.expert_tokens))

    def first_token(self, ttft: float, queue_time: float | None) -> None:
        self.ttft.observe(ttft)
        if queue_time is not None:
            self.queue_time.observe(max(0.0, queue_time))

    def tokens(self, prompt: int, generated: int, lora_name: str | None = None) -> None:
        """Counted as they are computed: prompts at their first output, tokens as they stream
        (also per adapter, for a request with one)."""
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        if lora_name is not None:
            self.lora_prompt_tokens.labels(lora_name=lora_name).inc(prompt)
            self.lora_generation_tokens.labels(lora_name=lora_name).inc(generated)

    def finished(self, reasons: list[str | None], output_tokens: int, e2e: float,
                 decode_time: float | None, lora_name: str | None = None) -> None:
        self.finished_requests.inc()
        if lora_name is not None:
            self.lora_requests.labels(lora_name=lora_name).inc()
        for reason in reasons:
            self.request_success.labels(finished_reason=reason or "abort").inc()
        self.e2e.observe(e2e)
        if decode_time is not None and output_tokens > len(reasons):
            self.tpot.observe(decode_time / (output_tokens - len(reasons)))

    def watch_frontend(self, in_flight, queued_sequences, queued_tokens, loop_tasks) -> None:
        """Gauges read from the front end's own counters (callables) at each scrape."""
        self.in_flight.set_function(in_flight)
        self.queued_sequences.set_function(queued_sequences)
        self.queued_tokens.set_function(queued_tokens)
        self.loop_tasks.set_function(loop_tasks)

    def rejected(self) -> None:
        self.rejections.inc()

    def aborted(self) -> None:
        self.aborts.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def stats_line(self) -> str | None:
        """Throughput since the last call and the current gauges; None when idle throughout."""
        now = time.monotonic()
        prompt, gen = self.prompt_tokens._value.get(), self.generation_tokens._value.get()
        last_prompt, last_gen = self._tokens_at_last_log
        elapsed = max(now - self._last_log, 1e-9)
        self._tokens_at_last_log, self._last_log = (prompt, gen), now
        running, waiting = _total(self.running), _total(self.waiting)
        if prompt == last_prompt and gen == last_gen and not running and not waiting:
            return None
        queries, hits = self._prefix_total
        dq, dh = queries - self._prefix_at_last_log[0], hits - self._prefix_at_last_log[1]
        self._prefix_at_last_log = (queries, hits)
        hit_rate = f"{100 * dh / dq:.1f}%" if dq else "n/a"
        return (f"prompt throughput {(prompt - last_prompt) / elapsed:.1f} tokens/s, "
                f"generation throughput {(gen - last_gen) / elapsed:.1f} tokens/s, "
                f"running {running:.0f}, waiting {waiting:.0f}, "
                f"KV cache usage {100 * _total(self.kv_usage) / max(1, len(self._seen)):.1f}%, "
                f"prefix cache hit rate {hit_rate}")


def _total(gauge: Gauge) -> float:
    """A labelled gauge's samples summed over its label sets."""
    return sum(sample.value for metric in gauge.collect() for sample in metric.samples)
