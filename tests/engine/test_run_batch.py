"""`octavo run-batch`: a 100-line batch of good and bad lines run offline (the app in process)
and against a real server (--url): the output format, one record per line in input order,
per-line errors that never stop the batch, greedy outputs equal to the server's; and the output
written whole or not at all."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx
import pytest

from octavo.entrypoints.batch import BatchRunner, OrderedAtomicWriter
from tests.e2e.conftest import start_server

ENGINE = ["--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory", "256MiB"]
PROMPTS = ["The capital of France is", "Once upon a time", "List three colors:",
           "def fibonacci(n):", "The best way to learn is", "Water boils at"]


def _line(custom_id, url="/v1/completions", body=None, method="POST", **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url,
                       "body": body if body is not None else {}, **extra})


def batch_lines() -> tuple[list[str], list[tuple[str | None, str]]]:
    """100 lines (two blank) and, per non-blank line, (custom_id, what it must give)."""
    lines, expect = [], []

    def add(text, custom_id, kind):
        lines.append(text)
        expect.append((custom_id, kind))

    for i in range(50):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 2:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 6 + i % 3,
                    "temperature": 0}
            add(_line(f"chat-{i}", "/v1/chat/completions", body), f"chat-{i}", "chat")
        else:
            body = {"prompt": prompt, "max_tokens": 5 + i % 4, "temperature": 0}
            add(_line(f"cmpl-{i}", "/v1/completions", body), f"cmpl-{i}", "completion")
        if i % 6 == 5:  # the bad lines are spread among the good ones
            j = i // 6
            add("{not json", None, "invalid_request:None")
            add(_line(f"emb-{j}", "/v1/embeddings", {"input": "x"}), f"emb-{j}",
                "invalid_request:url")
            add(_line(f"unknown-{j}", body={"prompt": "x", "bogus": 1}), f"unknown-{j}",
                "400:bogus")
            add(_line(f"neg-{j}", body={"prompt": "x", "max_tokens": -1}), f"neg-{j}",
                "400:max_tokens")
    for j in range(3):
        add(_line(None, body={"prompt": "x"}), None, "invalid_request:custom_id")
        add(_line("cmpl-0", body={"prompt": "x"}), "cmpl-0", "invalid_request:custom_id")
        add(_line(f"get-{j}", method="GET", body={"prompt": "x"}), f"get-{j}",
            "invalid_request:method")
        add(_line(f"stream-{j}", body={"prompt": "x", "stream": True}), f"stream-{j}",
            "invalid_request:body.stream")
    add(_line("not-object", body=[1, 2]), "not-object", "invalid_request:body")
    add(_line("model", body={"prompt": "x", "model": "nope"}), "model", "404:model")
    add(json.dumps([1]), None, "invalid_request:None")
    add(_line("extra", body={"prompt": "x"}, priority=1), "extra", "invalid_request:priority")
    lines.insert(10, "")
    lines.insert(50, "   ")
    assert len(lines) == 100
    return lines, expect


def run_batch(tmp_path, name: str, lines: list[str], *args: str) -> list[dict]:
    src, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}-out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "run-batch",
                           "-i", str(src), "-o", str(out), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    return [json.loads(line) for line in out.read_text().splitlines()]


def check_records(records: list[dict], expect: list[tuple[str | None, str]]) -> None:
    assert len(records) == len(expect)
    for record, (custom_id, kind) in zip(records, expect):
        assert record["custom_id"] == custom_id, (record, kind)
        assert record["id"].startswith("batch_req_")
        assert set(record) == {"id", "custom_id", "response", "error"}
        if kind in ("chat", "completion"):
            response = record["response"]
            assert record["error"] is None and response["status_code"] == 200, record
            assert response["request_id"]
            body = response["body"]
            assert body["object"] == ("chat.completion" if kind == "chat"
                                      else "text_completion")
            assert body["usage"]["completion_tokens"] >= 1
        elif kind.startswith("invalid_request"):
            param = kind.split(":")[1]
            assert record["response"] is None
            assert record["error"]["code"] == "invalid_request"
            assert record["error"]["param"] == (None if param == "None" else param), record
            assert record["error"]["message"].startswith("line ")
        else:
            status, param = kind.split(":")
            assert record["response"]["status_code"] == int(status), record
            assert param in record["error"]["message"] or record["error"]["param"] == param
            assert record["response"]["body"]["error"] == record["error"]


def _texts(records: list[dict]) -> dict[str, str]:
    out = {}
    for r in records:
        if r["error"] is None:
            choice = r["response"]["body"]["choices"][0]
            out[r["custom_id"]] = choice.get("text", (choice.get("message") or {}).get(
                "content"))
    return out


@pytest.mark.slow
def test_batch_offline_and_against_a_server(smollm_gguf, tmp_path):
    lines, expect = batch_lines()
    offline = run_batch(tmp_path, "offline", lines, str(smollm_gguf), *ENGINE)
    check_records(offline, expect)
    server = start_server(smollm_gguf, tmp_path)
    try:
        remote = run_batch(tmp_path, "remote", lines, "--url", server.url)
        one = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0}).json()
    finally:
        server.stop()
    check_records(remote, expect)
    offline_texts, remote_texts = _texts(offline), _texts(remote)
    assert len(offline_texts) == 50
    assert offline_texts == remote_texts  # greedy: the same bodies give the server's outputs
    assert offline_texts["cmpl-0"] == one["choices"][0]["text"]


def test_url_mode_refuses_engine_flags(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(_line("a", body={"prompt": "x"}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "run-batch",
                           "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--url",
                           "http://127.0.0.1:9", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--dtype" in proc.stderr
    assert not (tmp_path / "out.jsonl").exists()


# -- the runner and the writer, on a stand-in server -------------------------------------------

def _stand_in(crash_on: str | None = None):
    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["prompt"] == crash_on:
            raise RuntimeError("the process dies here")
        await asyncio.sleep(0.001 * (hash(body["prompt"]) % 20))  # finish out of order
        return httpx.Response(200, json={"echo": body["prompt"]},
                              headers={"x-request-id": f"r-{body['prompt']}"})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://t")


def _run(lines, path, client, concurrency=8):
    async def go():
        writer = OrderedAtomicWriter(path)
        try:
            count = await BatchRunner(client, concurrency).run(lines, writer)
            writer.commit()
        except BaseException:
            writer.discard()
            raise
        return count

    return asyncio.run(go())


def test_records_keep_input_order_under_concurrency(tmp_path):
    lines = [_line(f"id-{i}", body={"prompt": str(i)}) for i in range(50)]
    out = tmp_path / "out.jsonl"
    assert _run(lines, out, _stand_in()) == 50
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == [f"id-{i}" for i in range(50)]
    assert [r["response"]["body"]["echo"] for r in records] == [str(i) for i in range(50)]
    assert records[7]["response"]["request_id"] == "r-7"
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask  # as a plain open makes it


def test_a_crash_mid_batch_leaves_no_output(tmp_path):
    lines = [_line(f"id-{i}", body={"prompt": str(i)}) for i in range(30)]
    out = tmp_path / "out.jsonl"
    out.write_text("the previous results\n")
    with pytest.raises(RuntimeError, match="dies here"):
        _run(lines, out, _stand_in(crash_on="17"))
    assert out.read_text() == "the previous results\n"  # untouched: no partial file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
