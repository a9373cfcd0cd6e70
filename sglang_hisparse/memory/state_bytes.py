"""Device bytes of the coordinator's per-request state: pure arithmetic (no torch, no sglang).

Per TP rank and request slot, whatever the request's length (the tensors are sized for the
longest request when the coordinator is built; shapes in ``coordinator.state``)::

    slot_tokens   L * (B+W) * 4         int32, per layer
    slot_rows         (B+W) * 4         int32, shared by the layers
    lru           L *  B    * 2         int16, per layer
    resident      L * ceil(P/32) * 4    int32 bitmap, per layer; without speculative decoding
                                        only (the resident hint)
    policy_state  L *  S    * 4         int32, per layer: the replacement policy's S words
                                        (kernel_policy.state_width: 0 lru, B fra, 1 slru)
    host_rows               P * 8       int64, shared by the layers (the host pool's page table,
                                        on the GPU: the resolve kernel reads it)
    resident pages  ceil(P/ps) * 4 + 4  int32 device page table and flag of a fully resident
                                        request (``"residency": "pressure"`` only; ps = page size)

``P`` = ``host_rows`` columns (the longest request, SGLang's ``req_to_token`` width), ``W`` the
slots past the history, ``tail_slots``: 1 (slot B) without speculative decoding, else the verify
window of ``num_draft_tokens`` D. Every helper takes D (0 = off) and derives W and the hint
from it, as ``SlotState`` does: D = 1 is a one-row verify window without the hint. GLM-5.1 (78 layers, B = 4096) at 128K: 4.3 MB
a request slot, 1.1 GB for 256 of them; the hint and ``host_rows`` grow with P, the rest with B.

Per decode-batch row, the resolver's buffers (``coordinator.resolver``, one set for all layers;
shapes in ``kernels.contract``), with ``k`` = top-k::

    out_rows          c * 4             int32, the slots handed to attention
    plan              c * 12 + 4        int64 host rows, int32 device rows, int32 count
    batch ids, arrivals  4 + 4          int32 (arrivals: the kernel's counters, CUDA only)

with ``c`` = k columns (decode) or, under speculative decoding, W * k (the verify kernel's
buffers; the resolver then serves verify steps only and holds no decode ones). 32 KB a row at
k = 2048 (96 KB at W = 3): under 1 % of the slot state above.

What a server's coordinator holds in all, ``coordinator_state_bytes``: R request slots (SGLang's
``req_to_token`` rows, the padding row and PD's pre-allocation slots included) of slot state, and
as many rows of resolver buffers (the adapter sizes the decode batch to the request slots). SGLang
sizes its KV pool before the coordinator exists, so ``sglang_adapter.budget`` reserves this figure
out of the KV budget; the planner charges the same per request (R = 1).

NOTE: not next to ``SlotState`` in ``coordinator/state.py``: importing the coordinator package
imports torch, and the planner must not. ``SlotState`` takes its width from ``tail_slots`` and
the hint's from ``hint_words``, and tests/unit/test_state_bytes.py checks ``slot_state_bytes`` against the
tensors the coordinator allocates, so formula and allocation cannot drift apart silently.
"""

from __future__ import annotations

from ..kernel_limits import position_words
from ..kernel_policy import DEFAULT_POLICY, state_width

__all__ = ["coordinator_state_bytes", "hint_words", "residency_columns", "resolver_bytes",
           "slot_state_bytes", "tail_slots"]


def tail_slots(num_draft_tokens: int) -> int:
    """Slots past the B history slots: slot B (the newest token) without speculative decoding
    (``num_draft_tokens`` 0), else the verify window of ``num_draft_tokens`` slots."""
    return num_draft_tokens if num_draft_tokens > 0 else 1


def hint_words(*, max_context: int, num_draft_tokens: int) -> int:
    """int32 words per layer and request of the resident hint; 0 = no hint (speculative
    decoding at any W, whose verify kernel does not read it, or no host pool columns)."""
    return 0 if num_draft_tokens > 0 else position_words(max_context)


def residency_columns(*, max_context: int, page_size: int) -> int:
    """Columns of the resident page table (one per page of the longest request); 0 = none
    (``page_size`` 0: residency off)."""
    return -(-max_context // page_size) if page_size > 0 else 0


def slot_state_bytes(
    *, num_layers: int, buffer_size: int, max_context: int, num_draft_tokens: int = 0,
    policy: str = DEFAULT_POLICY,
    residency_page_size: int = 0,
) -> int:
    """Device bytes per request slot (module docstring): ``SlotState``'s tensors built with
    ``hint_positions = max_context`` plus the slot's ``host_rows`` row.

    num_layers: L local layers; buffer_size: B; max_context: P; num_draft_tokens: D (0 = off);
    policy: the replacement policy (its state words, ``kernel_policy.state_width``).
    residency_page_size: the page size when the resident page table exists (0: it does not).
    """
    L, B, P, D = num_layers, buffer_size, max_context, num_draft_tokens
    W = tail_slots(D)
    per_layer = (B + W) * 4 + B * 2 + hint_words(max_context=P, num_draft_tokens=D) * 4
    per_layer += 4 * state_width(policy, B)
    cols = residency_columns(max_context=P, page_size=residency_page_size)
    table = cols * 4 + 4 if cols else 0
    return L * per_layer + (B + W) * 4 + P * 8 + table


def resolver_bytes(*, top_k: int, num_draft_tokens: int = 0, cuda: bool = True) -> int:
    """Device bytes per decode-batch row of the resolver's output, plan, batch-id and counter
    buffers (module docstring). ``num_draft_tokens``: W, 0 without speculative decoding (k
    columns), else W * k; ``cuda``: include the kernel's arrival counters (not allocated on a CPU
    device)."""
    cols = top_k * num_draft_tokens if num_draft_tokens > 0 else top_k
    arrivals = 4 if cuda else 0
    return cols * 4 + cols * 12 + 4 + 4 + arrivals  # out_rows, plan, batch ids, counters


def coordinator_state_bytes(
    *,
    request_slots: int,
    num_layers: int,
    buffer_size: int,
    max_context: int,
    top_k: int,
    num_draft_tokens: int = 0,
    cuda: bool = True,
    policy: str = DEFAULT_POLICY,
    residency_page_size: int = 0,
) -> int:
    """Device bytes of a coordinator built for ``request_slots`` R (module docstring): R slots
    of ``slot_state_bytes`` plus R decode-batch rows of ``resolver_bytes``."""
    per_slot = slot_state_bytes(
        num_layers=num_layers, buffer_size=buffer_size, max_context=max_context,
        num_draft_tokens=num_draft_tokens, policy=policy, residency_page_size=residency_page_size,
    )
    per_row = resolver_bytes(top_k=top_k, num_draft_tokens=num_draft_tokens, cuda=cuda)
    return request_slots * (per_slot + per_row)
