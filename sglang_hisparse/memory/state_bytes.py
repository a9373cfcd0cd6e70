"""Device bytes of the coordinator's per-request state: pure arithmetic (no torch, no sglang).

Per TP rank and request slot, whatever the request's length (the tensors are sized for the
longest request when the coordinator is built; shapes in ``coordinator.state``)::

    slot_tokens   L * (B+W) * 4         int32, per layer
    slot_rows         (B+W) * 4         int32, shared by the layers
    lru           L *  B    * 2         int16, per layer
    resident      L * ceil(P/32) * 4    int32 bitmap, per layer; W = 1 only (the resident hint)
    host_rows               P * 8       int64, shared by the layers (the host pool's page table,
                                        on the GPU: the resolve kernel reads it)

``P`` = ``host_rows`` columns (the longest request, SGLang's ``req_to_token`` width), ``W`` the
verify window (1 without speculative decoding). GLM-5.1 (78 layers, B = 4096) at 128K: 4.3 MB
a request slot, 1.1 GB for 256 of them; the hint and ``host_rows`` grow with P, the rest with B.

Per decode-batch row, the resolver's buffers (``coordinator.resolver``, one set for all layers;
shapes in ``kernels.contract``), with ``k`` = top-k::

    out_rows          k * 4             int32, the slots handed to attention
    plan              k * 12 + 4        int64 host rows, int32 device rows, int32 count
    batch ids, arrivals  4 + 4          int32 (arrivals: the kernel's counters, CUDA only)
    and with speculative decoding the same for the verify kernel at W * k columns (no batch ids)

32 KB a row at k = 2048 (128 KB at W = 3): under 1 % of the slot state above.

What a server's coordinator holds in all, ``coordinator_state_bytes``: R request slots (SGLang's
``req_to_token`` rows, the padding row and PD's pre-allocation slots included) of slot state, and
as many rows of resolver buffers (the adapter sizes the decode batch to the request slots). SGLang
sizes its KV pool before the coordinator exists, so ``sglang_adapter.budget`` reserves this figure
out of the KV budget; the planner charges the same per request (R = 1).

NOTE: not next to ``SlotState`` in ``coordinator/state.py``: importing the coordinator package
imports torch, and the planner must not. ``SlotState`` takes the hint's width from
``hint_words``, and tests/unit/test_state_bytes.py checks ``slot_state_bytes`` against the
tensors the coordinator allocates, so formula and allocation cannot drift apart silently.
"""

from __future__ import annotations

from ..kernel_limits import position_words

__all__ = ["coordinator_state_bytes", "hint_words", "resolver_bytes", "slot_state_bytes"]


def hint_words(*, max_context: int, window: int) -> int:
    """int32 words per layer and request of the resident hint; 0 = no hint (speculative
    decoding, whose verify kernel does not read it, or no host pool columns)."""
    return position_words(max_context) if window == 1 else 0


def slot_state_bytes(
    *, num_layers: int, buffer_size: int, max_context: int, window: int = 1
) -> int:
    """Device bytes per request slot (module docstring): ``SlotState``'s tensors built with
    ``hint_positions = max_context`` plus the slot's ``host_rows`` row.

    num_layers: L local layers; buffer_size: B; max_context: P; window: W (>= 1).
    """
    L, B, W, P = num_layers, buffer_size, window, max_context
    per_layer = (B + W) * 4 + B * 2 + hint_words(max_context=P, window=W) * 4
    return L * per_layer + (B + W) * 4 + P * 8


def resolver_bytes(*, top_k: int, num_draft_tokens: int = 0, cuda: bool = True) -> int:
    """Device bytes per decode-batch row of the resolver's output, plan and counter buffers
    (module docstring). ``num_draft_tokens``: W, 0 without speculative decoding (then no verify
    buffers); ``cuda``: include the kernels' arrival counters (not allocated on a CPU device).
    """
    arrivals = 4 if cuda else 0
    single = top_k * 4 + top_k * 12 + 4 + 4 + arrivals  # out_rows, plan, batch ids, counters
    if num_draft_tokens <= 0:
        return single
    wk = num_draft_tokens * top_k
    return single + wk * 4 + wk * 12 + 4 + arrivals


def coordinator_state_bytes(
    *,
    request_slots: int,
    num_layers: int,
    buffer_size: int,
    max_context: int,
    top_k: int,
    num_draft_tokens: int = 0,
    cuda: bool = True,
) -> int:
    """Device bytes of a coordinator built for ``request_slots`` R (module docstring): R slots
    of ``slot_state_bytes`` (W = max(1, num_draft_tokens)) plus R decode-batch rows of
    ``resolver_bytes``."""
    window = max(1, num_draft_tokens)
    per_slot = slot_state_bytes(
        num_layers=num_layers, buffer_size=buffer_size, max_context=max_context, window=window
    )
    per_row = resolver_bytes(top_k=top_k, num_draft_tokens=num_draft_tokens, cuda=cuda)
    return request_slots * (per_slot + per_row)
