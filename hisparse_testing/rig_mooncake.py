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
        #: return codes of the batch writes that failed (e.g. a held write after the peer aborted)
        self.failed: list[int | str] = []
        self._lock = threading.Lock()
        self.bootstrap_server: Any = None
        #: while this file exists a write waits before it starts (after creating ``held``), so a
        #: decode-side abort lands mid-transfer (the failure scenarios; set by the prefill)
        self.hold: Path | None = None
        register, write = engine.batch_register, engine.batch_transfer_sync

        def batch_register(ptrs: list[int], lens: list[int]) -> int:
            ret = register(ptrs, lens)
            self.registered += [(int(ret), p, n) for p, n in zip(ptrs, lens, strict=True)]
            return ret

        def batch_transfer_sync(session: str, bufs: list[int], peers: list[int], lens: list[int]) -> int:
            self._wait_hold()
            try:
                ret = write(session, bufs, peers, lens)
            except Exception as e:
                with self._lock:
                    self.failed.append(f"{type(e).__name__}: {e}")
                raise
            with self._lock:
                if ret >= 0:
                    self.bytes += sum(lens)
                    self.writes += 1
                else:
                    self.failed.append(int(ret))
            return ret

        # NOTE: instance attributes over SGLang's engine wrapper, calling through: SGLang's
        # batch_register only logs a failed registration at debug level (mooncake_transfer_engine.py),
        # so without this a pool the engine refused would show up as a hung transfer
        engine.batch_register, engine.batch_transfer_sync = batch_register, batch_transfer_sync

    def _wait_hold(self) -> None:
        """NOTE: timing only (the transfer thread sleeps before it writes; what it writes, where,
        and SGLang's abort handshake are untouched): a TCP write of a few pages on one machine
        takes well under a scheduler step, so without a hold no abort lands mid-transfer."""
        if self.hold is None or not self.hold.exists():
            return
        (self.hold.parent / "held").write_text("1")
        stop = time.monotonic() + DEADLINE_S
        while self.hold.exists() and time.monotonic() < stop:
            time.sleep(0.01)

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


def _configs(port: int, radix: bool = False) -> tuple[Any, Any]:
    """(prefill, decode) rig configurations: the ``pd_decode`` group's decode setup (with
    ``radix``, its decode radix cache on: ``pd_decode_radix``), and a prefill of the same toy
    with HiSparse off (SGLang's own DSA pool)."""
    from hisparse_testing.sglang_rig import RigConfig

    boot = ("--disaggregation-bootstrap-port", str(port))
    prefill = RigConfig(hisparse=False, max_running_requests=8,
                        extra_args=("--disaggregation-mode", "prefill", *_PD, *boot))
    tree = ("--disaggregation-decode-enable-radix-cache",) if radix else ()
    decode = RigConfig(max_running_requests=8, radix=radix,
                       extra_args=("--disaggregation-mode", "decode", *_PD, *boot, *tree))
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


def _wait_file(path: Path, what: str, deadline: float) -> None:
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {path.name} did not appear")
        time.sleep(0.01)


