"""Verify-step resolve kernel == pure-torch reference, bit for bit (GPU; skipped without CUDA).

Grid (issue 7): n in {1, 3} draft tokens (W = n+1 rows), k in {64, 2048}, B in {4k, (n+2)k};
item 656 B for B = 4k and 1152 B for B = (n+2)k (both sizes for every (n, k) while keeping the
number of JIT builds at 8). Each case runs three successive verify steps on a batch that mixes
long, barely-long, transition (n0 <= B < n0+n), short and padding requests with padding and
duplicate entries, and compares out_rows, slot_tokens, lru, the plan and every device KV byte;
under the slru policy also its level boundaries (``policy_state``).
"""

from __future__ import annotations

import pytest
import torch

from sglang_hisparse import kernel_policy as kp
from sglang_hisparse.kernels import ops
from sglang_hisparse.kernels import reference as ref
from sglang_hisparse.kernels.contract import MissPlan, ResolveMode
from sglang_hisparse.kernels.synthetic import HotState, make_verify_state, make_verify_topk
from sglang_hisparse.kernels.verify_ops import reserve_verify_workspace, resolve_verify

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="verify kernel tests need a CUDA GPU")

GRID = [(n, k, B, 656 if B == 4 * k else 1152)
        for n in (1, 3) for k in (64, 2048) for B in (4 * k, (n + 2) * k)]


