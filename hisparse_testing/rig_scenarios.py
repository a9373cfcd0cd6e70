"""Scenarios for the real-scheduler rig, grouped by the scheduler configuration they need.

SGLang's parallel runtime is process-global, so each group runs in a process of its own::

    python -m hisparse_testing.rig_scenarios GROUP WORKDIR   -> one JSON line per scenario

Each scenario submits requests through the scheduler's input socket, steps it until idle, and
checks that every finished request's tokens equal :func:`reference_generate` (the same toy
model with full KV, i.e. HiSparse off, under greedy sampling) and that SGLang's idle leak
check and ours pass (``Rig.check_idle``). A scenario that aborts a request checks the tokens
of the others, and that the aborted one finished with an abort.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hisparse_testing.sglang_rig import Rig, RigConfig, pretend_sm90
from hisparse_testing.token_model import reference_generate

Scenario = Callable[[Rig], dict[str, Any]]


def _random_requests(rnd: random.Random, count: int, lengths: tuple[int, int],
                     new_tokens: tuple[int, int], prefix: str) -> dict[str, tuple[list[int], int]]:
    return {
        f"{prefix}{i}": ([rnd.randrange(1000) for _ in range(rnd.randint(*lengths))], rnd.randint(*new_tokens))
        for i in range(count)
    }


def _submit_all(rig: Rig, reqs: dict[str, tuple[list[int], int]]) -> None:
    for rid, (prompt, new) in reqs.items():
        rig.submit(rid, prompt, new)


Reference = Callable[[Rig, str, list[int], int], list[int]]


def _full_kv(rig: Rig, rid: str, prompt: list[int], new: int) -> list[int]:
    """Co-located: greedy decode with full KV."""
    return reference_generate(rig.toy, prompt, new)


def _check_tokens(rig: Rig, reqs: dict[str, tuple[list[int], int]], skip: set[str] = frozenset(),
                  reference: Reference = _full_kv) -> int:
    """Every request in ``reqs`` (but ``skip``) finished by length with ``reference``'s tokens."""
    for rid, (prompt, new) in reqs.items():
        if rid in skip:
            continue
        res = rig.results[rid]
        want = reference(rig, rid, prompt, new)
        if res.output_ids != want:
            first = next((i for i, (a, b) in enumerate(zip(res.output_ids, want, strict=False)) if a != b), None)
            raise AssertionError(
                f"{rid} (prompt {len(prompt)}, {new} new): tokens differ from full KV at output "
                f"{first}; got {len(res.output_ids)} tokens, finish {res.finish_reason}"
            )
        if (res.finish_reason or {}).get("type") != "length":
            raise AssertionError(f"{rid}: finished with {res.finish_reason}, expected length")
    return len(reqs) - len(skip)


def _expect_aborted(rig: Rig, rids: set[str] | dict[str, Any]) -> None:
    for rid in rids:
        res = rig.results[rid]
        if (res.finish_reason or {}).get("type") != "abort":
            raise AssertionError(f"{rid}: finished with {res.finish_reason} after {len(res.output_ids)} "
                                 f"tokens; expected an abort")


def _stats(rig: Rig) -> dict[str, Any]:
    t = rig.coordinator.telemetry() if rig.coordinator is not None else {}
    out = {k: t[k] for k in ("hits", "misses", "staged_tokens", "backups", "prefix_hit_tokens",
                             "prefix_load_tokens", "prefix_copy_rows", "tree_tokens") if k in t}
    if rig.coordinator is not None:
        c = rig.coordinator.core.residency_counts()
        out.update(shrinks=c["shrinks"], resident_admissions=c["resident_admissions"])
    draft = getattr(rig.scheduler.draft_worker, "draft_worker", None)
    if draft is not None and hasattr(draft, "accept_lengths"):
        out.update(accept_lengths=dict(sorted(draft.accept_lengths.items())),
                   drafts=draft.proposed, drafts_corrupted=draft.corrupted)
    return out


# -- speculative decoding ----------------------------------------------------------------------
def spec_mixed_lengths(rig: Rig) -> dict[str, Any]:
    """EAGLE chain verify rounds over requests shorter and longer than B, chunked prefill, with
    random accept lengths: every length 1 .. W must occur (all drafts rejected, some, all)."""
    rnd = random.Random(5)
    reqs = _random_requests(rnd, 10, (3, 200), (1, 30), "spec")
    _submit_all(rig, reqs)
    rig.run_until_idle()
    rig.check_idle()
    stats = _stats(rig)
    w = rig.config.draft_tokens
    if set(stats.get("accept_lengths", {})) != set(range(1, w + 1)):
        raise AssertionError(f"spec_mixed_lengths: accept lengths {stats.get('accept_lengths')}; "
                             f"every length 1..{w} must occur")
    return {"requests": _check_tokens(rig, reqs), **stats}


# -- radix cache --------------------------------------------------------------------------------
def _hit_tokens(rig: Rig) -> int:
    return int(rig.coordinator.telemetry()["prefix_hit_tokens"]) if rig.coordinator is not None else 0


