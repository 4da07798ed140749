"""Real `octavo serve` processes on free loopback ports."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

API_KEY = "test-key-123"
SERVED_NAME = "smol"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(model_path, tmp_dir, *extra: str, timeout: float = 180) -> Server:
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    cmd = [sys.executable, "-m", "octavo.entrypoints.cli.main", "serve", str(model_path),
           "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
           "--kv-cache-memory", "256MiB", "--served-model-name", SERVED_NAME, "smollm2",
           *extra]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{open(log_path).read()[-5000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return Server(proc, url, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{open(log_path).read()[-5000:]}")


@pytest.fixture(scope="session")
def server(smollm_gguf, tmp_path_factory):
    srv = start_server(smollm_gguf, tmp_path_factory.mktemp("server"), "--api-key", API_KEY,
                       "--max-num-seqs", "32", "--max-request-bytes", "200000",
                       "--allowed-origins", "http://example.com")
    yield srv
    srv.stop()


def metric(url: str, name: str) -> float:
    """Sum of the samples of a Prometheus metric (all label sets)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total


def idle_within(url: str, seconds: float) -> bool:
    """Does the server fall idle (nothing running or waiting, no KV block held) in time?"""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if metric(url, "octavo:num_requests_running") == 0 and \
                metric(url, "octavo:num_requests_waiting") == 0 and \
                metric(url, "octavo:kv_cache_usage_perc") == 0:
            return True
        time.sleep(0.05)
    return False


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a server's engine cores), from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(entry))
            except OSError:
                continue
    return out
