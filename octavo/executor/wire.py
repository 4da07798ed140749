"""Messages between an executor (mp, ray) and its ranks' workers (msgpack via msgspec, never
pickle).

The executor sends every rank the same calls in the same order; each rank answers each call with
one reply. The core↔worker dataclasses (SchedulerOutput, ModelOutput, the SamplingParams inside)
travel as themselves: msgspec encodes dataclasses field by field and rebuilds them through their
constructors (so SamplingParams is validated again); numpy arrays are packed as (dtype, shape,
bytes). A worker's start-up arguments (`WorkerSpec`) are encoded the same way.
"""
from __future__ import annotations

from pathlib import Path, PurePath
from typing import Any, Union

import msgspec
import numpy as np

from octavo.arch_config import ArchConfig
from octavo.config import EngineConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.model_source import ModelSource


class WorkerSpec(msgspec.Struct):
    """What one rank needs to build its Worker, wherever it runs."""

    rank: int
    tp_size: int
    pp_size: int
    local_rank: int  # the rank's index among the ranks on its machine (its share of the cores)
    local_world_size: int  # the ranks on its machine
    distributed_init_method: str
    log_level: int
    config: EngineConfig
    source: ModelSource
    arch: ArchConfig
    max_model_len: int
    eos_token_ids: list[int]


class ProcessStart(msgspec.Struct):
    """An mp worker process's stdin: its rank's spec and where its executor is."""

    address: str  # the executor's ZeroMQ socket
    parent_pid: int
    spec: WorkerSpec


# --- calls, executor -> every rank ------------------------------------------------------------

class InitKVCache(msgspec.Struct, tag=True):
    call_id: int
    num_blocks: int  # the count the executor fitted into every rank's budget
    block_size: int


class StateBytes(msgspec.Struct, tag=True):
    call_id: int


class KVBytesPerBlock(msgspec.Struct, tag=True):
    call_id: int
    block_size: int


class AvailableMemory(msgspec.Struct, tag=True):
    call_id: int


class Describe(msgspec.Struct, tag=True):
    call_id: int


class DoIdleWork(msgspec.Struct, tag=True):
    call_id: int


class Execute(msgspec.Struct, tag=True):
    call_id: int
    scheduler_output: SchedulerOutput


class CheckHealth(msgspec.Struct, tag=True):
    """Answered at once by a live rank (where the executor cannot see its process)."""

    call_id: int


class Shutdown(msgspec.Struct, tag=True):
    call_id: int


Call = Union[InitKVCache, KVBytesPerBlock, StateBytes, AvailableMemory, Describe, DoIdleWork,
             Execute, CheckHealth, Shutdown]


# --- replies, each rank -> executor -----------------------------------------------------------

class Reply(msgspec.Struct, tag=True):
    """A call's result (call_id -1: the rank has loaded its model and is ready, or failed to);
    `error` is the rank's exception and traceback, and then `value` is None."""

    rank: int
    call_id: int
    value: int | bool | str | None = None
    error: str | None = None


class ExecuteReply(msgspec.Struct, tag=True):
    """A step's reply: the ModelOutput from the output rank, None from the others."""

    rank: int
    call_id: int
    output: ModelOutput | None = None
    error: str | None = None


WorkerReply = Union[Reply, ExecuteReply]
READY_CALL_ID = -1


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, list(obj.shape), obj.tobytes())
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    if isinstance(obj, PurePath):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__} for a worker message")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        # bytearray: a writable array (torch.from_numpy of a read-only one warns)
        return np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    if kind is Path:
        return Path(obj)
    raise NotImplementedError(f"cannot decode {kind} from a worker message")


encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
call_decoder = msgspec.msgpack.Decoder(Call, dec_hook=_dec_hook)
reply_decoder = msgspec.msgpack.Decoder(WorkerReply, dec_hook=_dec_hook)
spec_decoder = msgspec.msgpack.Decoder(WorkerSpec, dec_hook=_dec_hook)
start_decoder = msgspec.msgpack.Decoder(ProcessStart, dec_hook=_dec_hook)
