"""A request's stream in the server's front end: deltas that arrive while its handler has not
taken the last one merge into one output, so a client that stops reading costs one output."""
from __future__ import annotations

import asyncio

from octavo.engine.request_stream import RequestStream
from octavo.params import CompletionOutput, Logprob, RequestOutput


def _delta(i: int, finished: bool = False) -> RequestOutput:
    outs = [CompletionOutput(c, f"t{i}.{c} ", [i * 10 + c], -float(i), [{i: Logprob(-0.5, 1)}],
                             "length" if finished else None) for c in range(2)]
    return RequestOutput("r", None, [1, 2], None, outs, finished)


def test_a_lagging_reader_gets_one_merged_output():
    async def run():
        stream = RequestStream()
        for i in range(1000):
            stream.put(_delta(i, finished=i == 999))
        assert isinstance(stream.pending, RequestOutput)  # one output held, not a backlog
        got = await asyncio.wait_for(stream.get(), 1)
        assert not stream.ready.is_set() and stream.pending is None
        return got

    out = asyncio.run(run())
    assert out.finished
    for c, comp in enumerate(out.outputs):
        assert comp.text == "".join(f"t{i}.{c} " for i in range(1000))
        assert comp.token_ids == [i * 10 + c for i in range(1000)]
        assert len(comp.logprobs) == 1000 and comp.finish_reason == "length"
        assert comp.cumulative_logprob == -999.0


def test_an_error_stands_over_later_outputs():
    async def run():
        stream = RequestStream()
        stream.put(_delta(0))
        stream.put(RuntimeError("engine gone"))
        stream.put(_delta(1))
        return await stream.get()

    assert isinstance(asyncio.run(run()), RuntimeError)


def test_prompt_logprobs_are_not_repeated_by_a_merge():
    """Every output of a request carries its prompt logprobs so far (not a delta): a merge
    keeps the latest list, as the last output would have given it (found with echo=true and
    logprobs on the server, where a merge had repeated the prompt's positions)."""
    prompt_lp = [None, {5: Logprob(-1.0, 1)}, {6: Logprob(-2.0, 1)}]

    async def run():
        stream = RequestStream()
        for i in range(3):
            out = _delta(i)
            out.prompt_logprobs = prompt_lp
            stream.put(out)
        return await stream.get()

    assert asyncio.run(run()).prompt_logprobs == prompt_lp
