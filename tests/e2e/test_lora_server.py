"""LoRA on SmolLM2, the real model: adapters made with peft on its transformers weights, served
offline (against peft) and by `octavo serve` (--lora-modules, the OpenAI model field, the
admin routes that load and unload adapters under --lora-root, metrics per adapter, the adapter
named in a gRPC Generate)."""
from __future__ import annotations

import shutil

import httpx
import pytest
import torch

from octavo import LoRARequest, SamplingParams
from tests.e2e.conftest import free_port, metric, start_server
from tests.parity.greedy import TOP

pytest.importorskip("peft")

ADMIN_KEY = "admin-456"
NEW_TOKENS = 16
PROMPTS = ["The capital of France is", "def fib(n):", "List three colors: red,"]


@pytest.fixture(scope="module")
def adapters(smollm_oracle_folder, tmp_path_factory):
    """Two adapters under a LoRA root (rank 8 on every projection, rank 16 on q and v) and
    peft's greedy tokens and top-5 per step for each prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.parity.test_lora import ALL, make_adapter

    root = tmp_path_factory.mktemp("lora-root")
    base = AutoModelForCausalLM.from_pretrained(smollm_oracle_folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm_oracle_folder)
    ids = [tok(p).input_ids for p in PROMPTS]
    expected = {}
    for name, rank, targets in [("sql", 8, ALL), ("poet", 16, ["q_proj", "v_proj"])]:
        model = make_adapter(base, rank, targets, False, rank, root / name)
        with torch.inference_mode():
            for i, p in enumerate(ids):
                out = model.generate(torch.tensor([p]), do_sample=False,
                                     max_new_tokens=NEW_TOKENS, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=0)
                top = [torch.log_softmax(x[0].float(), -1).topk(TOP).indices.tolist()
                       for x in out.logits]
                expected[(name, i)] = (out.sequences[0, len(p):].tolist(), top)
    return root, ids, expected


def _agrees(ours: list[int], ours_top: list[list[int]], ref: list[int], ref_top) -> bool:
    """Equal tokens, or at the first divergence each side's token in the other's top 5."""
    for j, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return a in ref_top[j] and b in ours_top[j]
    return len(ours) == len(ref)


def test_smollm2_adapters_match_peft(smollm_gguf, adapters):
    """SmolLM2's GGUF in float32 with two adapters and the base model in one batch."""
    from octavo import LLM

    root, ids, expected = adapters
    llm = LLM(str(smollm_gguf), dtype="float32", max_model_len=512, kv_cache_memory=64 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    loras = {"sql": LoRARequest("sql", 1, str(root / "sql")),
             "poet": LoRARequest("poet", 2, str(root / "poet"))}
    cases = [(name, i) for i in range(len(ids)) for name in ("sql", "poet", None)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                            logprobs=TOP)
    outs = llm.generate([ids[i] for _, i in cases], params, use_tqdm=False,
                        lora_request=[loras.get(name) for name, _ in cases])
    base = {i: o.outputs[0] for o, (name, i) in zip(outs, cases) if name is None}
    for out, (name, i) in zip(outs, cases):
        if name is None:
            continue
        got = out.outputs[0]
        assert _agrees(got.token_ids, [list(p) for p in got.logprobs], *expected[(name, i)])
        first = got.token_ids[0]  # the adapter is applied: its logprobs are its own
        if first in base[i].logprobs[0]:
            assert got.logprobs[0][first].logprob != base[i].logprobs[0][first].logprob


@pytest.fixture(scope="module")
def lora_server(smollm_gguf, adapters, tmp_path_factory):
    root, _, _ = adapters
    srv = start_server(smollm_gguf, tmp_path_factory.mktemp("lora-server"), "--enable-lora",
                       "--max-loras", "2", "--max-lora-rank", "16",
                       "--grpc-port", str(free_port()),
                       "--lora-modules", f"sql={root / 'sql'}",
                       "--allow-runtime-lora-updating", "--lora-root", str(root),
                       "--admin-api-key", ADMIN_KEY)
    yield srv
    srv.stop()


def _complete(server, model: str, prompt: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True}, timeout=120)


