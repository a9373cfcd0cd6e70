"""Shared memory the resolve kernels need, so a configuration that cannot launch fails at startup.

Pure arithmetic (no torch), mirroring the shared-memory layouts in ``jit_kernels/resolve.cuh``
(``Layout<K, B>``) and ``jit_kernels/resolve_verify.cuh`` (``VerifyLayout<K, B, W>``); the
kernels' launchers check the same figure against the GPU at run time, and the GPU tests launch
configurations at the edge. Keep both in step when a layout changes.
"""

from __future__ import annotations

#: cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90 (H100/H200): 227 KiB.
SM90_MAX_SMEM_PER_BLOCK = 232448
_SCAN_BYTES = 4 * 40  # block-scan scratch at the end of both layouts


def _pow2_ceil(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def _ceil16(n: int) -> int:
    return (n + 15) // 16 * 16


def _hash_entries(selected: int) -> int:
    # Open-addressing table over the selected positions at load factor <= 1/2, at least 64.
    return max(64, _pow2_ceil(2 * selected))


def resolve_smem_bytes(top_k: int, buffer: int) -> int:
    """Bytes per CTA of the single-row resolve kernel for ``k = top_k``, ``B = buffer``.

    Hash keys + values (8·H) and the top-k codes (4·k); one region that first holds the staged
    slot tokens (4·B) and later the miss lists (16·k) and the new LRU order (2·B); the staged
    LRU (2·B), one flag bit per LRU position and per top-k entry, a position filter of H bytes
    and the scan scratch; every piece 16-byte aligned, as ``Layout<K, B>`` lays them out.
    """
    h = _hash_entries(top_k)
    head = _ceil16(8 * h + 4 * top_k)
    reuse = _ceil16(max(4 * buffer, 16 * top_k + 2 * buffer))
    bits = 4 * ((buffer + 31) // 32 + (top_k + 31) // 32)
    tail = _ceil16(2 * buffer) + _ceil16(bits) + _ceil16(h)
    return head + reuse + tail + _SCAN_BYTES


def verify_smem_bytes(top_k: int, buffer: int, rows: int) -> int:
    """Bytes per CTA of the verify kernel for ``W = rows`` query rows per request.

    Hash over the union of W·k selections (8·H), miss positions and victims (6·W·k), LRU order
    (2·B) and hit flags (B), then the scan scratch; the copy lists reuse the hash.
    """
    wk = rows * top_k
    h = _hash_entries(wk)
    return _ceil16(8 * h + 6 * wk + 3 * buffer) + _SCAN_BYTES


def largest_buffer(fits, limit: int = SM90_MAX_SMEM_PER_BLOCK, hi: int = 1 << 15) -> int:
    """Largest B in [0, hi) with ``fits(B) <= limit`` (the byte counts grow with B); 0 if none."""
    lo, top = 0, hi - 1
    if fits(0) > limit:
        return 0
    while lo < top:
        mid = (lo + top + 1) // 2
        if fits(mid) <= limit:
            lo = mid
        else:
            top = mid - 1
    return lo
