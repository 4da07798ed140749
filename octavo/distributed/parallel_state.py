"""Which rank this process is and the collectives between ranks (torch.distributed: gloo on the
CPU, nccl on CUDA).

Ranks are laid out as vLLM lays them out, context parallelism between the two: rank = (pp_rank *
cp_size + cp_rank) * tp_size + tp_rank, so a tensor-parallel group is tp_size consecutive ranks, a
context-parallel group the ranks of one stage with the same tp_rank, and a pipeline group the ranks
with the same tp_rank and cp_rank. Where a mixture's experts span data-parallel replicas (expert
parallelism with several replicas), the replicas' ranks form one world, replica after replica:
global rank = dp_rank * (a replica's ranks) + rank; every other group stays within its replica.
A process that never called `init` is the only rank of every
group: every collective is then the identity, so the model code calls them unconditionally.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank sits in a tp_size x cp_size x pp_size layout (`rank`: its place in its
    replica), and its replica among the dp_size whose ranks form one world."""

    rank: int
    tp_size: int = 1
    pp_size: int = 1
    # a mixture's experts partitioned over the tensor- and context-parallel ranks of a stage
    # (each holds whole experts) rather than each expert sliced over them
    expert_parallel: bool = False
    cp_size: int = 1  # context parallel: ranks that split a step's tokens or its KV cache
    # data-parallel replicas joined in one world: their experts are partitioned over all of them
    dp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1 or self.cp_size < 1 or self.dp_size < 1:
            raise ValueError(f"tensor, context, pipeline and data parallel sizes must be >= 1, "
                             f"got {self.tp_size}, {self.cp_size}, {self.pp_size} and "
                             f"{self.dp_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"replica {self.dp_rank} outside {self.dp_size} replicas")

    @classmethod
    def of(cls, parallel, rank: int) -> RankPlacement:
        """Rank `rank` of a replica run with this ParallelConfig."""
        spans = parallel.experts_span_replicas
        return cls(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                   parallel.enable_expert_parallel, parallel.context_parallel_size,
                   parallel.data_parallel_size if spans else 1,
                   parallel.data_parallel_rank if spans else 0)

    @property
    def world_size(self) -> int:
        """The replica's ranks."""
        return self.tp_size * self.cp_size * self.pp_size

    @property
    def global_rank(self) -> int:
        """Its rank in the world of every joined replica's ranks."""
        return self.dp_rank * self.world_size + self.rank

    @property
    def global_world_size(self) -> int:
        return self.dp_size * self.world_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp_size % self.cp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.cp_size)

    def _rank_of(self, pp: int, cp: int, tp: int, dp: int | None = None) -> int:
        """A global rank: of this rank's replica unless `dp` names another."""
        dp = self.dp_rank if dp is None else dp
        return dp * self.world_size + (pp * self.cp_size + cp) * self.tp_size + tp

    def tp_ranks(self) -> list[int]:
        return [self._rank_of(self.pp_rank, self.cp_rank, t) for t in range(self.tp_size)]

    def cp_ranks(self) -> list[int]:
        return [self._rank_of(self.pp_rank, c, self.tp_rank) for c in range(self.cp_size)]

    def pp_ranks(self) -> list[int]:
        return [self._rank_of(stage, self.cp_rank, self.tp_rank) for stage in range(self.pp_size)]

    @property
    def ep_rank(self) -> int:
        """Its place among the stage's ranks the experts are partitioned over."""
        if not self.expert_parallel:
            return 0
        return (self.dp_rank * self.cp_size + self.cp_rank) * self.tp_size + self.tp_rank

    @property
    def ep_size(self) -> int:
        return self.tp_size * self.cp_size * self.dp_size if self.expert_parallel else 1

    @property
    def dispatches_experts(self) -> bool:
        """Whether a mixture's rows go to their experts' ranks and back (all-to-all): where
        the expert-parallel ranks may hold different tokens (context-parallel ranks split a
        step's, replicas run batches of their own). Tensor-parallel ranks hold the same tokens:
        each computes its experts' rows and the layer's all-reduce sums them."""
        return self.expert_parallel and (self.cp_size > 1 or self.dp_size > 1)

    def ep_ranks(self) -> list[int]:
        """The stage's ranks over every joined replica, in expert-parallel order (ep_rank =
        (dp_rank * cp_size + cp_rank) * tp_size + tp_rank)."""
        return [self._rank_of(self.pp_rank, c, t, d) for d in range(self.dp_size)
                for c in range(self.cp_size) for t in range(self.tp_size)]

    def replica_ep_ranks(self) -> range:
        """The ep ranks of this rank's replica."""
        per_replica = self.tp_size * self.cp_size
        return range(self.dp_rank * per_replica, (self.dp_rank + 1) * per_replica)

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of each kind over the whole world, in one order every rank agrees on."""
        ranks = [RankPlacement(r, self.tp_size, self.pp_size, cp_size=self.cp_size,
                               dp_size=self.dp_size, dp_rank=d)
                 for d in range(self.dp_size) for r in range(self.world_size)]
        kinds = {"tp": RankPlacement.tp_ranks, "cp": RankPlacement.cp_ranks,
                 "pp": RankPlacement.pp_ranks, "ep": RankPlacement.ep_ranks}
        return {kind: sorted({tuple(ranks_of(r)) for r in ranks}) for kind, ranks_of in
                kinds.items()}


_SINGLE = RankPlacement(0)
_placement = _SINGLE
_tp_group = None
_cp_group = None
_pp_group = None
_ep_group = None  # only where experts are dispatched (across context-parallel ranks, replicas)
_tp_shm = None  # the tp group's shared-memory all-reduce, where its ranks share this machine
_cp_shm = None  # the cp group's, for its all-gathers
_ep_shm = None  # the ep group's, where it has one


def placement() -> RankPlacement:
    return _placement


def tp_rank() -> int:
    return _placement.tp_rank


def tp_size() -> int:
    return _placement.tp_size


def ep_size() -> int:
    """The ranks a mixture's experts are partitioned over: a stage's tensor- and
    context-parallel ranks (of every joined replica) under expert parallelism, else 1 (every
    rank holds a share of every expert)."""
    return _placement.ep_size


def ep_rank() -> int:
    return _placement.ep_rank


def ep_dispatches() -> bool:
    return _placement.dispatches_experts


def pp_rank() -> int:
    return _placement.pp_rank


def pp_size() -> int:
    return _placement.pp_size


def init(where: RankPlacement, init_method: str, backend: str = "gloo",
         timeout_s: float = 600.0) -> None:
    """Join the world at `init_method` (tcp://host:port) as `where.global_rank` and make the
    groups. Every rank must call it with the same sizes."""
    global _placement, _tp_group, _cp_group, _pp_group, _ep_group, _tp_shm, _cp_shm, _ep_shm
    import datetime

    import torch.distributed as dist
    dist.init_process_group(backend, init_method=init_method, rank=where.global_rank,
                            world_size=where.global_world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    # new_group is collective: every rank creates every group, in the same order.
    mine = {}
    for kind, groups in where.groups().items():
        if (kind == "cp" and where.cp_size == 1) or (kind == "ep"
                                                      and not where.dispatches_experts):
            mine[kind] = None  # no collective of its own (the identity, or the tp group's)
            continue
        for ranks in groups:
            group = dist.new_group(list(ranks))
            if where.global_rank in ranks:
                mine[kind] = group
    _tp_group, _cp_group, _pp_group, _ep_group = mine["tp"], mine["cp"], mine["pp"], mine["ep"]
    from octavo.distributed import shm_all_reduce
    if backend == "gloo" and where.tp_size > 1:
        _tp_shm = shm_all_reduce.open_for_group(_tp_group, where.tp_ranks(), where.tp_rank,
                                                timeout_s=timeout_s)
    if backend == "gloo" and where.cp_size > 1:
        _cp_shm = shm_all_reduce.open_for_group(_cp_group, where.cp_ranks(), where.cp_rank,
                                                timeout_s=timeout_s)
    if backend == "gloo" and _ep_group is not None:
        _ep_shm = shm_all_reduce.open_for_group(_ep_group, where.ep_ranks(), where.ep_rank,
                                                timeout_s=timeout_s)
    _placement = where


def destroy() -> None:
    global _placement, _tp_group, _cp_group, _pp_group, _ep_group, _tp_shm, _cp_shm, _ep_shm
    import torch.distributed as dist
    for shm in (_tp_shm, _cp_shm, _ep_shm):
        if shm is not None:
            shm.close()
    _tp_shm = _cp_shm = _ep_shm = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _placement, _tp_group, _cp_group, _pp_group, _ep_group = _SINGLE, None, None, None, None


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the tensor-parallel group, in place."""
    if _placement.tp_size == 1:
        return x
    if _tp_shm is not None and _tp_shm.fits(x):
        return _tp_shm.all_reduce(x)
    import torch.distributed as dist
    dist.all_reduce(x, group=_tp_group)
    return x


def _tp_all_reduce_op(x: torch.Tensor) -> None:
    tp_all_reduce(x)


# tp_all_reduce as an op of torch's dispatcher, for the callers outside Python: the C++ decode
# stack (model/decode_stack.py) calls it by this name after each row-parallel projection.
TP_ALL_REDUCE_OP = "octavo_parallel::tp_all_reduce"
_ops = torch.library.Library("octavo_parallel", "DEF")
_ops.define("tp_all_reduce(Tensor(a!) x) -> ()")
_ops.impl("tp_all_reduce", _tp_all_reduce_op, "CompositeExplicitAutograd")


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every tensor-parallel rank's `x`, concatenated along `dim` in rank order."""
    if _placement.tp_size == 1:
        return x
    import torch.distributed as dist
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_placement.tp_size)]
    dist.all_gather(parts, x, group=_tp_group)
    return torch.cat(parts, dim)