def radix_shared_prefix(rig: Rig) -> dict[str, Any]:
    """A 4-page system prompt: one request computes it, then 8 others whose prompts start with
    it (suffixes of 1..90 tokens) match it, load it back from host or read its rows, and decode
    exactly; at least 90 % of their prefix tokens are not computed again."""
    rnd = random.Random(21)
    ps = rig.config.page_size
    base = [rnd.randrange(1000) for _ in range(4 * ps)]
    first = {"sys0": (base + [rnd.randrange(1000) for _ in range(10)], 6)}
    _submit_all(rig, first)
    rig.run_until_idle()
    before = _hit_tokens(rig)
    reqs = {f"sys{i}": (base + [rnd.randrange(1000) for _ in range(rnd.randint(1, 90))], rnd.randint(2, 24))
            for i in range(1, 9)}
    _submit_all(rig, reqs)
    rig.run_until_idle()
    hits = _hit_tokens(rig) - before
    if hits < 0.9 * 8 * len(base):
        raise AssertionError(f"radix_shared_prefix: {hits} prefix tokens matched, want >= 90 % of {8 * len(base)}")
    if rig.coordinator is not None:
        tree = int(rig.coordinator.telemetry()["tree_tokens"])
        if tree < len(base):
            raise AssertionError(f"radix_shared_prefix: the tree_tokens gauge says {tree}; the tree keeps at "
                                 f"least the {len(base)}-token system prompt")
    stats = _stats(rig)
    rig.check_idle()
    return {"requests": _check_tokens(rig, {**first, **reqs}), "matched": hits, **stats}


def radix_multi_turn(rig: Rig) -> dict[str, Any]:
    """Six turns of one conversation: each prompt is the previous prompt, its output and a
    few new tokens, so it matches the previous turn's prompt + output (the tree keeps them at
    finish, the newest token's KV written to host then)."""
    rnd = random.Random(22)
    prompt = [rnd.randrange(1000) for _ in range(150)]
    done: dict[str, tuple[list[int], int]] = {}
    matched = []
    for turn in range(6):
        rid, new = f"turn{turn}", rnd.randint(8, 40)
        before = _hit_tokens(rig)
        rig.submit(rid, prompt, new)
        rig.run_until_idle()
        matched.append(_hit_tokens(rig) - before)
        done[rid] = (prompt, new)
        prompt = prompt + rig.results[rid].output_ids + [rnd.randrange(1000) for _ in range(rnd.randint(1, 30))]
    if not all(m > 0 for m in matched[1:]):
        raise AssertionError(f"radix_multi_turn: matched tokens per turn {matched}; every later turn must match")
    stats = _stats(rig)
    rig.check_idle()
    return {"requests": _check_tokens(rig, done), "matched_per_turn": matched, **stats}


def radix_identical_batch(rig: Rig) -> dict[str, Any]:
    """Three identical prompts and two sharing their first pages, submitted together: one
    prefill batch, whose checkpoints find each other's pages (SGLang frees the duplicates and
    repoints the rows), then requests finished at their prefill (one output token) whose
    pages later requests match."""
    rnd = random.Random(23)
    ps = rig.config.page_size
    same = [rnd.randrange(1000) for _ in range(2 * ps + 20)]
    reqs = {f"dup{i}": (list(same), rnd.randint(3, 20)) for i in range(3)}
    reqs.update({f"near{i}": (same[: ps + 10] + [rnd.randrange(1000) for _ in range(30)], 5) for i in range(2)})
    _submit_all(rig, reqs)
    rig.run_until_idle()
    one = [rnd.randrange(1000) for _ in range(ps + 40)]
    short = {"one0": (one, 1)}
    _submit_all(rig, short)
    rig.run_until_idle()
    after = {"one1": (one + [rnd.randrange(1000) for _ in range(12)], 9)}
    _submit_all(rig, after)
    rig.run_until_idle()
    stats = _stats(rig)
    rig.check_idle()
    return {"requests": _check_tokens(rig, {**reqs, **short, **after}), **stats}


def radix_abort_between_chunks(rig: Rig) -> dict[str, Any]:
    """A long prompt aborted while its chunks prefill (SGLang releases it without
    ``request_finished``; the tree keeps the pages its chunks published), then a request whose
    prompt starts with those pages matches them: their KV must have reached host."""
    rnd = random.Random(24)
    chunk = rig.config.chunked_prefill_size or 64
    long = [rnd.randrange(1000) for _ in range(6 * chunk)]
    victim = "chunky"
    rig.submit(victim, long, 8)
    acted = []

    def on_step(r: Rig) -> None:
        chunked = getattr(r.scheduler, "chunked_req", None)
        published = chunked.kv.cache_protected_len if chunked is not None and chunked.rid == victim else 0
        if not acted and published >= 2 * chunk:  # two chunks in the tree, more to come
            r.abort(victim)
            acted.append(published)

    rig.run_until_idle(on_step=on_step)
    if not acted:
        raise AssertionError("radix_abort_between_chunks: the victim was never seen between chunks")
    _expect_aborted(rig, {victim})
    held = sorted(rig.coordinator.dual._held)
    if held:  # before a later request reuses the slot (its collect would drop them)
        raise AssertionError(f"radix_abort_between_chunks: request slots {held} still hold pages after the abort")
    before = _hit_tokens(rig)
    reqs = {"after_chunks": (long[: 2 * chunk] + [rnd.randrange(1000) for _ in range(20)], 12)}
    _submit_all(rig, reqs)
    rig.run_until_idle()
    stats = _stats(rig)
    rig.check_idle()
    return {"requests": _check_tokens(rig, reqs), "aborted_at_prefix": acted[0],
            "matched": _hit_tokens(rig) - before, **stats}


