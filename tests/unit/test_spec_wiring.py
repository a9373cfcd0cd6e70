"""Speculative wiring around the core: state widths, swap_in shape contract, precompile list."""

from __future__ import annotations

import pytest
import torch

import sglang_hisparse.kernels.__main__ as kmain
from hisparse_testing.engine import DecodeEngine, EngineSizes
from hisparse_testing.toy_model import ToyModel

MODEL = ToyModel(num_layers=2, top_k=4, item_bytes=16, shared=(False, True))
SIZES = EngineSizes(num_reqs=3, buffer_size=12, device_rows=128, max_ctx=64)


def test_without_spec_the_state_is_unchanged() -> None:
    core = DecodeEngine(MODEL, SIZES, skip_io=False).core
    assert core.spec is None and core.num_draft_tokens == 0
    assert tuple(core.state.slot_tokens.shape) == (2, 3, 13) and tuple(core.state.slot_rows.shape) == (3, 13)
    assert core.resolver.row_shape == (4,) and tuple(core.resolver.out_rows.shape[1:]) == (4,)
    core.reserve_spec([0])  # SGLang calls allocate_spec_scratch for every batch: a no-op
    with pytest.raises(ValueError, match=r"num_draft_tokens = 0.*speculative_num_draft_tokens"):
        core.commit_spec(torch.empty(0, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"top_k has shape \(1, 3, 4\); a verify step needs \[bs, W, 4\] with W = num_draft_tokens = 0"):
        core.swap_in(torch.zeros(1), torch.ones(3), torch.zeros(1, 3, 4, dtype=torch.int32), 0)


def test_with_spec_the_state_has_the_window() -> None:
    core = DecodeEngine(MODEL, SIZES, skip_io=False, num_draft_tokens=3, max_batch=5).core
    assert core.spec is not None and core.num_draft_tokens == 3
    assert tuple(core.state.slot_tokens.shape) == (2, 3, 15) and tuple(core.state.lru.shape) == (2, 3, 12)
    # the resolver serves verify steps only: its one set of buffers is the verify kernel's
    assert tuple(core.resolver.out_rows.shape) == (5, 3, 4) and core.resolver.plan.src.shape[1] == 12
    with pytest.raises(ValueError, match=r"top_k has shape \(1, 2, 4\); a verify step needs \[bs, W, 4\] with W = num_draft_tokens = 3"):
        core.swap_in(torch.zeros(1), torch.ones(2), torch.zeros(1, 2, 4, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match=r"serves speculative verify steps only \(num_draft_tokens = 3\)"):
        core.swap_in(torch.zeros(1), torch.ones(1), torch.zeros(1, 4, dtype=torch.int32), 0)
    core.commit_spec(torch.empty(0, dtype=torch.int32))  # idle batch: nothing was prepared
    with pytest.raises(ValueError, match="no verify round was prepared"):
        core.commit_spec(torch.tensor([[0, -1, -1]], dtype=torch.int32))


def test_precompile_builds_verify_modules_for_the_draft_tokens(monkeypatch, capsys) -> None:
    seen = {}
    monkeypatch.setattr(kmain, "precompile", lambda specs, items, **kw: seen.update(specs=specs, **kw))
    monkeypatch.setattr(kmain._jit, "cache_dir", lambda: "/cache")
    monkeypatch.setattr(kmain._jit, "cuda_arch", lambda: "90")
    assert kmain.main(["--buffer", "4096", "10240", "--items", "656", "--draft-tokens", "4"]) == 0
    assert seen["specs"] == [(2048, 4096, 656), (2048, 10240, 656)]
    assert seen["verify_specs"] == [(2048, 10240, 4, 656)]  # B = 4096 cannot hold 4 * 2048
    assert kmain.main(["--buffer", "4096"]) == 0 and seen["verify_specs"] == []
    assert kmain.main(["--buffer", "4096", "--draft-tokens", "4"]) == 2
    assert "needs B >= W*top_k, e.g. --buffer 10240" in capsys.readouterr().err


def test_one_draft_token_is_still_a_verify_window() -> None:
    """SGLang passes num_draft_tokens = 0 without spec; W = 1 (spec on, no drafts) runs the
    verify path with a one-row window and stays exact."""
    import random

    from hisparse_testing.scenario import ScenarioSpec, run_scenario
    from hisparse_testing.spec_engine import SpecDecodeEngine

    for seed in range(3):
        engine = SpecDecodeEngine(MODEL, SIZES, num_draft_tokens=1, skip_io=False, accept_seed=seed)
        assert tuple(engine.core.state.slot_rows.shape) == (3, 13) and engine.core.spec is not None
        assert engine.core.state.resident is None  # the verify kernel reads no resident hint
        stats = run_scenario(engine, random.Random(seed), ScenarioSpec(num_requests=4, max_prompt=30))
        assert stats.checked_outputs > 0 and engine.accepted == engine.verified
