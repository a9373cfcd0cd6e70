"""Host memory budget: how much RAM this process may still claim, checked before pinning.

``available_host_bytes()`` is the smaller of ``/proc/meminfo`` MemAvailable and the headroom
of every cgroup limit that applies (v2 ``memory.max - memory.current``, v1
``memory.limit_in_bytes - memory.usage_in_bytes``). Containers usually see the host's
MemAvailable, so ignoring the cgroup would let a pool pass the check and then get the
process OOM-killed halfway through pinning.
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


def check_host_budget(
    required_bytes: int, *, what: str, available_bytes: int | None = None, ranks_per_host: int = 1
) -> None:
    """Raise ValueError, before anything is allocated, when ``required_bytes`` does not fit.

    ``available_bytes`` defaults to ``available_host_bytes()``; it is split evenly across
    ``ranks_per_host`` processes that each build the same pool on this machine.
    """
    if ranks_per_host < 1:
        raise ValueError(f"ranks_per_host = {ranks_per_host} must be >= 1.")
    avail = (
        available_host_bytes() if available_bytes is None else available_bytes
    ) // ranks_per_host
    if required_bytes > avail:
        raise ValueError(
            f"{what} needs {required_bytes / GIB:.2f} GiB of pinned host memory but only "
            f"{avail / GIB:.2f} GiB is available to this rank ({ranks_per_host} rank(s) per host, "
            f"MemAvailable bounded by cgroup limits). Lower 'host_to_device_ratio' in "
            f"--hisparse-config, lower --mem-fraction-static (fewer device rows), or give the "
            f"machine/container more RAM."
        )
