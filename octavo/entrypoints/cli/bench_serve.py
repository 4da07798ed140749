"""`octavo bench serve`: streaming clients against a running OpenAI-compatible server.

Requests arrive all at once or as a Poisson process (`--request-rate`), at most
`--max-concurrency` in flight; each streams a completion of `--output-len` tokens for a prompt of
`--input-len` random token ids, over HTTP server-sent events or (`--grpc HOST:PORT`) octavo's gRPC
Generate. Reports TTFT, TPOT, ITL and end-to-end latency percentiles and output throughput,
goodput: completed requests per second that met `--slo-ttft` and `--slo-tpot` (milliseconds;
either may be omitted), and where the server's /metrics tells its front end's CPU time, that
time per output token: what streaming costs the server, per protocol.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Timing:
    """One streamed request's timings, from its start to each chunk with text and the end."""

    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    start: float = field(default_factory=time.perf_counter)
    last: float = 0.0
    chunks: int = 0

    def chunk(self) -> None:
        """A chunk with text arrived now."""
        now = time.perf_counter()
        if self.chunks == 0:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.chunks += 1

    def done(self) -> Timing:
        self.e2e = time.perf_counter() - self.start
        self.output_tokens = self.output_tokens or self.chunks  # no usage: a token per chunk
        self.ok = True
        return self


def register(kinds: argparse._SubParsersAction) -> None:
    s = kinds.add_parser("serve", help="streaming clients against a running server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", default=None, help="model name to send (default: the first served)")
    s.add_argument("--api-key", default=None)
    s.add_argument("--num-prompts", type=int, default=32)
    s.add_argument("--input-len", type=int, default=128)
    s.add_argument("--output-len", type=int, default=64)
    s.add_argument("--vocab-size", type=int, default=49152,
                   help="random prompt ids are drawn below this")
    s.add_argument("--tokenizer", default=None,
                   help="send text prompts: random ids decoded with this model's tokenizer (for "
                        "servers that take no token ids, like llama_cpp.server)")
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s of a Poisson arrival process (inf = all at once)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--slo-ttft", type=float, default=None, help="goodput: TTFT bound in ms")
    s.add_argument("--slo-tpot", type=float, default=None, help="goodput: TPOT bound in ms")
    s.add_argument("--grpc", default=None, metavar="HOST:PORT",
                   help="stream over octavo's gRPC API at this address (octavo serve "
                        "--grpc-port) instead of HTTP; --base-url still gives /metrics")
    s.add_argument("--json", default=None)
    s.set_defaults(run=run)


