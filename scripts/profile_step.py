#!/usr/bin/env python3
"""Per-kernel GPU time of one decode step from an Nsight Compute CSV.

`bash scripts/gpu_engine_run.sh profile` runs bench_gpu_engine with OSCAR_BENCH_PROFILE=1
under `ncu --metrics gpu__time_duration.sum --csv`: one step per timed configuration,
kernels serialized. This groups each step's kernels by name (a step starts at the
embedding kernel) and prints their total, count and mean, largest first.

    python3 scripts/profile_step.py out/profile.csv [--labels "w-only B1,bf16 1x32K,..."] [--merge N]

--merge N sums every N consecutive steps into one group (a prompt profiled in chunks: each chunk
starts at the embedding kernel, so a 32K prompt in chunks of 8192 is --merge 4).
"""
import argparse
import collections
import csv
import re


def short(name: str) -> str:
    name = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "").replace("void ", "")
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"<.*", "", name)
    return name.replace("oscar::", "").strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--labels", default="", help="comma-separated names of the profiled steps, in order")
    ap.add_argument("--merge", type=int, default=1, help="sum every N consecutive steps into one group")
    args = ap.parse_args()
    rows = [r for r in csv.reader(open(args.csv)) if len(r) > 10]
    if not rows:
        raise SystemExit(f"{args.csv}: no kernel rows")
    hdr, rows = rows[0], rows[1:]
    ki, vi, ui = hdr.index("Kernel Name"), hdr.index("Metric Value"), hdr.index("Metric Unit")
    scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}
    names = [short(r[ki]) for r in rows]
    starts = [i for i, n in enumerate(names) if "embed" in n] or [0]
    starts = starts[:: max(1, args.merge)]
    labels = [s for s in args.labels.split(",") if s]
    for k, b in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else len(rows)
        tot, cnt = collections.defaultdict(float), collections.Counter()
        for r, n in zip(rows[b:e], names[b:e]):
            us = float(r[vi].replace(",", "")) * scale.get(r[ui], 1e-3)
            tot[n] += us
            cnt[n] += 1
        label = labels[k] if k < len(labels) else f"step {k}"
        print(f"\n== {label}: {e - b} kernels, {sum(tot.values()) / 1e3:.3f} ms of kernel time")
        for n, t in sorted(tot.items(), key=lambda x: -x[1]):
            print(f"  {t:9.1f} us  {cnt[n]:4d}x  {t / cnt[n]:7.2f} us  {n[:90]}")


if __name__ == "__main__":
    main()
