"""Plots one benchmark run (bench_decode's CSV + flashinfer_decode.py's CSV,
the same inputs as report.py): per shape the time of one layer's decode
attention for the INT2 kernel, our BF16 kernel and FlashInfer's BF16 kernel
(log scale), and the INT2 kernel's speedups with the issue's targets
(5x FlashInfer at >= 32K for batch >= 8, 3x at batch 1 x 128K) and its share
of the measured copy bandwidth.

    python3 plot_shapes.py OURS.csv FLASHINFER.csv OUT.png [TITLE]
"""
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import join  # noqa: E402


def main():
    t, _, keys = join(sys.argv[1], sys.argv[2])  # report.py's join of the two CSVs
    out = sys.argv[3]
    title = sys.argv[4] if len(sys.argv) > 4 else "decode attention, one Qwen3-8B layer, H200"
    shapes = [(b, c) for b, c in keys if ("int2", b, c) in t and ("fi", b, c) in t]
    if not shapes:
        sys.exit("no shape has both an INT2 and a FlashInfer row")
    lab = [f"{b}x{c // 1024}K" for b, c in shapes]
    x = list(range(len(shapes)))
    us = {k: [float(t[(k, b, c)]["time_us"]) if (k, b, c) in t else float("nan") for b, c in shapes]
          for k in ("int2", "bf16", "fi")}
    pct = [float(t[("int2", b, c)]["pct_copy"]) for b, c in shapes]
    sp_fi = [f / i for f, i in zip(us["fi"], us["int2"])]
    sp_bf = [f / i for f, i in zip(us["bf16"], us["int2"])]

    fig, (a0, a1) = plt.subplots(2, 1, figsize=(max(8, 0.6 * len(shapes) + 3), 8), sharex=True)
    w = 0.27
    a0.bar([v - w for v in x], us["int2"], w, label="INT2 (ours)", color="#1f77b4")
    a0.bar(x, us["bf16"], w, label="BF16 (ours)", color="#aec7e8")
    a0.bar([v + w for v in x], us["fi"], w, label="BF16 FlashInfer", color="#ff7f0e")
    a0.set_yscale("log")
    a0.set_ylabel("time per layer (us, log)")
    a0.legend(loc="upper left")
    a0.set_title(title)
    a0.grid(axis="y", which="both", alpha=0.3)

    a1.plot(x, sp_fi, "o-", color="#ff7f0e", label="INT2 vs FlashInfer BF16")
    a1.plot(x, sp_bf, "s--", color="#aec7e8", label="INT2 vs our BF16")
    for i, (b, c) in enumerate(shapes):
        if b >= 8 and c >= 32768:  # the 5x target's shapes
            a1.plot([i - 0.4, i + 0.4], [5, 5], color="red", lw=2)
        if b == 1 and c >= 131072:
            a1.plot([i - 0.4, i + 0.4], [3, 3], color="red", lw=2)
        a1.annotate(f"{sp_fi[i]:.2f}x\n{pct[i]:.0f}% copy", (i, sp_fi[i]), textcoords="offset points",
                    xytext=(0, 8), ha="center", fontsize=7)
    a1.plot([], [], color="red", lw=2, label="target (issue 5)")
    a1.set_ylabel("speedup")
    a1.set_ylim(0, max(max(sp_fi), max(v for v in sp_bf if v == v)) * 1.25)
    a1.legend(loc="upper left")
    a1.grid(axis="y", alpha=0.3)
    a1.set_xticks(x)
    a1.set_xticklabels(lab, rotation=45, ha="right")
    a1.set_xlabel("batch x context")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({len(shapes)} shapes)")


if __name__ == "__main__":
    main()
