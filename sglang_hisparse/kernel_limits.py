"""Shared memory the resolve kernels need, so a configuration that cannot launch fails at startup.

Pure arithmetic (no torch), so that argument validation runs where no GPU or compiler is: the
figures of the shared-memory layouts in ``jit_kernels/resolve.cuh`` (``Layout<K, B>``) and
``jit_kernels/resolve_verify.cuh`` (``VerifyLayout<K, B, W>``). The kernel's own constants are
the source: each compiled module exports its layout's figure (``smem_bytes``) and GPU tests
assert these functions equal it over a grid (``test_kernel_limits_mirror_the_kernels_shared_memory``,
``test_kernel_limits_mirror_the_verify_kernels_shared_memory``), so a layout change that is not
made here fails the GPU suite. The launchers check the same figure against the GPU at run time.
"""

from __future__ import annotations

from .kernel_policy import POLICY_FRA, POLICY_SLRU, policy_id

#: cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90 (H100/H200): 227 KiB.
SM90_MAX_SMEM_PER_BLOCK = 232448
_SCAN_BYTES = 4 * 40  # scan scratch at the end of both layouts (common.cuh: kScanScratchInts)


def _pow2_ceil(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def _ceil16(n: int) -> int:
    return (n + 15) // 16 * 16


def position_words(positions: int) -> int:
    """32-bit words of a one-bit-per-position bitmap over ``positions`` (host_rows columns):
    the resolve kernel's position bitmap and the resident hint's row (the launcher computes
    the same)."""
    return (positions + 31) // 32


def slots_needed(top_k: int, num_draft_tokens: int = 0) -> int:
    """The hot-buffer rule, the one copy of it: the slots B one step needs per request and
    layer. Every position a step selects needs a slot in that step (B >= k), and a verify step
    resolves its W rows' selections at once (B >= W * k). ``config.check_buffer_holds_selection``
    (the flag's error) and ``kernels.contract`` (the launch's) both compare against this."""
    return max(1, int(num_draft_tokens or 0)) * int(top_k)


def _hash_entries(selected: int) -> int:
    # Open-addressing table over the selected positions at load factor <= 1/2, at least 64.
    return max(64, _pow2_ceil(2 * selected))


def resolve_smem_bytes(top_k: int, buffer: int, max_context: int = 0, policy: str = "lru") -> int:
    """Bytes per CTA of the single-row resolve kernel for ``k = top_k``, ``B = buffer`` and
    requests of up to ``max_context`` positions (the host pool's ``host_rows`` columns).

    Compile-time part, as ``Layout<K, B>`` lays it out (16-byte aligned pieces): the staged
    top-k (4·k), a dense id per entry (2·k), first index and slot per id (4·k + 2·k); one region
    that first holds the staged slot tokens (4·B) and later the miss lists (16·k) and the new
    LRU order (2·B); the staged LRU (2·B), one flag bit per LRU position and per top-k entry, and
    the scan scratch. Run-time part: the position bitmap (one bit per position) and its 16-bit
    prefix count per 32 positions, 0.1875 B per position (24 KiB at 128K). The ``fra`` policy
    (``kernel_policy``) adds a bucket and a hit count per slot (2·B), its 256-bin histogram and
    32 per-warp counts; ``slru`` 32 per-warp counts.
    """
    k, b = top_k, buffer
    fixed = _ceil16(4 * k) + _ceil16(2 * k) + _ceil16(4 * k) + _ceil16(2 * k)
    fixed += _ceil16(max(4 * b, 16 * k + 2 * b)) + _ceil16(2 * b)
    fixed += _ceil16(4 * ((b + 31) // 32 + (k + 31) // 32)) + _SCAN_BYTES
    if policy_id(policy) == POLICY_FRA:
        fixed = _ceil16(_ceil16(fixed + 2 * b) + 4 * 256 + 4 * 32)
    elif policy_id(policy) == POLICY_SLRU:  # its per-warp level counts
        fixed = _ceil16(fixed + 4 * 32)
    words = position_words(max_context)
    return fixed + _ceil16(4 * words) + _ceil16(2 * words)


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


def check_resolve_fits(top_k: int, buffer: int, max_context: int,
                       limit: int = SM90_MAX_SMEM_PER_BLOCK, policy: str = "lru") -> None:
    """Raise ValueError, with both ways out, when the resolve kernel for ``(top_k, B)`` over
    requests of up to ``max_context`` positions needs more shared memory than ``limit``.

    NOTE: checked when the coordinator is built (the first point where the pool's context is
    known), so a server fails at startup, not on its first long decode step.
    """
    need = resolve_smem_bytes(top_k, buffer, max_context, policy)
    if need <= limit:
        return
    ctx_most = largest_buffer(lambda c: resolve_smem_bytes(top_k, buffer, c, policy), limit, hi=1 << 26)
    buf_most = largest_buffer(lambda b: resolve_smem_bytes(top_k, b, max_context, policy), limit)
    fixes = [f"--context-length <= {ctx_most}"] if ctx_most else []
    if buf_most >= top_k:
        fixes.append(f"'device_buffer_size' <= {buf_most} in --hisparse-config")
    raise ValueError(
        f"HiSparse: the resolve kernel for top_k = {top_k}, device_buffer_size = {buffer} and "
        f"requests of up to {max_context} tokens needs {need} B of shared memory per CTA (its "
        f"position bitmap takes 3 B per 16 tokens), above the {limit} B an H100/H200 allows. "
        f"Use {' or '.join(fixes) or 'a smaller top_k'}."
    )

