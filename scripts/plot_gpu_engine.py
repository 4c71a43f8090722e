#!/usr/bin/env python3
"""The GPU engine's throughput plot of docs/gpu-engine.md, from bench_gpu_engine's JSON files
(docs/results/gpu-engine-qwen3-8b-flashinfer.json and gpu-engine-llama3-8b-flashinfer.json):

  left   equal KV memory: decode tokens/s of the BF16 cache (our kernel and FlashInfer's
         tensor-core decode) and of the 2-bit cache at the batch each one holds, with the
         sequences held and the 2-bit cache's ratio to the faster BF16 decode;
  right  equal batch (Qwen3-8B shapes): each step split into its linear layers, the other small
         kernels and attention + cache, against the roofline (weight + KV bytes at the copy
         bandwidth measured in the same run).

    python3 scripts/plot_gpu_engine.py -o docs/results/gpu-engine.png

Needs matplotlib (pip install matplotlib).
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RES = os.path.join(os.path.dirname(HERE), "docs", "results")
BF16, FI, INT2 = "bf16", "bf16 (flashinfer-tc)", "int2 (oscar layout)"
COLORS = {BF16: "#7f7f7f", FI: "#1f77b4", INT2: "#d62728"}
NAMES = {BF16: "BF16 cache, our decode", FI: "BF16 cache, FlashInfer tensor-core decode", INT2: "2-bit cache (OSCAR layout)"}


def load(name):
    with open(os.path.join(RES, name)) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--output", default=os.path.join(RES, "gpu-engine.png"))
    ap.add_argument("--qwen", default="gpu-engine-qwen3-8b-flashinfer.json")
    ap.add_argument("--llama", default="gpu-engine-llama3-8b-flashinfer.json")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_gpu_engine.py: matplotlib is not installed (pip install matplotlib)")
    qwen, llama = load(args.qwen), load(args.llama)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 6.2), gridspec_kw={"width_ratios": [1, 1.35]})

    # Equal KV memory: one group per (model, context).
    groups = [("Qwen3-8B", r["ctx"]) for r in qwen["equal_memory"] if r["method"] == INT2]
    groups += [("Llama-3-8B", r["ctx"]) for r in llama["equal_memory"] if r["method"] == INT2]
    width = 0.27
    ymax = max(r["tok_s"] for d in (qwen, llama) for r in d["equal_memory"])
    for gi, (model, ctx) in enumerate(groups):
        rows = {r["method"]: r for r in (qwen if model == "Qwen3-8B" else llama)["equal_memory"] if r["ctx"] == ctx}
        for mi, m in enumerate((BF16, FI, INT2)):
            if m not in rows:
                continue
            r = rows[m]
            x = gi + (mi - 1) * width
            ax1.bar(x, r["tok_s"], width, color=COLORS[m], label=NAMES[m] if gi == 0 else None)
            ax1.text(x, r["tok_s"], f"{r['fits']}", ha="center", va="bottom", fontsize=8)
        best_bf16 = max(rows[m]["tok_s"] for m in (BF16, FI) if m in rows)
        ax1.text(gi + width, rows[INT2]["tok_s"] + 0.06 * ymax, f"{rows[INT2]['tok_s'] / best_bf16:.1f}×",
                 ha="center", va="bottom", fontsize=10, fontweight="bold", color=COLORS[INT2])
    ax1.set_xticks(range(len(groups)))
    ax1.set_xticklabels([f"{m}\n{c // 1024}K" for m, c in groups])
    ax1.set_ylabel("decode tokens/s at the largest batch that fits")
    ax1.set_title(f"Equal KV memory ({qwen['kv_gib']:.0f} GiB of pages), H200\n"
                  "(number over a bar: sequences held; bold: 2-bit / faster BF16)", fontsize=10)
    ax1.set_ylim(0, ymax * 1.3)
    ax1.legend(fontsize=8, loc="upper right")

    # Equal batch (Qwen3-8B): stacked split, the faster BF16 decode and the 2-bit cache per shape.
    shapes = []
    for r in qwen["equal_batch"]:
        if (r["batch"], r["ctx"]) not in shapes:
            shapes.append((r["batch"], r["ctx"]))
    labels, y = [], 0.0
    for b, c in shapes:
        rows = {r["method"]: r for r in qwen["equal_batch"] if (r["batch"], r["ctx"]) == (b, c) and r["step_ms"] > 0}
        bf = [rows[m] for m in (BF16, FI) if m in rows]
        pick = []
        if bf:
            pick.append((min(bf, key=lambda r: r["step_ms"]), "BF16"))
        if INT2 in rows:
            pick.append((rows[INT2], "2-bit"))
        for r, cache in pick:
            gemm, other = r["gemm_ms"], r["weights_only_ms"] - r["gemm_ms"]
            attn = r["step_ms"] - r["weights_only_ms"]
            color = COLORS[INT2] if cache == "2-bit" else COLORS[FI]
            ax2.barh(y, gemm, color="#bcbd22", label="linear layers" if not labels else None)
            ax2.barh(y, other, left=gemm, color="#c7c7c7", label="other small kernels" if not labels else None)
            ax2.barh(y, attn, left=gemm + other, color=color, alpha=0.85)
            ax2.plot([r["roofline_ms"]] * 2, [y - 0.4, y + 0.4], color="k", lw=2,
                     label="roofline (weight + KV bytes at copy bandwidth)" if not labels else None)
            ax2.text(r["step_ms"] + 0.2, y, f"{r['step_ms']:.2f} ms ({100 * r['roofline_ms'] / r['step_ms']:.0f} %)",
                     va="center", fontsize=8)
            ctx = f"{c // 1024}K" if c % 1024 == 0 else f"{c / 1000:g}K"
            labels.append((y, f"{b} × {ctx} {cache}"))
            y += 1
        y += 0.5
    ax2.barh([0], [0], color=COLORS[FI], alpha=0.85, label="attention + cache (BF16, the faster decode)")
    ax2.barh([0], [0], color=COLORS[INT2], alpha=0.85, label="attention + cache (2-bit)")
    ax2.set_yticks([p for p, _ in labels])
    ax2.set_yticklabels([t for _, t in labels], fontsize=8)
    ax2.invert_yaxis()
    ax2.set_xlabel("decode step (ms)")
    ax2.set_title("Equal batch, Qwen3-8B shapes: where a step goes\n(percent: roofline / step; BF16 32 and 64 × 32K "
                  "do not fit)", fontsize=10)
    ax2.set_xlim(0, max(r["step_ms"] for r in qwen["equal_batch"]) * 1.3)
    ax2.legend(fontsize=8, loc="lower right")

    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
