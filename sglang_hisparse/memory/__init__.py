"""Memory layer: paged ids, the dual address space (logical ids and device rows), hot
buffers, the per-layer device KV, the pinned host KV and the host-memory budget, and the
byte arithmetic of the coordinator's GPU state. No ``sglang`` import."""
