"""The plot of bench_e2e (six panels, from the report dict alone, so a finished run's JSON can
be drawn anywhere matplotlib is installed: ``python benchmarks/e2e_report.py JSON PNG``)."""

from __future__ import annotations

from pathlib import Path


def write_plot(report: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: plot skipped (the JSON has every figure)"
    fig, axes = plt.subplots(2, 3, figsize=(19, 9))
    mains = [p for p in report["points"] if p.get("kind") == "main" and isinstance(p.get("modes"), dict)]
    if mains:
        _plot_modes(axes[0, 0], axes[0, 1], mains)
    _plot_io_hiding(axes[0, 2], [r for r in report["tables"]["io_hiding"] if "error" not in r])
    _plot_pressure(axes[1, 0], axes[1, 1], report["tables"])
    ramp = next((p["ramp"] for p in report["points"] if p.get("kind") == "ramp" and "ramp" in p), None)
    if ramp:
        _plot_ramp(axes[1, 2], ramp)
    fig.suptitle("HiSparse vs plugin off (full KV), calibrated selections")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"plot: {path}"


def _plot_modes(ax_tps, ax_link, mains: list[dict]) -> None:
    modes = [m for m in mains[0]["modes"] if "error" not in mains[0]["modes"][m]]
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(mains))]
        ax_tps.bar(xs, [p["modes"].get(mode, {}).get("tokens_per_s", 0) for p in mains], width, label=mode)
        ax_link.bar(xs, [p["modes"].get(mode, {}).get("link_util") or 0 for p in mains], width, label=mode)
    for ax in (ax_tps, ax_link):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(mains))])
        ax.set_xticklabels([p["label"] for p in mains])
        ax.legend(fontsize=7)
    ax_tps.set_title("decode tokens/s (full = plugin off)")
    ax_link.set_title("link utilisation = bytes moved / step / same-run ceiling (idle share = 1 - it)")


def _plot_io_hiding(ax, io: list[dict]) -> None:
    if io:
        xs = range(len(io))
        ax.bar([x - 0.2 for x in xs], [r["before_over_noio"] for r in io], 0.4, label="before (prefetch)")
        ax.bar([x + 0.2 for x in xs], [r["after_over_noio"] for r in io], 0.4, label="after")
        ax.axhline(0.85, color="k", lw=0.8, ls="--")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['point']}\n{r['change']}" for r in io], fontsize=6, rotation=60)
        ax.set_ylim(0, 1.1)
        ax.legend(fontsize=7)
    ax.set_title("IO hiding: throughput / no-IO oracle, one change at a time")


def _plot_pressure(ax_low, ax_high, tabs: dict) -> None:
    low = tabs["low_pressure"]
    for key in sorted({k for r in low for k in r if k.endswith("_over_full")}):
        ax_low.plot([r["batch"] for r in low], [r.get(key) for r in low], marker="o", label=key[:-10])
    ax_low.axhline(1.02, color="k", lw=0.8, ls="--")
    if low:
        ax_low.set_xscale("log", base=2)
        ax_low.legend(fontsize=7)
    ax_low.set_xlabel("batch (the same for both)")
    ax_low.set_title("low pressure: HiSparse step / plugin-off step (target pressure <= 1.02)")
    high = tabs.get("high_pressure", [])
    if high:
        ax_high.bar(range(len(high)), [r["pressure_over_always_hot"] for r in high])
        ax_high.axhline(0.97, color="k", lw=0.8, ls="--")
        ax_high.set_xticks(range(len(high)))
        ax_high.set_xticklabels([f"{r['point']}\nbatch {r['batch']}" for r in high], fontsize=7)
    ax_high.set_title("high pressure: pressure / always-hot throughput (target >= 0.97)")


def _plot_ramp(ax, ramp: dict) -> None:
    ax2 = ax.twinx()
    for mode, rec in ramp["modes"].items():
        steps = rec.get("steps", [])
        seen: dict[int, int] = {}
        xs, ys = [], []
        for st in steps:  # steps of one level side by side; a gap where a mode skips levels
            if xs and st["level"] - int(xs[-1]) > 1:
                xs.append(float("nan"))
                ys.append(float("nan"))
            xs.append(st["level"] + 0.1 * seen.get(st["level"], 0))
            ys.append(st["step_ms"])
            seen[st["level"]] = seen.get(st["level"], 0) + 1
        ax.plot(xs, ys, marker=".", label=f"{mode} step ms")
        if mode == "pressure":
            for key in ("resident", "hot", "free_rows"):
                if steps and key in steps[0]:
                    ax2.plot([st["level"] for st in steps], [st[key] for st in steps], ls="--", label=key)
    levels = next((r["levels"] for r in ramp["modes"].values() if "levels" in r), [])
    ax.set_xticks(range(len(levels)))
    ax.set_xticklabels([str(c) for c in levels], fontsize=7)
    ax.set_xlabel("ramp level (concurrency)")
    ax2.set_yscale("symlog", linthresh=1)
    ax2.set_ylim(bottom=0)
    ax.set_title("ramp: step ms; pressure's resident / hot requests, free rows (dashed)")
    ax.legend(loc="upper left", fontsize=7)
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(loc="upper right", fontsize=7)
