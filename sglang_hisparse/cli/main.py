"""``python -m sglang_hisparse <command>``: one entry point for the operator tools.

Each command lives in ``sglang_hisparse/cli/<name>.py`` with ``add_parser(subparsers)`` and
``run(args) -> int``; a command whose optional dependencies are missing still lists itself
and explains what to install when run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

#: (command, module, one-line summary) in the order --help shows them.
COMMANDS = (
    ("plan", "sglang_hisparse.cli.plan", "capacity planner: batch, HBM, host DRAM and link time with and without HiSparse"),
    ("doctor", "sglang_hisparse.cli.doctor", "check SGLang, the plugin hooks, tvm-ffi, the kernel toolchain, the GPU and a --hisparse-config"),
    ("simulate", "sglang_hisparse.cli.simulate", "replay a selection trace under replacement policies and buffer sizes"),
    ("record-trace", "sglang_hisparse.cli.record_trace", "record oracle top-k selections of a Hugging Face model on a text"),
)

EPILOG = """\
fresh machine, no GPU needed:
  python -m sglang_hisparse plan                     # GLM-5.1 on 8xH200 at 128K context
  python -m sglang_hisparse doctor --hisparse-config '{"device_buffer_size": 4096}'

serving: install this package next to sglang==0.5.23 (not on PyPI yet): from a clone,
  pip install -e .   (or python -m build --wheel, then pip install dist/sglang_hisparse-*.whl)
then
  python -m sglang.launch_server ... --enable-hisparse --hisparse-config '{...}'
(the radix cache may stay on: matched prefixes are shared through the host pool)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_hisparse",
        description="sglang-hisparse operator tools.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, summary in COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            p = sub.add_parser(name, help=f"{summary} (unavailable: {e})")
            p.set_defaults(_unavailable=f"'{name}' could not be loaded: {e}")
            continue
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(args._unavailable, file=sys.stderr)
        return 2
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`plan --json | head`): what it read is all it wanted. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
