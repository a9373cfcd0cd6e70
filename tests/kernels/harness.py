"""Kernel-vs-reference harness shared by the GPU tests and the sanitizer script.

A scenario is a hot-buffer state for ``bs + 2`` request slots (CPU, host cache pinned) plus a
batch of selections over a mix of request kinds (long, just past B, exactly B, short), churns
(0 % .. 100 %), duplicates and padding entries, with the last batch row a padding row.
``run_both`` resolves it with the reference on CPU and with the CUDA op on GPU copies of the
same state and returns both results for a bit-exact comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_hisparse.kernels import ops
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.contract import MissPlan, ResidentRows, ResolveMode
from sglang_hisparse.kernels.synthetic import HotState, make_state, make_topk

CHURNS = [0.0, 0.05, 0.15, 0.5, 1.0, 0.3]


@dataclass
class Scenario:
    state: HotState
    top_k: torch.Tensor  # int32 [bs, k], CPU
    req_index: torch.Tensor
    seq_lens: torch.Tensor
    num_real: int


def scenario(k: int, B: int, item: int, bs: int, *, seed: int = 0, pad_row: bool = True,
             idx_dtype: torch.dtype = torch.int64, hint: str | None = None) -> Scenario:
    """``hint``: keep a resident hint of that kind (``HotState.with_hint``), else none."""
    g = torch.Generator().manual_seed(seed)
    R = bs + 2
    max_ctx = 4 * B + 8
    lens = []
    for r in range(R):
        kind = r % 4
        if kind == 0:
            lens.append(int(torch.randint(B + 2, max_ctx + 1, (1,), generator=g)))
        elif kind == 1:
            lens.append(B + 1)
        elif kind == 2:
            lens.append(B)
        else:
            lens.append(int(torch.randint(1, B + 1, (1,), generator=g)))
    st = make_state(seq_lens=lens, B=B, item=item, max_ctx=max_ctx,
                    host_pool_rows=min(R * max_ctx, 1 << 16), pin=True, seed=seed)
    if hint is not None:
        st = st.with_hint(hint, seed=seed)
    req = torch.randperm(R, generator=g)[:bs].tolist()
    churn = [CHURNS[(i + seed) % len(CHURNS)] for i in range(bs)]
    tk = make_topk(st, req, k=k, churn=churn, dup_frac=0.05, pad_entries=seed % 2, seed=seed)
    nr = bs - 1 if (pad_row and bs > 1) else bs
    req_t = torch.tensor(req, dtype=idx_dtype)
    return Scenario(st, tk, req_t, st.seq_lens[req].to(idx_dtype), nr)


def next_selection(sc: Scenario, state: HotState, *, seed: int, num_real: int | None = None
                   ) -> Scenario:
    """Same batch rows as ``sc``, a fresh selection drawn against ``state`` (e.g. after a step)."""
    bs, k = sc.top_k.shape
    churn = [CHURNS[(i + seed) % len(CHURNS)] for i in range(bs)]
    tk = make_topk(state, sc.req_index.tolist(), k=k, churn=churn, dup_frac=0.05, seed=seed)
    return Scenario(state, tk, sc.req_index, sc.seq_lens,
                    sc.num_real if num_real is None else num_real)


def block_selection(sc: Scenario, block: int, *, seed: int) -> tuple[Scenario, torch.Tensor]:
    """A block top-k (MiniMax-M3) for ``sc``'s rows: int32 [bs, k / block] block ids (CPU), some
    -1, some past a row's length, the newest token's block usually in; and the scenario whose
    top-k is their expansion (``reference.expand_blocks``), the positions the reference takes."""
    g = torch.Generator().manual_seed(seed)
    bs, k = sc.top_k.shape
    nb = k // block
    rows = []
    for b in range(bs):
        n = int(sc.seq_lens[b])
        have = -(-n // block)
        ids = torch.randperm(have + 2, generator=g)[:nb]  # up to 2 blocks past the end
        ids = torch.cat([ids, torch.full((nb - ids.numel(),), -1, dtype=ids.dtype)])
        if b % 2 == 0 and have - 1 not in ids.tolist():
            ids[0] = have - 1  # the newest block (the forced local block of M3)
        ids[torch.rand(nb, generator=g) < 0.1] = -1
        rows.append(ids)
    blocks = torch.stack(rows).to(torch.int32)
    expanded = ref.expand_blocks(blocks, sc.seq_lens, block)
    return Scenario(sc.state, expanded, sc.req_index, sc.seq_lens, sc.num_real), blocks


def to_cuda(st: HotState) -> HotState:
    return HotState(st.slot_tokens.cuda(), st.slot_rows.cuda(), st.lru.cuda(), st.host_rows.cuda(),
                    st.host_cache, st.device_cache.cuda(), st.seq_lens.clone(),
                    None if st.resident is None else st.resident.cuda())


def call(fn, st: HotState, sc: Scenario, top_k, *, plan, mode=ResolveMode.COPY, **extra):
    dev = st.slot_tokens.device
    bs, k = sc.top_k.shape
    out = torch.full((bs, k), 7777, dtype=torch.int32, device=dev)
    fn(top_k=top_k.to(dev), req_index=sc.req_index.to(dev), seq_lens=sc.seq_lens.to(dev),
       num_real_reqs=torch.tensor([sc.num_real], dtype=torch.int32, device=dev),
       slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru, host_rows=st.host_rows,
       host_cache=st.host_cache, device_cache=st.device_cache, out_rows=out, plan=plan,
       mode=mode, resident=st.resident, **extra)
    return out


def resident_rows(sc: Scenario, *, page_size: int, seed: int = 0, ring: int = 0) -> ResidentRows:
    """Fully resident request slots for ``sc`` (CPU): every other batch row's request, with a
    random page table over the device cache's pages; ``ring`` is the record block."""
    g = torch.Generator().manual_seed(seed)
    st = sc.state
    R, P = st.host_rows.shape
    D = st.device_cache.shape[0]
    flag = torch.zeros(R, dtype=torch.int32)
    for r in sc.req_index.tolist()[::2]:
        flag[r] = 1
    cols = -(-P // page_size)
    pages = torch.randint(0, D // page_size, (R, cols), generator=g, dtype=torch.int32)
    return ResidentRows(flag=flag, pages=pages, page_size=page_size,
                        ring=torch.tensor([ring], dtype=torch.int32))


def rr_to(rr: ResidentRows, device) -> ResidentRows:
    return ResidentRows(rr.flag.to(device), rr.pages.to(device), rr.page_size, rr.ring.to(device))


def empty_plan(bs: int, k: int, device) -> MissPlan:
    p = MissPlan.empty(bs, k, device)
    p.src.fill_(-5)
    p.dst.fill_(-5)
    p.count.fill_(-5)
    return p


def reference_result(sc: Scenario, *, mode=ResolveMode.COPY, **extra):
    st = sc.state.clone()
    bs, k = sc.top_k.shape
    plan = empty_plan(bs, k, "cpu")
    out = call(ref.resolve, st, sc, sc.top_k, plan=plan, mode=mode, **extra)
    return st, out, plan


def kernel_result(sc: Scenario, *, mode=ResolveMode.COPY, top_k=None, **extra):
    """``top_k``: what the kernel takes instead of ``sc.top_k`` (a block selection)."""
    st = to_cuda(sc.state)
    bs, k = sc.top_k.shape
    plan = empty_plan(bs, k, "cuda")
    out = call(ops.resolve, st, sc, sc.top_k if top_k is None else top_k, plan=plan, mode=mode,
               validate=False, **extra)
    torch.cuda.synchronize()
    return st, out, plan


def mismatches(a, b) -> list[str]:
    """Names of the outputs that differ between two (state, out, plan) results."""
    (sa, oa, pa), (sb, ob, pb) = a, b
    bad = []
    for name in ("slot_tokens", "lru", "device_cache"):
        if not torch.equal(getattr(sa, name).cpu(), getattr(sb, name).cpu()):
            bad.append(name)
    if (sa.resident is None) != (sb.resident is None) or (
            sa.resident is not None and not torch.equal(sa.resident.cpu(), sb.resident.cpu())):
        bad.append("resident")
    if not torch.equal(oa.cpu(), ob.cpu()):
        bad.append("out_rows")
    if not torch.equal(pa.count.cpu(), pb.count.cpu()):
        bad.append("plan.count")
    else:
        for b, c in enumerate(pa.count.cpu().tolist()):
            if not (torch.equal(pa.src[b, :c].cpu(), pb.src[b, :c].cpu())
                    and torch.equal(pa.dst[b, :c].cpu(), pb.dst[b, :c].cpu())):
                bad.append(f"plan row {b}")
                break
    return bad
