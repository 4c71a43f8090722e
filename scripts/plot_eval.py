#!/usr/bin/env python3
"""Plots an `oscar eval --json` file: KL(p_bf16 || p_quant), perplexity change
and attention-output error by context length, one line per method.

    python3 scripts/plot_eval.py eval.json -o eval.png
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="output of oscar eval --json")
    ap.add_argument("-o", "--output", default="eval.png", help="PNG to write")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_eval.py: matplotlib is not installed (pip install matplotlib)")
    with open(a.json) as f:
        rows = json.load(f)["results"]
    ref = {r["ctx"]: r["ppl"] for r in rows if r["method"].startswith("bf16")}
    methods = []
    for r in rows:
        if r["method"] not in methods and not r["method"].startswith("bf16"):
            methods.append(r["method"])
    panels = [("kl", "KL(p_bf16 || p_quant) [nats]", True),
              ("dppl", "perplexity vs BF16 [%]", False),
              ("o_err", "attention-output rel. MSE", True)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, title, logy) in zip(axes, panels):
        for m in methods:
            pts = sorted((r["ctx"], r) for r in rows if r["method"] == m)
            xs = [c for c, _ in pts]
            if key == "dppl":
                ys = [100.0 * (r["ppl"] / ref[c] - 1.0) if c in ref else float("nan") for c, r in pts]
            else:
                ys = [r[key] for _, r in pts]
            bpe = pts[-1][1]["bpe"] if pts else 0
            ax.plot(xs, ys, marker="o", label=f"{m} ({bpe:.2f} b/e)")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("context length [tokens]")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.output, dpi=120)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
