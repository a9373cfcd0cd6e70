"""The kernels' launch signatures, written once.

A tvm-ffi module exports a C++ function whose parameters the wrapper declares (``_jit``) and
forwards to the launcher in ``jit_kernels/*.cuh``; the Python op passes the arguments by
position. Both sides come from one ordered list of named parameters here::

    Signature("resolve", (Param("top_k"), ..., Param("ctas", INT), ...))
        .args  -> "TensorView top_k, ..., int64_t ctas, ..."    (the wrapper's parameter list)
        .call  -> "top_k, ..., ctas, ..."                      (its call of the launcher)
        .pack(top_k=t, ctas=8, ...) -> (t, ..., 8, ...)        (the op's positional arguments)

A launch names every argument; ``pack`` puts them in the signature's order, fills an absent
optional tensor with the launch's sentinel (a tensor the kernel never reads while the matching
flag is off) and an absent integer with its default, and refuses a missing or unknown name.
The C++ launcher's own parameter list is the one other copy; a CPU test pins the generated
wrapper text, so a change here that the launcher does not take fails before any build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TENSOR = "TensorView"
INT = "int64_t"


@dataclass(frozen=True)
class Param:
    """One launch parameter: a tensor (``TensorView``) or an integer (``int64_t``).

    ``optional``: a tensor a launch may leave out (the sentinel takes its place) or an integer
    with ``default``; ``by_pointer``: the launcher takes a ``const TensorView*`` (the wrapper
    passes ``&name``), which is how a launcher marks an argument only some builds read."""

    name: str
    ctype: str = TENSOR
    optional: bool = False
    default: int | None = None
    by_pointer: bool = False


@dataclass(frozen=True)
class Signature:
    name: str
    params: tuple[Param, ...]

    def plus(self, *more: Param) -> Signature:
        """This signature with ``more`` parameters at the end (e.g. a policy build's state)."""
        return Signature(self.name, self.params + more)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def args(self) -> str:
        """The wrapper function's parameter list."""
        return ", ".join(f"{p.ctype} {p.name}" for p in self.params)

    @property
    def call(self) -> str:
        """The wrapper's arguments to the launcher."""
        return ", ".join(("&" if p.by_pointer else "") + p.name for p in self.params)

    def pack(self, *, sentinel: Any = None, **values: Any) -> tuple:
        """The positional arguments of one launch, from named ones (see the module docstring)."""
        unknown = sorted(set(values) - set(self.names))
        if unknown:
            raise TypeError(f"{self.name} launch: unknown argument(s) {unknown}; it takes {list(self.names)}")
        out = []
        for p in self.params:
            v = values.get(p.name)
            if v is None:
                if not p.optional:
                    raise TypeError(f"{self.name} launch: argument {p.name!r} is required")
                if p.ctype == TENSOR:
                    if sentinel is None:
                        raise TypeError(f"{self.name} launch: {p.name!r} left out and no sentinel given")
                    v = sentinel
                else:
                    v = p.default
            out.append(v)
        return tuple(out)


def _tensors(*names: str, optional: bool = False) -> tuple[Param, ...]:
    return tuple(Param(n, TENSOR, optional=optional) for n in names)


def _ints(*names: str) -> tuple[Param, ...]:
    return tuple(Param(n, INT) for n in names)


#: the state every resolve flavour reads and writes, and the miss plan it may write
_CORE = _tensors("top_k", "req_index", "seq_lens", "num_real", "slot_tokens", "slot_rows", "lru",
                 "host_rows", "host_cache", "device_cache", "out_rows", "plan_src", "plan_dst",
                 "plan_count", "arrivals")

#: ``resolve.cuh:resolve_launch``. ``resident``: the resident hint (absent: no hint);
#: ``rr_*``: the resident selection record (``rr_page`` 0: none).
RESOLVE = Signature("resolve", _CORE + _tensors("resident", "rr_flag", "rr_pages", "rr_ring", optional=True)
                    + (Param("rr_page", INT, optional=True, default=0),)
                    + _ints("ctas", "block", "write_plan", "copy", "stage_rows"))
#: a policy build (``kernel_policy``: slru, fra) also takes its per-slot state
RESOLVE_POLICY = RESOLVE.plus(Param("policy_state", TENSOR, by_pointer=True))

#: ``resolve_verify.cuh:resolve_verify_launch`` (lru builds ignore ``policy_state``)
VERIFY = Signature("resolve_verify", _CORE + _ints("ctas", "block", "write_plan", "copy")
                   + _tensors("policy_state", optional=True))

#: ``replay.cuh:replay_launch``
REPLAY = Signature("replay", _tensors("plan_src", "plan_dst", "plan_count", "num_real", "host_cache",
                                      "device_cache") + _ints("ctas", "block"))
