"""ParallelConfig: validation naming the field, the default backend, the derived flags and vLLM's
keyword names."""
from __future__ import annotations

import argparse

import pytest

from octavo.config import EngineConfig, ParallelConfig, add_engine_args
from octavo.engine.arg_utils import EngineArgs, engine_config


def test_the_default_backend_follows_the_world_size():
    assert ParallelConfig().executor_backend == "uniproc"
    assert ParallelConfig(tensor_parallel_size=2).executor_backend == "mp"
    assert ParallelConfig(pipeline_parallel_size=2).world_size == 2
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6
    assert ParallelConfig(distributed_executor_backend="mp").executor_backend == "mp"
    assert ParallelConfig(tensor_parallel_size=2,
                          distributed_executor_backend="ray").executor_backend == "ray"


@pytest.mark.parametrize("kwargs, field", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"tensor_parallel_size": True}, "tensor_parallel_size"),
    ({"pipeline_parallel_size": -1}, "pipeline_parallel_size"),
    ({"pipeline_parallel_size": 1.5}, "pipeline_parallel_size"),
    ({"distributed_executor_backend": "threads"}, "distributed_executor_backend"),
    ({"cpu_binding": "numa"}, "cpu_binding"),
    ({"data_parallel_backend": "threads"}, "data_parallel_backend"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ParallelConfig(**kwargs)


def test_uniproc_holds_one_rank_only():
    with pytest.raises(ValueError, match="uniproc"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uniproc")
    with pytest.raises(ValueError, match="uniproc"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2, distributed_executor_backend="uniproc")


def test_flags_are_derived_with_vllms_short_aliases():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["-tp", "2", "-pp", "3", "--distributed-executor-backend", "mp",
                              "--cpu-binding", "none"])
    assert EngineConfig.from_cli(args).parallel == ParallelConfig(2, 3, "mp", "none")
    args = parser.parse_args(["--tensor-parallel-size", "4", "--pipeline-parallel-size", "1"])
    assert EngineConfig.from_cli(args).parallel == ParallelConfig(4, 1)
    with pytest.raises(SystemExit):
        parser.parse_args(["--distributed-executor-backend", "threads"])
    args = parser.parse_args(["-dp", "2", "--data-parallel-backend", "ray"])
    parallel = EngineConfig.from_cli(args).parallel
    assert (parallel.data_parallel_size, parallel.data_parallel_backend) == (2, "ray")


def test_vllm_keywords_reach_the_parallel_config():
    config = engine_config("m", tensor_parallel_size=2, pipeline_parallel_size=2,
                           distributed_executor_backend="mp")
    assert config.parallel == ParallelConfig(2, 2, "mp")
    assert config.replace(max_num_seqs=3).parallel == config.parallel
    assert EngineArgs("m", tensor_parallel_size=2).create_engine_config().parallel \
        .executor_backend == "mp"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs("m", tensor_parallel_size=0)
    assert engine_config("m", data_parallel_size=2, data_parallel_backend="ray").parallel \
        .data_parallel_backend == "ray"


def test_context_parallelism_is_a_dimension_of_its_own():
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                              prefill_context_parallel_size=3, decode_context_parallel_size=3)
    assert (parallel.context_parallel_size, parallel.world_size) == (3, 12)
    assert parallel.output_rank == 6 and parallel.layout == "tp 2, cp 3, pp 2"
    assert ParallelConfig(decode_context_parallel_size=2).executor_backend == "mp"
    assert ParallelConfig(pipeline_parallel_size=2).output_rank == 1
    assert EngineConfig.from_kwargs(decode_context_parallel_size=4, block_size=8) \
        .core_block_size == 32
    assert EngineConfig.from_kwargs(prefill_context_parallel_size=4).core_block_size == 16
    with pytest.raises(ValueError, match="decode_context_parallel_size"):
        ParallelConfig(decode_context_parallel_size=0)
    with pytest.raises(ValueError, match="share one group"):
        ParallelConfig(prefill_context_parallel_size=2, decode_context_parallel_size=4)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    parallel = EngineConfig.from_cli(parser.parse_args(["-pcp", "2", "-dcp", "2"])).parallel
    assert (parallel.prefill_context_parallel_size, parallel.decode_context_parallel_size) == (2, 2)
    assert engine_config("m", decode_context_parallel_size=2).parallel.world_size == 2


