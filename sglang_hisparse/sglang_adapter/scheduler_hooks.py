"""Hooks on SGLang's ``Scheduler`` for paths where it forgets HiSparse's requests.

``Scheduler.abort_request`` (SGLang 0.5.23, ``managers/scheduler.py``) marks an aborted
request wherever it looks (waiting queue, PD queues, running and last batch), but never in the
HiSparse coordinator's staging queue: a request whose prefill finished and whose prompt is
still being copied to host is ignored, and decodes to its own stop condition once collected
(reproduced by the real-scheduler rig, ``abort_while_staging``; docs/patches.md, "Upstream
issues"). :func:`abort_staging_requests` runs after it and marks those requests the way SGLang
marks a running one (``to_finish``, its "abort method 3"): once collected, the request runs
one decode step and SGLang's result processor finishes and releases it as aborted.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("sglang_hisparse")


def abort_staging_requests(result: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``Scheduler.abort_request(recv_req: AbortReq)``; returns None (the
    original's result stands)."""
    coordinator = getattr(scheduler, "hisparse_coordinator", None)
    if coordinator is None:
        return None
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for entry in coordinator.ack_staging_queue:
        req = entry.req
        if req is None or req.finished() or req.to_finish is not None:
            continue
        if recv_req.abort_all or req.rid.startswith(recv_req.rid):
            req.to_finish = FINISH_ABORT(recv_req.abort_message) if recv_req.abort_message else FINISH_ABORT()
            logger.info("sglang-hisparse: abort of %s while its prompt stages to host; it "
                        "finishes at its first decode step.", req.rid)
    return None