def cp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every context-parallel rank's `x` (the same shape on each), stacked in rank order:
    [cp_size, *x.shape]."""
    if _placement.cp_size == 1:
        return x[None]
    import torch.distributed as dist
    x = x.contiguous()
    out = x.new_empty((_placement.cp_size, *x.shape))
    if _cp_shm is not None and _cp_shm.fits(x):
        return _cp_shm.all_gather(x, out)
    dist.all_gather(list(out.unbind(0)), x, group=_cp_group)
    return out


def ep_all_to_all(parts: list[torch.Tensor], send_counts: list[int],
                  matrix: torch.Tensor | None = None
                  ) -> tuple[list[torch.Tensor], list[int], torch.Tensor]:
    """Rows to the expert-parallel ranks: each of `parts` (the same number of rows) holds
    send_counts[0] rows for ep rank 0, then send_counts[1] for ep rank 1...; returns each
    part's rows received (every rank's, in rank order), how many each rank sent, and the
    group's counts, matrix[r][d] rows from rank r to d (give its transpose to send the rows
    back: then nothing is exchanged to learn it). Through shared memory where every rank's
    rows fit its slot (one decision, from the matrix every rank has), else gloo."""
    import torch.distributed as dist
    me = ep_rank()
    counts = torch.tensor(send_counts, dtype=torch.int64, device=parts[0].device)
    if matrix is None:
        matrix = counts.new_empty((len(send_counts), len(send_counts)))
        if _ep_shm is not None:
            _ep_shm.all_gather(counts, matrix)
        else:
            dist.all_gather(list(matrix.unbind(0)), counts, group=_ep_group)
    recv_counts = matrix[:, me].tolist()
    row_bytes = sum(math.prod(p.shape[1:]) * p.element_size() for p in parts)
    largest = 8 * len(send_counts) + int(matrix.sum(1).max()) * row_bytes + 8 * len(parts)
    if _ep_shm is not None and largest <= _ep_shm.capacity:
        received, _ = _ep_shm.all_to_all(parts, send_counts)
        return received, recv_counts, matrix
    out = []
    for part in parts:
        got = part.new_empty((sum(recv_counts), *part.shape[1:]))
        dist.all_to_all_single(got, part.contiguous(), recv_counts, send_counts, group=_ep_group)
        out.append(got)
    return out, recv_counts, matrix


def ep_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the expert-parallel ranks that dispatch (ep_dispatches), in place."""
    if _ep_shm is not None and _ep_shm.fits(x):
        return _ep_shm.all_reduce(x)
    import torch.distributed as dist
    dist.all_reduce(x, group=_ep_group)
    return x


def pp_send(x: torch.Tensor, stage: int) -> None:
    """Send `x` to pipeline stage `stage` (same tp_rank)."""
    import torch.distributed as dist
    dist.send(x.contiguous(), _placement.pp_ranks()[stage])


def pp_recv(x: torch.Tensor, stage: int) -> torch.Tensor:
    """Receive into `x` from pipeline stage `stage` (same tp_rank)."""
    import torch.distributed as dist
    dist.recv(x, _placement.pp_ranks()[stage])
    return x
