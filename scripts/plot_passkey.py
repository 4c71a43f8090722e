#!/usr/bin/env python3
"""Passkey accuracy against context length, one line per method, with 95 % Wilson intervals.

    python3 scripts/plot_passkey.py RESULTS.json [MORE.json ...] -o passkey.png [--title T]

Reads the JSON of `oscar eval passkey --json` (or scripts/gpu_passkey.sh): {"passkey": [{method,
ctx, depth, trials, correct}, ...]}; cells of the same (method, ctx) are summed over depths.
Needs matplotlib.
"""
import argparse
import json
import math
from collections import defaultdict


def wilson(k, n, z=1.96):
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, c - h), min(1.0, c + h)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--title", default="Passkey retrieval")
    ap.add_argument("--legend", default="lower left", help="matplotlib legend location")
    a = ap.parse_args()
    cells = defaultdict(lambda: [0, 0])
    for path in a.json:
        for r in json.load(open(path))["passkey"]:
            c = cells[(r["method"], int(r["ctx"]))]
            c[0] += int(r["correct"])
            c[1] += int(r["trials"])
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.8))
    methods = list(dict.fromkeys(m for m, _ in cells))
    for m in methods:
        xs = sorted(ctx for mm, ctx in cells if mm == m)
        ys, lo, hi = [], [], []
        for x in xs:
            k, n = cells[(m, x)]
            ys.append(100 * k / n)
            l, h = wilson(k, n)
            lo.append(100 * k / n - 100 * l)
            hi.append(100 * h - 100 * k / n)
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=m)
    ax.set_xscale("log", base=2)
    xt = sorted({ctx for _, ctx in cells})
    ax.set_xticks(xt)
    ax.set_xticklabels([f"{x // 1024}K" for x in xt])
    ax.set_ylim(-3, 103)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("correct (%), 95 % Wilson interval")
    ax.set_title(a.title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc=a.legend)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}: {len(methods)} methods, {len(xt)} contexts")


if __name__ == "__main__":
    main()