async def _one(client, model: str | None, prompt: list[int], output_len: int) -> Timing:
    t = Timing()
    # min_tokens as well as ignore_eos: servers without the latter still run to max_tokens.
    body = {"prompt": prompt, "max_tokens": output_len, "min_tokens": output_len, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                t.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return t
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    t.output_tokens = obj["usage"]["completion_tokens"]
                if obj["choices"] and obj["choices"][0]["text"]:
                    t.chunk()
    except Exception as exc:  # a failed request is counted, not fatal
        t.error = f"{type(exc).__name__}: {exc}"
        return t
    return t.done()


async def _one_grpc(stub, metadata: list, model: str | None, prompt: list[int] | str,
                    output_len: int) -> Timing:
    from octavo.entrypoints.grpc import octavo_pb2 as pb

    t = Timing()
    request = pb.GenerateRequest(model=model or "", sampling_params=pb.SamplingParams(
        max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=0))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    try:
        async for reply in stub.Generate(request, metadata=metadata):
            if reply.finished:
                t.output_tokens = reply.usage.completion_tokens
            if any(c.text for c in reply.choices):
                t.chunk()
    except Exception as exc:  # a failed request is counted, not fatal
        t.error = f"{type(exc).__name__}: {exc}"
        return t
    return t.done()


async def _frontend_cpu_s(client) -> float | None:
    """The server front end's CPU seconds so far (process_cpu_seconds_total), if it says."""
    try:
        text = (await client.get("/metrics")).text
    except Exception:
        return None
    for line in text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    return None


def _as_text(prompts: list[list[int]], model: str) -> list[str]:
    from octavo.engine.tokenizer import load_tokenizer
    from octavo.model_source import resolve_model

    tokenizer = load_tokenizer(resolve_model(model), None)
    return [tokenizer.decode(p, skip_special_tokens=True) for p in prompts]


async def _run(args: argparse.Namespace) -> dict:
    import httpx

    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(100, args.vocab_size - 100, args.input_len).tolist()
               for _ in range(args.num_prompts)]
    if args.tokenizer:
        prompts = _as_text(prompts, args.tokenizer)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
    arrivals = random.Random(args.seed)

    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=3600) as c, \
            contextlib.AsyncExitStack() as stack:
        one = functools.partial(_one, c)
        if args.grpc:
            import grpc

            from octavo.entrypoints.grpc import octavo_pb2_grpc as pb_grpc

            channel = await stack.enter_async_context(grpc.aio.insecure_channel(args.grpc))
            metadata = [("authorization", headers["Authorization"])] if headers else []
            one = functools.partial(_one_grpc, pb_grpc.OctavoStub(channel), metadata)

        async def gated(p):
            async with limit:
                return await one(args.model, p, args.output_len)

        cpu_before = await _frontend_cpu_s(c)
        tasks = []
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(gated(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(arrivals.expovariate(args.request_rate))
        timings = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        cpu_after = await _frontend_cpu_s(c)
    ok = [t for t in timings if t.ok]

    def pct(values: list[float]) -> dict:
        if not values:
            return {}
        a = np.array(values) * 1000
        return {"mean_ms": round(float(a.mean()), 2), "p50_ms": round(float(np.percentile(a, 50)), 2),
                "p90_ms": round(float(np.percentile(a, 90)), 2),
                "p99_ms": round(float(np.percentile(a, 99)), 2)}

    tpot_of = {id(t): (t.e2e - t.ttft) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1}
    tpot = list(tpot_of.values())
    good = [t for t in ok
            if (args.slo_ttft is None or t.ttft * 1000 <= args.slo_ttft)
            and (args.slo_tpot is None or tpot_of.get(id(t), 0.0) * 1000 <= args.slo_tpot)]
    out_tokens = sum(t.output_tokens for t in ok)
    cpu_per_token = None
    if cpu_before is not None and cpu_after is not None and out_tokens:
        cpu_per_token = round((cpu_after - cpu_before) * 1000 / out_tokens, 4)
    return {"num_prompts": args.num_prompts, "completed": len(ok),
            "protocol": "grpc" if args.grpc else "http",
            "frontend_cpu_ms_per_output_token": cpu_per_token,
            "failed": len(timings) - len(ok), "errors": sorted({t.error for t in timings
                                                                if t.error})[:5],
            "duration_s": round(duration, 3),
            "output_tokens_per_s": round(out_tokens / duration, 2),
            "requests_per_s": round(len(ok) / duration, 3),
            "goodput_requests_per_s": round(len(good) / duration, 3),
            "slo": {"ttft_ms": args.slo_ttft, "tpot_ms": args.slo_tpot},
            "ttft": pct([t.ttft for t in ok]), "tpot": pct(tpot),
            "itl": pct([x for t in ok for x in t.itl]), "e2e": pct([t.e2e for t in ok])}


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    report = asyncio.run(_run(args))
    print(f"completed {report['completed']}/{report['num_prompts']} in {report['duration_s']} s: "
          f"{report['output_tokens_per_s']} output tokens/s, goodput "
          f"{report['goodput_requests_per_s']} requests/s ({report['protocol']})")
    if report["frontend_cpu_ms_per_output_token"] is not None:
        print(f"  server front end: {report['frontend_cpu_ms_per_output_token']} ms of CPU per "
              f"output token")
    for key in ("ttft", "tpot", "itl", "e2e"):
        if report[key]:
            r = report[key]
            print(f"  {key:>4}: mean {r['mean_ms']} ms, p50 {r['p50_ms']}, p90 {r['p90_ms']}, "
                  f"p99 {r['p99_ms']}")
    if report["errors"]:
        print("  errors:", "; ".join(report["errors"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["failed"] == 0 else 1
