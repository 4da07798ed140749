"""vLLM's AsyncLLM surface, written as vLLM's examples use it (imports changed): cumulative
outputs equal to the offline engine's, abort from another task, leaving the loop early, and
vLLM's engine arguments."""
from __future__ import annotations

import asyncio

import pytest

from octavo import AsyncLLM, SamplingParams  # from vllm import ...
from octavo.engine.arg_utils import AsyncEngineArgs, EngineArgs  # vllm.engine.arg_utils


@pytest.fixture(scope="module")
def engine(smollm_gguf):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(smollm_gguf), dtype="float32", max_model_len=1024,
        kv_cache_memory=64 << 20, max_num_seqs=8, enforce_eager=False,
        tensor_parallel_size=1, trust_remote_code=False, disable_log_stats=True))
    yield engine
    engine.shutdown()
    assert not any(r.process.is_alive() for r in engine.engine.replicas)


def test_generate_streams_cumulative_outputs_equal_to_offline(engine, smollm_llm):
    params = SamplingParams(max_tokens=12, temperature=0)
    prompt = "The capital of France is"
    expected = smollm_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]

    async def run():
        seen = []
        async for out in engine.generate(prompt, params, "req-1"):
            seen.append(out)
        return seen

    seen = asyncio.run(run())
    assert seen[-1].finished and not any(o.finished for o in seen[:-1])
    texts = [o.outputs[0].text for o in seen]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, not deltas
    assert seen[-1].outputs[0].token_ids == expected.token_ids
    assert seen[-1].outputs[0].text == expected.text


def test_abort_from_another_task_and_leaving_early(engine):
    params = SamplingParams(max_tokens=500, ignore_eos=True, temperature=0)

    async def run():
        got = []

        async def consume():
            async for out in engine.generate({"prompt": "Count to a thousand:"}, params,
                                             "long-1"):
                got.append(out)

        task = asyncio.ensure_future(consume())
        while not got:
            await asyncio.sleep(0.01)
        await engine.abort("long-1")
        await asyncio.wait_for(task, 30)  # the generator ends: it is not left waiting
        async for out in engine.generate("Count:", params, "long-2"):
            break  # leaving early aborts
        return got

    got = asyncio.run(run())
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "abort"
    assert engine.engine.num_streams == 0


def test_engine_args_translate_vllm_names_and_refuse_what_octavo_cannot_do():
    config = EngineArgs(model="smollm2-135m-instruct", gpu_memory_utilization=0.3,
                        max_num_seqs=4).create_engine_config()
    assert config.cache.kv_cache_memory_fraction == 0.3 and config.scheduler.max_num_seqs == 4
    assert EngineArgs(data_parallel_size=2, enable_expert_parallel=True).create_engine_config() \
        .parallel.data_parallel_size == 2
    with pytest.raises(NotImplementedError, match="never runs code"):
        EngineArgs(trust_remote_code=True)
    with pytest.raises(ValueError, match="unknown engine option"):
        EngineArgs(swap_space_gb=4)


@pytest.mark.parametrize("config, level", [(3, 3), ({"level": 2}, 2), ({"mode": 1}, 1),
                                           ('{"level": 3, "backend": "inductor"}', 3), (0, 0)])
def test_compilation_config_sets_the_level(config, level):
    assert EngineArgs(compilation_config=config).create_engine_config() \
        .device.compilation_level == level


def test_cuda_graph_sizes_by_vllm_names():
    for options in ({"compilation_config": {"level": 3, "cudagraph_capture_sizes": [4, 1, 2]}},
                    {"cuda_graph_sizes": [2, 4, 1, 4]}, {"cudagraph_capture_sizes": (1, 2, 4)}):
        device = EngineArgs(**options).create_engine_config().device
        assert device.cudagraph_capture_sizes == (1, 2, 4)
    for bad in ([], [0, 1], [1.5], "8"):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes must be batch sizes"):
            EngineArgs(cuda_graph_sizes=bad)


def test_vllm_cli_flags_for_gpu_memory_and_graphs():
    import argparse

    from octavo.config import EngineConfig, add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = EngineConfig.from_cli(parser.parse_args(
        ["--gpu-memory-utilization", "0.8", "--cuda-graph-sizes", "8", "1", "2"]))
    assert config.kv_memory_fraction == 0.8
    assert config.device.cudagraph_capture_sizes == (1, 2, 8)


def test_compilation_config_refuses_what_it_cannot_do():
    with pytest.raises(NotImplementedError, match="cudagraph_mode"):
        EngineArgs(compilation_config={"level": 3, "cudagraph_mode": "FULL"})
    with pytest.raises(ValueError, match="compilation_level must be 0, 1, 2 or 3"):
        EngineArgs(compilation_config=4)
    with pytest.raises(ValueError, match="compilation_level must be 0, 1, 2 or 3"):
        EngineArgs(compilation_level=True)


def test_output_kinds_delta_and_final_only(engine):
    from octavo.sampling_params import RequestOutputKind  # vllm.sampling_params

    prompt = "The capital of France is"

    async def collect(kind):
        params = SamplingParams(max_tokens=10, temperature=0, output_kind=kind)
        return [out async for out in engine.generate(prompt, params, f"kind-{kind.name}")]

    cumulative = asyncio.run(collect(RequestOutputKind.CUMULATIVE))
    deltas = asyncio.run(collect(RequestOutputKind.DELTA))
    final = asyncio.run(collect(RequestOutputKind.FINAL_ONLY))
    whole = cumulative[-1].outputs[0]
    assert "".join(d.outputs[0].text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == whole.token_ids
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == whole.text
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)
