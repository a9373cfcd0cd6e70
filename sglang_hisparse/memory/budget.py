"""Host memory budget: how much RAM this machine may still give, checked before pinning.

``available_host_bytes()`` is the smaller of ``/proc/meminfo`` MemAvailable and the headroom
of every cgroup limit that applies (v2 ``memory.max - memory.current``, v1
``memory.limit_in_bytes - memory.usage_in_bytes``). Containers usually see the host's
MemAvailable, so ignoring the cgroup would let a pool pass the check and then get the
process OOM-killed halfway through pinning.

``check_host_budget`` is the one budget policy: the pools of all ``ranks_per_host`` ranks on
the machine (``ranks_per_host()``, SGLang's launch layout) against that free memory.
"""

from __future__ import annotations

import os
from pathlib import Path

GIB = 1024**3

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the value is in kB
    except OSError:
        return None
    return None


def _limits(d: Path, limit_file: str, usage_file: str) -> int | None:
    limit = _read_int(d / limit_file)
    # v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX); treat >= 2**60 as none
    if limit is None or limit >= 2**60:
        return None
    return limit - (_read_int(d / usage_file) or 0)


def _cgroup_headroom(root: Path, proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Smallest (limit - usage) over this process's cgroup (v2 and v1 memory) and its ancestors.

    Inside a container the cgroup mount is often the group itself, so the mount root is
    checked as well as the path /proc/self/cgroup names.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    candidates: list[tuple[Path, str, str]] = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        group = base / rel.lstrip("/")
        for d in (group, *group.parents):
            candidates.append((d, *files))
            if d == base:
                break
    rooms = [r for d, lim, use in candidates if (r := _limits(d, lim, use)) is not None]
    return max(min(rooms), 0) if rooms else None


def available_host_bytes(
    *, meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = _CGROUP_ROOT
) -> int:
    """Bytes of host RAM this process can still allocate (MemAvailable bounded by cgroups)."""
    avail = _meminfo_available(meminfo)
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = _cgroup_headroom(cgroup_root)
    return avail if room is None else min(avail, room)


def ranks_per_host(*, tp_size: int, pp_size: int = 1, nnodes: int = 1, dp_replicas: int = 1) -> int:
    """Scheduler processes SGLang starts on one machine, each building its own host pool.

    SGLang's launcher (``_calculate_rank_ranges`` in ``sglang/srt/entrypoints/engine.py``, and
    ``launch_tensor_parallel_group`` in ``managers/data_parallel_controller.py``) gives every
    node ``max(pp // nnodes, 1)`` pipeline stages of ``tp // max(nnodes // pp, 1)`` TP ranks;
    data parallelism without DP attention launches ``dp_replicas`` such groups per node
    (DP attention splits ``tp_size`` itself: pass 1).
    """
    for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("nnodes", nnodes),
                        ("dp_replicas", dp_replicas)):
        if value < 1:
            raise ValueError(f"ranks_per_host: {name} = {value} must be >= 1.")
    pp_per_node = max(pp_size // nnodes, 1)
    tp_per_node = max(tp_size // max(nnodes // pp_size, 1), 1)
    return dp_replicas * pp_per_node * tp_per_node


def check_host_budget(
    per_rank_bytes: int,
    *,
    what: str,
    ranks_per_host: int,
    available_bytes: int | None = None,
    ratio: int | None = None,
) -> None:
    """Raise ValueError, before anything is allocated or pinned, unless the pools of every rank
    on this machine fit: ``ranks_per_host * per_rank_bytes <= available_bytes``.

    Every rank on a machine builds the same pool and checks at about the same time (the pool
    is sized from the KV budget, which SGLang agrees across TP ranks), so each one compares the
    whole machine's need with the machine's free memory; a rank that compared only its own pool
    would let the machine pin ``ranks_per_host`` times what it has. ``available_bytes``
    defaults to ``available_host_bytes()``. ``ratio``: the ``host_to_device_ratio`` behind
    ``per_rank_bytes`` (the pool grows linearly with it), to name the largest that fits.
    """
    if ranks_per_host < 1:
        raise ValueError(f"ranks_per_host = {ranks_per_host} must be >= 1.")
    avail = available_host_bytes() if available_bytes is None else available_bytes
    need = per_rank_bytes * ranks_per_host
    if need <= avail:
        return
    fit = ""
    if ratio is not None:
        most = ratio * avail // need
        fit = f" (at most {most} fits)" if most >= 1 else " (not even 1 fits)"
    raise ValueError(
        f"{what} needs {per_rank_bytes / GIB:.2f} GiB of pinned host memory per rank; "
        f"{ranks_per_host} rank(s) on this machine need {need / GIB:.2f} GiB but only "
        f"{avail / GIB:.2f} GiB is available (MemAvailable bounded by cgroup limits). Lower "
        f"'host_to_device_ratio' in --hisparse-config{fit}, cap the device KV rows the host pool "
        f"mirrors (--max-total-tokens, or a lower --mem-fraction-static), or give the "
        f"machine/container more RAM."
    )