@pytest.mark.parametrize("kwargs, what", [
    ({"enable_lora": True}, "enable_lora"),
    ({"speculative_config": {"method": "draft_model", "model": "m"}}, "draft model")])
def test_context_parallelism_refuses_what_it_does_not_split_yet(kwargs, what):
    with pytest.raises(NotImplementedError, match=what):
        EngineConfig.from_kwargs(decode_context_parallel_size=2, **kwargs)
    EngineConfig.from_kwargs(**kwargs)  # fine without it


def test_rank_layout_puts_context_parallel_between_tensor_and_pipeline():
    from octavo.distributed.parallel_state import RankPlacement

    where = RankPlacement(5, tp_size=2, pp_size=2, cp_size=2)
    assert (where.tp_rank, where.cp_rank, where.pp_rank) == (1, 0, 1)
    assert (where.tp_ranks(), where.cp_ranks(), where.pp_ranks()) == ([4, 5], [5, 7], [1, 5])
    groups = where.groups()
    assert groups["cp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    for kind in ("tp", "cp", "pp"):  # each kind partitions the world
        assert sorted(r for g in groups[kind] for r in g) == list(range(8))
    assert RankPlacement(3, tp_size=2, pp_size=2).pp_ranks() == [1, 3]  # as before without cp


def test_replicas_whose_experts_span_them_form_one_world():
    """Expert parallelism with two replicas of tp 2: global rank = replica * 2 + rank; tp and
    pp groups stay within a replica, the ep group is all four ranks (ep_rank = replica * 2 +
    tp_rank), and each replica counts its own ep ranks."""
    from octavo.distributed.parallel_state import RankPlacement

    parallel = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2,
                              enable_expert_parallel=True, data_parallel_rank=1,
                              data_parallel_master_port=1234)
    assert parallel.experts_span_replicas and parallel.world_size == 2
    assert parallel.replica_init_method == "tcp://127.0.0.1:1234"
    where = RankPlacement.of(parallel, 1)
    assert (where.global_rank, where.global_world_size, where.ep_rank, where.ep_size) == \
        (3, 4, 3, 4)
    assert where.dispatches_experts and where.tp_ranks() == [2, 3]
    groups = where.groups()
    assert groups["tp"] == [(0, 1), (2, 3)] and groups["ep"] == [(0, 1, 2, 3)]
    assert list(where.replica_ep_ranks()) == [2, 3]
    # without expert parallelism the replicas stay apart: each a world of its own
    apart = RankPlacement.of(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2,
                                            data_parallel_rank=1), 1)
    assert (apart.global_rank, apart.global_world_size, apart.ep_size) == (1, 2, 1)
    assert ParallelConfig(data_parallel_size=2).replica_init_method is None
    with pytest.raises(ValueError, match="replica 2 outside 2"):
        RankPlacement(0, dp_size=2, dp_rank=2)


@pytest.mark.parametrize("kwargs, what", [
    ({"pipeline_parallel_size": 2}, "pipeline parallelism"),
    ({"enable_lora": True}, "enable_lora"),
    ({"speculative_config": {"method": "draft_model", "model": "m"}}, "draft model")])
def test_experts_across_replicas_refuse_what_lockstep_cannot_run_yet(kwargs, what):
    with pytest.raises(NotImplementedError, match=what):
        EngineConfig.from_kwargs(data_parallel_size=2, enable_expert_parallel=True, **kwargs)
    EngineConfig.from_kwargs(data_parallel_size=2, **kwargs)  # fine: replicas stay apart


def test_the_launchers_fields_are_not_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--data-parallel-master-port", "1"])
    assert not hasattr(parser.parse_args([]), "data_parallel_rank")