def radix_chunk_race(rig: Rig) -> dict[str, Any]:
    """A long prompt publishes its chunks to the tree as it prefills; a short request arrives
    matching the first two while the long one is still prefilling, on hot buffers (its misses
    read the shared pages' host rows). SGLang 0.5.23 gives a chunk the whole prefill budget,
    so the short one joins the long one's last chunk and both stage together; the collect
    would hold it back otherwise (``DualSpaceAllocator.host_pending``: a page whose host copy
    has not landed)."""
    rnd = random.Random(25)
    chunk = rig.config.chunked_prefill_size or 64
    long = [rnd.randrange(1000) for _ in range(6 * chunk)]
    reqs = {"race_long": (long, 10)}
    rig.submit("race_long", long, 10)
    sent = []

    def on_step(r: Rig) -> None:
        chunked = getattr(r.scheduler, "chunked_req", None)
        if not sent and chunked is not None and chunked.rid == "race_long" and chunked.kv.cache_protected_len >= 2 * chunk:
            prompt = long[: 2 * chunk] + [rnd.randrange(1000) for _ in range(10)]
            reqs["race_short"] = (prompt, 30)
            r.submit("race_short", prompt, 30)
            sent.append(chunked.kv.cache_protected_len)

    before = _hit_tokens(rig)
    rig.run_until_idle(on_step=on_step)
    if not sent:
        raise AssertionError("radix_chunk_race: the long prompt was never seen between chunks")
    stats = _stats(rig)
    rig.check_idle()
    return {"requests": _check_tokens(rig, reqs), "matched": _hit_tokens(rig) - before, **stats}


# -- co-located --------------------------------------------------------------------------------
def v4_mixed_lengths(rig: Rig) -> dict[str, Any]:
    """DeepSeek-V4: concurrent requests of 8-600 tokens (2 to 150 C4 entries: shorter and longer
    than B), several prefill chunks, decodes that cross 4-token groups and C4 pages."""
    return _mixed(rig, random.Random(7), 8, (8, 600), (5, 40), "v4")


def _mixed(rig: Rig, rnd: random.Random, count: int, lengths: tuple[int, int], new: tuple[int, int],
           prefix: str) -> dict[str, Any]:
    reqs = _random_requests(rnd, count, lengths, new, prefix)
    _submit_all(rig, reqs)
    rig.run_until_idle()
    rig.check_idle()
    return {"requests": _check_tokens(rig, reqs), **_stats(rig)}


def mixed_lengths(rig: Rig) -> dict[str, Any]:
    """Many concurrent requests, prompts shorter and longer than B, several prefill chunks."""
    return _mixed(rig, random.Random(1), 14, (3, 200), (1, 40), "mix")


def pressure_shrinks(rig: Rig) -> dict[str, Any]:
    """Pressure-driven residency on a pool too small to keep every request resident: requests
    start resident, the scheduler keeps admitting by logical capacity, and residents shrink to
    hot buffers (on a step's watermark and inside prefill allocations) while other steps are in
    flight. Tokens must equal full KV, and both states must have occurred."""
    rnd = random.Random(5)
    reqs = _random_requests(rnd, 12, (90, 400), (20, 60), "prs")
    _submit_all(rig, reqs)
    rig.run_until_idle()
    rig.check_idle()
    stats = _stats(rig)
    if not stats["shrinks"] or not stats["resident_admissions"]:
        raise AssertionError(f"pressure_shrinks: expected resident admissions and shrinks, got {stats}")
    return {"requests": _check_tokens(rig, reqs), **stats}


def radix_keeps_matched_cache(rig: Rig) -> dict[str, Any]:
    """A finished request's pages stay on the device as cached prefix rows; a request matching
    them arrives when the device rows are short, so its extend must evict cached pages: the
    ones it matched are protected (the oldest, but loading them back from host would be
    waste), the rest go."""
    rnd = random.Random(35)
    ps = rig.config.page_size
    long = {"hold": ([rnd.randrange(1000) for _ in range(5 * ps - 40)], 150)}
    _submit_all(rig, long)
    rig.step()
    base = [rnd.randrange(1000) for _ in range(2 * ps)]
    first = {"base": (base, 4)}
    _submit_all(rig, first)
    while rig.results["base"].finish_reason is None:
        rig.step()
    dual = rig.coordinator.dual
    cached = dual.cached_rows
    before = rig.coordinator.telemetry()
    follow = {"match": (base + [rnd.randrange(1000) for _ in range(ps + 20)], 4)}
    _submit_all(rig, follow)
    rig.run_until_idle()
    after = rig.coordinator.telemetry()
    hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    loaded = after["prefix_load_tokens"] - before["prefix_load_tokens"]
    if not cached or hit < 2 * ps:
        raise AssertionError(f"radix_keeps_matched_cache: {cached} cached rows, {hit} prefix tokens hit; the "
                             f"scenario needs the base's pages cached and matched")
    if loaded:
        raise AssertionError(f"radix_keeps_matched_cache: {loaded} of the {hit} matched tokens were loaded from "
                             f"host; the extend evicted its own cached prefix")
    rig.check_idle()
    return {"requests": _check_tokens(rig, {**long, **first, **follow}), "cached_rows": cached,
            "matched": hit, "loaded": loaded, **_stats(rig)}


def abort_while_staging(rig: Rig) -> dict[str, Any]:
    """Aborts that arrive while a prompt is staging to host (after prefill, before the
    coordinator hands the request to decode): one seen in staging once, one twice.

    SGLang's own ``abort_request`` does not look in the staging queue (docs/patches.md,
    "Upstream issues"): without the plugin's AFTER hook both victims decode to their end.
    With it each finishes as aborted at its first decode step; nothing may leak and every
    other request decodes exactly."""
    rnd = random.Random(2)
    reqs = _random_requests(rnd, 4, (40, 120), (5, 20), "stg")
    victims = {"stg1": 1, "stg2": 2}  # abort after this many iterations seen in staging
    _submit_all(rig, reqs)
    seen: dict[str, int] = {}
    sent: dict[str, int] = {}

    def on_step(r: Rig) -> None:
        staging = {e.req.rid for e in r.coordinator.ack_staging_queue if e.req is not None}
        for v, after in victims.items():
            if v in staging and v not in sent:
                seen[v] = seen.get(v, 0) + 1
                if seen[v] >= after:
                    r.abort(v)
                    sent[v] = r.steps

    rig.run_until_idle(on_step=on_step)
    rig.check_idle()
    if set(sent) != set(victims):
        raise AssertionError(f"abort_while_staging: aborts sent {sent}; victims never seen staging long enough")
    _expect_aborted(rig, victims)
    return {"requests": _check_tokens(rig, reqs, skip=set(victims)),
            "victim_tokens": {v: len(rig.results[v].output_ids) for v in victims}}