def prefill_main(workdir: Path) -> int:
    """The prefill instance: serve the plan phase by phase (each once the decode writes its
    ``go{i}``), check idle after each, write each phase's bytes to ``phase{i}.json``, and keep
    the engine and bootstrap server up until the decode's stop."""
    from hisparse_testing.sglang_rig import Rig

    plan = json.loads((workdir / "plan.json").read_text())
    out: dict[str, Any] = {"ok": False}
    t0 = time.perf_counter()
    try:
        rig = Rig(_configs(plan["port"])[0], workdir / "prefill")
        rig.wire.hold = workdir / "hold"
        out["startup_s"] = round(time.perf_counter() - t0, 2)
        (workdir / "prefill.ready").write_text("1")
        for i, phase in enumerate(plan["phases"]):
            _wait_file(workdir / f"go{i}", f"prefill phase {phase['name']}", time.monotonic() + DEADLINE_S)
            bytes0, writes0, failed0 = rig.wire.bytes, rig.wire.writes, len(rig.wire.failed)
            for r in phase["requests"]:
                rig.submit(r["rid"], r["prompt"], r["new"], room=r["room"])
            rids = [r["rid"] for r in phase["requests"]]
            _serve(rig, rids, f"prefill phase {phase['name']}", time.monotonic() + DEADLINE_S)
            rig.check_idle()
            rec = {"bytes": rig.wire.bytes - bytes0, "writes": rig.wire.writes - writes0,
                   # the prefill finished its requests while one of its writes was still held
                   "finished_with_write_held": (workdir / "held").exists(),
                   "failed_writes": rig.wire.failed[failed0:],
                   "first_tokens": {rid: rig.results[rid].output_ids for rid in rids},
                   "finish": {rid: rig.results[rid].finish_reason for rid in rids}}
            (workdir / f"phase{i}.json").write_text(json.dumps(rec))
        out.update(ok=True, patches=rig.patches, seconds=round(time.perf_counter() - t0, 2))
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


def _requests(name: str, seed: int, lens: list[int], news: list[int]) -> list[dict[str, Any]]:
    import random

    rnd = random.Random(seed)
    return [{"rid": f"{name}{i}", "prompt": [rnd.randrange(1000) for _ in range(n)], "new": new,
             "room": rnd.randrange(1 << 40)} for i, (n, new) in enumerate(zip(lens, news, strict=True))]


def plan_dsa_short() -> list[dict[str, Any]]:
    """DSA, short prompts (5-60 tokens: shorter and longer than B = 32, one page each), short
    outputs (4-20 tokens): SGLang's prefill instance sends each prompt's KV page and indexer
    keys over Mooncake TCP into our host pool; every token equals full KV, both instances
    idle clean."""
    import random

    rnd = random.Random(52)
    return [{"name": "dsa_short", "requests": [
        {"rid": f"mc{i}", "prompt": [rnd.randrange(1000) for _ in range(rnd.randint(5, 60))],
         "new": rnd.randint(4, 20), "room": rnd.randrange(1 << 40)} for i in range(6)]}]


def plan_dsa_long() -> list[dict[str, Any]]:
    """DSA, long prompts (300-900 tokens: 5-15 pages of 64, each prompt's last page partial)
    sent in one transfer each, together in flight: every page lands where the decode's
    prealloc published it, so every selected row of every step equals full KV."""
    return [{"name": "dsa_long", "requests": _requests("long", 521, [300, 517, 704, 900], [6, 12, 4, 9])}]


#: the prefix scenarios' shared prompt: 9 whole pages, what a decode radix cache can match
PREFIX_TOKENS = 576


def plan_prefix() -> list[dict[str, Any]]:
    """A request (576 + 40 tokens), then, once it finished, one sharing its first 576 tokens
    (9 pages) with a 124-token suffix of its own: with the decode radix cache only the suffix's
    2 pages cross the wire, without it all 11. The first phase keeps the tree (no idle check,
    which evicts it); the second checks both instances idle."""
    first = _requests("pre", 5210, [PREFIX_TOKENS + 40], [8])
    second = _requests("suf", 5211, [PREFIX_TOKENS + 124], [8])
    second[0]["prompt"][:PREFIX_TOKENS] = first[0]["prompt"][:PREFIX_TOKENS]
    return [{"name": "prefix_first", "requests": first, "keep_tree": True},
            {"name": "prefix_suffix", "requests": second}]


def plan_abort() -> list[dict[str, Any]]:
    """A decode-side abort mid-transfer: the prefill's first write of the victim (300 tokens)
    is held (``Wire.hold``) until the decode, with the request in its transfer queue, has
    aborted it and stepped on; then the write goes through SGLang's abort handshake. Both
    instances must idle clean, and the decode serve the next request exactly."""
    return [{"name": "abort_mid_transfer", "requests": _requests("ab", 5212, [300], [8]), "abort": ["ab0"]},
            {"name": "after_abort", "requests": _requests("next", 5213, [200, 40], [8, 6])}]


