"""The soak: one long real-traffic run through SGLang's scheduler on a ``traffic_*`` group's rig.

    python -m hisparse_testing.rig_soak GROUP WORKDIR [--requests N] [--seed S] [--max-new LO HI]

The traffic is ``rig_traffic``'s (its module docstring says what a run draws and checks); the
groups and their environment are ``rig_scenarios``' (``TRAFFIC_GROUPS``, ``GROUP_ENV``). This
entry point sits above both, so neither imports the other's caller.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from hisparse_testing.rig_scenarios import GROUP_ENV, TRAFFIC_GROUPS
from hisparse_testing.rig_traffic import TrafficSpec, run_traffic


def main(argv: list[str]) -> int:
    """``python -m hisparse_testing.rig_soak GROUP WORKDIR [--requests N] [--seed S]``:
    one long traffic run (the soak) on a ``traffic_*`` group's rig; prints one ``TRAFFIC {json}``
    summary (SGLang's own log lines go to stderr as it runs)."""
    parser = argparse.ArgumentParser(prog="python -m hisparse_testing.rig_soak",
                                     description="A long real-traffic run (the soak) through SGLang's "
                                                 "scheduler on one of the rig's traffic groups.")
    parser.add_argument("group", choices=sorted(TRAFFIC_GROUPS))
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--requests", type=int, default=2000, help="requests to send (default 2000)")
    parser.add_argument("--seed", type=int, default=1, help="the traffic's seed (default 1)")
    parser.add_argument("--max-new", type=int, nargs=2, default=TrafficSpec.max_new, metavar=("LO", "HI"),
                        help=f"each request's max_new_tokens is drawn from LO..HI (default {TrafficSpec.max_new})")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(GROUP_ENV.get(args.group, {}))
    from hisparse_testing.sglang_rig import Rig, pretend_sm90

    pretend_sm90()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    config, _ = TRAFFIC_GROUPS[args.group]
    rig = Rig(config, args.workdir)
    t0 = time.perf_counter()
    spec = TrafficSpec(requests=args.requests, seed=args.seed, max_new=tuple(args.max_new),
                       max_steps=100 * args.requests + 10_000)
    try:
        out = run_traffic(rig, spec, pd=rig.pd_decode)
        out.update(ok=True)
    except AssertionError as e:
        out = {"ok": False, "error": str(e)}
    out.update(group=args.group, seconds=round(time.perf_counter() - t0, 1))
    print("TRAFFIC " + json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
