"""Real traffic for the real-scheduler rig: SGLang admits, over-admits, retracts and evicts by
its own rules.

The scenario groups of ``rig_scenarios`` run requests with ``ignore_eos``, so SGLang
reserves each one's whole output at admission and never over-admits. Here requests stop at a
stop token (SGLang's EOS path) or their drawn ``max_new_tokens``, so admission runs on SGLang's
estimate of the remaining output (``new_token_ratio``) and decode retracts by its own rules
when the estimate was low; nothing forces a retraction (no ``SGLANG_TEST_RETRACT``).

```
seeded draw (TrafficSpec)                    every step (TrafficRun.run)
  arrivals: Bernoulli per step, `rate`       submit what arrived, abort what is due
  prompt:   fresh | on a shared system       record peaks (logical ids, device rows)
            prompt | an exact duplicate of   no output for `stall_steps` with work queued:
            one in flight | a follow-up        fail, naming every queue and free count
            turn (prompt + output + new)     at the end: every request's tokens equal full
  output:   the model's EOS, a stop set,       KV (aborted ones: a prefix of them), both
            max_new_tokens                     idle checks pass (Rig.check_idle)
  abort:    at a drawn step after arrival
```

Used by the ``traffic_*`` groups of ``rig_scenarios`` (a short seeded run in CI) and by
``python -m hisparse_testing.rig_soak GROUP WORKDIR --requests N`` (the soak, run under
``-m slow``), which prints one ``TRAFFIC {json}`` summary.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from hisparse_testing.token_model import TokenModel

__all__ = ["TrafficRun", "TrafficSpec", "reference_until_stop", "run_traffic"]


@dataclass(frozen=True)
class TrafficSpec:
    """What one traffic run draws from its seed."""

    requests: int = 48
    seed: int = 0
    #: chance that a request arrives at a scheduler step (one at most per step)
    rate: float = 0.8
    #: prompt lengths (shorter and longer than the rig's hot buffer)
    prompt_len: tuple[int, int] = (3, 160)
    #: each request's max_new_tokens
    max_new: tuple[int, int] = (40, 400)
    #: size of each request's stop set over the toy's 1000-token vocabulary: an output stops
    #: after vocab / stops tokens on average (SGLang's EOS path, ``stop_token_ids``)
    stops: int = 2
    #: prompt kinds, by probability: on a shared system prompt, an exact duplicate of a recent
    #: prompt, a follow-up turn of a finished request; the rest fresh
    shared: float = 0.25
    duplicate: float = 0.1
    follow_up: float = 0.15
    #: system prompts to share, and their lengths
    system_prompts: int = 3
    system_len: tuple[int, int] = (32, 96)
    #: chance that a request is aborted, at a step drawn from ``abort_after`` after arrival
    abort: float = 0.06
    abort_after: tuple[int, int] = (1, 60)
    #: a run that produces no output for this many steps with work queued has hung
    stall_steps: int = 300
    max_steps: int = 200_000


def reference_until_stop(model: TokenModel, prompt: list[int], max_new: int, stops: set[int],
                         first: int | None = None) -> list[int]:
    """Greedy outputs with full KV (HiSparse off) until an output in ``stops`` (kept, as SGLang
    keeps its EOS token in ``output_ids``) or ``max_new`` of them; ``first`` (PD decode: the
    prefill's handoff token) is the first output when given."""
    tokens, out = list(prompt), []
    while len(out) < max_new:
        nxt = model.full_kv_step(tokens) if first is None or out else first
        out.append(nxt)
        tokens.append(nxt)
        if nxt in stops:
            break
    return out


@dataclass
class _Request:
    prompt: list[int]
    max_new: int
    stops: set[int]
    kind: str
    arrive: int
    abort_at: int | None
    parent: str | None = None


class TrafficRun:
    """One seeded traffic run over a live :class:`~hisparse_testing.sglang_rig.Rig`.

    ``reference(rid, prompt, max_new, stops)`` gives the tokens the request must produce (full
    KV; on a PD decode instance the prefill's handoff token first)."""

    def __init__(self, rig: Any, spec: TrafficSpec,
                 reference: Callable[[str, list[int], int, set[int]], list[int]]) -> None:
        self.rig, self.spec, self.reference = rig, spec, reference
        self.rnd = random.Random(spec.seed)
        self.vocab = rig.toy.vocab
        self.systems = [self._tokens(self.rnd.randint(*spec.system_len)) for _ in range(spec.system_prompts)]
        self.reqs: dict[str, _Request] = {}
        self.follow_ups: list[str] = []  # finished requests a follow-up turn may continue
        #: submitted and not yet finished (kept per step: a soak has thousands of requests)
        self.open: dict[str, None] = {}
        #: step -> requests to abort then
        self.abort_due: dict[int, list[str]] = {}
        self.closed = 0  # finished requests plus their outputs (_progress)
        self.kinds: dict[str, int] = {}
        self.aborts_sent = 0
        self.peak_logical = self.peak_rows = 0.0
        self.retractions = self.evicted_tokens = 0
        self._observe()

    # -- what the scheduler did -------------------------------------------------------------
    def _observe(self) -> None:
        """Count SGLang's own retractions and radix evictions without changing them."""
        rig, run = self.rig, self
        batch_cls = type(rig.scheduler.running_batch)
        original_retract = batch_cls.retract_decode

        def retract_decode(batch: Any, *a: Any, **kw: Any) -> Any:  # NOTE: observes only
            out = original_retract(batch, *a, **kw)
            run.retractions += len(out[0]) + len(out[2])
            return out

        batch_cls.retract_decode = retract_decode
        tree = rig.scheduler.tree_cache
        original_evict = getattr(tree, "evict", None)
        if original_evict is not None and not getattr(tree, "disable", True):
            def evict(params: Any, *a: Any, **kw: Any) -> Any:  # NOTE: observes only
                out = original_evict(params, *a, **kw)
                run.evicted_tokens += int(getattr(out, "num_tokens_evicted", 0) or 0)
                return out

            tree.evict = evict

    # -- drawing ------------------------------------------------------------------------------
    def _tokens(self, n: int) -> list[int]:
        return [self.rnd.randrange(self.vocab) for _ in range(n)]

    def _draw(self, rid: str, step: int) -> _Request:
        s, rnd = self.spec, self.rnd
        u, parent = rnd.random(), None
        in_flight = list(self.open)
        if u < s.shared:
            kind, prompt = "shared", rnd.choice(self.systems) + self._tokens(rnd.randint(1, 90))
        elif u < s.shared + s.duplicate and in_flight:
            parent = rnd.choice(in_flight)
            kind, prompt = "duplicate", list(self.reqs[parent].prompt)
        elif u < s.shared + s.duplicate + s.follow_up and self.follow_ups:
            parent = rnd.choice(self.follow_ups)
            prev = self.reqs[parent]
            kind = "follow_up"
            prompt = prev.prompt + self.rig.results[parent].output_ids + self._tokens(rnd.randint(1, 40))
        else:
            kind, prompt = "fresh", self._tokens(rnd.randint(*s.prompt_len))
        stops = {rnd.randrange(self.vocab) for _ in range(s.stops)}
        abort_at = step + rnd.randint(*s.abort_after) if rnd.random() < s.abort else None
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        return _Request(prompt, rnd.randint(*s.max_new), stops, kind, step, abort_at, parent)

    # -- running ------------------------------------------------------------------------------
    def _pending(self) -> list[str]:
        return list(self.open)

    def _stalled(self, idle_for: int) -> str:
        s, dual = self.rig.scheduler, self.rig.coordinator.dual if self.rig.coordinator else None
        parts = [f"no output for {idle_for} steps with {len(self._pending())} requests unfinished "
                 f"({self._pending()[:6]})", f"waiting {len(s.waiting_queue)}",
                 f"running {len(s.running_batch.reqs)}"]
        for name in ("disagg_decode_prealloc_queue", "disagg_decode_transfer_queue"):
            q = getattr(s, name, None)
            if q is not None:
                parts.append(f"{name.removeprefix('disagg_decode_')} {len(q.queue)}")
                if getattr(q, "retracted_queue", None):
                    parts.append(f"retracted {len(q.retracted_queue)}")
        if dual is not None:
            parts.append(f"free logical ids {dual.logical.available_size()}/{dual.size_full}, "
                         f"free device rows {dual.rows.available_size()}/{dual.size_device}")
        tree = s.tree_cache
        if not getattr(tree, "disable", True):
            parts.append(f"tree evictable {tree.evictable_size()} protected {tree.protected_size()}")
        return "traffic hung: " + "; ".join(parts)

    def _progress(self) -> int:
        """Outputs and finishes so far (grows with every token or finish)."""
        return self.closed + sum(len(self.rig.results[r].output_ids) for r in self.open)

    def run(self) -> dict[str, Any]:
        s, rig = self.spec, self.rig
        step, last, idle, n, stalled_for = 0, -1, 0, 0, 0
        while n < s.requests or self._pending() or idle < 2:
            if n < s.requests and self.rnd.random() < s.rate:
                rid = f"t{s.seed}_{n}"
                req = self.reqs[rid] = self._draw(rid, step)
                rig.submit(rid, req.prompt, req.max_new, stop_token_ids=sorted(req.stops))
                self.open[rid] = None
                if req.abort_at is not None:
                    self.abort_due.setdefault(req.abort_at, []).append(rid)
                n += 1
            for rid in self.abort_due.pop(step, ()):
                if rid in self.open:
                    rig.abort(rid)
                    self.aborts_sent += 1
            ran = rig.step()
            idle = 0 if ran or n < s.requests else idle + 1
            for rid in [r for r in self.open if rig.results[r].finish_reason is not None]:
                del self.open[rid]
                self.closed += 1 + len(rig.results[rid].output_ids)
                if rig.results[rid].finish_reason.get("type") in ("stop", "length"):
                    self.follow_ups.append(rid)
            self._peaks()
            progress = self._progress()
            stalled_for = 0 if progress != last else stalled_for + 1
            last = progress
            if self._pending() and stalled_for >= s.stall_steps:
                raise AssertionError(self._stalled(stalled_for))
            step += 1
            if step > s.max_steps:
                raise AssertionError(f"traffic: {len(self._pending())} requests unfinished after {step} steps")
        rig.check_idle()
        return self._verdict(step)

    def _peaks(self) -> None:
        coord = self.rig.coordinator
        if coord is None:
            return
        dual = coord.dual
        self.peak_logical = max(self.peak_logical, dual.logical.used_size() / dual.size_full)
        self.peak_rows = max(self.peak_rows, dual.rows.used_size() / dual.size_device)

    def _verdict(self, steps: int) -> dict[str, Any]:
        finished: dict[str, int] = {}
        mismatches: list[str] = []
        output_tokens = 0
        server_aborts: dict[str, int] = {}
        for rid, req in self.reqs.items():
            res = self.rig.results[rid]
            how = (res.finish_reason or {}).get("type", "none")
            finished[how] = finished.get(how, 0) + 1
            message = str((res.finish_reason or {}).get("message", ""))
            if how == "abort" and req.abort_at is None:  # SGLang's own (no client abort was sent)
                server_aborts[message[:60]] = server_aborts.get(message[:60], 0) + 1
            output_tokens += len(res.output_ids)
            want = self.reference(rid, req.prompt, req.max_new, req.stops)
            # an aborted request (by the client, or by SGLang on a retraction without a backup)
            # emitted a prefix of its tokens; every other one all of them
            got = res.output_ids
            ok = got == want[: len(got)] if how == "abort" else got == want
            if not ok:
                first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
                mismatches.append(f"{rid} ({req.kind}, prompt {len(req.prompt)}, finish {how}): "
                                  f"{len(got)} tokens, want {len(want)}, first difference at {first}")
        if mismatches:
            raise AssertionError(f"traffic: {len(mismatches)} requests differ from full KV: {mismatches[:4]}")
        stats: dict[str, Any] = {}
        if self.rig.coordinator is not None:
            t = self.rig.coordinator.telemetry()
            stats = {k: t[k] for k in ("hits", "misses", "prefix_hit_tokens", "prefix_load_tokens") if k in t}
            stats.update(shrinks=self.rig.coordinator.core.residency_counts()["shrinks"])
        return {"requests": len(self.reqs), "finished": finished, "kinds": self.kinds, "steps": steps,
                "output_tokens": output_tokens, "aborts_sent": self.aborts_sent, "server_aborts": server_aborts,
                "retractions": self.retractions, "evicted_tokens": self.evicted_tokens,
                "peak_logical": round(self.peak_logical, 3), "peak_rows": round(self.peak_rows, 3),
                "mismatches": 0, "leaks": 0, **stats}


def run_traffic(rig: Any, spec: TrafficSpec, *, pd: bool) -> dict[str, Any]:
    """A :class:`TrafficRun` with the reference of a co-located or a PD decode server."""
    toy = rig.toy
    # the model's own EOS (the toy config's class default, as SGLang reads it from the config)
    eos = set(getattr(rig.scheduler.model_config, "hf_eos_token_id", None) or ())
    if pd:
        from types import SimpleNamespace

        from sglang.srt.disaggregation.decode import _generate_fake_prefill_handoff_output_id

        def reference(rid: str, prompt: list[int], new: int, stops: set[int]) -> list[int]:
            # the fake backend's handoff token (derived from the rid and the vocabulary)
            first = _generate_fake_prefill_handoff_output_id(SimpleNamespace(rid=rid, vocab_size=toy.vocab))
            return reference_until_stop(toy, prompt, new, stops | eos, first=first)
    else:
        def reference(rid: str, prompt: list[int], new: int, stops: set[int]) -> list[int]:
            return reference_until_stop(toy, prompt, new, stops | eos)

    out = TrafficRun(rig, spec, reference).run()
    out["spec"] = {k: v for k, v in asdict(spec).items() if k in ("requests", "seed", "rate", "max_new")}
    return out
