"""The shared-memory all-reduce of local CPU ranks gives gloo's sums (bit for bit with two ranks,
whose sum has one order; within rounding with three), the same bits on every rank, over many
calls in a row of changing sizes and dtypes (its all-gather gloo's, interleaved with them; its
all-to-all of rows gloo's);
tensors larger than its slots go to gloo; and
parallel_state's tp all-reduce uses it on local ranks."""
from __future__ import annotations

import multiprocessing
import socket
import traceback

import pytest

from octavo.distributed import shm_all_reduce

pytestmark = pytest.mark.skipif(not shm_all_reduce.supported(), reason="x86 only")

CAPACITY = 64 << 10  # small slots, so that some cases do not fit


def _cases():
    import torch
    sizes = [1, 3, 576, 1152, 4097, CAPACITY // 4, CAPACITY // 2 + 1]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    return [(i, dtypes[i % len(dtypes)], sizes[(i * 5) % len(sizes)]) for i in range(120)]


def _tolerance(dtype, scale: float) -> float:
    """Sums of three ranks in two orders: a few roundings apart."""
    import torch
    if not dtype.is_floating_point:
        return 0.0  # integer sums are exact in any order
    return 4 * torch.finfo(dtype).eps * max(scale, 1.0)


def _rank_main(rank: int, world: int, init_method: str, results) -> None:
    try:
        import torch
        import torch.distributed as dist

        from octavo.distributed import parallel_state
        from octavo.distributed.parallel_state import RankPlacement

        torch.set_num_threads(1)
        parallel_state.init(RankPlacement(rank, world), init_method, "gloo", timeout_s=60)
        assert parallel_state._tp_shm is not None, "local ranks use shared memory"
        shm = shm_all_reduce.open_for_group(None, list(range(world)), rank, CAPACITY, 60)
        report = []
        for i, dtype, numel in _cases():
            gen = torch.Generator().manual_seed(1000 * i + rank)
            x = (torch.randint(-1000, 1000, (numel,), generator=gen) if not dtype.is_floating_point
                 else torch.randn(numel, generator=gen)).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            if shm.fits(x):
                gathered = shm.all_gather(x, x.new_empty((world, numel)))
                expected = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(expected, x)
                assert torch.equal(gathered, torch.stack(expected)), ("all_gather", i)
                got = shm.all_reduce(x.clone())
            else:
                assert numel * x.element_size() > CAPACITY
                got = ref.clone()
            through_state = parallel_state.tp_all_reduce(x.clone())
            everyone = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(everyone, got)
            report.append((i, torch.equal(got, ref),
                           float((got.double() - ref.double()).abs().max()),
                           float(ref.double().abs().max()),
                           all(torch.equal(e, everyone[0]) for e in everyone),
                           # beyond these small slots: its own (larger) slots, gloo's sum
                           torch.equal(through_state, got) if shm.fits(x) or world == 2
                           else float((through_state.double() - got.double()).abs().max())
                           <= _tolerance(dtype, float(ref.double().abs().max()))))
        for i in range(20):  # all-to-all of rows, sizes of each rank's own, against gloo's
            gen = torch.Generator().manual_seed(100 * i + rank)
            send = torch.randint(0, 7, (world,), generator=gen).tolist()
            rows = torch.randn(sum(send), 3, 5, generator=gen).to(torch.bfloat16)
            ids = torch.randint(0, 99, (sum(send),), generator=gen)
            (got_rows, got_ids), recv = shm.all_to_all([rows, ids], send)
            counts = torch.empty(world, dtype=torch.int64)
            dist.all_to_all_single(counts, torch.tensor(send))
            assert recv == counts.tolist(), ("all_to_all counts", i)
            for part, got in ((rows, got_rows), (ids, got_ids)):
                want = part.new_empty((sum(recv), *part.shape[1:]))
                dist.all_to_all_single(want, part, recv, send)
                assert torch.equal(got, want), ("all_to_all", i)
        shm.close()
        parallel_state.destroy()
        results.put((rank, report, None))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, None, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_sums_equal_gloos(world):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, world, init, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        reports = {}
        for _ in range(world):
            rank, report, error = results.get(timeout=120)
            assert error is None, f"rank {rank}:\n{error}"
            reports[rank] = report
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    cases = {i: (dtype, numel) for i, dtype, numel in _cases()}
    for rank, report in reports.items():
        for i, equal, err, scale, same_everywhere, state_same in report:
            assert same_everywhere, (rank, cases[i])
            assert state_same, (rank, cases[i])
            if world == 2 or not cases[i][0].is_floating_point:
                assert equal, (rank, cases[i], err)
            else:  # gloo sums three ranks in another order
                assert err <= _tolerance(cases[i][0], scale), (rank, cases[i], err)