def plan_kill() -> list[dict[str, Any]]:
    """The prefill instance killed (SIGKILL) while its first write of a 300-token request is
    held: the decode finds the peer dead through SGLang's heartbeat (``/health`` on the
    bootstrap server), fails the request, releases its rows once the deferred-release deadline
    passes (no drain ack can come) and idles clean. The last phase: no prefill is left to serve
    more (the rig cannot fork a new one from a decode that has built its scheduler)."""
    return [{"name": "kill_mid_transfer", "requests": _requests("kill", 5214, [300], [8]), "kill": ["kill0"]}]


def plan_timeout() -> list[dict[str, Any]]:
    """SGLang's decode-side wait for KV (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, 2 s here)
    runs out while the prefill's write of a 300-token request is held: the decode fails the
    request and keeps its rows until the prefill, its write let go, acks the drain; then the
    decode serves the next requests exactly."""
    return [{"name": "timeout_mid_transfer", "requests": _requests("to", 5215, [300], [8]), "timeout": ["to0"]},
            {"name": "after_timeout", "requests": _requests("next", 5216, [200, 40], [8, 6])}]


#: scenario -> (decode radix cache on, its phases); pure Python: the plan is written before
#: either instance imports SGLang. Scenarios given together run in order over one pair of
#: instances, so they must agree on the decode radix cache.
PLANS = {"dsa_short": (False, plan_dsa_short), "dsa_long": (False, plan_dsa_long),
         "prefix": (False, plan_prefix), "prefix_radix": (True, plan_prefix),
         "abort_transfer": (False, plan_abort), "kill_prefill": (False, plan_kill),
         "timeout_transfer": (False, plan_timeout)}

#: SGLang settings a scenario needs in both instances, set before SGLang is imported (scenarios
#: given together must agree). The heartbeat's floor is 2 s and one miss (conn.py); the deferred
#: release waits 2 s for a drain ack a dead prefill never sends (30 s by default).
ENV = {"kill_prefill": {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
                        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
                        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "2"},
       "timeout_transfer": {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "2"}}


def _start_prefill(workdir: Path, scenarios: list[str]) -> Any:
    """Write the plan and fork the prefill instance's process, its output in prefill.log.

    NOTE: forked after SGLang and the plugin are imported, before either instance builds
    anything (no scheduler, engine, ZMQ context or torch thread pool exists yet), rather than
    a fresh interpreter: the import is ~20 s of CPU a process, a third of the CI budget on
    two cores. From the fork on the two processes share nothing but the machine."""
    import multiprocessing

    radix = {PLANS[n][0] for n in scenarios}
    if len(radix) != 1:
        raise ValueError(f"rig_mooncake: {scenarios} disagree on the decode radix cache; run them apart")
    phases = [{**ph, "scenario": n} for n in scenarios for ph in PLANS[n][1]()]
    (workdir / "plan.json").write_text(json.dumps({"port": _free_port(), "radix": radix.pop(), "phases": phases}))
    child = multiprocessing.get_context("fork").Process(target=_prefill_child, args=(workdir,), daemon=True)
    child.start()
    return child


