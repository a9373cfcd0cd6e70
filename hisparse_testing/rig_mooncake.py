"""PD decode over a real transfer engine: SGLang's prefill instance and Mooncake over TCP.

Two processes, each a real SGLang ``Scheduler`` on CPU with the rig's stand-in model worker
(SGLang's parallel runtime and its Mooncake engine are process-global):

```
python -m hisparse_testing.rig_mooncake SCENARIO WORKDIR   the decode instance (the plugin):
  │   imports SGLang, writes WORKDIR/plan.json (rid, prompt, max_new_tokens, bootstrap room)
  └─ fork: prefill_main                                   the prefill instance (HiSparse off):
       SGLang's bootstrap server (start_disagg_service), PrefillBootstrapQueue, the stand-in
       computing the toy's prompt KV and indexer keys into SGLang's DSA pool, MooncakeKVSender
```

Both build SGLang's shared ``MooncakeTransferEngine`` (``maybe_init_shared_mooncake_transfer_engine``,
before the scheduler, whose own ``init_parallel_runtime`` call then finds it built) with
protocol ``tcp`` (``MOONCAKE_PROTOCOL=tcp``, ``MC_FORCE_TCP=1``: no RDMA device). The decode
instance's ``MooncakeKVManager`` registers our host pool's layers (``get_kv_transfer_buf_infos``
of the coordinator's ``mem_pool_host``) and the DSA indexer-key state; the prefill's transfer
threads write the prompt's pages into them. Nothing of the wire is changed: :class:`Wire`
observes the engine (the return code of every registration, the bytes of every batch write).

Stood in, beyond the rig's usual stand-ins (``docs/real-scheduler-rig.md``): the tokenizer
manager's ``start_disagg_service`` call (the prefill rig calls SGLang's function itself), the
prefill's pinned-memory + CUDA-event copy of page indices (``Wire.start``), and the indexer's
Triton ``SetKAndS`` / ``GetKAndS`` (``StandInRunner._pool_keys``: the toy's key in the first 8
bytes of each token's slot of SGLang's index-K buffer, so the transfer moves it).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["PLANS", "Wire", "engine_missing", "main", "run_decode"]

#: what a scenario may wait for the other instance (startup included), seconds
DEADLINE_S = 120.0


def engine_missing() -> str | None:
    """Why the Mooncake transfer engine cannot run here, or None when it can."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:  # the wheel, or a library it links (libibverbs.so.1) is absent
        return f"mooncake.engine is not importable ({e}); pip install mooncake-transfer-engine-non-cuda " \
               "(it links libibverbs.so.1 even for TCP: apt-get install libibverbs1)"
    return None


