"""Exactness harness: a toy DSA-like model and a decode engine driving ``HiSparseCore`` with
SGLang's call protocol (no SGLang import; CPU or CUDA); ``SpecDecodeEngine`` makes every step a
speculative verify round. See docs/coordinator.md."""

from hisparse_testing.engine import DecodeEngine, EngineSizes, Mismatch, ToyRequest
from hisparse_testing.scenario import ScenarioSpec, ScenarioStats, run_scenario
from hisparse_testing.spec_engine import SpecDecodeEngine
from hisparse_testing.toy_model import ToyModel

__all__ = [
    "DecodeEngine", "EngineSizes", "Mismatch", "ScenarioSpec", "ScenarioStats", "SpecDecodeEngine", "ToyModel",
    "ToyRequest", "run_scenario",
]
