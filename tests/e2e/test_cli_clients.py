"""`octavo chat --url` and `octavo complete` against the session server: --quick and the stdin
REPL stream the same greedy text the server answers whole; keys, models and refusals."""
from __future__ import annotations

import subprocess
import sys

import httpx

from tests.e2e.conftest import API_KEY, SERVED_NAME

OCTAVO = [sys.executable, "-m", "octavo.entrypoints.cli.main"]


def octavo(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*OCTAVO, *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


def whole(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json={"model": SERVED_NAME, **body}, timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_quick_streams_the_servers_greedy_reply(server):
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "What color is the sky?"}]
    want = whole(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 10,
                                                  "temperature": 0})
    done = octavo("chat", "--url", server.url + "/v1", "--api-key", API_KEY,
                  "--system-prompt", "You answer in one word.", "--max-tokens", "10",
                  "--temperature", "0", "--quick", "What color is the sky?")
    assert done.returncode == 0, done.stderr
    assert done.stdout == want["choices"][0]["message"]["content"] + "\n"


def test_complete_quick_and_the_default_model(server):
    want = whole(server, "/v1/completions", {"prompt": "The capital of France is",
                                             "max_tokens": 6, "temperature": 0})
    done = octavo("complete", "--url", server.url, "--api-key", API_KEY, "--max-tokens", "6",
                  "--temperature", "0", "--quick", "The capital of France is")
    assert done.returncode == 0, done.stderr
    assert done.stdout == want["choices"][0]["text"] + "\n"


def test_chat_repl_keeps_the_conversation_until_eof(server):
    first = [{"role": "user", "content": "Name a fruit."}]
    reply = whole(server, "/v1/chat/completions", {"messages": first, "max_tokens": 8,
                                                   "temperature": 0})
    reply = reply["choices"][0]["message"]["content"]
    second = first + [{"role": "assistant", "content": reply},
                      {"role": "user", "content": "Another one?"}]
    then = whole(server, "/v1/chat/completions", {"messages": second, "max_tokens": 8,
                                                  "temperature": 0})
    done = octavo("chat", "--url", server.url, "--api-key", API_KEY, "--model", "smollm2",
                  "--max-tokens", "8", "--temperature", "0",
                  stdin="Name a fruit.\nAnother one?\n/reset\nName a fruit.\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("> ")[1:] == [  # the prompt, a reply per message, and at EOF
        reply + "\n", then["choices"][0]["message"]["content"] + "\n", "", reply + "\n",
        "\n"]
    assert "octavo chat with smollm2" in done.stderr


def test_a_refusal_is_a_clear_error(server):
    done = octavo("complete", "--url", server.url, "--quick", "x")  # no key
    assert done.returncode == 1 and "401" in done.stderr and "API key" in done.stderr
    done = octavo("chat", "--url", server.url, "--api-key", API_KEY, "--model", "nope",
                  "--quick", "x")
    assert done.returncode == 1 and "404" in done.stderr and "nope" in done.stderr
    done = octavo("chat", "--url", server.url, "--dtype", "float32", "--quick", "x")
    assert done.returncode == 2 and "--dtype" in done.stderr


def test_an_unreachable_server_is_a_clear_error():
    done = octavo("complete", "--url", "http://127.0.0.1:9", "--quick", "x")
    assert done.returncode == 1 and "cannot reach" in done.stderr
