"""`octavo generate` (one-shot prompts) and `octavo chat` (an interactive streaming REPL, on a
model loaded here or, with --url, on a running server: see client.py)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from octavo.config import DEFAULT_MODEL, EngineConfig, add_engine_args
from octavo.entrypoints.cli.args import (
    add_sampling_args, changed_flags, sampling_params_from_args)
from octavo.entrypoints.cli.client import add_client_args, input_lines
from octavo.llm import LLM

_CHAT_SAMPLING = {"max_tokens": 512, "temperature": 0.7}
# Sampling flags a chat over --url sends as body fields of the same name.
_SENDABLE = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids",
             "ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="complete one or more prompts")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(run=run_generate)

    c = sub.add_parser("chat", help="chat with a model in the terminal (streams replies), "
                                    "loaded here or on a server (--url)")
    c.add_argument("--system", "--system-prompt", dest="system", default=None,
                   help="system prompt")
    c.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    add_client_args(c, "chat with the server at this address (e.g. http://127.0.0.1:8000) "
                       "instead of loading the model here; --model is then the served name "
                       "(default: the first at /v1/models)", None)
    add_engine_args(c)
    add_sampling_args(c, **_CHAT_SAMPLING)
    c.set_defaults(run=run_chat, model=None)  # None: DEFAULT_MODEL here, the server's first


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    llm = LLM.from_config(EngineConfig.from_cli(args))
    for out in llm.generate(args.prompt, params, use_tqdm=False):
        for completion in out.outputs:
            print(completion.text)
            if len(out.outputs) > 1 or len(args.prompt) > 1:
                print(f"--- [{out.request_id}.{completion.index}] "
                      f"finish_reason={completion.finish_reason}")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    if args.url:
        from octavo.entrypoints.cli.client import run_chat_client

        return run_chat_client(args, _client_sampling(args))
    if args.api_key is not None:
        raise ValueError("--api-key is for a server (--url)")
    args.model = args.model or DEFAULT_MODEL
    params = sampling_params_from_args(args)
    llm = LLM.from_config(EngineConfig.from_cli(args))
    template = open(args.chat_template).read() if args.chat_template else None
    engine = llm.engine
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.quick is None:
        print("octavo chat: type a message, /reset to start over, Ctrl-D to quit.",
              file=sys.stderr)
    for line in [args.quick] if args.quick is not None else input_lines("> "):
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        ids = llm.apply_chat_template(history, template)
        rid = engine.next_request_id()
        engine.add_request(rid, ids, params)
        reply = []
        try:
            while engine.has_unfinished_requests():
                for out in engine.step(delta=True):
                    piece = out.outputs[0].text
                    reply.append(piece)
                    print(piece, end="", flush=True)
        except KeyboardInterrupt:
            engine.abort_request(rid)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _client_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The body fields of a chat over --url: max_tokens and temperature (the chat's defaults),
    and the sampling flags the command line changed. Flags with no meaning for a server's
    request are refused, not dropped."""
    changed = changed_flags(args, add_engine_args, lambda p: add_sampling_args(
        p, **_CHAT_SAMPLING))
    changed.pop("model", None)
    wrong = [name for name in changed if name not in _SENDABLE]
    if args.chat_template:
        wrong.append("chat_template")
    if wrong:
        raise ValueError(f"with --url the server runs the model; these flags are for a model "
                         f"loaded here: {', '.join('--' + w.replace('_', '-') for w in wrong)}")
    return {**_CHAT_SAMPLING, **{k: getattr(args, k) for k in ("max_tokens", "temperature")},
            **changed}
