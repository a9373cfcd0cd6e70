"""Memory layer: paged ids, the dual address space (logical ids and device rows: the address
map, prefill rows, prefix sharing, the handover to hot buffers, the hot buffers), the
per-layer device KV, the pinned host KV and the host-memory budget, and the byte arithmetic
of the coordinator's GPU state. No ``sglang`` import."""
