"""Types and input checks shared by the resolve/replay reference and the CUDA ops.

Shapes (per TP rank, one layer; see docs/architecture.md):

    top_k          int32 [bs, k]       logical positions, -1 = padding entry
    req_index      int32|int64 [bs]    request slot r of each batch row
    seq_lens       int32|int64 [bs]    n, tokens of the request (newest is n-1)
    num_real_reqs  int32 [1]           rows b >= it are padding (device tensor)
    slot_tokens    int32 [R, B+1]      position held by each hot slot, -1 empty; slot B = newest
    slot_rows      int32 [R, B+1]      device KV row behind each slot
    lru            int16 [R, B]        slot ids oldest -> newest
    host_rows      int64 [R, max_ctx]  host KV row of each position
    host_cache     uint8 [H, I]        host KV (pinned when the op runs on CUDA)
    device_cache   uint8 [D, I]        device KV of this layer
    out_rows       int32 [bs, k]       result: device row of each top-k entry, -1 for padding
    plan           MissPlan            optional record of the copies (src/dst rows, count)

Validation is named and skippable: :func:`validate_resolve` and :func:`validate_replay` run
when ``validate=True`` is passed to an op or ``SGLANG_HISPARSE_VALIDATE=1`` is set. The value
checks read device tensors back (host syncs), so they never run while a CUDA graph is being
captured; the cheap shape/dtype checks always run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..kernel_limits import position_words, slots_needed

#: Kernels copy rows with 16-byte loads; an item size must be a multiple of this.
ROW_ALIGN = 16


class ResolveMode(enum.Enum):
    """What ``resolve`` does with the bytes of a miss."""

    #: Bookkeeping plus the host -> device copy of every miss (production).
    COPY = "copy"
    #: All bookkeeping (state, out_rows, plan) but no bytes copied. Timing oracle only:
    #: the device rows of misses then hold stale data.
    NO_IO = "no_io"


@dataclass
class MissPlan:
    """Per batch row, the copies a resolve made, replayable for another layer's KV arrays.

    ``src`` int64 [bs, k]: host rows; ``dst`` int32 [bs, k]: device rows; ``count`` int32 [bs]:
    copies of row b are ``src[b, :count[b]]`` -> ``dst[b, :count[b]]``, in top-k order of the
    misses. Entries past ``count[b]`` are left untouched by resolve (stale).
    """

    src: torch.Tensor
    dst: torch.Tensor
    count: torch.Tensor

    @classmethod
    def empty(cls, bs: int, k: int, device: torch.device | str) -> MissPlan:
        """Allocate a plan for ``bs`` rows of ``k`` copies (allocate once, before capture)."""
        return cls(
            src=torch.zeros(bs, k, dtype=torch.int64, device=device),
            dst=torch.zeros(bs, k, dtype=torch.int32, device=device),
            count=torch.zeros(bs, dtype=torch.int32, device=device),
        )


@dataclass
class ResidentRows:
    """Fully resident requests (``"residency": "pressure"``): every position has a device row.

    ``flag`` int32 [R]: 1 = request slot r is fully resident; its resolve maps each selected
    position p through ``pages`` and returns (no hash, no LRU, no host read, plan count 0).
    ``pages`` int32 [R, cols]: device page of positions ``c*page_size .. c*page_size+page_size-1``
    of request r (row = ``pages[r, p // page_size] * page_size + p % page_size``).
    ``ring`` int32 [1]: the resolve records each resident request's selection of this step
    (positions ``0 <= p < n-1``, else -1) into ``slot_tokens[r, ring*k : ring*k + k]`` (unused
    while resident), so that a later shrink to a hot buffer starts warm; the coordinator
    advances it every decode step modulo ``B // k``.
    """

    flag: torch.Tensor
    pages: torch.Tensor
    page_size: int
    ring: torch.Tensor


def check_resident_rows(rr: ResidentRows | None, *, lru: torch.Tensor, top_k: torch.Tensor) -> None:
    """Dtypes, shapes and devices of the optional :class:`ResidentRows` (host-only checks)."""
    if rr is None:
        return
    _need("resident_rows.flag", rr.flag, (torch.int32,), 1)
    _need("resident_rows.pages", rr.pages, (torch.int32,), 2)
    _need("resident_rows.ring", rr.ring, (torch.int32,), 1)
    R = lru.shape[0]
    _same("resident_rows.flag.shape[0]", rr.flag.shape[0], R, "request slots (lru.shape[0])")
    _same("resident_rows.pages.shape[0]", rr.pages.shape[0], R, "request slots (lru.shape[0])")
    if rr.page_size < 1:
        raise ValueError(f"resident_rows.page_size = {rr.page_size} must be >= 1.")
    if lru.shape[1] < top_k.shape[1]:
        raise ValueError(
            f"resident_rows: the selection record needs B >= k (B = {lru.shape[1]}, k = {top_k.shape[1]})."
        )
    for name, t in (("flag", rr.flag), ("pages", rr.pages), ("ring", rr.ring)):
        if t.device != lru.device:
            raise ValueError(f"resident_rows.{name} is on {t.device} but the state is on {lru.device}.")
    if rr.pages.stride(-1) != 1:
        raise ValueError("resident_rows.pages must have a contiguous last dimension.")


def validation_enabled(validate: bool | None) -> bool:
    """``validate`` if given, else the SGLANG_HISPARSE_VALIDATE switch."""
    if validate is not None:
        return validate
    from sglang_hisparse import envs

    return bool(envs.get("SGLANG_HISPARSE_VALIDATE"))


def _is_capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _need(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; it must be {want}. Cast it with .to().")
    if t.dim() != ndim:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; it must have {ndim} dims.")


def _same(name: str, got: int, want: int, rule: str) -> None:
    if got != want:
        raise ValueError(f"{name} = {got} but {rule} = {want}; they must match.")


def check_rows_and_strides(**tensors: torch.Tensor) -> int:
    """Item bytes shared by ``host_cache`` and ``device_cache`` (a positive multiple of 16), and
    a contiguous last dimension for every tensor given; returns the item size."""
    host_cache, device_cache = tensors["host_cache"], tensors["device_cache"]
    item = host_cache.shape[1]
    _same("device_cache.shape[1] (item bytes)", device_cache.shape[1], item, "host_cache.shape[1]")
    if item % ROW_ALIGN or item == 0:
        raise ValueError(
            f"item size {item} B is not a positive multiple of {ROW_ALIGN}: the kernels copy "
            f"rows with 16-byte loads. Pad KV rows to a multiple of {ROW_ALIGN} bytes."
        )
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride {t.stride()}).")
    return item


#: dtypes and ndim of the hot-buffer state every resolve flavour reads (single-row and verify)
_STATE_DTYPES = {
    "req_index": ((torch.int32, torch.int64), 1),
    "num_real_reqs": ((torch.int32,), 1),
    "slot_tokens": ((torch.int32,), 2),
    "slot_rows": ((torch.int32,), 2),
    "lru": ((torch.int16,), 2),
    "host_rows": ((torch.int64,), 2),
    "host_cache": ((torch.uint8,), 2),
    "device_cache": ((torch.uint8,), 2),
}


def check_state_dtypes(**state: torch.Tensor) -> None:
    """Dtype/ndim of the state tensors named in ``_STATE_DTYPES`` (all of them, by keyword)."""
    for name, (dtypes, ndim) in _STATE_DTYPES.items():
        _need(name, state[name], dtypes, ndim)


def check_resolve_shapes(
    *, top_k, req_index, seq_lens, num_real_reqs, slot_tokens, slot_rows, lru,
    host_rows, host_cache, device_cache, out_rows, plan,
) -> tuple[int, int, int, int]:
    """Shape/dtype checks of a decode resolve (window W = 1) that need no device read.
    Returns ``(bs, k, B, item_bytes)``."""
    bs, _, k, B, item = _check_shapes(dict(
        top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real_reqs=num_real_reqs,
        slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows,
        host_cache=host_cache, device_cache=device_cache, out_rows=out_rows, plan=plan,
    ), verify=False)
    return bs, k, B, item


def check_verify_shapes(
    *, top_k, req_index, seq_lens, num_real_reqs, slot_tokens, slot_rows, lru,
    host_rows, host_cache, device_cache, out_rows, plan,
) -> tuple[int, int, int, int, int]:
    """Shape/dtype checks of a verify-step resolve (window W) with no device read. Returns
    ``(bs, W, k, B, item_bytes)``.

    ``top_k`` int32 [bs, W, k]; ``req_index`` int32|int64 [bs]; ``seq_lens`` int32|int64
    [bs, W]; ``num_real_reqs`` int32 [1]; ``slot_tokens``/``slot_rows`` int32 [R, B+W];
    ``lru`` int16 [R, B]; ``host_rows`` int64 [R, max_ctx]; ``host_cache``/``device_cache``
    uint8 [H|D, I]; ``out_rows`` int32 [bs, W, k]; ``plan`` src/dst [bs, >= W*k].
    """
    return _check_shapes(dict(
        top_k=top_k, req_index=req_index, seq_lens=seq_lens, num_real_reqs=num_real_reqs,
        slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows,
        host_cache=host_cache, device_cache=device_cache, out_rows=out_rows, plan=plan,
    ), verify=True)


def _check_shapes(kw: dict, *, verify: bool) -> tuple[int, int, int, int, int]:
    """The one shape check of both resolve flavours: decode (``verify`` False: top_k [bs, k],
    seq_lens [bs], slots [R, B+1], the window W = 1) and verify (top_k [bs, W, k], seq_lens
    [bs, W], slots [R, B+W]). Returns ``(bs, W, k, B, item_bytes)``."""
    top_k, seq_lens, out_rows, lru = kw["top_k"], kw["seq_lens"], kw["out_rows"], kw["lru"]
    nd = 3 if verify else 2
    _need("top_k", top_k, (torch.int32,), nd)
    _need("seq_lens", seq_lens, (torch.int32, torch.int64), nd - 1)
    _need("out_rows", out_rows, (torch.int32,), nd)
    check_state_dtypes(**{name: kw[name] for name in _STATE_DTYPES})
    if verify:
        bs, W, k = top_k.shape
    else:
        (bs, k), W = top_k.shape, 1
    R, B = lru.shape
    _same("num_real_reqs.numel()", kw["num_real_reqs"].numel(), 1, "a one-element tensor")
    _same("req_index.shape[0]", kw["req_index"].shape[0], bs, "top_k.shape[0] (batch)")
    if verify:
        _same("seq_lens.shape", tuple(seq_lens.shape), (bs, W),
              "top_k.shape[:2] (pass dsa_seqlens_expanded.view(bs, W))")
    else:
        _same("seq_lens.shape[0]", seq_lens.shape[0], bs, "top_k.shape[0] (batch)")
    _same("out_rows.shape", tuple(out_rows.shape), tuple(top_k.shape), "top_k.shape")
    slots, rule = ((R, B + W), "(lru.shape[0], B + W)") if verify else (
        (R, B + 1), "(lru.shape[0], lru.shape[1]+1)")
    _same("slot_tokens.shape", tuple(kw["slot_tokens"].shape), slots, rule)
    _same("slot_rows.shape", tuple(kw["slot_rows"].shape), slots, rule)
    _same("host_rows.shape[0]", kw["host_rows"].shape[0], R, "lru.shape[0] (request slots)")
    if verify and (W < 1 or k < 1):
        raise ValueError(f"top_k has shape {tuple(top_k.shape)}; W and k must be >= 1.")
    if verify and B < slots_needed(k, W):
        raise ValueError(
            f"lru has B = {B} slots but a verify step selects up to W*k = {W}*{k} = {W * k} "
            f"positions: the union must fit, so set device_buffer_size >= {W * k} "
            f"((speculative_num_draft_tokens) * top_k)."
        )
    if B < slots_needed(k):
        raise ValueError(
            f"lru has B = {B} slots but top_k has k = {k} columns: every selected position "
            f"needs a hot slot, so B must be >= k (set device_buffer_size >= top_k)."
        )
    item = check_rows_and_strides(**{name: kw[name] for name in (
        "top_k", "out_rows", "slot_tokens", "slot_rows", "lru", "host_rows", "host_cache",
        "device_cache")})
    if verify:
        for name in ("top_k", "out_rows"):
            if kw[name].stride(1) != k:
                raise ValueError(f"{name} rows of one request must be contiguous "
                                 f"(stride {kw[name].stride()}).")
    if kw["plan"] is not None:
        check_plan_shapes(kw["plan"], bs=bs, k=W * k)
    return bs, W, k, B, item


def check_resident(resident: torch.Tensor | None, *, lru: torch.Tensor,
                   host_rows: torch.Tensor) -> None:
    """The optional resident hint: int32 [R, ceil(host_rows.shape[1] / 32)] on the state's
    device (one bit per position; see ``reference`` for what it means)."""
    if resident is None:
        return
    _need("resident", resident, (torch.int32,), 2)
    want = (lru.shape[0], position_words(host_rows.shape[1]))
    _same("resident.shape", tuple(resident.shape), want,
          "(request slots, ceil(host_rows.shape[1] / 32)): one bit per host_rows column")
    if resident.device != lru.device:
        raise ValueError(f"resident is on {resident.device} but the state is on {lru.device}.")
    if resident.stride(-1) != 1:
        raise ValueError("resident must have a contiguous last dimension.")


def check_plan_shapes(plan: MissPlan, *, bs: int | None = None, k: int | None = None) -> None:
    """Dtypes and shapes of a :class:`MissPlan` (optionally against a batch of ``bs`` x ``k``)."""
    _need("plan.src", plan.src, (torch.int64,), 2)
    _need("plan.dst", plan.dst, (torch.int32,), 2)
    _need("plan.count", plan.count, (torch.int32,), 1)
    _same("plan.dst.shape", tuple(plan.dst.shape), tuple(plan.src.shape), "plan.src.shape")
    _same("plan.count.shape[0]", plan.count.shape[0], plan.src.shape[0], "plan.src.shape[0]")
    if bs is not None:
        _same("plan.src.shape[0]", plan.src.shape[0], bs, "top_k.shape[0] (batch)")
    if k is not None and plan.src.shape[1] < k:
        raise ValueError(f"plan.src has {plan.src.shape[1]} columns, fewer than k = {k}.")


#: Threads per CTA when the caller gives none (the config default ``swap_in_block_size``).
DEFAULT_BLOCK_SIZE = 512


def check_block_size(block: int) -> int:
    """``block`` if it is a valid CUDA block size for the resolve kernels (a positive multiple
    of 32, at most 1024: every such size works with one build), else ValueError."""
    if block < 32 or block % 32 or block > 1024:
        raise ValueError(
            f"block_size = {block} must be a positive multiple of 32 no larger than 1024 "
            f"(CUDA threads per block); e.g. {DEFAULT_BLOCK_SIZE}."
        )
    return block


def check_real_rows(kw: dict, bs: int) -> tuple[int, torch.Tensor, torch.Tensor, int]:
    """Value checks every resolve flavour shares (host syncs): ``0 <= num_real_reqs <= bs`` and
    real rows' ``req_index`` in ``[0, R)`` without duplicates. Returns ``(num_real, req_index,
    seq_lens, max_ctx)`` with the real rows' values on the CPU as int64."""
    R, max_ctx = kw["host_rows"].shape
    nr = int(kw["num_real_reqs"].reshape(-1)[0])
    if not 0 <= nr <= bs:
        raise ValueError(f"num_real_reqs = {nr} is outside [0, batch={bs}].")
    req = kw["req_index"][:nr].long().cpu()
    lens = kw["seq_lens"][:nr].long().cpu()
    if nr and (req.min() < 0 or req.max() >= R):
        raise ValueError(f"req_index has {req.tolist()} outside [0, {R}) (request slots R).")
    if req.unique().numel() != nr:
        raise ValueError(f"req_index has duplicate request slots among real rows: {req.tolist()}.")
    return nr, req, lens, max_ctx


def validate_resolve(**kw) -> None:
    """Full check of decode resolve inputs: shapes/dtypes, then values (host syncs; skipped in
    capture). The rules of :func:`validate_verify` with W = 1: ``seq_lens`` in
    ``[1, host_rows.shape[1]]`` and every ``top_k`` entry -1 or in ``[0, seq_len)``."""
    check_resolve_shapes(**kw)
    _validate_values(kw, verify=False)


def validate_verify(**kw) -> None:
    """Full check of verify-step resolve inputs (host syncs; value checks skipped in capture).

    Value rules: ``0 <= num_real_reqs <= bs``; real rows' ``req_index`` in ``[0, R)`` and
    unique; ``seq_lens[b, 0] >= 1``, ``seq_lens[b, j] == seq_lens[b, 0] + j`` and
    ``seq_lens[b, W-1] <= host_rows.shape[1]``; ``top_k[b, j, i]`` is -1 or in
    ``[0, seq_lens[b, j])``.
    """
    check_verify_shapes(**kw)
    _validate_values(kw, verify=True)


def _validate_values(kw: dict, *, verify: bool) -> None:
    """The value rules of both flavours on the window form (decode: W = 1, one row per request)."""
    top_k = kw["top_k"]
    bs = top_k.shape[0]
    if _is_capturing(top_k) or bs == 0:
        return
    nr, req, lens, max_ctx = check_real_rows(kw, bs)
    if not nr:
        return
    tk = top_k[:nr].long().cpu()
    if not verify:
        lens, tk = lens[:, None], tk[:, None, :]
    W = lens.shape[1]
    steps = lens - lens[:, :1]
    if not torch.equal(steps, torch.arange(W).expand(nr, W)):
        b = int((steps != torch.arange(W)).any(1).nonzero()[0])
        raise ValueError(
            f"seq_lens[{b}] = {lens[b].tolist()}: verify row j must have length seq_lens[b, 0] + j "
            f"(SGLang's dsa_seqlens_expanded for one request, viewed as [bs, W])."
        )
    if lens[:, 0].min() < 1 or lens[:, -1].max() > max_ctx:
        shown = lens if verify else lens[:, 0]
        raise ValueError(f"seq_lens {shown.tolist()} outside [1, {max_ctx}] (host_rows.shape[1]).")
    bad = (tk < -1) | (tk >= lens[:, :, None])
    if bool(bad.any()):
        b, j, i = (int(x) for x in bad.nonzero()[0])
        if verify:
            raise ValueError(
                f"top_k[{b}, {j}, {i}] = {int(tk[b, j, i])} is outside [0, seq_len="
                f"{int(lens[b, j])}) and not -1 (padding). Verify row {j} may only select tokens "
                f"before its own length."
            )
        raise ValueError(
            f"top_k[{b}, {i}] = {int(tk[b, j, i])} is outside [0, seq_len={int(lens[b, j])}) and "
            f"not -1 (padding). Positions must name existing tokens of request {int(req[b])}."
        )


def validate_replay(*, plan: MissPlan, num_real_reqs, host_cache, device_cache) -> None:
    """Check replay inputs: plan shapes; values (counts, row bounds) unless capturing."""
    check_plan_shapes(plan)
    _need("num_real_reqs", num_real_reqs, (torch.int32,), 1)
    _need("host_cache", host_cache, (torch.uint8,), 2)
    _need("device_cache", device_cache, (torch.uint8,), 2)
    _same("device_cache.shape[1]", device_cache.shape[1], host_cache.shape[1], "host_cache.shape[1]")
    if host_cache.shape[1] % ROW_ALIGN:
        raise ValueError(f"item size {host_cache.shape[1]} B is not a multiple of {ROW_ALIGN}.")
    if _is_capturing(plan.count) or plan.src.shape[0] == 0:
        return
    bs, k = plan.src.shape
    nr = int(num_real_reqs.reshape(-1)[0])
    if not 0 <= nr <= bs:
        raise ValueError(f"num_real_reqs = {nr} is outside [0, plan rows={bs}].")
    cnt = plan.count[:nr].long().cpu()
    if nr and (cnt.min() < 0 or cnt.max() > k):
        raise ValueError(f"plan.count {cnt.tolist()} outside [0, {k}].")
    cols = torch.arange(k)[None, :] < cnt[:, None]
    src, dst = plan.src[:nr].cpu()[cols], plan.dst[:nr].long().cpu()[cols]
    if src.numel() and (src.min() < 0 or src.max() >= host_cache.shape[0]):
        raise ValueError(f"plan.src has rows outside [0, {host_cache.shape[0]}) (host_cache rows).")
    if dst.numel() and (dst.min() < 0 or dst.max() >= device_cache.shape[0]):
        raise ValueError(f"plan.dst has rows outside [0, {device_cache.shape[0]}) (device_cache rows).")
