"""`octavo generate` (one-shot prompts) and `octavo chat` (an interactive streaming REPL)."""
from __future__ import annotations

import argparse
import sys

from octavo.config import EngineConfig, add_engine_args
from octavo.entrypoints.cli.args import add_sampling_args, sampling_params_from_args
from octavo.llm import LLM


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="complete one or more prompts")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(run=run_generate)

    c = sub.add_parser("chat", help="chat with a model in the terminal (streams replies)")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    add_engine_args(c)
    add_sampling_args(c, max_tokens=512, temperature=0.7)
    c.set_defaults(run=run_chat)


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
    params = sampling_params_from_args(args)
    llm = LLM.from_config(EngineConfig.from_cli(args))
    template = open(args.chat_template).read() if args.chat_template else None
    engine = llm.engine
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("octavo chat: type a message, /reset to start over, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
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