def _prefill_child(workdir: Path) -> None:
    with open(workdir / "prefill.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.exit(prefill_main(workdir))


def _prefill_phase(workdir: Path, i: int, child: Any) -> dict[str, Any]:
    """The prefill's report of phase ``i`` (its bytes, first tokens, finishes), once written."""
    deadline = time.monotonic() + DEADLINE_S
    path = workdir / f"phase{i}.json"
    while not path.exists():
        pre = workdir / "prefill.json"
        if pre.exists() or not child.is_alive() or time.monotonic() > deadline:
            rec = json.loads(pre.read_text()) if pre.exists() else {}
            raise AssertionError(f"prefill instance, phase {i}: {rec.get('error', 'no report')}\n"
                                 f"{rec.get('traceback', '')}")
        time.sleep(0.01)
    return json.loads(path.read_text())


def _fail_mid_transfer(rig: Any, workdir: Path, phase: dict[str, Any], child: Any, deadline: float) -> dict[str, Any]:
    """Step until the prefill holds a write of the phase's victims (``Wire.hold``) and the
    decode has them in its transfer queue (metadata sent, KV not arrived), then fail them one
    way: ``abort`` (the decode aborts them, steps 100 times), ``timeout`` (SGLang's waiting
    timeout fails them) or ``kill`` (SIGKILL to the prefill; SGLang's heartbeat fails them).
    With the write still held (or its writer dead) the decode must keep their rows bound
    (SGLang's deferred release) and finish them as aborted. Returns what happened."""
    mode = next(m for m in ("abort", "timeout", "kill") if phase.get(m))
    rids = phase[mode]
    s = rig.scheduler
    queue = s.disagg_decode_transfer_queue
    while not ((workdir / "held").exists() and set(rids) <= {d.req.rid for d in queue.queue}):
        if time.monotonic() > deadline:
            raise AssertionError(f"{mode}: {rids} never in the transfer queue with a held write")
        rig.step()
        time.sleep(0.002)
    t = time.monotonic()
    if mode == "abort":
        for rid in rids:
            rig.abort(rid)
        for _ in range(100):
            rig.step()
            time.sleep(0.005)
    else:
        if mode == "kill":
            child.kill()  # SIGKILL: no atexit, no goodbye on any socket
            child.join(timeout=10)
        while not all(rig.results[r].finish_reason is not None for r in rids):
            if time.monotonic() > deadline:
                raise AssertionError(f"{mode}: the decode never finished {rids}")
            rig.step()
            time.sleep(0.005)
    failed_s = time.monotonic() - t
    # the request is finished, but the prefill may still write into its rows: SGLang's
    # deferred release must keep them bound until the write drains (or, for a device
    # destination, its deadline passes)
    host = rig.coordinator.host_pool
    done = {r: (rig.results[r].finish_reason or {}).get("type") for r in rids}
    bound, deferred = int(host.allocated_lens.sum()), queue.num_pending_deferred_releases()
    if set(done.values()) != {"abort"} or not bound or not deferred:
        raise AssertionError(f"{mode} with a held write: finishes {done}, host pool binds {bound} positions, "
                             f"deferred releases {deferred}; the host rows must stay bound until the "
                             "prefill's write drains")
    out = {"mode": mode, "failed_after_s": round(failed_s, 2), "bound_while_held": bound,
           "messages": {r: (rig.results[r].finish_reason or {}).get("message") for r in rids}}
    if mode == "kill":  # no drain ack can come: the rows go at the deferred-release deadline
        t = time.monotonic()
        while queue.has_pending_deferred_releases():
            if time.monotonic() > deadline:
                raise AssertionError(f"kill: {rids}' rows never released")
            rig.step()
            time.sleep(0.005)
        out["released_after_s"] = round(time.monotonic() - t, 2)
    (workdir / "hold").unlink()
    (workdir / "held").unlink(missing_ok=True)
    return out


def run_decode(workdir: Path, child: Any) -> list[dict[str, Any]]:
    """The decode instance over the plan, phase by phase: serve it, check tokens and idle, and
    read the prefill's report of the phase (bytes written, first tokens, its idle check). One
    record a scenario, with each phase's figures."""
    from hisparse_testing.sglang_rig import Rig
    from hisparse_testing.token_model import reference_generate

    plan = json.loads((workdir / "plan.json").read_text())
    t0 = time.perf_counter()
    rig = Rig(_configs(plan["port"], plan["radix"])[1], workdir / "decode")
    host = rig.coordinator.host_pool
    missing = [li for li in range(host.num_layers) if not rig.wire.covers(host.kv[li].data_ptr(), host.kv[li].nbytes)]
    if missing:
        raise AssertionError(f"decode: SGLang's KV manager did not register our host pool's layers {missing}")
    deadline = time.monotonic() + DEADLINE_S
    while not (workdir / "prefill.ready").exists():
        if not child.is_alive() or time.monotonic() > deadline:
            raise AssertionError(f"prefill instance did not start:\n{(workdir / 'prefill.log').read_text()[-4000:]}")
        time.sleep(0.05)
    startup_s = time.perf_counter() - t0
    kv_page, state_page = _page_bytes(rig)
    ps = rig.server_args.page_size
    records: dict[str, dict[str, Any]] = {}
    for i, phase in enumerate(plan["phases"]):
        reqs = phase["requests"]
        aborted = phase.get("abort", []) + phase.get("timeout", []) + phase.get("kill", [])
        t = time.perf_counter()
        if aborted:
            (workdir / "hold").write_text("1")
        (workdir / f"go{i}").write_text("1")
        for r in reqs:
            rig.submit(r["rid"], r["prompt"], r["new"], room=r["room"])
        failure = _fail_mid_transfer(rig, workdir, phase, child, time.monotonic() + DEADLINE_S) if aborted else None
        _serve(rig, [r["rid"] for r in reqs], f"decode phase {phase['name']}", time.monotonic() + DEADLINE_S)
        serve_s = time.perf_counter() - t
        if not phase.get("keep_tree"):
            rig.check_idle()
        for r in reqs:
            res = rig.results[r["rid"]]
            if r["rid"] in aborted:
                if (res.finish_reason or {}).get("type") != "abort" or res.output_ids:
                    raise AssertionError(f"{r['rid']}: aborted mid-transfer, yet {res.finish_reason}, {res.output_ids}")
                continue
            got, want = res.output_ids, reference_generate(rig.toy, r["prompt"], r["new"])
            if got != want:
                first = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
                raise AssertionError(f"{r['rid']} (prompt {len(r['prompt'])}): tokens differ from full KV at "
                                     f"output {first}: {got} vs {want}")
        rec = records.setdefault(phase["scenario"], {"scenario": phase["scenario"], "phases": []})
        if phase.get("kill"):  # the last phase: the prefill is dead, it reports nothing
            rec["phases"].append({"phase": phase["name"], "requests": len(reqs), "aborted": aborted,
                                  "prompt_tokens": [len(r["prompt"]) for r in reqs], "pages": 0, "bytes": 0,
                                  "failure": failure, "serve_s": round(serve_s, 2),
                                  "prefill_exitcode": child.exitcode})
            break
        pre = _prefill_phase(workdir, i, child)
        served = [r for r in reqs if r["rid"] not in aborted]
        firsts = {r["rid"]: rig.results[r["rid"]].output_ids[:1] for r in served}
        if {rid: pre["first_tokens"][rid] for rid in firsts} != firsts:
            raise AssertionError(f"{phase['name']}: the decode's first tokens {firsts} are not the prefill's "
                                 f"{pre['first_tokens']}")
        pages = sum(-(-len(r["prompt"]) // ps) for r in reqs)
        if not plan["radix"] and not aborted and pre["bytes"] < pages * (kv_page + state_page):
            raise AssertionError(f"{phase['name']}: the prefill wrote {pre['bytes']} bytes, fewer than the "
                                 f"{pages * (kv_page + state_page)} of the pages sent")
        rec["phases"].append({
            "phase": phase["name"], "requests": len(reqs), "prompt_tokens": [len(r["prompt"]) for r in reqs],
            "failure": failure,
            "pages": pages, "bytes": pre["bytes"], "writes": pre["writes"], "failed_writes": pre["failed_writes"],
            "aborted": aborted, "prefill_finished_with_write_held": pre["finished_with_write_held"],
            "bytes_per_request": pre["bytes"] // len(reqs), "serve_s": round(serve_s, 2),
            "prefill_finish": {rid: (f or {}).get("type") for rid, f in pre["finish"].items()},
        })
    (workdir / "stop").write_text("1")
    child.join(timeout=30)
    killed = any(ph.get("kill") for ph in plan["phases"])
    pre = json.loads((workdir / "prefill.json").read_text()) if (workdir / "prefill.json").exists() else {}
    if killed:  # what the prefill reported at startup is gone with it
        pre = {"ok": True, "startup_s": None, "patches": None}
    if not pre.get("ok"):
        raise AssertionError(f"prefill instance: {pre.get('error')}\n{pre.get('traceback', '')}")
    common = {"kv_bytes_per_page": kv_page, "state_bytes_per_page": state_page, "radix": plan["radix"],
              "decode_startup_s": round(startup_s, 2), "prefill_startup_s": pre["startup_s"],
              "decode_patches": rig.patches, "prefill_patches": pre["patches"],
              **{k: v for k, v in rig.coordinator.telemetry().items() if k in ("hits", "misses", "staged_tokens")}}
    out = []
    for rec in records.values():
        ph = rec["phases"]
        total, n = sum(p["bytes"] for p in ph), sum(p["requests"] for p in ph)
        # the metadata a request costs beyond its pages: only where every page of every
        # prompt was sent (no decode radix match, no abort)
        whole = [p for p in ph if not p["aborted"]]
        meta = (sum(p["bytes"] - p["pages"] * (kv_page + state_page) for p in whole)
                // max(1, sum(p["requests"] for p in whole)))
        out.append({**rec, **common, "requests": n, "bytes": total, "bytes_per_request": total // n,
                    "metadata_bytes_per_request": None if plan["radix"] or not whole else meta,
                    "serve_s": round(sum(p["serve_s"] for p in ph), 2)})
    return out


def main(argv: list[str]) -> int:
    """``--prefill WORKDIR`` (the prefill instance) or ``SCENARIO[,SCENARIO...] WORKDIR`` (the
    decode instance, which starts the prefill's process, runs the scenarios in order over the
    one pair and prints one ``RIG {json}`` line a scenario)."""
    names = argv[0].split(",") if argv else []
    if len(argv) != 2 or (argv[0] != "--prefill" and not all(n in PLANS for n in names)):
        print(f"usage: python -m hisparse_testing.rig_mooncake {{{','.join(PLANS)}}}[,...]|--prefill WORKDIR",
              file=sys.stderr)
        return 2
    workdir = Path(argv[1])
    workdir.mkdir(parents=True, exist_ok=True)
    envs = [ENV.get(n, {}) for n in names if n in PLANS]
    if any(e != envs[0] for e in envs):
        print(f"rig_mooncake: {names} need different SGLang settings; run them apart", file=sys.stderr)
        return 2
    os.environ.update(envs[0] if envs else {})
    t = time.perf_counter()
    from hisparse_testing.sglang_rig import pretend_sm90

    pretend_sm90()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    if argv[0] == "--prefill":
        return prefill_main(workdir)
    import sglang.srt.managers.scheduler  # noqa: F401  (what both instances import next)
    import sglang.srt.models.registry  # noqa: F401

    child = _start_prefill(workdir, names)
    try:
        recs = [{**r, "ok": True} for r in run_decode(workdir, child)]
    except Exception as e:
        failed = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        recs = [{"scenario": n, **failed} for n in names]
    finally:
        (workdir / "stop").write_text("1")
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    for rec in recs:
        rec["seconds"] = round(time.perf_counter() - t, 2)
        print("RIG " + json.dumps(rec), flush=True)
    return 0 if all(r["ok"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