def abort_mid_decode(rig: Rig) -> dict[str, Any]:
    """Aborts of requests that are decoding, one short (n <= B) and one long (n > B)."""
    rnd = random.Random(3)
    reqs = _random_requests(rnd, 6, (10, 100), (20, 40), "dec")
    reqs["decshort"] = ([rnd.randrange(1000) for _ in range(8)], 40)
    reqs["declong"] = ([rnd.randrange(1000) for _ in range(90)], 40)
    victims = {"decshort", "declong"}
    _submit_all(rig, reqs)
    sent: dict[str, int] = {}

    def on_step(r: Rig) -> None:
        for req in r.scheduler.running_batch.reqs:
            if req.rid in victims and req.rid not in sent and len(req.output_ids) >= 5:
                r.abort(req.rid)
                sent[req.rid] = len(req.output_ids)

    rig.run_until_idle(on_step=on_step)
    rig.check_idle()
    if set(sent) != victims:
        raise AssertionError(f"abort_mid_decode: aborted {sent}, wanted {victims} mid-decode")
    _expect_aborted(rig, victims)
    return {"requests": _check_tokens(rig, reqs, skip=victims), "aborted_after_tokens": sent}


def padded_batches(rig: Rig) -> dict[str, Any]:
    """Decode batches padded to CUDA-graph sizes (num_real_reqs < rows): 3, 5, 6, 7 requests."""
    rnd = random.Random(4)
    reqs = _random_requests(rnd, 7, (20, 90), (4, 30), "pad")
    _submit_all(rig, reqs)
    rig.run_until_idle()
    rig.check_idle()
    return {"requests": _check_tokens(rig, reqs)}


def long_output_past_device_rows(rig: Rig) -> dict[str, Any]:
    """A request (``ignore_eos``, no radix cache: SGLang's strictest admission path) whose
    prompt and outputs together exceed the device rows but fit the logical ids: its outputs
    take logical ids and at most B + 1 rows, so it must be admitted and decode to its end."""
    dual = rig.coordinator.dual
    prompt = [random.Random(36).randrange(1000) for _ in range(100)]
    reqs = {"past_rows": (prompt, dual.size_device - len(prompt) + 2 * rig.config.page_size)}
    if len(prompt) + reqs["past_rows"][1] > dual.size_full:
        raise AssertionError("long_output_past_device_rows: the request must fit the logical ids")
    _submit_all(rig, reqs)
    rig.run_until_idle(max_steps=4 * dual.size_device)
    rig.check_idle()
    return {"requests": _check_tokens(rig, reqs), "device_rows": dual.size_device, **_stats(rig)}


# -- retraction: a KV pool too small for the decode demand -----------------------------------
def retract_and_resume(rig: Rig) -> dict[str, Any]:
    """Decode runs out of KV, SGLang retracts requests (``retract_req``), and they resume by
    prefilling prompt + generated tokens again."""
    coord = rig.coordinator
    calls: list[str] = []
    original = coord.retract_req

    def spy(req: Any) -> None:  # NOTE: observes only; the real method runs unchanged
        calls.append(req.rid)
        original(req)

    coord.retract_req = spy
    rnd = random.Random(5)
    reqs = _random_requests(rnd, 8, (40, 80), (100, 150), "ret")
    _submit_all(rig, reqs)
    rig.run_until_idle(max_steps=20_000)
    rig.check_idle()
    if not calls:
        raise AssertionError("retract_and_resume: no request was retracted; the pool is not small enough")
    return {"requests": _check_tokens(rig, reqs), "retracted": len(calls), **_stats(rig)}


# -- real traffic (rig_traffic): EOS / stop sets, arrivals, SGLang's own retraction -------------
#: the CI run's size; the soak (``-m slow``) runs ``python -m hisparse_testing.rig_soak``
TRAFFIC_REQUESTS = 32


def traffic(rig: Rig) -> dict[str, Any]:
    """Seeded real traffic (``rig_traffic``): requests that stop at a stop token or their
    drawn length, random arrivals, mixed lengths, shared prefixes, duplicates in flight,
    follow-up turns, aborts, at a load where SGLang over-admits and retracts by its own rules.
    Every token equals full KV, no stall, both idle checks pass."""
    from hisparse_testing.rig_traffic import TrafficSpec, run_traffic

    return run_traffic(rig, TrafficSpec(requests=TRAFFIC_REQUESTS, seed=11), pd=rig.pd_decode)