def _admin(server, path: str, body: dict, key: str | None = ADMIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_server_selects_adapters_by_model_name(lora_server, adapters):
    root, ids, expected = adapters
    models = httpx.get(lora_server.url + "/v1/models", timeout=10).json()["data"]
    cards = {m["id"]: m for m in models}
    assert cards["sql"]["parent"] == "smol" and cards["smol"]["parent"] is None
    texts = {}
    for model in ("smol", "sql"):
        bodies = [_complete(lora_server, model, p).json() for p in PROMPTS]
        assert all(b["model"] == model for b in bodies)
        texts[model] = [b["choices"][0]["text"] for b in bodies]
    assert texts["sql"] != texts["smol"]
    assert _complete(lora_server, "poet", PROMPTS[1]).status_code == 404  # not loaded yet
    assert metric(lora_server.url, "octavo:lora_requests_total") >= 1
    assert metric(lora_server.url, "octavo:lora_generation_tokens_total") >= NEW_TOKENS


def test_grpc_generate_names_the_adapter(lora_server):
    grpc = pytest.importorskip("grpc")
    from octavo.entrypoints.grpc import octavo_pb2 as pb
    from octavo.entrypoints.grpc import octavo_pb2_grpc as pb_grpc

    cmd = lora_server.proc.args
    port = cmd[cmd.index("--grpc-port") + 1]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.OctavoStub(channel)
        for model in ("smol", "sql"):
            params = pb.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            replies = stub.Generate(pb.GenerateRequest(text=PROMPTS[0], model=model,
                                                       sampling_params=params))
            text = "".join(c.text for r in replies for c in r.choices)
            http = _complete(lora_server, model, PROMPTS[0]).json()["choices"][0]["text"]
            assert text == http, model


def test_runtime_load_and_unload(lora_server, adapters):
    root, _, _ = adapters
    body = {"lora_name": "poet", "lora_path": "poet"}  # relative to --lora-root
    assert _admin(lora_server, "/v1/load_lora_adapter", body, key=None).status_code == 401
    assert _admin(lora_server, "/v1/load_lora_adapter", body).status_code == 200
    assert _admin(lora_server, "/v1/load_lora_adapter", body).status_code == 400  # loaded
    first = _complete(lora_server, "poet", PROMPTS[2]).json()["choices"][0]["text"]
    assert _admin(lora_server, "/v1/unload_lora_adapter", {"lora_name": "poet"}).status_code \
        == 200
    assert _complete(lora_server, "poet", PROMPTS[2]).status_code == 404
    assert _admin(lora_server, "/v1/unload_lora_adapter", {"lora_name": "poet"}).status_code \
        == 404
    assert _admin(lora_server, "/v1/load_lora_adapter",
                  {"lora_name": "poet", "lora_path": str(root / "poet")}).status_code == 200
    again = _complete(lora_server, "poet", PROMPTS[2]).json()["choices"][0]["text"]
    assert again == first


def test_runtime_loads_stay_under_the_root(lora_server, adapters, tmp_path):
    root, _, _ = adapters
    outside = tmp_path / "outside"
    shutil.copytree(root / "sql", outside)  # a good adapter, but not under the root
    (root / "escape").symlink_to(tmp_path)  # a link out of the root
    linked = root / "linked"  # a directory under the root whose weights are a link out
    linked.mkdir()
    shutil.copy(root / "sql" / "adapter_config.json", linked)
    (linked / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    for path in ["../outside", str(outside), "escape/outside", "linked", "/etc"]:
        r = _admin(lora_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert r.status_code == 400 and "outside --lora-root" in r.json()["error"]["message"]
    r = _admin(lora_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "nothing"})
    assert r.status_code == 400 and "'x'" in r.json()["error"]["message"]
    assert _complete(lora_server, "sql", PROMPTS[0]).status_code == 200  # others unaffected
