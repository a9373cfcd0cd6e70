"""Arrival counters of the multi-CTA resolve kernels, allocated outside CUDA-graph capture.

Each request's CTAs count themselves in on an int32 counter so the last one to arrive writes
the request's state; the kernel resets the counter to zero before it exits, so one zeroed
buffer per device serves every later launch, captured or eager.
"""

from __future__ import annotations

import torch

#: Smallest buffer handed out, so small batches do not reallocate as the batch grows.
MIN_ROWS = 256


class ArrivalCounters:
    """Per-device int32 zeros, one per batch row, grown only outside graph capture.

    ``op`` and ``reserve_call`` name the op and its public reserve function in the error
    raised when a capture needs a larger buffer than any eager call has made.
    """

    def __init__(self, op: str, reserve_call: str) -> None:
        self._op = op
        self._reserve_call = reserve_call
        self._by_device: dict[torch.device, torch.Tensor] = {}

    @staticmethod
    def _key(device: torch.device | str) -> torch.device:
        # NOTE: "cuda" and "cuda:0" must be one key: a reserve("cuda") before capture has to be
        # found by the launch, which sees the tensor's indexed device.
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def reserve(self, device: torch.device | str, max_batch: int) -> None:
        """Make sure batches up to ``max_batch`` have counters on ``device``."""
        dev = self._key(device)
        cur = self._by_device.get(dev)
        if cur is None or cur.numel() < max_batch:
            self._by_device[dev] = torch.zeros(max(max_batch, MIN_ROWS), dtype=torch.int32, device=dev)

    def get(self, device: torch.device, bs: int) -> torch.Tensor:
        """Counters for a batch of ``bs`` rows (allocating first when not capturing)."""
        dev = self._key(device)
        cur = self._by_device.get(dev)
        if cur is None or cur.numel() < bs:
            if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                have = 0 if cur is None else cur.numel()
                raise RuntimeError(
                    f"{self._op}: batch {bs} needs the arrival workspace, which is smaller ({have}) "
                    f"and cannot be allocated during CUDA-graph capture. Call "
                    f"{self._reserve_call}({str(dev)!r}, {bs}) (or one eager call) before capturing."
                )
            self.reserve(dev, bs)
        return self._by_device[dev]
