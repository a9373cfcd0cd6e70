"""Replacement policies on the H200: fra and slru against lru in the same run (JSON out).

1. Resolve time per call, no-IO (bookkeeping only) and COPY, batch 1 / 16 / 64, k 2048, B 4096,
   32K context, 656- and 1152-byte rows, 5 % and 15 % churn, with an exact resident hint (as the
   coordinator calls it: COPY runs the early fetch): the same selections and state for
   every policy (the miss count of one step does not depend on the policy, only the victims
   do), fra with random words, slru with its levels at their caps. Each call restores the
   state and flushes L2 (a 256 MB memset) outside the timed region; the policies' calls
   alternate, the order rotating each rep; medians of ``--reps`` calls, samples kept.
2. Misses per step on recorded traces replayed through the kernel (NO_IO), every policy,
   at B = 2k and 4k of each trace's k: what each saves against lru.
3. The verdict per policy and batch: its extra bookkeeping (no-IO delta) against the IO it
   saves (lru's IO time per miss x the misses it avoids at B = 2k on the traces).

    python benchmarks/bench_policy.py --out policy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sglang_hisparse import kernel_policy as kp  # noqa: E402
from sglang_hisparse.kernels import ops  # noqa: E402
from sglang_hisparse.kernels.contract import MissPlan, ResolveMode  # noqa: E402
from sglang_hisparse.kernels.reference import resident_hint  # noqa: E402
from sglang_hisparse.kernels.synthetic import make_state, make_topk  # noqa: E402
from sglang_hisparse.traces.format import load_trace  # noqa: E402
from sglang_hisparse.traces.kernel_replay import kernel_misses  # noqa: E402

K, B, CTX = 2048, 4096, 32768
POLICIES = ("lru", "fra", "slru")
RIVALS = POLICIES[1:]


def random_words(R: int, seq_lens: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hits = torch.randint(0, 64, (R, B), generator=g)
    last = (torch.rand(R, B, generator=g) * seq_lens.view(R, 1)).long()
    return ((last << 8) | hits).to(torch.int32)


def bench_state(*, bs: int, item: int, seed: int):
    """The hot-buffer state of ``bs`` requests at 32K (built once per batch and row size: the
    random KV bytes take seconds on the CPU)."""
    return make_state(seq_lens=[CTX] * bs, B=B, item=item, max_ctx=CTX,
                      host_pool_rows=min(bs * CTX, 1 << 18), pin=True, seed=seed)


def bench_config(st, *, bs: int, item: int, churn: float, reps: int, flush: torch.Tensor, seed: int) -> dict:
    R = bs
    tk = make_topk(st, list(range(R)), k=K, churn=churn, seed=seed).cuda()
    # the coordinator's call: an exact resident hint, so COPY runs the early fetch
    hint = resident_hint(st.slot_tokens, B, (st.host_rows.shape[1] + 31) // 32)
    init = {"slot_tokens": st.slot_tokens.cuda(), "lru": st.lru.cuda(), "resident": hint.cuda()}
    live = {name: t.clone() for name, t in init.items()}
    device_cache = st.device_cache.cuda()  # its bytes do not matter here: not restored
    cap1, cap2 = kp.slru_caps(B)
    state0 = {"fra": random_words(R, st.seq_lens, seed).cuda(),
              "slru": torch.full((R, 1), kp.slru_pack(B - cap2 - cap1, B - cap2, B), dtype=torch.int32,
                                 device="cuda")}
    state = {p: t.clone() for p, t in state0.items()}
    common = dict(top_k=tk, req_index=torch.arange(R, device="cuda"),
                  seq_lens=st.seq_lens.cuda(), num_real_reqs=torch.tensor([R], dtype=torch.int32, device="cuda"),
                  slot_rows=st.slot_rows.cuda(), host_rows=st.host_rows.cuda(), host_cache=st.host_cache,
                  out_rows=torch.empty(R, K, dtype=torch.int32, device="cuda"),
                  plan=MissPlan.empty(R, K, "cuda"))

    def call(policy: str, mode: ResolveMode) -> None:
        extra = dict(policy=policy, policy_state=state[policy]) if policy != "lru" else {}
        ops.resolve(**common, slot_tokens=live["slot_tokens"], lru=live["lru"], resident=live["resident"],
                    device_cache=device_cache, mode=mode, **extra)

    def timed(policy: str, mode: ResolveMode) -> float:
        for name, t in init.items():
            live[name].copy_(t)
        for p, t in state0.items():
            state[p].copy_(t)
        flush.zero_()  # cold L2, as in a layer after attention
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call(policy, mode)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3  # us

    rec: dict = {"batch": bs, "item": item, "churn": churn}
    for mode in (ResolveMode.NO_IO, ResolveMode.COPY):
        for p in POLICIES:
            timed(p, mode)  # warm-up: builds, workspace
        samples: dict[str, list[float]] = {p: [] for p in POLICIES}
        for i in range(reps):
            j = i % len(POLICIES)
            for p in POLICIES[j:] + POLICIES[:j]:
                samples[p].append(timed(p, mode))
        key = "no_io" if mode is ResolveMode.NO_IO else "copy"
        for p in POLICIES:
            rec[f"{p}_{key}_us"] = statistics.median(samples[p])
            rec[f"{p}_{key}_samples"] = [round(x, 2) for x in samples[p]]
        for p in RIVALS:
            rec[f"{p}_over_lru_{key}"] = rec[f"{p}_{key}_us"] / rec[f"lru_{key}_us"]
    rec["misses_per_call"] = int(common["plan"].count.sum())
    return rec


def trace_misses(paths: list[Path], mults=(2, 4)) -> list[dict]:
    out = []
    for path in paths:
        trace = load_trace(str(path))
        k = int(trace.header["top_k"])
        for mult in mults:
            row = {"trace": path.name, "k": k, "B": mult * k}
            for policy in POLICIES:
                got = kernel_misses(trace, mult * k, policy)
                steps = sum(len(c) for c in got.values())
                row[f"{policy}_misses"] = int(sum(int(c.sum()) for c in got.values()))
                row[f"{policy}_misses_per_step"] = row[f"{policy}_misses"] / max(steps, 1)
            for policy in RIVALS:
                row[f"{policy}_saves"] = 1 - row[f"{policy}_misses"] / max(row["lru_misses"], 1)
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def verdicts(configs: list[dict], traces: list[dict]) -> list[dict]:
    out = []
    for p in RIVALS:
        at2k = [t[f"{p}_saves"] for t in traces if t["B"] == 2 * t["k"]]
        saves = statistics.mean(at2k) if at2k else 0.0
        for c in configs:
            io_per_miss = (c["lru_copy_us"] - c["lru_no_io_us"]) / max(c["misses_per_call"], 1)
            cost = c[f"{p}_no_io_us"] - c["lru_no_io_us"]
            saving = io_per_miss * c["misses_per_call"] * saves
            out.append({"policy": p, "batch": c["batch"], "item": c["item"], "churn": c["churn"],
                        "bookkeeping_cost_us": cost, "bookkeeping_ratio": c[f"{p}_over_lru_no_io"],
                        "copy_ratio": c[f"{p}_over_lru_copy"], "io_saved_us_at_2k": saving,
                        "misses_saved_at_2k": saves, "within_10pct": c[f"{p}_over_lru_no_io"] <= 1.10,
                        "saves_more_than_costs": saving > cost})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--items", type=int, nargs="+", default=[656, 1152])
    p.add_argument("--churns", type=float, nargs="+", default=[0.05, 0.15])
    p.add_argument("--traces", nargs="*", default=["tests/data/smollm2_shakespeare.npz",
                                                    "tests/data/gemma3_lear_32k.npz"])
    p.add_argument("--skip-traces", action="store_true")
    a = p.parse_args(argv)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    doc: dict = {"gpu": torch.cuda.get_device_name(), "k": K, "B": B, "context": CTX, "reps": a.reps,
                 "configs": [], "traces": [], "verdicts": []}

    def save() -> None:
        Path(a.out).write_text(json.dumps(doc, indent=1))

    for bs in a.batches:
        for item in a.items:
            st = bench_state(bs=bs, item=item, seed=bs + item)
            for churn in a.churns:
                rec = bench_config(st, bs=bs, item=item, churn=churn, reps=a.reps, flush=flush,
                                   seed=bs + item + int(100 * churn))
                doc["configs"].append(rec)
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()
                       if not k.endswith("samples")}, flush=True)
                save()
    if not a.skip_traces:
        paths = [ROOT / t for t in a.traces if (ROOT / t).exists()]
        doc["traces"] = trace_misses(paths)
    doc["verdicts"] = verdicts(doc["configs"], doc["traces"])
    for v in doc["verdicts"]:
        print(v, flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
