"""Random request lifecycles over a :class:`DecodeEngine` (the exactness property test).

One scenario: ``num_requests`` requests with random prompt lengths (short ``<= B`` and long
``> B``), random output lengths and admission paths (co-located staging or PD direct). Each
scheduler iteration admits what fits, may abort a request still staging, collects staged
requests, may abort or retract a running one, runs one decode step (optionally padded like
a CUDA-graph batch) and finishes requests that reached their output length. Every decode
step is checked bit for bit by the engine; at the end nothing may be left allocated.

A *lifecycle* is one admission of one request up to its release (finish, abort or retract);
a retracted request re-enters the queue and counts again when readmitted.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from hisparse_testing.engine import DecodeEngine, ReqStatus, ToyRequest


@dataclass(frozen=True)
class ScenarioSpec:
    """Knobs of one random scenario (probabilities are per scheduler iteration)."""

    num_requests: int = 6
    max_prompt: int = 40
    max_new: int = 16
    p_direct: float = 0.3
    p_abort_staging: float = 0.05
    p_abort: float = 0.04
    p_retract: float = 0.05
    pad_batches: bool = True
    #: radix engines: share of requests whose prompt starts with one of ``prefix_seeds``
    #: shared prefixes (of random length), so the tree matches across requests
    p_shared: float = 0.0
    prefix_seeds: int = 2


@dataclass
class ScenarioStats:
    lifecycles: int = 0
    steps: int = 0
    checked_outputs: int = 0
    aborts: int = 0
    staging_aborts: int = 0
    retracts: int = 0
    directs: int = 0
    long_requests: int = 0
    pressure_retracts: int = 0  # retracted by retract_decode (no memory for the next step)
    pressure_aborts: int = 0
    prefetch: str = "off"  # engine.prefetch_coverage: "replayed" only with a shared layer


def run_scenario(engine: DecodeEngine, rng: random.Random, spec: ScenarioSpec) -> ScenarioStats:
    """Drive ``engine`` through one random scenario; raises ``Mismatch`` or ``AssertionError``."""
    B = engine.sizes.buffer_size
    if spec.max_prompt + spec.max_new > engine.sizes.max_ctx:
        raise ValueError(
            f"ScenarioSpec(max_prompt={spec.max_prompt}, max_new={spec.max_new}) can draw a request of "
            f"{spec.max_prompt + spec.max_new} tokens but EngineSizes.max_ctx is {engine.sizes.max_ctx}: "
            "lower max_prompt/max_new or raise max_ctx (such a request could never be admitted)")
    stats = ScenarioStats(prefetch=engine.prefetch_coverage)
    waiting = []
    # NOTE: drawn only when sharing is on, so a spec without it draws what it drew before
    prefix_seeds = [rng.randint(0, 2**30) for _ in range(spec.prefix_seeds)] if spec.p_shared else []
    for i in range(spec.num_requests):
        prompt = rng.randint(1, spec.max_prompt)
        req = ToyRequest(
            rid=i, seed=rng.randint(0, 2**30), prompt_len=prompt,
            max_new=rng.randint(1, spec.max_new), direct=rng.random() < spec.p_direct,
        )
        if spec.p_shared and rng.random() < spec.p_shared:
            req.prefix_seed, req.shared_len = rng.choice(prefix_seeds), rng.randint(1, spec.max_prompt)
        stats.long_requests += prompt + req.max_new > B
        waiting.append(req)
    guard = 0
    while waiting or engine.running or engine.staging:
        guard += 1
        if guard > 10_000:
            raise AssertionError("scenario did not terminate (admission starved?)")
        for req in list(waiting)[: rng.randint(0, 2) or 1]:
            if not engine.can_admit(req):
                break
            waiting.remove(req)
            stats.lifecycles += 1
            if req.direct:
                engine.admit_direct(req)
                stats.directs += 1
            else:
                engine.prefill(req, defer=True)  # one batch: checkpoints after every prefill
        engine.flush_prefills()
        if engine.staging and rng.random() < spec.p_abort_staging:
            engine.release(rng.choice(engine.staging), "abort")
            stats.staging_aborts += 1
        engine.collect()
        if engine.running and rng.random() < spec.p_abort:
            engine.release(rng.choice(engine.running), "abort")
            stats.aborts += 1
        if engine.running and rng.random() < spec.p_retract:
            victim = rng.choice(engine.running)
            engine.release(victim, "retract")
            waiting.append(victim)
            stats.retracts += 1
        retracted, aborted = engine.retract_decode()
        waiting.extend(retracted)
        stats.pressure_retracts += len(retracted)
        stats.pressure_aborts += len(aborted)
        if engine.running:
            pad = len(engine.running) + rng.randint(0, 2) if spec.pad_batches else None
            engine.step(pad_to=pad)
            stats.steps += 1
            engine.check_integrity()
        for req in list(engine.running):
            if req.generated >= req.max_new:
                engine.release(req, "finish")
        if not engine.running and not engine.staging and waiting and not engine.can_admit(waiting[0]):
            raise AssertionError(f"request {waiting[0].rid} can never be admitted: sizes too small")
    stats.checked_outputs = engine.checked_outputs
    assert all(r.status is not ReqStatus.RUNNING for r in waiting)
    engine.check_no_leaks()
    return stats


SEED_ENV = "HISPARSE_TEST_SEED"


def ci_seed() -> int:
    """The base seed of a randomized test: ``$HISPARSE_TEST_SEED`` to replay, else a fresh one,
    so every CI run draws new scenarios. Tests print it and name it in their failures."""
    value = os.environ.get(SEED_ENV, "").strip()
    return int(value) if value else random.SystemRandom().randrange(2**32)


def replay_note(seed: int, test: str) -> str:
    """The line a failure carries so it can be run again with the same scenarios."""
    return f"replay: {SEED_ENV}={seed} python -m pytest -p no:cacheprovider '{test}'"
