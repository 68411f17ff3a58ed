#!/usr/bin/python3
"""Plots bench/rl_sim's JSON: one PNG per spec (average GPU stall per step by mode and strategy,
log scale) and a summary of best-baseline / WeightBridge stall ratios with the paper's 42x line.
Usage: rl_sim_plot.py RL_SIM_JSON OUT_DIR (called by `bazel run //bench:rl_sim`)."""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STRATS = ["weightbridge", "rank0_broadcast", "owner_broadcast", "p2p_no_dedup"]
COLORS = {"weightbridge": "#1b9e77", "rank0_broadcast": "#d95f02", "owner_broadcast": "#7570b3",
          "p2p_no_dedup": "#e7298a"}


def main():
    data = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    summary = []
    for spec in data["specs"]:
        modes = list(spec.get("modes", {}).keys())
        if not modes:
            continue
        fig, ax = plt.subplots(figsize=(7, 3.6))
        w = 0.8 / len(STRATS)
        for i, s in enumerate(STRATS):
            vals = [max(spec["modes"][m][s]["avg_gpu_stall_s"], 1e-4) for m in modes]
            xs = [k + (i - 1.5) * w for k in range(len(modes))]
            ax.bar(xs, vals, w, label=s, color=COLORS[s])
        ax.set_yscale("log")
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels(["%s\n(best baseline %.0fx)" % (m, spec["modes"][m]["ratio_vs_best_baseline"]) for m in modes])
        ax.set_ylabel("avg GPU stall per step (s)")
        ax.set_title("%s: %d trainer / %d rollout GPUs, T=%gs R=%gs" % (
            spec["spec"], spec["trainer_gpus"], spec["rollout_gpus"], data["train_s"], data["rollout_s"]), fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "rl_sim_%s.png" % spec["spec"]), dpi=110)
        plt.close(fig)
        for m in modes:
            summary.append(("%s\n%s" % (spec["spec"].split("_")[0], m), spec["modes"][m]["ratio_vs_best_baseline"]))
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(summary)), 3.8))
    ax.bar(range(len(summary)), [r for _, r in summary], color="#1b9e77")
    ax.axhline(42, color="red", linestyle="--", label="paper: up to 42x")
    ax.set_yscale("log")
    ax.set_xticks(range(len(summary)))
    ax.set_xticklabels([n for n, _ in summary], fontsize=6)
    ax.set_ylabel("best baseline stall / WeightBridge stall")
    ax.set_title("Simulated average GPU stall ratio (T=%gs, R=%gs)" % (data["train_s"], data["rollout_s"]), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "rl_sim_ratio.png"), dpi=110)
    print("wrote plots to", out)


if __name__ == "__main__":
    main()
