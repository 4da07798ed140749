"""`octavo serve --grpc-port` on SmolLM2: every RPC of octavo.v1.Octavo through a real gRPC
client against the HTTP routes of the same server (greedy tokens and logprobs, embeddings),
streaming, cancellation and Abort (the request is aborted, its blocks freed), each error
status, the health service and reflection. The last test kills the engine: UNAVAILABLE."""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_health")
pytest.importorskip("grpc_reflection")

from octavo.entrypoints.grpc import octavo_pb2 as pb  # noqa: E402
from octavo.entrypoints.grpc import octavo_pb2_grpc as pb_grpc  # noqa: E402
from tests.e2e.conftest import (  # noqa: E402
    API_KEY, child_pids, free_port, idle_within, metric, start_server)

AUTH = [("authorization", f"Bearer {API_KEY}")]
HTTP_AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_REQUEST_BYTES = 100_000


@pytest.fixture(scope="module")
def grpc_server(smollm_gguf, tmp_path_factory):
    port = free_port()
    srv = start_server(smollm_gguf, tmp_path_factory.mktemp("grpc"), "--api-key", API_KEY,
                       "--grpc-port", str(port), "--max-request-bytes",
                       str(MAX_REQUEST_BYTES))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    yield srv, channel
    channel.close()
    srv.stop()


def _stub(grpc_server) -> pb_grpc.OctavoStub:
    return pb_grpc.OctavoStub(grpc_server[1])


def _http(grpc_server, path: str, body: dict) -> dict:
    r = httpx.post(grpc_server[0].url + path, json=body, headers=HTTP_AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_streams_what_the_http_api_returns(grpc_server):
    stub = _stub(grpc_server)
    params = pb.SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    replies = list(stub.Generate(pb.GenerateRequest(
        text="The capital of France is", sampling_params=params, request_id="g1"),
        metadata=AUTH))
    assert len(replies) >= 2 and all(r.request_id == "g1" for r in replies)
    assert replies[-1].finished and not any(r.finished for r in replies[:-1])
    choices = [c for r in replies for c in r.choices]
    tokens = [t for c in choices for t in c.token_ids]
    text = "".join(c.text for c in choices)
    http = _http(grpc_server, "/v1/completions", {
        "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
        "logprobs": 3, "ignore_eos": True, "return_token_ids": True})["choices"][0]
    assert tokens == http["token_ids"] and text == http["text"]
    top = [{e.token_id: e.logprob for e in p.entries if e.rank <= 3}
           for c in choices for p in c.logprobs]
    http_top = http["logprobs"]["top_logprobs"]
    assert np.allclose([sorted(p.values()) for p in top],
                       [sorted(p.values()) for p in http_top], atol=1e-4)
    assert choices[-1].finish_reason == "length"
    usage = replies[-1].usage
    assert usage.completion_tokens == 12 and usage.prompt_tokens == len(
        replies[0].prompt_token_ids) > 0


def test_generate_from_token_ids_with_n_stop_and_structured_output(grpc_server):
    stub = _stub(grpc_server)
    ids = list(stub.Tokenize(pb.TokenizeRequest(text="Count: one, two,"), metadata=AUTH)
               .token_ids)
    replies = list(stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), sampling_params=pb.SamplingParams(
            n=2, temperature=0.8, seed=7, max_tokens=30, stop=[","],
            prompt_logprobs=1)), metadata=AUTH))
    finals = {c.index: c for r in replies for c in r.choices if c.finish_reason}
    assert set(finals) == {0, 1}
    assert all(c.finish_reason in ("stop", "length") for c in finals.values())
    assert any(c.stop_string == "," for c in finals.values() if c.finish_reason == "stop")
    assert list(replies[0].prompt_token_ids) == ids
    prompt_lps = [p for r in replies for p in r.prompt_logprobs]
    assert len(prompt_lps) == len(ids) and not prompt_lps[0].entries  # none for the first
    choice = pb.StructuredOutputs(choice=pb.Choices(values=["yes", "no"]))
    text = "".join(c.text for r in stub.Generate(pb.GenerateRequest(
        text="Is water wet? Answer:", sampling_params=pb.SamplingParams(
            temperature=1.0, seed=3, max_tokens=8, structured_outputs=choice)),
        metadata=AUTH) for c in r.choices)
    assert text in ("yes", "no")


def test_embed_tokenize_detokenize_and_model_info(grpc_server):
    stub = _stub(grpc_server)
    texts = ["A man is eating food.", "Le chat dort."]
    reply = stub.Embed(pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in texts]),
                       metadata=AUTH)
    http = _http(grpc_server, "/v1/embeddings", {"input": texts})
    assert np.allclose([list(e.values) for e in reply.embeddings],
                       [d["embedding"] for d in http["data"]], atol=1e-5)
    assert reply.prompt_tokens == http["usage"]["prompt_tokens"]
    ids = stub.Tokenize(pb.TokenizeRequest(text="Hello world"), metadata=AUTH)
    assert list(ids.token_ids) == _http(grpc_server, "/tokenize",
                                        {"prompt": "Hello world"})["tokens"]
    assert ids.max_model_len == 2048
    text = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids.token_ids), metadata=AUTH).text
    assert text == "Hello world"
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH)
    assert list(info.served_model_names) == ["smol", "smollm2"]
    assert info.task == "generate" and info.max_model_len == 2048
    assert info.vocab_size == 49152 and info.version


