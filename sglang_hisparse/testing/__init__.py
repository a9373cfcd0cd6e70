"""Exactness harness: a toy DSA-like model and a decode engine driving ``HiSparseCore`` with
SGLang's call protocol (no SGLang import; CPU or CUDA); ``SpecDecodeEngine`` makes every step a
speculative verify round. See docs/coordinator.md."""

from sglang_hisparse.testing.engine import DecodeEngine, EngineSizes, Mismatch, ToyRequest
from sglang_hisparse.testing.scenario import ScenarioSpec, ScenarioStats, run_scenario
from sglang_hisparse.testing.spec_engine import SpecDecodeEngine
from sglang_hisparse.testing.toy_model import ToyModel

__all__ = [
    "DecodeEngine", "EngineSizes", "Mismatch", "ScenarioSpec", "ScenarioStats", "SpecDecodeEngine", "ToyModel",
    "ToyRequest", "run_scenario",
]