class Wire:
    """SGLang's shared Mooncake engine of this process, observed (not changed).

    ``registered``: (ret, ptr, length) of every region SGLang's KV manager registered;
    ``bytes`` / ``writes``: the sum of the lengths, and the count, of every batch write that
    returned success (the prefill side writes; the decode side only receives)."""

    #: what this process changed of SGLang's objects, for ``Rig.patches``
    patches = ["MooncakeTransferEngine.batch_register (observer)",
                 "MooncakeTransferEngine.batch_transfer_sync (observer)"]
    #: the prefill instance's one stand-in on SGLang's send path (:meth:`start`)
    prefill_patches = ["MooncakeKVSender.supports_host_tensor_indices = False"]

    def __init__(self, engine: Any, bootstrap_host: str, bootstrap_port: int) -> None:
        self.engine = engine
        self.bootstrap_host, self.bootstrap_port = bootstrap_host, bootstrap_port
        self.registered: list[tuple[int, int, int]] = []
        self.bytes = self.writes = 0
        self._lock = threading.Lock()
        self.bootstrap_server: Any = None
        register, write = engine.batch_register, engine.batch_transfer_sync

        def batch_register(ptrs: list[int], lens: list[int]) -> int:
            ret = register(ptrs, lens)
            self.registered += [(int(ret), p, n) for p, n in zip(ptrs, lens, strict=True)]
            return ret

        def batch_transfer_sync(session: str, bufs: list[int], peers: list[int], lens: list[int]) -> int:
            ret = write(session, bufs, peers, lens)
            if ret >= 0:
                with self._lock:
                    self.bytes += sum(lens)
                    self.writes += 1
            return ret

        # NOTE: instance attributes over SGLang's engine wrapper, calling through: SGLang's
        # batch_register only logs a failed registration at debug level (mooncake_transfer_engine.py),
        # so without this a pool the engine refused would show up as a hung transfer
        engine.batch_register, engine.batch_transfer_sync = batch_register, batch_transfer_sync

    @classmethod
    def start(cls, *, prefill: bool) -> Wire:
        """Build SGLang's shared engine over TCP (before the scheduler, whose KV manager reads
        it) and, on the prefill instance, SGLang's bootstrap server."""
        os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")
        os.environ.setdefault("MC_FORCE_TCP", "1")
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            get_mooncake_transfer_engine,
            maybe_init_shared_mooncake_transfer_engine,
        )
        from sglang.srt.runtime_context import get_disagg, get_serving

        maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
        wire = cls(get_mooncake_transfer_engine(), get_serving().host,
                   int(get_disagg().disaggregation_bootstrap_port))
        if prefill:  # what TokenizerManager does at startup (tokenizer_manager.py:806)
            from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
            from sglang.srt.managers.disagg_service import start_disagg_service

            wire.bootstrap_server = start_disagg_service()
            # NOTE: a stand-in for a CUDA-only piece of the send path: with host-tensor indices
            # the prefill copies the page indices into pinned memory and records a CUDA event
            # (prefill.py _send_kv_chunk), which fails without a GPU; off, SGLang takes its own
            # synchronous kv_to_page_indices branch. Same pages, same sender, same bytes.
            MooncakeKVSender.supports_host_tensor_indices = False
            wire.patches = wire.patches + wire.prefill_patches
        return wire

    def check_registered(self) -> None:
        bad = [r for r in self.registered if r[0] != 0]
        if not self.registered or bad:
            raise RuntimeError(f"Mooncake registration: {len(self.registered)} regions, failed: {bad[:4]}")

    def covers(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies in one registered region."""
        return any(p <= ptr and ptr + nbytes <= p + n for _, p, n in self.registered)


# -- the two instances ----------------------------------------------------------------------------
_PD = ("--disaggregation-transfer-backend", "mooncake", "--disaggregation-decode-retraction-backup", "none")


def _configs(port: int) -> tuple[Any, Any]:
    """(prefill, decode) rig configurations: the ``pd_decode`` group's decode setup, and a
    prefill of the same toy with HiSparse off (SGLang's own DSA pool)."""
    from hisparse_testing.sglang_rig import RigConfig

    boot = ("--disaggregation-bootstrap-port", str(port))
    prefill = RigConfig(hisparse=False, max_running_requests=8,
                        extra_args=("--disaggregation-mode", "prefill", *_PD, *boot))
    decode = RigConfig(max_running_requests=8, extra_args=("--disaggregation-mode", "decode", *_PD, *boot))
    return prefill, decode


def _serve(rig: Any, rids: list[str], what: str, deadline: float) -> None:
    """Step until every request in ``rids`` finished and the scheduler is idle, sleeping a
    little on idle steps (the other instance shares the machine's cores)."""
    idle = 0
    while time.monotonic() < deadline:
        ran = rig.step()
        done = all(rig.results[r].finish_reason is not None for r in rids)
        idle = 0 if ran else idle + 1
        if done and idle >= 2 and rig.scheduler.is_fully_idle():
            return
        if not ran:
            time.sleep(0.002)
    pending = [r for r in rids if rig.results[r].finish_reason is None]
    raise AssertionError(f"{what}: {len(pending)} requests unfinished at the deadline: {pending[:8]}")


def prefill_main(workdir: Path) -> int:
    """The prefill instance: serve the plan, check idle, report, wait for the decode's stop."""
    from hisparse_testing.sglang_rig import Rig

    plan = json.loads((workdir / "plan.json").read_text())
    out: dict[str, Any] = {"ok": False}
    t0 = time.perf_counter()
    try:
        rig = Rig(_configs(plan["port"])[0], workdir / "prefill")
        out["startup_s"] = round(time.perf_counter() - t0, 2)
        (workdir / "prefill.ready").write_text("1")
        for r in plan["requests"]:
            rig.submit(r["rid"], r["prompt"], r["new"], room=r["room"])
        _serve(rig, [r["rid"] for r in plan["requests"]], "prefill", time.monotonic() + DEADLINE_S)
        rig.check_idle()
        firsts = {r["rid"]: rig.results[r["rid"]].output_ids for r in plan["requests"]}
        out.update(ok=True, bytes=rig.wire.bytes, writes=rig.wire.writes, first_tokens=firsts, patches=rig.patches,
                   finish={rid: rig.results[rid].finish_reason for rid in firsts},
                   seconds=round(time.perf_counter() - t0, 2))
    except Exception as e:
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    (workdir / "prefill.json").write_text(json.dumps(out))
    stop = time.monotonic() + DEADLINE_S
    while out["ok"] and not (workdir / "stop").exists() and time.monotonic() < stop:
        time.sleep(0.05)  # keep the engine and bootstrap server up until the decode is done
    return 0 if out["ok"] else 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _page_bytes(rig: Any) -> tuple[int, int]:
    """(KV bytes, DSA-state bytes) one page costs on the wire, from the decode KV manager's
    registered layout (every KV buffer's item, every state buffer's item)."""
    args = rig.scheduler.disagg_decode_prealloc_queue.kv_manager.kv_args
    state = sum(sum(lens) for lens in args.state_item_lens)
    return sum(args.kv_item_lens), state


def plan_dsa_short() -> list[dict[str, Any]]:
    """DSA, short prompts (5-60 tokens: shorter and longer than B = 32, one page each), short
    outputs (4-20 tokens): SGLang's prefill instance sends each prompt's KV page and indexer
    keys over Mooncake TCP into our host pool; every token equals full KV, both instances
    idle clean."""
    import random

    rnd = random.Random(52)
    return [{"rid": f"mc{i}", "prompt": [rnd.randrange(1000) for _ in range(rnd.randint(5, 60))],
             "new": rnd.randint(4, 20), "room": rnd.randrange(1 << 40)} for i in range(6)]


#: scenario -> its requests (pure Python: the plan is written before either instance imports SGLang)
PLANS = {"dsa_short": plan_dsa_short}


def _start_prefill(workdir: Path, reqs: list[dict[str, Any]]) -> Any:
    """Write the plan and fork the prefill instance's process, its output in prefill.log.

    NOTE: forked after SGLang and the plugin are imported, before either instance builds
    anything (no scheduler, engine, ZMQ context or torch thread pool exists yet), rather than
    a fresh interpreter: the import is ~20 s of CPU a process, a third of the CI budget on
    two cores. From the fork on the two processes share nothing but the machine."""
    import multiprocessing

    (workdir / "plan.json").write_text(json.dumps({"port": _free_port(), "requests": reqs}))
    child = multiprocessing.get_context("fork").Process(target=_prefill_child, args=(workdir,), daemon=True)
    child.start()
    return child


def _prefill_child(workdir: Path) -> None:
    with open(workdir / "prefill.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.exit(prefill_main(workdir))


def run_decode(workdir: Path, child: Any) -> dict[str, Any]:
    """The decode instance over the plan: serve it, check tokens and idle, and read the
    prefill's report (bytes written, first tokens, its idle check)."""
    from hisparse_testing.sglang_rig import Rig
    from hisparse_testing.token_model import reference_generate

    plan = json.loads((workdir / "plan.json").read_text())
    reqs = plan["requests"]
    t0 = time.perf_counter()
    rig = Rig(_configs(plan["port"])[1], workdir / "decode")
    host = rig.coordinator.host_pool
    missing = [li for li in range(host.num_layers) if not rig.wire.covers(host.kv[li].data_ptr(), host.kv[li].nbytes)]
    if missing:
        raise AssertionError(f"decode: SGLang's KV manager did not register our host pool's layers {missing}")
    deadline = time.monotonic() + DEADLINE_S
    while not (workdir / "prefill.ready").exists():
        if not child.is_alive() or time.monotonic() > deadline:
            raise AssertionError(f"prefill instance did not start:\n{(workdir / 'prefill.log').read_text()[-4000:]}")
        time.sleep(0.05)
    t_ready = time.perf_counter()
    for r in reqs:
        rig.submit(r["rid"], r["prompt"], r["new"], room=r["room"])
    _serve(rig, [r["rid"] for r in reqs], "decode", time.monotonic() + DEADLINE_S)
    serve_s = time.perf_counter() - t_ready
    rig.check_idle()
    for r in reqs:
        got, want = rig.results[r["rid"]].output_ids, reference_generate(rig.toy, r["prompt"], r["new"])
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            raise AssertionError(f"{r['rid']} (prompt {len(r['prompt'])}): tokens differ from full KV at "
                                 f"output {first}: {got} vs {want}")
    (workdir / "stop").write_text("1")
    child.join(timeout=30)
    pre = json.loads((workdir / "prefill.json").read_text()) if (workdir / "prefill.json").exists() else {}
    if not pre.get("ok"):
        raise AssertionError(f"prefill instance: {pre.get('error')}\n{pre.get('traceback', '')}")
    firsts = {r["rid"]: rig.results[r["rid"]].output_ids[:1] for r in reqs}
    if pre["first_tokens"] != firsts:
        raise AssertionError(f"the decode's first tokens {firsts} are not the prefill's {pre['first_tokens']}")
    pages = sum(-(-len(r["prompt"]) // rig.server_args.page_size) for r in reqs)
    kv_page, state_page = _page_bytes(rig)
    expected = pages * (kv_page + state_page)
    if pre["bytes"] < expected:
        raise AssertionError(f"the prefill wrote {pre['bytes']} bytes, fewer than the {expected} of the pages sent")
    return {
        "requests": len(reqs), "prompt_tokens": sum(len(r["prompt"]) for r in reqs), "pages": pages,
        "bytes": pre["bytes"], "writes": pre["writes"], "bytes_per_request": pre["bytes"] // len(reqs),
        "kv_bytes_per_page": kv_page, "state_bytes_per_page": state_page,
        "metadata_bytes_per_request": (pre["bytes"] - expected) // len(reqs),
        "serve_s": round(serve_s, 2), "decode_startup_s": round(t_ready - t0, 2),
        "prefill_startup_s": pre["startup_s"], "decode_patches": rig.patches, "prefill_patches": pre["patches"],
        **{k: v for k, v in rig.coordinator.telemetry().items() if k in ("hits", "misses", "staged_tokens")},
    }


def main(argv: list[str]) -> int:
    """``--prefill WORKDIR`` (the prefill instance) or ``SCENARIO WORKDIR`` (the decode
    instance, which starts the prefill's process and prints one ``RIG {json}`` line)."""
    if len(argv) != 2 or (argv[0] != "--prefill" and argv[0] not in PLANS):
        print(f"usage: python -m hisparse_testing.rig_mooncake {{{','.join(PLANS)}}}|--prefill WORKDIR",
              file=sys.stderr)
        return 2
    workdir = Path(argv[1])
    workdir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    from hisparse_testing.sglang_rig import pretend_sm90

    pretend_sm90()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    if argv[0] == "--prefill":
        return prefill_main(workdir)
    import sglang.srt.managers.scheduler  # noqa: F401  (what both instances import next)
    import sglang.srt.models.registry  # noqa: F401

    child = _start_prefill(workdir, PLANS[argv[0]]())
    rec: dict[str, Any] = {"scenario": argv[0]}
    try:
        rec.update(ok=True, **run_decode(workdir, child))
    except Exception as e:
        rec.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    finally:
        (workdir / "stop").write_text("1")
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    rec["seconds"] = round(time.perf_counter() - t, 2)
    print("RIG " + json.dumps(rec), flush=True)
    return 0 if rec["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