def test_cancelling_the_call_aborts_the_request(grpc_server):
    srv, _ = grpc_server
    stub = _stub(grpc_server)
    aborted = metric(srv.url, "octavo:requests_aborted_total")
    call = stub.Generate(pb.GenerateRequest(text="Tell a long story", sampling_params=(
        pb.SamplingParams(max_tokens=1500, ignore_eos=True))), metadata=AUTH)
    next(call)
    assert metric(srv.url, "octavo:num_requests_running") == 1
    call.cancel()
    assert idle_within(srv.url, 10.0)
    assert metric(srv.url, "octavo:requests_aborted_total") == aborted + 1


def test_abort_ends_a_stream_and_an_embed_call(grpc_server):
    srv, _ = grpc_server
    stub = _stub(grpc_server)
    replies: list = []
    call = stub.Generate(pb.GenerateRequest(
        text="Tell a long story", request_id="long-1",
        sampling_params=pb.SamplingParams(max_tokens=1500, ignore_eos=True)), metadata=AUTH)
    reader = threading.Thread(target=lambda: replies.extend(call))
    reader.start()
    deadline = time.time() + 30
    while not replies and time.time() < deadline:
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as dup:  # the id is taken while it runs
        next(stub.Generate(pb.GenerateRequest(text="x", request_id="long-1"), metadata=AUTH))
    assert dup.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    answer = stub.Abort(pb.AbortRequest(request_ids=["long-1", "unknown"]), metadata=AUTH)
    reader.join(30)
    assert answer.aborted == 1
    assert replies[-1].finished and replies[-1].choices[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for r in replies for c in r.choices) < 1500
    assert idle_within(srv.url, 10.0)


@pytest.mark.parametrize("request_, code, words", [
    (pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(top_p=3)),
     "INVALID_ARGUMENT", "top_p"),
    (pb.GenerateRequest(sampling_params=pb.SamplingParams()), "INVALID_ARGUMENT", "prompt"),
    (pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(
        structured_outputs=pb.StructuredOutputs(regex="(")), ), "INVALID_ARGUMENT",
     "structured_outputs"),
    (pb.GenerateRequest(text="x", model="nope"), "NOT_FOUND", "nope"),
    (pb.GenerateRequest(text="word " * 30_000), "RESOURCE_EXHAUSTED", ""),
    (pb.GenerateRequest(text="word " * 3000), "INVALID_ARGUMENT", "max_model_len"),
])
def test_errors_are_the_statuses_of_the_http_ones(grpc_server, request_, code, words):
    with pytest.raises(grpc.RpcError) as err:
        list(_stub(grpc_server).Generate(request_, metadata=AUTH))
    assert err.value.code() == getattr(grpc.StatusCode, code), err.value.details()
    assert words in (err.value.details() or "")


def test_bad_embed_and_detokenize_input_and_missing_keys(grpc_server):
    stub = _stub(grpc_server)
    for call, request_, words in [
            (stub.Embed, pb.EmbedRequest(), "inputs"),
            (stub.Embed, pb.EmbedRequest(inputs=[pb.EmbedInput(text="hi")], dimensions=8),
             "dimensions"),
            (stub.Detokenize, pb.DetokenizeRequest(token_ids=[10**6]), "token_ids")]:
        with pytest.raises(grpc.RpcError) as err:
            call(request_, metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in err.value.details()
    for metadata in [None, [("authorization", "Bearer wrong")], [("x-api-key", "wrong")]]:
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            next(stub.Generate(pb.GenerateRequest(text="x"), metadata=metadata))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("x-api-key", API_KEY)])


def test_health_and_reflection_need_no_key(grpc_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase)

    channel = grpc_server[1]
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "octavo.v1.Octavo"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    database = ProtoReflectionDescriptorDatabase(channel)
    assert "octavo.v1.Octavo" in set(database.get_services())
    from google.protobuf.descriptor_pool import DescriptorPool

    service = DescriptorPool(database).FindServiceByName("octavo.v1.Octavo")
    assert {m.name for m in service.methods} == {
        "Generate", "Embed", "Tokenize", "Detokenize", "GetModelInfo", "Abort"}


def test_engine_death_is_unavailable(grpc_server):
    """Last in this module: it kills the server's engine."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    srv, channel = grpc_server
    for pid in child_pids(srv.proc.pid):
        os.kill(pid, signal.SIGKILL)
    stub, health = _stub(grpc_server), health_pb2_grpc.HealthStub(channel)
    seen, statuses = set(), set()
    deadline = time.time() + 10
    while time.time() < deadline and srv.proc.poll() is None:
        try:
            statuses.add(health.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
            next(stub.Generate(pb.GenerateRequest(text="x"), metadata=AUTH, timeout=5))
        except grpc.RpcError as err:
            seen.add((err.code(), "engine is dead" in (err.details() or "")))
        time.sleep(0.05)
    assert (grpc.StatusCode.UNAVAILABLE, True) in seen, seen
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
    assert srv.proc.wait(30) != 0

