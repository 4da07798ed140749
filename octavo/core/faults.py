"""Which request made a step fail: an error caused by one request aborts that request, with its
error as the output, and the engine goes on.

A step that raises (filling the grammar bitmask, the worker's forward pass or sampling, the
update from its output) had some set of requests in it. With one request, that request is the
cause: it is aborted. With several, all of them go back to waiting to be recomputed from scratch
(`Scheduler.requeue`: the worker forgets them, their blocks leave the prefix cache) and become
suspects. While suspects remain, each step runs one suspect alone, up to the point where its
failed step ended: if it fails alone it is the cause and is aborted; if it gets past that point
it is cleared and runs with the others again. Only a fault that no single request explains fails
the engine: `MAX_LONE_FAILURES` steps in a row that fail with one request each, whichever
requests they were, raise `EngineFault`.
"""
from __future__ import annotations

import logging

from octavo.core.contract import SchedulerOutput
from octavo.core.request import RequestStatus
from octavo.core.scheduler import EngineCoreOutput, Scheduler

logger = logging.getLogger(__name__)

MAX_LONE_FAILURES = 3


class EngineFault(RuntimeError):
    """Steps keep failing whichever request runs: the engine itself is broken."""


class StepFaults:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.suspects: dict[str, int] = {}  # request id -> tokens computed when its step failed
        self.lone_failures = 0

    def before_schedule(self) -> None:
        """Point the scheduler at the suspect to run alone (the first still unfinished)."""
        requests = self.scheduler.requests
        for req_id in list(self.suspects):
            if req_id in requests:
                self.scheduler.isolated = req_id
                return
            del self.suspects[req_id]  # finished or aborted meanwhile
        self.scheduler.isolated = None

    def succeeded(self, sched: SchedulerOutput) -> None:
        self.lone_failures = 0
        req_id = self.scheduler.isolated
        if req_id is None or req_id not in sched.num_scheduled_tokens:
            return
        req = self.scheduler.requests.get(req_id)
        if req is None or req.num_computed_tokens >= self.suspects.get(req_id, 0):
            self.suspects.pop(req_id, None)  # past where it failed: not the cause

    def failed(self, sched: SchedulerOutput, exc: BaseException) -> list[EngineCoreOutput]:
        """Handle a step that raised `exc`; returns the error outputs of requests aborted."""
        scheduler = self.scheduler
        scheduler.resend_dropped(sched.finished_req_ids | sched.preempted_req_ids)
        in_step = [r for r in sched.num_scheduled_tokens
                   if r in scheduler.requests
                   and scheduler.requests[r].status == RequestStatus.RUNNING]
        reason = f"error: {type(exc).__name__}: {exc}"[:500]
        if len(in_step) > 1:
            logger.error("a step of %d requests failed (%s); running them one at a time to "
                         "find the cause", len(in_step), reason, exc_info=exc)
            for req_id in in_step:
                self.suspects.setdefault(req_id, scheduler.requests[req_id].num_computed_tokens)
            scheduler.requeue(in_step)
            return []
        self.lone_failures += 1
        if self.lone_failures >= MAX_LONE_FAILURES:
            raise EngineFault(f"{self.lone_failures} steps in a row failed, each with one "
                              f"request: the engine, not a request, is at fault "
                              f"({reason})") from exc
        outputs = []
        for req_id in in_step:
            logger.error("request %s aborted: its step failed (%s)", req_id, reason,
                         exc_info=exc)
            self.suspects.pop(req_id, None)
            out = scheduler.fail(req_id, reason)
            if out is not None:
                outputs.append(out)
        return outputs