#: environment a group's process needs before SGLang is imported (module-level constants)
# -- PD decode (--disaggregation-mode decode, fake transfer backend) -------------------------
def _pd_reference(rig: Rig, rid: str, prompt: list[int], new: int) -> list[int]:
    """What a PD decode instance must emit: the prefill's handoff token (the fake backend
    derives it from the rid and the vocabulary), then greedy decode with full KV."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.decode import _generate_fake_prefill_handoff_output_id

    first = _generate_fake_prefill_handoff_output_id(SimpleNamespace(rid=rid, vocab_size=rig.toy.vocab))
    return [first] + reference_generate(rig.toy, prompt + [first], new - 1)


def pd_success(rig: Rig) -> dict[str, Any]:
    """Requests arrive by (fake) transfer into the host pool and decode: short and long."""
    rnd = random.Random(6)
    reqs = _random_requests(rnd, 8, (5, 150), (2, 30), "pd")
    _submit_all(rig, reqs)
    rig.run_until_idle()
    rig.check_idle()
    return {"requests": _check_tokens(rig, reqs, reference=_pd_reference), "published": len(rig.prefill.published), **_stats(rig)}


def v4_tiny_prompts(rig: Rig) -> dict[str, Any]:
    """DeepSeek-V4 prompts of 1-7 tokens: those under 4 have no C4 entry when they join decode
    (nothing to stage or transfer), and gain their first at the 4th token."""
    rnd = random.Random(43)
    reqs = {f"tiny{n}": ([rnd.randrange(1000) for _ in range(n)], 12) for n in range(1, 8)}
    _submit_all(rig, reqs)
    rig.run_until_idle()
    rig.check_idle()
    ref = _pd_reference if rig.pd_decode else _full_kv
    return {"requests": _check_tokens(rig, reqs, reference=ref), **_stats(rig)}


def v4_pd_mixed_lengths(rig: Rig) -> dict[str, Any]:
    """DeepSeek-V4 PD decode: prompts of 5-700 tokens (1-175 C4 entries, past B = 64 for the
    long ones: admitted with the newest entry in slot B and every other selection a miss from
    the host pages the transfer wrote), short and long outputs."""
    rnd = random.Random(41)
    reqs = _random_requests(rnd, 8, (5, 700), (2, 40), "v4pd")
    _submit_all(rig, reqs)
    rig.run_until_idle()
    rig.check_idle()
    stats = _stats(rig)
    if not stats["misses"]:
        raise AssertionError("v4_pd_mixed_lengths: no request missed; the long prompts must exceed B")
    return {"requests": _check_tokens(rig, reqs, reference=_pd_reference), **stats}


def pd_radix_suffix_only(rig: Rig) -> dict[str, Any]:
    """PD decode with its radix cache: a request finishes, then requests whose prompts start
    with its prompt (and a follow-up turn on its prompt + output) match it on the decode
    instance; only their unmatched suffixes are transferred, the rest is read from the tree's
    host rows, and they decode exactly."""
    rnd = random.Random(26)
    ps = rig.config.page_size
    base = [rnd.randrange(1000) for _ in range(3 * ps + 5)]
    first = {"pdr0": (base, 12)}
    _submit_all(rig, first)
    rig.run_until_idle()
    turn = base + rig.results["pdr0"].output_ids + [rnd.randrange(1000) for _ in range(7)]
    reqs = {f"pdr{i}": (base[: 3 * ps] + [rnd.randrange(1000) for _ in range(rnd.randint(1, 60))], rnd.randint(2, 20))
            for i in range(1, 5)}
    reqs["pdr_turn"] = (turn, 9)
    _submit_all(rig, reqs)
    rig.run_until_idle()
    short = {rid: rig.prefill.delivered[rid] for rid in reqs}
    if any(short[rid] > len(prompt) - 3 * ps for rid, (prompt, _) in reqs.items()):
        raise AssertionError(f"pd_radix_suffix_only: transferred positions {short}; the matched {3 * ps} must not be")
    stats = _stats(rig)
    rig.check_idle()
    return {"requests": _check_tokens(rig, {**first, **reqs}, reference=_pd_reference),
            "transferred": short, **stats}


def pd_radix_identical_in_flight(rig: Rig) -> dict[str, Any]:
    """PD decode radix cache: identical prompts in flight together. Joining decode, each is
    checkpointed into the tree; the later ones' duplicate ids are freed and their rows repointed
    to the first's. Later transfers reuse the freed ids and write other prompts' KV into their
    host rows, while the identical requests still decode past B (every step misses on host
    rows): they must read the tree's rows, not the freed ones (the stand-in checks the bytes of
    every row it reads)."""
    rnd = random.Random(33)
    same = [rnd.randrange(1000) for _ in range(3 * rig.config.page_size + 10)]
    twins = {f"twin{i}": (list(same), 60) for i in range(3)}
    _submit_all(rig, twins)
    joined = set()

    def on_step(r: Rig) -> None:
        joined.update(q.rid for q in r.scheduler.running_batch.reqs if q.rid in twins)

    for _ in range(200):
        rig.step()
        on_step(rig)
        if joined == set(twins):
            break
    later = _random_requests(rnd, 6, (150, 220), (10, 30), "late")
    _submit_all(rig, later)
    rig.run_until_idle(on_step=on_step)
    rig.check_idle()
    return {"requests": _check_tokens(rig, {**twins, **later}, reference=_pd_reference), **_stats(rig)}


def pd_radix_keeps_tree(rig: Rig) -> dict[str, Any]:
    """PD decode radix cache with the device rows taken by running hot buffers and logical ids
    to spare: a new request's prealloc evicts the tree only for logical ids it lacks (none
    here), so the finished prompts the tree keeps stay matchable. Every tree eviction is
    observed with the free logical ids at its call."""
    rnd = random.Random(34)
    done = _random_requests(rnd, 4, (100, 150), (2, 4), "kept")
    _submit_all(rig, done)
    rig.run_until_idle()
    tree, dual = rig.scheduler.tree_cache, rig.coordinator.dual
    kept = int(tree.evictable_size())
    evictions: list[tuple[int, int]] = []
    original = tree.evict_for_alloc

    def evict_for_alloc(params: Any, *a: Any, **kw: Any) -> Any:  # NOTE: observes only
        evictions.append((int(params.num_tokens), dual.logical.available_size()))
        return original(params, *a, **kw)

    tree.evict_for_alloc = evict_for_alloc
    # one hot buffer (B + 1 rows) per page: all pages but one taken, then requests whose
    # prompts need more rows than are left (a PD prealloc takes logical ids and host rows only)
    pages = dual.size_device // rig.config.page_size
    running = _random_requests(rnd, pages - 1, (100, 120), (60, 80), "busy")
    _submit_all(rig, running)
    for _ in range(20):
        rig.step()
    probes = _random_requests(rnd, 3, (3 * rig.config.page_size, 4 * rig.config.page_size), (2, 6), "probe")
    _submit_all(rig, probes)
    try:
        rig.run_until_idle()
    finally:
        tree.evict_for_alloc = original
    needless = [(n, free) for n, free in evictions if free >= 4 * rig.config.page_size + n]
    if needless:
        raise AssertionError(f"pd_radix_keeps_tree: {len(needless)} tree evictions with logical ids to spare "
                             f"(asked, free logical ids): {needless[:4]}; the tree kept {kept} tokens")
    rig.check_idle()
    return {"requests": _check_tokens(rig, {**done, **running, **probes}, reference=_pd_reference),
            "tree_kept": kept, "evictions": len(evictions), **_stats(rig)}


def _pd_release_before_admission(rig: Rig, how: str) -> dict[str, Any]:
    rnd = random.Random({"fail": 7, "abort": 8, "timeout": 9}[how])
    reqs = _random_requests(rnd, 5, (20, 120), (3, 15), f"pd{how}")
    victims = {f"pd{how}1", f"pd{how}3"}
    _submit_all(rig, reqs)
    for v in victims:
        rig.prefill.hold(v)
    host = rig.coordinator.host_pool
    acted: dict[str, int] = {}

    def on_step(r: Rig) -> None:
        for v in victims:
            if v in acted or v not in r.prefill.published:
                continue
            acted[v] = int(host.allocated_lens.sum())  # host-row positions bound while in flight
            if how == "abort":
                r.abort(v)
            else:  # a transfer error, or a receiver giving up after its waiting timeout
                r.prefill.fail(v)

    rig.run_until_idle(on_step=on_step)
    rig.check_idle()
    if set(acted) != victims:
        raise AssertionError(f"{how}: acted on {sorted(acted)}, wanted {sorted(victims)} in flight")
    _expect_aborted(rig, victims)
    return {"requests": _check_tokens(rig, reqs, skip=victims, reference=_pd_reference), "host_rows_in_use_in_flight": acted}


def pd_transfer_failure(rig: Rig) -> dict[str, Any]:
    """A transfer fails after the decode side preallocated logical ids and host pages."""
    return _pd_release_before_admission(rig, "fail")


def pd_abort_before_admission(rig: Rig) -> dict[str, Any]:
    """The client aborts while the transfer is in flight."""
    return _pd_release_before_admission(rig, "abort")


def pd_timeout_before_admission(rig: Rig) -> dict[str, Any]:
    """The transfer never completes and the receiver times out (KVPoll.Failed)."""
    return _pd_release_before_admission(rig, "timeout")


def pd_many_failures(rig: Rig) -> dict[str, Any]:
    """A burst of failed transfers, more than the host pool could hold if each leaked."""
    rnd = random.Random(10)
    host = rig.coordinator.host_pool
    total = 0
    for wave in range(4):
        reqs = _random_requests(rnd, 6, (150, 250), (2, 4), f"burst{wave}_")
        _submit_all(rig, reqs)
        for rid in reqs:
            rig.prefill.hold(rid)
        failed: set[str] = set()

        def on_step(r: Rig, reqs=reqs, failed=failed) -> None:
            for rid in reqs:
                if rid in r.prefill.published and rid not in failed:
                    r.prefill.fail(rid)
                    failed.add(rid)

        rig.run_until_idle(on_step=on_step)
        total += len(failed)
    rig.check_idle()
    return {"failed_transfers": total, "host_rows": host.size}


def pd_retract_without_backup(rig: Rig) -> dict[str, Any]:
    """PD decode retraction (``SGLANG_TEST_RETRACT``) with ``--disaggregation-decode-retraction-
    backup none``: SGLang aborts each retracted request (503, the client retries) after
    ``retract_req``. Every other request must still decode exactly, and nothing may leak."""
    rnd = random.Random(11)
    reqs = _random_requests(rnd, 8, (20, 120), (10, 30), "pdr")
    _submit_all(rig, reqs)
    rig.run_until_idle()
    rig.check_idle()
    aborted = {rid for rid in reqs if (rig.results[rid].finish_reason or {}).get("type") == "abort"}
    if not aborted:
        raise AssertionError("pd_retract_without_backup: no request was retracted")
    return {"requests": _check_tokens(rig, reqs, skip=aborted, reference=_pd_reference), "retracted_and_aborted": len(aborted)}


GROUP_ENV: dict[str, dict[str, str]] = {
    # SGLang's own retraction test knob: every 7th forward retracts decode requests, on top
    # of the real KV pressure of a small pool (which alone retracts only under some loads)
    "retract": {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "7"},
    "pd_retract": {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "7"},
    "radix_retract": {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "7"},
    # a server long past its warm-up: SGLang's new-token ratio decays to its floor in 20 decode
    # steps instead of 600, so admission counts on early stops as a busy server's does
    **{g: {"SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS": "20"}
       for g in ("traffic", "traffic_overlap", "traffic_pd", "traffic_pd_radix")},
}

_PD = ("--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
       "--disaggregation-decode-retraction-backup", "none")

#: SGLang admits on its estimate of each request's remaining output, scaled by
#: --schedule-conservativeness (an operator's throughput knob); 0.3 admits on a fifth of
#: max_new_tokens at first, so decode over-runs the pool and retracts by SGLang's own rules
_OVER_ADMIT = ("--schedule-conservativeness", "0.3")

#: real traffic on a pool its load overfills (1024 device rows, 2048 logical ids, 16 running),
#: with a hot buffer of several pages (B 64 over 16-token pages, as a server's B 2048 spans 32
#: pages of 64), so that decode grows buffers into the device rows: co-located and PD decode
#: (with and without its radix cache), each on the normal and the overlap loop, pressure
#: residency with slru and always-hot buffers with lru
_TRAFFIC = dict(device_rows=512, host_to_device_ratio=4, page_size=16, buffer_size=64, max_running_requests=16)
TRAFFIC_GROUPS: dict[str, tuple[RigConfig, list[Scenario]]] = {
    "traffic": (
        RigConfig(radix=True, chunked_prefill_size=128, staging_polls=2, extra_args=_OVER_ADMIT, **_TRAFFIC),
        [traffic],
    ),
    "traffic_overlap": (
        RigConfig(radix=True, overlap=True, residency="always_hot", policy="lru", chunked_prefill_size=128,
                  staging_polls=2, extra_args=_OVER_ADMIT, **_TRAFFIC),
        [traffic],
    ),
    "traffic_pd": (
        RigConfig(residency="always_hot", policy="lru", overlap=True, extra_args=(*_PD, *_OVER_ADMIT),
                  **_TRAFFIC),
        [traffic],
    ),
    "traffic_pd_radix": (
        RigConfig(radix=True, extra_args=(*_PD, *_OVER_ADMIT, "--disaggregation-decode-enable-radix-cache"),
                  **_TRAFFIC),
        [traffic],
    ),
}

GROUPS: dict[str, tuple[RigConfig, list[Scenario]]] = {
    # the longest group first: the test starts two groups at a time, in this order
    **TRAFFIC_GROUPS,
    "speculative": (
        RigConfig(buffer_size=64, draft_tokens=3, overlap=True, chunked_prefill_size=64,
                  max_running_requests=8, staging_polls=2),
        [spec_mixed_lengths, abort_mid_decode],
    ),
    # SGLang's default scheduler loop (the other groups run the normal loop)
    "overlap": (
        RigConfig(overlap=True, chunked_prefill_size=64, pad_decode=True, staging_polls=3),
        [mixed_lengths, abort_while_staging],
    ),
    "colocated": (
        RigConfig(chunked_prefill_size=64, pad_decode=True, max_running_requests=8, staging_polls=3),
        [mixed_lengths, abort_while_staging, abort_mid_decode, padded_batches],
    ),
    # pressure-driven residency on a small pool, on the overlap loop (shrinks while a step is
    # in flight), and the always-hot mode every other group's default replaced
    "residency": (
        RigConfig(overlap=True, device_rows=1536, chunked_prefill_size=128, max_running_requests=8,
                  staging_polls=2),
        [pressure_shrinks, abort_mid_decode],
    ),
    # ... with the lru replacement policy (hot buffers only: every long step resolves)
    "always_hot": (
        RigConfig(residency="always_hot", policy="lru", chunked_prefill_size=64, max_running_requests=8,
                  staging_polls=3),
        [mixed_lengths, abort_mid_decode],
    ),
    # SGLang's radix cache on: shared prefixes, multi-turn, duplicates in one batch, finish at
    # prefill, abort mid-decode; normal and overlap loops
    "radix": (
        RigConfig(radix=True, chunked_prefill_size=64, max_running_requests=8, staging_polls=3),
        [radix_shared_prefix, radix_multi_turn, radix_identical_batch, radix_abort_between_chunks,
         abort_mid_decode],
    ),
    "radix_hot": (
        RigConfig(radix=True, residency="always_hot", chunked_prefill_size=64, max_running_requests=8,
                  staging_polls=1),
        [radix_chunk_race, radix_shared_prefix],
    ),
    "radix_retract": (
        RigConfig(radix=True, device_rows=512, host_to_device_ratio=2, max_running_requests=8,
                  extra_args=("--schedule-conservativeness", "0.01")),
        [retract_and_resume],
    ),
    "radix_overlap": (
        RigConfig(radix=True, overlap=True, chunked_prefill_size=128, device_rows=1536,
                  max_running_requests=8, staging_polls=2),
        [radix_shared_prefix, radix_multi_turn, mixed_lengths],
    ),
    # MiniMax-M3: block top-k (blocks of 8, three per step, the last a forced local block)
    # over MHA K/V; dense layer 0 stays at logical size on the device; hot buffers (misses
    # every step, under the fra policy) on the normal loop, pressure residency on the overlap loop
    "m3": (
        RigConfig(num_layers=3, top_k=24, buffer_size=48, m3_block=8, residency="always_hot", policy="fra",
                  chunked_prefill_size=64, max_running_requests=8, staging_polls=3),
        [mixed_lengths, abort_while_staging, abort_mid_decode],
    ),
    "m3_overlap": (
        RigConfig(num_layers=3, top_k=24, buffer_size=48, m3_block=8, overlap=True, device_rows=1536,
                  chunked_prefill_size=128, max_running_requests=8, staging_polls=2),
        [pressure_shrinks, mixed_lengths],
    ),
    "m3_radix": (
        RigConfig(num_layers=3, top_k=24, buffer_size=48, m3_block=8, radix=True, chunked_prefill_size=64,
                  max_running_requests=8, staging_polls=3),
        [radix_shared_prefix, radix_multi_turn, abort_mid_decode],
    ),
    # DeepSeek-V4: C4 entries, 16 a step from B 64 hot slots,
    # through SGLang's own V4 pools and SWA allocator; hot buffers (the lru policy) on the
    # normal loop
    "v4": (
        RigConfig(num_layers=4, top_k=16, buffer_size=64, v4=True, page_size=256, device_rows=1024, policy="lru",
                  residency="always_hot", chunked_prefill_size=256, max_running_requests=4, staging_polls=2),
        [v4_mixed_lengths, v4_tiny_prompts, abort_while_staging, abort_mid_decode],
    ),
    # V4 under pressure residency (requests start resident, shrink as C4 rows run short) on
    # SGLang's overlap loop
    "v4_overlap": (
        RigConfig(num_layers=4, top_k=16, buffer_size=64, v4=True, page_size=256, device_rows=320, overlap=True,
                  max_running_requests=4, staging_polls=2),
        [v4_mixed_lengths],
    ),
    # MiniMax-M3 PD decode (K-only index layers, as SGLang's transfer needs): the sparse
    # layers' K and V land in the host pool's K and V arrays, the dense layer's K/V at logical
    # locations; hot buffers, prompts past B (48 tokens) all-miss at admission
    "m3_pd": (
        RigConfig(num_layers=3, top_k=24, buffer_size=48, m3_block=8, m3_index_values=False,
                  residency="always_hot", max_running_requests=8, extra_args=(
                      "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
                      "--disaggregation-decode-retraction-backup", "none")),
        [pd_success, pd_transfer_failure, pd_abort_before_admission, pd_many_failures],
    ),
    # DeepSeek-V4 PD decode: the prompt's C4 entries land in the host pool's C4 pages (the
    # pages SGLang's transfer addresses), then decode as co-located; hot buffers
    "v4_pd": (
        RigConfig(num_layers=4, top_k=16, buffer_size=64, v4=True, page_size=256, device_rows=1024,
                  residency="always_hot", max_running_requests=4, extra_args=(
                      "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
                      "--disaggregation-decode-retraction-backup", "none")),
        [v4_pd_mixed_lengths, v4_tiny_prompts, pd_success, pd_transfer_failure, pd_abort_before_admission],
    ),
    "pd_decode": (
        RigConfig(max_running_requests=8, extra_args=(
            "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
            "--disaggregation-decode-retraction-backup", "none")),
        [pd_success, pd_transfer_failure, pd_abort_before_admission, pd_timeout_before_admission,
         pd_many_failures],
    ),
    "pd_decode_radix": (
        RigConfig(radix=True, max_running_requests=8, extra_args=(
            "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
            "--disaggregation-decode-retraction-backup", "none",
            "--disaggregation-decode-enable-radix-cache")),
        [pd_radix_suffix_only, pd_success, pd_transfer_failure],
    ),
    # ... with hot buffers (every step past B misses on host rows), filling the device rows with
    # logical ids to spare (16 x 256 rows: SGLang's PD admission reserves 512 decode tokens a
    # request)
    "pd_radix_hot": (
        RigConfig(radix=True, residency="always_hot", device_rows=256, host_to_device_ratio=16,
                  max_running_requests=8, extra_args=(*_PD, "--disaggregation-decode-enable-radix-cache")),
        [pd_radix_identical_in_flight, pd_radix_keeps_tree],
    ),
    # a device pool of 7 usable pages: an extend must evict cached prefix pages
    "radix_tight": (
        RigConfig(radix=True, device_rows=512, host_to_device_ratio=4, max_running_requests=4,
                  residency_watermark=0.0),
        [radix_keeps_matched_cache],
    ),
    "pd_retract": (
        RigConfig(max_running_requests=8, extra_args=(
            "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
            "--disaggregation-decode-retraction-backup", "none")),
        [pd_retract_without_backup],
    ),
    # 512 device rows, 1024 logical ids, no radix cache
    "tight": (
        RigConfig(device_rows=512, host_to_device_ratio=2, max_running_requests=8),
        [long_output_past_device_rows],
    ),
    "retract": (
        # aggressive admission (conservativeness 0.01) into 1024 logical ids: decode must retract
        RigConfig(device_rows=512, host_to_device_ratio=2, max_running_requests=8,
                  extra_args=("--schedule-conservativeness", "0.01")),
        [retract_and_resume],
    ),
}


def run_group(name: str, workdir: Path, only: list[str] | None = None) -> list[dict[str, Any]]:
    """Build the group's rig and run its scenarios in order; one record per scenario."""
    config, scenarios = GROUPS[name]
    t0 = time.perf_counter()
    rig = Rig(config, workdir)
    records = [{"scenario": "startup", "ok": True, "seconds": round(time.perf_counter() - t0, 2)}]
    for fn in scenarios:
        if only and fn.__name__ not in only:
            continue
        t = time.perf_counter()
        rec: dict[str, Any] = {"scenario": fn.__name__}
        try:
            rec.update(ok=True, **fn(rig))
        except Exception as e:  # reported per scenario; the next one starts from idle if it can
            rec.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        rec["seconds"] = round(time.perf_counter() - t, 2)
        rec["steps"] = rig.steps
        records.append(rec)
    return records


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in GROUPS:
        print(f"usage: python -m hisparse_testing.rig_scenarios {{{','.join(GROUPS)}}} WORKDIR "
              "[SCENARIO ...]", file=sys.stderr)
        return 2
    import os

    os.environ.update(GROUP_ENV.get(argv[0], {}))
    pretend_sm90()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    for rec in run_group(argv[0], Path(argv[1]), argv[2:] or None):
        print("RIG " + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