class Case:
    """A CPU reference state and its GPU twin, plus the batch layout."""

    def __init__(self, *, n, k, B, item, seed=0, bs=6, nr=5, policy="lru"):
        W = n + 1
        self.policy = policy
        self.W, self.k, self.B, self.bs = W, k, B, bs
        lens = [B + 2, 3 * B + 11, B // 2, B - 1, 2 * B + 7, 2 * B][:bs]  # rows-0 lengths
        g = torch.Generator().manual_seed(seed)
        self.req = torch.randperm(bs, generator=g)[:bs].tolist()
        self.cpu = make_verify_state(seq_lens=lens, B=B, W=W, item=item, pin=True, seed=seed)
        self.gpu = self._to_gpu(self.cpu)
        self.nr = torch.tensor([nr], dtype=torch.int32)
        self.seed = seed
        # slru: random level boundaries within the caps (request slot 0: all level 0)
        self.pstate_cpu = self.pstate_gpu = None
        if policy == "slru":
            R = self.cpu.lru.shape[0]
            cap1, cap2 = kp.slru_caps(B)
            b2 = B - torch.randint(0, cap2 + 1, (R,), generator=g)
            b1 = (b2 - torch.randint(0, cap1 + 1, (R,), generator=g)).clamp(min=0)
            words = [kp.slru_pack(int(x), int(y), B) for x, y in zip(b1, b2, strict=True)]
            words[0] = 0
            self.pstate_cpu = torch.tensor(words, dtype=torch.int32).view(R, 1)
            self.pstate_gpu = self.pstate_cpu.cuda()

    @staticmethod
    def _to_gpu(st):
        return HotState(st.slot_tokens.cuda(), st.slot_rows.cuda(), st.lru.cuda(),
                        st.host_rows.cuda(), st.host_cache, st.device_cache.cuda(), st.seq_lens)

    def seq_lens(self):
        n0 = self.cpu.seq_lens[self.req]
        return n0[:, None] + torch.arange(self.W)

    def topk(self, step: int, churn: float) -> torch.Tensor:
        tk = make_verify_topk(self.cpu, self.req, W=self.W, k=self.k, churn=churn,
                              pad_entries=min(3, self.k // 8), seed=self.seed * 10 + step)
        d = self.k // 16
        tk[:, 1:, :d] = tk[:, :1, d:2 * d]  # positions shared across rows, within rows too
        tk[:, :, 2 * d:3 * d] = tk[:, :, 3 * d:4 * d]
        return tk

    def args(self, st, tk, dev):
        return dict(top_k=tk.to(dev), req_index=torch.tensor(self.req, device=dev),
                    seq_lens=self.seq_lens().to(dev, torch.int32), num_real_reqs=self.nr.to(dev),
                    slot_tokens=st.slot_tokens, slot_rows=st.slot_rows, lru=st.lru,
                    host_rows=st.host_rows, host_cache=st.host_cache,
                    device_cache=st.device_cache)


def step(case: Case, tk, *, mode=ResolveMode.COPY, plan=True, **launch):
    """One verify step on both states; returns (cpu out, gpu out, cpu plan, gpu plan)."""
    W, k, bs = case.W, case.k, case.bs
    outs, plans = [], []
    for st, dev in ((case.cpu, "cpu"), (case.gpu, "cuda")):
        out = torch.full((bs, W, k), 777, dtype=torch.int32, device=dev)
        p = MissPlan.empty(bs, W * k, dev) if plan else None
        fn = ref.resolve_verify if dev == "cpu" else resolve_verify
        pol = {} if case.policy == "lru" else dict(
            policy=case.policy, policy_state=case.pstate_cpu if dev == "cpu" else case.pstate_gpu)
        fn(**case.args(st, tk, dev), out_rows=out, plan=p, mode=mode, validate=True, **pol,
           **({} if dev == "cpu" else launch))
        outs.append(out)
        plans.append(p)
    torch.cuda.synchronize()
    return outs[0], outs[1], plans[0], plans[1]


def assert_same(case: Case, out_c, out_g, plan_c, plan_g):
    assert torch.equal(out_g.cpu(), out_c), "out_rows differ"
    assert torch.equal(case.gpu.slot_tokens.cpu(), case.cpu.slot_tokens), "slot_tokens differ"
    assert torch.equal(case.gpu.lru.cpu(), case.cpu.lru), "lru differs"
    assert torch.equal(case.gpu.device_cache.cpu(), case.cpu.device_cache), "device KV differs"
    if case.pstate_cpu is not None:
        assert torch.equal(case.pstate_gpu.cpu(), case.pstate_cpu), "policy_state differs"
    if plan_c is not None:
        assert torch.equal(plan_g.count.cpu(), plan_c.count), "plan counts differ"
        for b in range(case.bs):
            c = int(plan_c.count[b])
            assert torch.equal(plan_g.src[b, :c].cpu(), plan_c.src[b, :c]), f"plan.src row {b}"
            assert torch.equal(plan_g.dst[b, :c].cpu(), plan_c.dst[b, :c]), f"plan.dst row {b}"


@pytest.mark.parametrize("policy", ["lru", "slru"])
@pytest.mark.parametrize("n, k, B, item", GRID)
def test_kernel_matches_reference(n, k, B, item, policy):
    case = Case(n=n, k=k, B=B, item=item, seed=n * 7 + k % 13, policy=policy)
    for s, churn in enumerate((0.3, 0.05, 0.6)):
        assert_same(case, *step(case, case.topk(s, churn)))


@pytest.mark.parametrize("policy", ["lru", "slru"])
@pytest.mark.parametrize("block, ctas", [(32, 1), (128, 3), (1024, None), (96, 32)])
def test_every_block_size_and_cta_split(block, ctas, policy):
    case = Case(n=3, k=64, B=256, item=656, seed=block, policy=policy)
    for s in range(2):
        assert_same(case, *step(case, case.topk(s, 0.4), block_size=block, ctas_per_request=ctas))


@pytest.mark.parametrize("ctas", [0, 1025])
def test_cta_split_outside_the_range_is_refused(ctas):
    """ctas_per_request must be in [1, 1024]; None (not 0) picks one resident wave."""
    case = Case(n=3, k=64, B=256, item=656)
    with pytest.raises(ValueError, match=r"ctas_per_request = -?\d+ must be in \[1, 1024\]"):
        step(case, case.topk(0, 0.4), ctas_per_request=ctas)


def test_no_io_does_bookkeeping_only():
    case = Case(n=1, k=64, B=256, item=656, seed=3)
    before = case.gpu.device_cache.clone()
    out_c, out_g, plan_c, plan_g = step(case, case.topk(0, 0.5), mode=ResolveMode.NO_IO)
    assert torch.equal(case.gpu.device_cache, before)
    assert int(plan_c.count.sum()) > 0
    assert_same(case, out_c, out_g, plan_c, plan_g)


def test_plan_replays_with_the_replay_kernel():
    case = Case(n=3, k=64, B=320, item=1152, seed=4)
    _, _, plan_c, plan_g = step(case, case.topk(0, 0.6))
    other = torch.randint(0, 256, case.cpu.host_cache.shape, dtype=torch.uint8).pin_memory()
    dev_c, dev_g = case.cpu.device_cache.clone(), case.gpu.device_cache.clone()
    ops.replay(plan=plan_c, num_real_reqs=case.nr, host_cache=other, device_cache=dev_c)
    ops.replay(plan=plan_g, num_real_reqs=case.nr.cuda(), host_cache=other, device_cache=dev_g)
    torch.cuda.synchronize()
    assert torch.equal(dev_g.cpu(), dev_c)


@pytest.mark.parametrize("policy", ["lru", "slru"])
@pytest.mark.parametrize("n, k, B, item", [(3, 64, 256, 656), (1, 2048, 8192, 656)])
def test_cuda_graph_capture_and_replay(n, k, B, item, policy):
    case = Case(n=n, k=k, B=B, item=item, seed=5, policy=policy)
    W, bs = case.W, case.bs
    static = case.args(case.gpu, case.topk(0, 0.2), "cuda")
    out = torch.zeros(bs, W, k, dtype=torch.int32, device="cuda")
    plan = MissPlan.empty(bs, W * k, "cuda")
    reserve_verify_workspace("cuda", bs)
    pol = {} if policy == "lru" else dict(policy=policy, policy_state=case.pstate_gpu)
    call = dict(static, out_rows=out, plan=plan, validate=False, **pol)
    # Warm up on a throwaway copy of the state (builds the module, sets smem attributes).
    resolve_verify(**{**call, "slot_tokens": case.gpu.slot_tokens.clone(),
                      "lru": case.gpu.lru.clone(), "device_cache": case.gpu.device_cache.clone(),
                      **({} if policy == "lru" else {"policy_state": case.pstate_gpu.clone()})})
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        resolve_verify(**call)
    for s, (churn, nr) in enumerate(((0.3, 5), (0.1, 6), (0.5, 2))):
        tk = case.topk(s + 1, churn)
        static["top_k"].copy_(tk)
        static["num_real_reqs"].fill_(nr)
        case.nr = torch.tensor([nr], dtype=torch.int32)
        graph.replay()
        out_c = torch.full((bs, W, k), 777, dtype=torch.int32)
        plan_c = MissPlan.empty(bs, W * k, "cpu")
        ref.resolve_verify(**case.args(case.cpu, tk, "cpu"), out_rows=out_c, plan=plan_c,
                           **({} if policy == "lru" else dict(policy=policy, policy_state=case.pstate_cpu)))
        torch.cuda.synchronize()
        assert_same(case, out_c, out, plan_c, plan)


@pytest.mark.parametrize("k, B, W", [(64, 256, 2), (2048, 8192, 4), (2048, 10240, 4), (2048, 6144, 2)])
def test_kernel_limits_mirror_the_verify_kernels_shared_memory(k, B, W):
    """kernel_limits.verify_smem_bytes (what config validation checks) == the kernel's own
    VerifyLayout, so the startup refusal and the launch agree by construction."""
    from sglang_hisparse.kernel_limits import verify_smem_bytes
    from sglang_hisparse.kernels import _jit

    assert _jit.verify_module(k, B, W, 656).smem_bytes() == verify_smem_bytes(k, B, W)
