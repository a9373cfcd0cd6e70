"""The engine-agnostic HiSparse coordinator (no SGLang import); see docs/coordinator.md."""

from sglang_hisparse.coordinator.core import HiSparseCore
from sglang_hisparse.coordinator.lifecycle import StagingEntry
from sglang_hisparse.coordinator.state import Phase, SlotState

__all__ = ["HiSparseCore", "Phase", "SlotState", "StagingEntry"]
