"""Exactness harness: random lifecycles through the coordinator give bit-identical attention.

Each scenario runs requests through staging or PD direct admission, decode steps (padded
like CUDA-graph batches), aborts (while staging and while decoding), retractions and
finishes; every step's attention output is compared bit for bit with the all-resident
model, every allocator/pool is checked for integrity after every step, and afterwards they
must be empty. In total the configurations below run well over 200 request lifecycles.

Seeds are fresh on every run (``ci_seed``): the base seed is printed and every failure names
it; ``HISPARSE_TEST_SEED=<seed>`` replays the same scenarios. Memory pressure: admission
reserves ``new_token_ratio`` x the decode growth ahead (SGLang's PrefillAdder); at ratio 1 no
step runs short, below 1 the engine retracts like SGLang's ``retract_decode``.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

import sglang_hisparse.coordinator.step as step_module
from hisparse_testing.engine import DecodeEngine, EngineSizes, Mismatch, ToyRequest
from hisparse_testing.scenario import (
    ScenarioSpec,
    ScenarioStats,
    ci_seed,
    replay_note,
    run_scenario,
)
from hisparse_testing.toy_model import ToyModel

# (model, sizes): small B/k/I, 3-4 layers with index sharing, page sizes 1 and 4
CONFIGS = {
    "L4-k4-B8-I32-p1": (
        ToyModel(num_layers=4, top_k=4, item_bytes=32, shared=(False, True, True, False)),
        EngineSizes(num_reqs=6, buffer_size=8, device_rows=256, max_ctx=64, page_size=1),
    ),
    "L3-k8-B16-I64-p4": (
        ToyModel(num_layers=3, top_k=8, item_bytes=64, shared=(False, True, False)),
        EngineSizes(num_reqs=5, buffer_size=16, device_rows=320, max_ctx=96, page_size=4),
    ),
    "L4-k6-B12-I48-p2": (
        ToyModel(num_layers=4, top_k=6, item_bytes=48, shared=(False, False, True, True)),
        EngineSizes(num_reqs=6, buffer_size=12, device_rows=256, max_ctx=80, page_size=2),
    ),
}
SEEDS = 6
BASE_SEED = ci_seed()
LIFECYCLES: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report():
    print(f"\nharness base seed {BASE_SEED} (replay: HISPARSE_TEST_SEED={BASE_SEED})")
    yield
    print(f"\nharness lifecycles: {sum(LIFECYCLES.values())} ({dict(LIFECYCLES)})")


def _run(engine: DecodeEngine, seed: int, spec: ScenarioSpec, test: str) -> ScenarioStats:
    try:
        stats = run_scenario(engine, random.Random(seed), spec)
    except AssertionError as e:  # Mismatch included
        e.add_note(replay_note(BASE_SEED, test))
        raise
    LIFECYCLES[test.split("::")[-1].split("[")[0]] += stats.lifecycles
    return stats


def _total(stats: list[ScenarioStats], name: str) -> int:
    return sum(getattr(s, name) for s in stats)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_random_lifecycles_are_exact_and_leak_free(config: str, prefetch: bool) -> None:
    model, sizes = CONFIGS[config]
    spec = ScenarioSpec(max_prompt=sizes.max_ctx // 2, max_new=sizes.buffer_size + 4)
    stats = []
    for seed in range(SEEDS):
        engine = DecodeEngine(
            model, sizes, prefetch=prefetch, skip_io=False, max_batch=8, decode_alloc_rows=seed % 2 == 1,
            new_token_ratio=(1.0, 0.5)[seed % 2],
        )
        assert engine.core.prefetch_enabled is prefetch
        assert engine.prefetch_coverage == ("replayed" if prefetch else "off")
        stats.append(_run(engine, BASE_SEED + 1000 * seed + len(config), spec,
                          f"tests/unit/test_harness_exactness.py::test_random_lifecycles_are_exact_and_leak_free[{config}]"))
    # 3 configs x 2 modes x this >= 200 lifecycles in total
    assert _total(stats, "lifecycles") >= 34
    assert _total(stats, "checked_outputs") > 0
    assert _total(stats, "long_requests") > 0
    assert _total(stats, "directs") > 0
    assert _total(stats, "retracts") + _total(stats, "aborts") > 0


@pytest.mark.parametrize("policy", ["fra", "slru"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_policy_lifecycles_are_exact(config: str, policy: str) -> None:
    # The replacement policy only changes which slots are evicted: outputs stay exact through
    # every lifecycle (reset, install, PD direct admission, retract) with the policy's state.
    model, sizes = CONFIGS[config]
    spec = ScenarioSpec(max_prompt=sizes.max_ctx // 2, max_new=sizes.buffer_size + 4)
    stats = []
    for seed in range(2):
        engine = DecodeEngine(model, sizes, prefetch=True, skip_io=False, max_batch=8, policy=policy)
        assert engine.core.state.policy_state is not None
        stats.append(_run(engine, BASE_SEED + 7000 + 1000 * seed + len(config), spec,
                          f"tests/unit/test_harness_exactness.py::test_policy_lifecycles_are_exact[{config}-{policy}]"))
    assert _total(stats, "checked_outputs") > 0 and _total(stats, "long_requests") > 0


def test_every_path_is_exercised() -> None:
    """One busier scenario that is guaranteed to hit staging aborts, aborts and retracts."""
    model, sizes = CONFIGS["L4-k4-B8-I32-p1"]
    spec = ScenarioSpec(num_requests=24, p_abort_staging=0.3, p_abort=0.15, p_retract=0.2, max_new=20)
    engine = DecodeEngine(model, sizes, prefetch=True, skip_io=False)
    stats = _run(engine, BASE_SEED + 7, spec, "tests/unit/test_harness_exactness.py::test_every_path_is_exercised")
    assert stats.staging_aborts and stats.aborts and stats.retracts and stats.directs
    snap = engine.core.telemetry.snapshot()
    assert snap.misses > 0 and 0.0 < snap.hit_rate < 1.0
    assert snap.backup_tokens > 0 and snap.staged_requests > 0


# tight device rows: a few requests' hot buffers fill them, so growth pages run short
TIGHT = {
    f"p{page}": (ToyModel(num_layers=2, top_k=4, item_bytes=16, shared=(False, True)),
                 EngineSizes(num_reqs=8, buffer_size=8, device_rows=rows, max_ctx=48, page_size=page))
    for page, rows in ((1, 16), (2, 24), (4, 32), (8, 40))
}
TIGHT_SPEC = ScenarioSpec(num_requests=8, max_prompt=5, max_new=12, p_retract=0.0, p_abort=0.0)


@pytest.mark.parametrize("page", sorted(TIGHT))
def test_memory_pressure_retracts_instead_of_running_out(page: str) -> None:
    """Short requests growing their hot buffers in few device rows (used to end in
    'map_last_loc: no free device row'): admission at ratio 0.1 over-admits, retract_decode
    makes room the way SGLang does, and every output stays exact."""
    model, sizes = TIGHT[page]
    retracts = 0
    # NOTE: 6 scenarios: with 2, about 1 base seed in 150 gave none that over-admits at page 4
    # (seeds 238 and 298 of 0..299), which failed the "some retraction" check below; with 4
    # one random base seed still did.
    for seed in range(6):
        engine = DecodeEngine(model, sizes, prefetch=seed % 2 == 0, skip_io=False, max_batch=8,
                              new_token_ratio=0.1, decode_alloc_rows=seed % 2 == 1)
        stats = _run(engine, BASE_SEED + 31 * seed, TIGHT_SPEC,
                     f"tests/unit/test_harness_exactness.py::test_memory_pressure_retracts_instead_of_running_out[{page}]")
        retracts += stats.pressure_retracts
        assert stats.checked_outputs > 0
    assert retracts > 0


@pytest.mark.parametrize("page", sorted(TIGHT))
def test_full_reservation_never_runs_short(page: str) -> None:
    """At new_token_ratio 1 admission reserves all growth ahead: no step needs a retraction."""
    model, sizes = TIGHT[page]
    for seed in range(1):
        engine = DecodeEngine(model, sizes, prefetch=False, skip_io=False, max_batch=8, new_token_ratio=1.0,
                              decode_alloc_rows=page == "p1")
        stats = _run(engine, BASE_SEED + 17 * seed, TIGHT_SPEC,
                     f"tests/unit/test_harness_exactness.py::test_full_reservation_never_runs_short[{page}]")
        assert stats.pressure_retracts == stats.pressure_aborts == 0


def test_prefetch_without_a_shared_layer_says_so() -> None:
    """Prefetch on, but every layer runs its own indexer: nothing is replayed, and the stats
    say so instead of counting the run as prefetch coverage."""
    model = ToyModel(num_layers=2, top_k=4, item_bytes=16, shared=(False, False))
    sizes = EngineSizes(num_reqs=4, buffer_size=8, device_rows=256, max_ctx=64)
    engine = DecodeEngine(model, sizes, prefetch=True, skip_io=False)
    stats = _run(engine, BASE_SEED, ScenarioSpec(num_requests=3),
                 "tests/unit/test_harness_exactness.py::test_prefetch_without_a_shared_layer_says_so")
    assert stats.prefetch == "on, but no shared layer: nothing replayed"


def _long_run(engine: DecodeEngine, steps: int = 12) -> None:
    engine.prefill(ToyRequest(rid=0, seed=5, prompt_len=30, max_new=steps))
    engine.admit_direct(ToyRequest(rid=1, seed=6, prompt_len=25, max_new=steps, direct=True))
    engine.collect()
    for _ in range(steps):
        engine.step()


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "sync"])
def test_harness_detects_a_missing_backup(monkeypatch: pytest.MonkeyPatch, prefetch: bool) -> None:
    """The oracle is sensitive: dropping the write-through backup corrupts later misses."""
    monkeypatch.setattr(step_module.StepMapper, "_backup", lambda self, rs, slots, pos: None)
    model, sizes = CONFIGS["L4-k4-B8-I32-p1"]
    with pytest.raises(Mismatch):
        _long_run(DecodeEngine(model, sizes, prefetch=prefetch, skip_io=False))


def test_skip_io_outputs_are_invalid_but_bookkeeping_is_not() -> None:
    """SKIP_IO copies no miss bytes: the oracle must notice; counters still count misses."""
    model, sizes = CONFIGS["L4-k4-B8-I32-p1"]
    engine = DecodeEngine(model, sizes, prefetch=True, skip_io=True)
    with pytest.raises(Mismatch):
        _long_run(engine)
    assert engine.core.telemetry.snapshot().misses > 0


@pytest.mark.parametrize("residency", ["always_hot", "pressure"])
@pytest.mark.parametrize("config", ["L4-k4-B8-I32-p1", "L3-k8-B16-I64-p4"])
def test_a_compressed_layout_steps_the_core_only_on_aligned_tokens(config: str, residency: str) -> None:
    """A toy DeepSeek-V4 (compress ratio 4, docs/v4-m3.md): every request generates a token a
    step but gains an entry every fourth; the whole batch resolves every step over its
    entries through map_last_loc(grows=), bit-exact, through random lifecycles, leak-free."""
    model, sizes = CONFIGS[config]
    lifecycles = 0
    for seed in range(2):
        engine = DecodeEngine(model, sizes, prefetch=True, skip_io=False, compress_ratio=4,
                              residency=residency, watermark_rows=sizes.page_size * 2)
        spec = ScenarioSpec(max_prompt=sizes.max_ctx // 2, max_new=4 * sizes.buffer_size // 2)
        stats = _run(engine, BASE_SEED + 11 * seed, spec,
                     f"tests/unit/test_harness_exactness.py::test_a_compressed_layout_steps_the_core_only_on_aligned_tokens[{config}-{residency}]")
        lifecycles += stats.lifecycles
        assert stats.checked_outputs > 0
    assert lifecycles >= 8


@pytest.mark.parametrize("host_paged", [False, True], ids=["host_flat", "host_paged"])
@pytest.mark.parametrize("residency", ["always_hot", "pressure"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_c4_entries_in_flashmla_pages_are_resolved_exactly(page_size: int, residency: str, host_paged: bool) -> None:
    """The toy DeepSeek-V4 with its device rows in the C4 layout FlashMLA reads (64 entries per
    37440-byte page, ``kernels.row_layout.C4_PAGED``; 592-byte host rows, or with
    ``C4_PAGED_HOST`` the host rows in the same pages, as SGLang's PD transfer writes them):
    every core path that moves rows (resolve misses, shared-layer replay, staging backup,
    residency shrink, PD preload) goes through the layout, bit-exact through random
    lifecycles, leak-free."""
    from sglang_hisparse.kernels.row_layout import C4_PAGED, C4_PAGED_HOST

    layout = C4_PAGED_HOST if host_paged else C4_PAGED
    model = ToyModel(num_layers=3, top_k=8, item_bytes=592, shared=(False, True, False))
    sizes = EngineSizes(num_reqs=5, buffer_size=16, device_rows=320, max_ctx=96, page_size=page_size)
    lifecycles = 0
    for seed in range(2):
        engine = DecodeEngine(model, sizes, prefetch=True, skip_io=False, compress_ratio=4, residency=residency,
                              watermark_rows=sizes.page_size * 8, row_layout=layout)
        assert tuple(engine.pool.kv.shape) == (3, 6, 37440)  # 321 + padding rows in 64-entry pages
        host_rows = 320 * 4 + page_size  # ratio 4, the padding page
        assert tuple(engine.host.kv.shape) == ((3, -(-host_rows // 64), 37440) if host_paged else (3, host_rows, 592))
        stats = _run(engine, BASE_SEED + 17 * seed + page_size, ScenarioSpec(max_prompt=48, max_new=32),
                     f"tests/unit/test_harness_exactness.py::test_c4_entries_in_flashmla_pages_are_resolved_exactly[{page_size}-{residency}-{host_paged}]")
        lifecycles += stats.lifecycles
        assert stats.checked_outputs > 0
    assert lifecycles >= 8


@pytest.mark.parametrize("host_split", [False, True], ids=["host_rows", "host_split"])
@pytest.mark.parametrize("block_size", [2, 4])
def test_block_top_k_is_expanded_and_resolved_exactly(block_size: int, host_split: bool) -> None:
    """A toy MiniMax-M3 (docs/v4-m3.md): the indexer's selection as blocks of positions;
    swap_in_blocks expands them (positions past the length -1) and resolves the result, every
    step bit-exact against the positions computed independently, through random lifecycles;
    with ``KV_SPLIT_HOST`` the host rows' K and V halves in separate arrays (as SGLang's PD
    transfer writes them), the device rows K then V."""
    from sglang_hisparse.kernels.row_layout import KV_SPLIT_HOST, TOKEN

    model, sizes = CONFIGS["L4-k4-B8-I32-p1"]
    lifecycles = 0
    for seed in range(2):
        engine = DecodeEngine(model, sizes, prefetch=True, skip_io=False, block_size=block_size,
                              residency=("always_hot", "pressure")[seed], watermark_rows=2,
                              row_layout=KV_SPLIT_HOST if host_split else TOKEN)
        if host_split:
            assert engine.host.kv.shape[1:] == (2 * engine.host.total_rows, 16)
        stats = _run(engine, BASE_SEED + 13 * seed, ScenarioSpec(max_prompt=30, max_new=16),
                     f"tests/unit/test_harness_exactness.py::test_block_top_k_is_expanded_and_resolved_exactly[{block_size}-{host_split}]")
        lifecycles += stats.lifecycles
        assert stats.checked_outputs > 0
    assert lifecycles >= 8


def test_a_narrower_block_selection_is_padded_and_resolved_exactly() -> None:
    """MiniMax-M3 passes as many block columns as its merged selection has, which may be fewer
    than top_k / block: the core pads the rest with -1 blocks and returns the given blocks'
    rows, bit-exact through random lifecycles; more blocks than the build holds are refused."""
    import torch

    model, sizes = CONFIGS["L4-k4-B8-I32-p1"]
    engine = DecodeEngine(model, sizes, prefetch=True, skip_io=False, block_size=2, fewer_blocks=1)
    stats = _run(engine, BASE_SEED + 29, ScenarioSpec(max_prompt=30, max_new=16),
                 "tests/unit/test_harness_exactness.py::test_a_narrower_block_selection_is_padded_and_resolved_exactly")
    assert stats.checked_outputs > 0 and stats.lifecycles >= 4
    too_many = torch.zeros((1, model.top_k // 2 + 1), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"3 blocks of 2 = 6 positions, but the coordinator resolves top_k = 4"):
        engine.core.swap_in_blocks(torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), too_many, 0, 2)


def test_expand_blocks_contract() -> None:
    import torch

    from sglang_hisparse.kernels.reference import expand_blocks

    blocks = torch.tensor([[2, 0, -1], [1, -1, -1]], dtype=torch.int32)
    got = expand_blocks(blocks, torch.tensor([10, 3]), 4)
    assert got.tolist() == [[8, 9, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1],
                            [-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1]]
    with pytest.raises(ValueError, match="block_size = 0 must be >= 1"):
        expand_blocks(blocks, torch.tensor([10, 3]), 0)
