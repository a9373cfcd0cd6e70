"""Replay a recorded trace through the resolve op (the CUDA kernel, or the reference on CPU)
and count its misses per step, to hold them against ``simulator.simulate_stream``.

Each layer's streams are one batch per decode step (padded with -1 to the trace's top-k),
starting from the coordinator's admission state: token p in slot p, LRU s0..s(B-1), zero
policy words. The op runs NO_IO: misses are bookkeeping, not bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernel_policy import state_width
from ..kernels import ops
from ..kernels.contract import MissPlan, ResolveMode
from .format import Trace


def kernel_misses(trace: Trace, B: int, policy: str = "lru", *, device: str | torch.device = "cuda",
                  layers: int | None = None, item: int = 656) -> dict[tuple[int, int], np.ndarray]:
    """``{(stream, layer): misses per step (int64 [T])}`` for the first ``layers`` layers
    (all by default) of ``trace`` at ``B`` hot slots under ``policy`` ("lru", "fra" or "slru")."""
    dev = torch.device(device)
    k = int(trace.header["top_k"])
    by_layer: dict[int, list] = {}
    for st in trace.streams():
        by_layer.setdefault(st.layer, []).append(st)
    out = {}
    for layer in sorted(by_layer)[:layers]:
        sts = by_layer[layer]
        R, T = len(sts), max(len(s) for s in sts)
        max_ctx = int(max(s.seq_lens.max() for s in sts)) + 1
        slot_tokens = torch.arange(B + 1, dtype=torch.int32, device=dev).repeat(R, 1)
        slot_rows = (1 + torch.arange(R * (B + 1), dtype=torch.int32, device=dev)).view(R, B + 1)
        lru = torch.arange(B, dtype=torch.int16, device=dev).repeat(R, 1)
        extra = {}
        if policy != "lru":
            extra = dict(policy=policy, policy_state=torch.zeros(R, state_width(policy, B), dtype=torch.int32,
                                                                 device=dev))
        host_rows = torch.arange(R * max_ctx, dtype=torch.int64, device=dev).view(R, max_ctx)
        host_cache = torch.zeros(R * max_ctx, item, dtype=torch.uint8)
        if dev.type == "cuda":
            host_cache = host_cache.pin_memory()
        device_cache = torch.zeros(1 + R * (B + 1), item, dtype=torch.uint8, device=dev)
        out_rows = torch.empty(R, k, dtype=torch.int32, device=dev)
        counts = np.zeros((R, T), np.int64)
        for t in range(T):
            live = [i for i, s in enumerate(sts) if t < len(s)]
            top_k = torch.full((len(live), k), -1, dtype=torch.int32)
            for b, i in enumerate(live):
                sel = sts[i].selection(t)
                top_k[b, : sel.size] = torch.from_numpy(sel.astype(np.int32))
            plan = MissPlan.empty(len(live), k, dev)
            ops.resolve(top_k=top_k.to(dev), req_index=torch.tensor(live, dtype=torch.int32, device=dev),
                        seq_lens=torch.tensor([int(sts[i].seq_lens[t]) for i in live], dtype=torch.int64,
                                              device=dev),
                        num_real_reqs=torch.tensor([len(live)], dtype=torch.int32, device=dev),
                        slot_tokens=slot_tokens, slot_rows=slot_rows, lru=lru, host_rows=host_rows,
                        host_cache=host_cache, device_cache=device_cache, out_rows=out_rows[: len(live)],
                        plan=plan, mode=ResolveMode.NO_IO, **extra)
            counts[live, t] = plan.count.cpu().numpy()
        for i, s in enumerate(sts):
            out[(s.stream, layer)] = counts[i, : len(s)]
    return out
