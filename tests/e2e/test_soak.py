"""A bounded soak of a real server: mixed streaming and non-streaming requests, disconnects
before and during responses, n > 1, shared prefixes, rejected and refused requests, for
OCTAVO_SOAK_SECONDS (default 60, within the suite's time budget; longer by setting it). At the
end the server must be idle with nothing held: KV blocks, queues and front-end counters at zero;
resident memory grown by less than MAX_RSS_GROWTH_MB per process since the warm-up; no more file
descriptors, threads or event-loop tasks than after the warm-up; and received = finished +
aborted + rejected. It prints a one-line report of those figures (pytest -s)."""
from __future__ import annotations

import asyncio
import os
import random
import time

import httpx

from tests.e2e.conftest import child_pids, metric, start_server

SOAK_S = float(os.environ.get("OCTAVO_SOAK_SECONDS", "60"))
WARMUP_S = min(20.0, SOAK_S / 4)
CLIENTS = 12
MAX_RSS_GROWTH_MB = 64
PREFIX = "You are a careful assistant who answers in one short sentence. " * 8


def _proc_figures(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss_mb": int(status["VmRSS"].split()[0]) // 1024,
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task"))}


def _figures(srv, core_pid: int) -> dict[str, dict[str, int]]:
    return {"front": _proc_figures(srv.proc.pid), "core": _proc_figures(core_pid),
            "tasks": {"n": int(metric(srv.url, "octavo:frontend_asyncio_tasks"))}}


async def _one(client: httpx.AsyncClient, rng: random.Random, stats: dict) -> None:
    kind = rng.random()
    shared = rng.random() < 0.5
    prompt = (PREFIX if shared else "") + f"Question {rng.randrange(10**6)}: name a colour."
    body: dict = {"max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.8])}
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 4)
    if rng.random() < 0.5:
        path, body = "/v1/completions", {**body, "prompt": prompt}
    else:
        path, body = "/v1/chat/completions", {**body, "messages": [
            {"role": "user", "content": prompt}]}
    if kind < 0.08:  # refused at once: a 400 naming the field
        body["top_k"] = 2**63
    try:
        if kind < 0.45:
            r = await client.post(path, json=body)
            stats[r.status_code] = stats.get(r.status_code, 0) + 1
            if r.status_code == 429:  # busy: back off briefly, as a real client would
                await asyncio.sleep(0.05)
        elif kind < 0.55:  # gone before the answer
            with_timeout = client.post(path, json=body)
            try:
                await asyncio.wait_for(with_timeout, rng.uniform(0.01, 0.3))
            except asyncio.TimeoutError:
                stats["gone_early"] = stats.get("gone_early", 0) + 1
        else:
            body["stream"] = True
            leave_after = rng.randint(1, 6) if rng.random() < 0.3 else None
            async with client.stream("POST", path, json=body) as r:
                stats[r.status_code] = stats.get(r.status_code, 0) + 1
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if leave_after is not None and chunks >= leave_after:
                        stats["gone_mid_stream"] = stats.get("gone_mid_stream", 0) + 1
                        break
    except httpx.HTTPError as exc:
        stats[type(exc).__name__] = stats.get(type(exc).__name__, 0) + 1


async def _clients(url: str, seconds: float, seed: int) -> dict:
    stats: dict = {}
    end = time.monotonic() + seconds

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while time.monotonic() < end:
                await _one(client, rng, stats)

    await asyncio.gather(*(client_loop(i) for i in range(CLIENTS)))
    return stats


def _wait_idle(url: str) -> None:
    deadline = time.time() + 60
    names = ("octavo:frontend_requests_in_flight", "octavo:frontend_queued_sequences",
             "octavo:num_requests_running", "octavo:num_requests_waiting",
             "octavo:kv_cache_usage_perc")
    while time.time() < deadline:
        if all(metric(url, n) == 0 for n in names):
            return
        time.sleep(0.2)
    raise AssertionError({n: metric(url, n) for n in names})


def test_soak(smollm_gguf, tmp_path):
    srv = start_server(smollm_gguf, tmp_path, "--max-num-seqs", "8", "--max-queued-requests",
                       "16", "--kv-cache-memory", "64MiB", "--max-model-len", "512")
    try:
        core_pid = child_pids(srv.proc.pid)[0]
        warm = asyncio.run(_clients(srv.url, WARMUP_S, seed=1))
        _wait_idle(srv.url)
        before = _figures(srv, core_pid)
        stats = asyncio.run(_clients(srv.url, SOAK_S - WARMUP_S, seed=2))
        _wait_idle(srv.url)
        after = _figures(srv, core_pid)
        counts = {n: int(metric(srv.url, f"octavo:requests_{n}_total"))
                  for n in ("received", "finished", "aborted", "rejected")}
        growth = {p: after[p]["rss_mb"] - before[p]["rss_mb"] for p in ("front", "core")}
        print(f"\nsoak {SOAK_S:.0f} s, {CLIENTS} clients: statuses {stats} (warm-up {warm}); "
              f"metrics {counts}; rss growth MB {growth}; fds {before['front']['fds']}->"
              f"{after['front']['fds']} / {before['core']['fds']}->{after['core']['fds']}; "
              f"threads {before['front']['threads']}->{after['front']['threads']} / "
              f"{before['core']['threads']}->{after['core']['threads']}; loop tasks "
              f"{before['tasks']['n']}->{after['tasks']['n']}")
        assert stats.get(200, 0) > 100 and stats.get(400, 0) > 0, stats
        assert counts["received"] == counts["finished"] + counts["aborted"] + counts["rejected"]
        assert max(growth.values()) < MAX_RSS_GROWTH_MB, growth
        for proc in ("front", "core"):
            assert after[proc]["fds"] <= before[proc]["fds"], (before, after)
            assert after[proc]["threads"] <= before[proc]["threads"], (before, after)
        assert after["tasks"]["n"] <= before["tasks"]["n"], (before, after)
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()
