"""Host memory figures, cgroup-aware, for budget checks made before anything is pinned."""

from __future__ import annotations

from pathlib import Path

GIB = 1 << 30


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def available_host_bytes() -> int:
    """Bytes this process can still allocate: MemAvailable, capped by the cgroup's headroom.

    NOTE: containers report the host's /proc/meminfo; the cgroup limit (v2 ``memory.max`` or
    v1 ``memory.limit_in_bytes``) minus current usage is what actually kills us, so the
    smaller figure wins.
    """
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:
        import os

        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        limit = _read_int(limit_path)
        usage = _read_int(usage_path)
        if limit is not None and usage is not None and limit < (1 << 60):
            avail = min(avail, max(0, limit - usage))
            break
    return avail


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
