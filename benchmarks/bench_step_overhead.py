"""Host launches per decode step and GPU time of the per-step bookkeeping (fused in issue 29),
at 61 and 78 layers, 656-byte (fp8 DSA) and 1152-byte (bf16) rows, batch 1 / 16 / 64. Writes
JSON.

    python benchmarks/bench_step_overhead.py --out /tmp/step_overhead.json        # GPU, realistic
    python benchmarks/bench_step_overhead.py --smoke --out /tmp/smoke.json        # CPU, seconds

Sections, each timed per decode step (release: per finished request):

``map_last_loc``  the coordinator's step call SGLang makes before the forward: write-through
                  backup of the previous newest token (all layers), growth, newest-token mapping
``backup``        the backup's row copy alone (``transfer.to_host``, bs rows x L layers)
``translation``   the KV-write location translation of one forward: L layers translating
                  ``out_cache_loc`` (``memory.translation.ForwardTranslation``)
``release``       ``finish`` + the caller's ``free`` of one long request (B+1 hot rows) against a
                  logical mapping of ``--logical-ids`` entries

The pre-fusion code (a gather + ``index_copy_`` per layer, a translation in every layer, a
release that scans the whole mapping) ran against it in ``results/step_overhead_h200.json``
(modes "before" / "after") and was then deleted (docs/kernels.md, "Design history").

Launch counting. ``launches`` counts, with a ``TorchDispatchMode``, every non-view aten op
that touches device-resident data (on CUDA: a CUDA tensor; on CPU: the coordinator's device
state marked by ``hisparse_testing.sync_guard``, and everything derived from it), plus one per
tvm-ffi kernel call (``kernels.layer_copy``), which the dispatcher does not see. On CPU it leaves
out the host-to-device uploads of host-side lists (``torch.tensor(list).to(device)`` is a no-op
there); on CUDA they are counted. On CUDA ``cuda_launches`` is the ground truth: the CUDA runtime
launch and copy calls (``cudaLaunchKernel*``, ``cuLaunchKernel*``, ``cudaMemcpy*Async``,
``cudaMemsetAsync``) the torch profiler records in the section, and ``gpu_us`` the summed device
time of the kernels and copies it ran (every stream, the backup stream included). ``host_us``
is the wall time of the call on the host (no synchronization inside).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hisparse_testing.device_pool import DeviceKVPool  # noqa: E402
from hisparse_testing.sync_guard import DeviceSide, device_side, mark_device_state  # noqa: E402
from sglang_hisparse.coordinator import transfer  # noqa: E402
from sglang_hisparse.coordinator.core import HiSparseCore  # noqa: E402
from sglang_hisparse.memory.allocator import DualSpaceAllocator  # noqa: E402
from sglang_hisparse.memory.host_pool import HostKVPool  # noqa: E402
from sglang_hisparse.memory.translation import ForwardTranslation, translate_locations  # noqa: E402

_LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync",
                "cudaMemcpy2DAsync", "cudaMemsetAsync", "cuLaunchKernelEx")


class LaunchCounter(TorchDispatchMode):
    """Counts device-side aten ops (see the module docstring); ``opaque(fn)`` counts one launch
    for a call the dispatcher does not see and stops counting inside it (its CPU reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._paused = 0

    @staticmethod
    def _device_side(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and (x.is_cuda or isinstance(x, DeviceSide))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused or getattr(func, "is_view", False):
            return out
        flat = [*args, *kwargs.values(), *(out if isinstance(out, (tuple, list)) else (out,))]
        flat += [y for a in args if isinstance(a, (tuple, list)) for y in a]
        if any(self._device_side(a) for a in flat):
            self.count += 1
        return out

    @contextmanager
    def opaque(self):
        self.count += 1
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1


_COUNTER: LaunchCounter | None = None
_copy_rows = transfer.copy_rows


def _counted_copy_rows(**kw):
    if _COUNTER is None:
        return _copy_rows(**kw)
    with _COUNTER.opaque():
        return _copy_rows(**kw)


transfer.copy_rows = _counted_copy_rows  # one launch, whatever the CPU reference dispatches


#: requests admitted next to the batch and never stepped, so that every batch size has
#: releases to time (a release's cost does not depend on whether the request decoded)
EXTRA_RELEASES = 8


class StepRig:
    """``bs`` long requests (PD-admitted, ``n0 > B``) decoding on one coordinator, plus
    ``EXTRA_RELEASES`` admitted ones outside the batch."""

    def __init__(self, *, layers: int, item: int, bs: int, buffer: int, page: int,
                 logical_ids: int, steps: int, device: torch.device) -> None:
        self.device, self.bs, self.layers = device, bs, layers
        self.n0 = buffer + page + 1
        ctx_len = self.n0 + steps + 2 * page
        slots = bs + EXTRA_RELEASES
        rows = (slots * (buffer + 1 + 2 * page) // page + 2) * page
        ratio = max(1, math.ceil(logical_ids / rows))
        self.allocator = DualSpaceAllocator(rows, host_to_device_ratio=ratio, page_size=page,
                                            device=device)
        self.pool = DeviceKVPool(num_layers=layers, item_bytes=item, allocator=self.allocator)
        self.host = HostKVPool(num_layers=layers, item_bytes=item,
                               capacity_tokens=rows * ratio,  # a logical id's host row is the id
                               page_size=page, max_requests=slots + 1, max_context=ctx_len,
                               device=device)
        self.core = HiSparseCore(
            top_k=min(64, buffer), buffer_size=buffer, num_reqs=slots + 1, allocator=self.allocator,
            host=self.host, device_kv=list(self.pool.kv), host_kv=list(self.host.kv), device=device,
            max_batch=bs, prefetch=False, log_interval_s=0,
        )
        if device.type == "cpu":  # the CPU stand-in of "this lives on the device" (counting)
            mark_device_state(self.core)
            self.core.ctx.host_kv = [device_side(t) for t in self.core.ctx.host_kv]
            hot = self.allocator.hot
            hot.mapping = device_side(hot.mapping)
            hot._released = device_side(hot._released_scratch())
        self.translation = ForwardTranslation(translate_locations)
        self.req_to_token = torch.zeros(slots + 1, ctx_len, dtype=torch.int64, device=device)
        self.seq = [self.n0] * slots
        zero = torch.zeros(1, dtype=torch.int64)
        for r in range(slots):
            ids = self.allocator.alloc_logical_extend(zero, torch.tensor([self.n0]),
                                                      torch.full((1,), -1, dtype=torch.int64))
            self.req_to_token[r, : self.n0] = ids.to(device)
            self.host.bind(r, 0, ids)
            self.core.admit_direct(r, self.n0)
        self.req_index = torch.arange(bs, device=device)
        self._mark = (lambda t: device_side(t)) if device.type == "cpu" else (lambda t: t)

    def next_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's part before the call: seq_lens += 1 and one logical id per request."""
        seq = self.seq[: self.bs]
        new_lens = [n + 1 for n in seq]
        last = self.req_to_token[self.req_index, torch.tensor(seq, device=self.device) - 1]
        ids = self.allocator.alloc_decode(torch.tensor(new_lens), last)
        self.req_to_token[self.req_index, torch.tensor(seq, device=self.device)] = ids
        return self._mark(ids), self._mark(torch.tensor(new_lens, device=self.device))

    def map_last_loc(self, ids: torch.Tensor, lens: torch.Tensor) -> None:
        self.core.map_last_loc(req_index=self._mark(self.req_index), seq_lens=lens,
                               new_logical=ids, req_index_cpu=list(range(self.bs)),
                               seq_lens_cpu=[n + 1 for n in self.seq[: self.bs]])
        self.core.wait_for_pending_backup()
        self.seq[: self.bs] = [n + 1 for n in self.seq[: self.bs]]

    def translate_forward(self, ids: torch.Tensor) -> None:
        for layer in range(self.layers):
            self.translation(self.allocator.mapping, ids, layer)

    def backup_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.core.state
        dev_rows = st.slot_rows[self.req_index, self.core.buffer_size].to(torch.int64)
        q = torch.tensor([n - 2 for n in self.seq[: self.bs]], device=self.device)
        return dev_rows, self.host.host_rows[self.req_index, q]

    def release(self, r: int) -> None:
        self.core.finish(r)
        self.allocator.free(self.req_to_token[r, : self.seq[r]])

    def close(self) -> None:
        self.core.destroy()
        self.host.destroy()  # unregister the pinned pool before the next configuration pins


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: torch.device, fn: Callable[[], None], *, profile: bool) -> dict[str, Any]:
    """One call of ``fn``: launches (dispatcher), host wall time, and on CUDA with ``profile``
    the runtime launch calls and device time the profiler saw."""
    _sync(device)
    rec: dict[str, Any] = {}
    if profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            fn()
            _sync(device)
        events = p.events()
        rec["cuda_launches"] = sum(1 for e in events if e.name.startswith(_LAUNCH_APIS))
        rec["gpu_us"] = sum(e.time_range.elapsed_us() for e in events
                            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
        return rec
    if profile:
        return {"launches": count_launches(fn)}
    t0 = time.perf_counter()
    fn()
    rec["host_us"] = (time.perf_counter() - t0) * 1e6
    _sync(device)
    return rec


def count_launches(fn: Callable[[], None]) -> int:
    global _COUNTER
    counter = LaunchCounter()
    _COUNTER = counter
    try:
        with counter:
            fn()
    finally:
        _COUNTER = None
    return counter.count


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("launches", "cuda_launches", "host_us", "gpu_us"):
        vals = [s[key] for s in samples if key in s]
        if vals:
            out[key] = statistics.median(vals)
            out[f"{key}_samples"] = [round(v, 3) for v in vals]
    return out


def run_config(*, layers: int, item: int, bs: int, args, device) -> dict[str, Any]:
    steps = args.warmup + args.reps + args.profile_reps + 2
    rig = StepRig(layers=layers, item=item, bs=bs, buffer=args.buffer, page=args.page,
                  logical_ids=args.logical_ids, steps=steps, device=device)
    raw: dict[str, list[dict[str, Any]]] = {k: [] for k in ("map_last_loc", "backup", "translation", "release")}
    stale = -1
    try:
        for i in range(args.warmup + args.reps + args.profile_reps + 1):
            ids, lens = rig.next_ids()
            phase = "warm" if i < args.warmup else "time" if i < args.warmup + args.reps else "prof"
            if i == args.warmup + args.reps + args.profile_reps:
                phase = "count"
            step = {"map_last_loc": lambda ids=ids, lens=lens: rig.map_last_loc(ids, lens),
                    "translation": lambda ids=ids: rig.translate_forward(ids)}
            for name, fn in step.items():
                if phase == "count":
                    raw[name].append({"launches": count_launches(fn)})
                elif phase == "warm":
                    fn()
                else:
                    raw[name].append(measure(device, fn, profile=phase == "prof"))
                if name == "map_last_loc" and phase != "warm":
                    dev_rows, host_rows = rig.backup_rows()
                    ctx = rig.core.ctx
                    def backup(ctx=ctx, dev_rows=dev_rows, host_rows=host_rows) -> None:
                        transfer.to_host(ctx, dev_rows, host_rows)

                    if phase == "count":
                        raw["backup"].append({"launches": count_launches(backup)})
                    else:
                        raw["backup"].append(measure(device, backup, profile=phase == "prof"))
        for r in range(bs + EXTRA_RELEASES):
            phase = "count" if r == 0 else "prof" if r <= args.profile_reps else "time"
            fn = lambda r=r: rig.release(r)  # noqa: E731
            if phase == "count":
                raw["release"].append({"launches": count_launches(fn)})
            else:
                raw["release"].append(measure(device, fn, profile=phase == "prof"))
        # every request released and freed: no mapping may survive (cheap on the GPU, where a
        # full check_integrity of a 10^7-id mapping would cost seconds per configuration)
        stale = int((rig.allocator.mapping[:-1] != 0).sum())
        if stale:
            raise AssertionError(f"{stale} logical ids still mapped after every request was released")
    finally:
        rig.close()
    logical = rig.allocator.logical.total_ids
    rig = None  # free the device KV and the pinned pool before the next configuration
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"layers": layers, "item": item, "batch": bs,
            "logical_ids": logical, "stale_mappings_after_release": stale,
            "sections": {k: summarize(v) for k, v in raw.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON output file")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, seconds")
    ap.add_argument("--layers", type=int, nargs="+", default=[61, 78])
    ap.add_argument("--items", type=int, nargs="+", default=[656, 1152])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--buffer", type=int, default=128, help="B (hot slots); the costs do not depend on it")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--logical-ids", type=int, default=1 << 24,
                    help="logical mapping size (a server: device rows x host_to_device_ratio)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--profile-reps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
        args.layers, args.items, args.batches = [61], [656], [1, 16]
        args.buffer, args.page, args.logical_ids = 64, 16, 1 << 16
        args.warmup, args.reps, args.profile_reps = 1, 3, 1
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def write(complete: bool) -> None:
        """The JSON so far (after every configuration: a run cut short keeps what it measured)."""
        doc = {
            "benchmark": "bench_step_overhead", "device": str(device), "complete": complete,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "smoke": args.smoke,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "launch_counting": __doc__.split("Launch counting.")[1].strip(),
            "seconds": round(time.perf_counter() - t0, 1),
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))

    for L in args.layers:
        for item in args.items:
            for bs in args.batches:
                res = run_config(layers=L, item=item, bs=bs, args=args, device=device)
                results.append(res)
                s = res["sections"]
                print(f"L={L} item={item} bs={bs} " + "  ".join(
                    f"{k}: {v.get('cuda_launches', v.get('launches'))} launches "
                    f"{v.get('gpu_us', float('nan')):.1f} us gpu {v.get('host_us', float('nan')):.1f} us host"
                    for k, v in s.items()), flush=True)
                write(complete=False)
    write(complete=True)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
