"""The AFTER hook on ``Scheduler.abort_request``: aborts reach requests still staging.

The end-to-end case runs on SGLang's real scheduler (tests/integration, ``abort_while_staging``);
this pins the rule itself with SGLang's own ``Req`` and ``AbortReq``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.managers.schedule_batch")

from sglang.srt.managers.io_struct import AbortReq  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_hisparse.coordinator.lifecycle import StagingEntry  # noqa: E402
from sglang_hisparse.coordinator.streams import NullEvent  # noqa: E402
from sglang_hisparse.sglang_adapter.scheduler_hooks import abort_staging_requests  # noqa: E402


def _scheduler(*rids: str):
    reqs = [Req(rid, "", [1, 2, 3], SamplingParams(max_new_tokens=4)) for rid in rids]
    # the queue's entries are our coordinator core's own StagingEntry (what
    # SGLangHiSparseCoordinator.ack_staging_queue returns); the coordinator is ours, not SGLang's:
    # only its ack_staging_queue is read
    queue = [StagingEntry(req_slot=i, logical_ids=torch.arange(3), event=NullEvent(), req=r) for i, r in enumerate(reqs)]
    coord = SimpleNamespace(ack_staging_queue=queue)
    return _scheduler_with(coord), reqs


def _scheduler_with(coordinator) -> SimpleNamespace:
    # NOTE: a stand-in for SGLang's Scheduler: Scheduler.__init__ starts the model workers, the
    # tokenizer and the ZMQ sockets of a whole server; the hook reads only .hisparse_coordinator
    return SimpleNamespace(hisparse_coordinator=coordinator)


def test_an_abort_marks_the_matching_staging_request_only() -> None:
    sched, (a, b) = _scheduler("a-1", "b-1")
    abort_staging_requests(None, sched, AbortReq(rid="a-1"))
    assert isinstance(a.to_finish, FINISH_ABORT) and b.to_finish is None


def test_abort_all_marks_every_staging_request_and_keeps_the_message() -> None:
    sched, reqs = _scheduler("a", "b")
    abort_staging_requests(None, sched, AbortReq(rid="", abort_all=True, abort_message="SLA timeout"))
    assert all(isinstance(r.to_finish, FINISH_ABORT) for r in reqs)
    assert reqs[0].to_finish.message == "SLA timeout"


def test_without_a_coordinator_nothing_happens() -> None:
    assert abort_staging_requests(None, _scheduler_with(None), AbortReq(rid="x")) is None
