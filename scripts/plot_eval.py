#!/usr/bin/env python3
"""Plots `oscar eval --json` files: KL(p_bf16 || p_quant), perplexity change vs
BF16, and the attention errors before (o err) and after o_proj (proj err) by
context length, one line per method. Several files (e.g. one per context) are
merged; a method's label `NAME=path/FILE.safetensors...` is shown as
`NAME@FILE...` (the label newer builds print), so runs of different dates line up.

    python3 scripts/plot_eval.py eval.json -o eval.png
    python3 scripts/plot_eval.py docs/results/accuracy-2k.json docs/results/accuracy-4k.json docs/results/accuracy-8k.json \\
        --methods int2-hadamard,kivi2,oscar -o docs/results/accuracy.png
"""
import argparse
import json
import math
import re
import sys


def norm_label(m):
    return re.sub(r"=(?:[^=+,]*/)?([^/=+,]+?)\.safetensors", r"@\1", m)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="output(s) of oscar eval --json")
    ap.add_argument("-o", "--output", default="eval.png", help="PNG to write")
    ap.add_argument("--methods", default="", help="comma-separated labels to plot (default: all)")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_eval.py: matplotlib is not installed (pip install matplotlib)")
    rows = []
    for path in a.json:
        with open(path) as f:
            for r in json.load(f)["results"]:
                r = dict(r)
                r["method"] = norm_label(r["method"])
                rows.append(r)
    ref = {r["ctx"]: r["ppl"] for r in rows if r["method"].startswith("bf16")}
    keep = [m.strip() for m in a.methods.split(",") if m.strip()]
    methods = []
    for r in rows:
        m = r["method"]
        if m not in methods and not m.startswith("bf16") and (not keep or m in keep):
            methods.append(m)
    if keep:
        methods.sort(key=keep.index)
    if not methods:
        sys.exit("plot_eval.py: no method to plot")
    panels = [("kl", "KL(p_bf16 || p_quant) [nats/token]", True),
              ("dppl", "perplexity vs BF16 [%]", False),
              ("o_err", "attention output rel. MSE (before o_proj)", True),
              ("proj_err", "attention block rel. MSE (after o_proj)", True)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2))
    for ax, (key, title, logy) in zip(axes, panels):
        for m in methods:
            pts = {}
            for r in rows:  # the last file wins for a repeated (method, ctx)
                if r["method"] == m:
                    pts[r["ctx"]] = r
            pts = sorted(pts.items())
            xs, ys = [], []
            for c, r in pts:
                if key == "dppl":
                    y = 100.0 * (r["ppl"] / ref[c] - 1.0) if c in ref else float("nan")
                else:
                    y = r.get(key, float("nan"))
                if not math.isnan(y):
                    xs.append(c)
                    ys.append(y)
            if xs:
                ax.plot(xs, ys, marker="o", label=m)
        ax.set_xscale("log", base=2)
        ctxs = sorted({r["ctx"] for r in rows})
        ax.set_xticks(ctxs, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in ctxs])
        ax.minorticks_off()
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("context length [tokens]")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=min(len(labels), 4), frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # room for the legend below the panels
    fig.savefig(a.output, dpi=110)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
