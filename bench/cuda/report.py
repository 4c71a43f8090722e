"""Joins bench_decode's CSV (ours: int2, bf16) with flashinfer_decode.py's CSV
into one markdown table (DESIGN §7): per layer times, bytes, GB/s, % of the
measured copy bandwidth, floor (the bytes at copy bandwidth), read floor (the
same bytes read by a plain streaming kernel timed the same way: launch and
ramp included), speedups, write+demotion as % of the INT2 attention time
of the same layer, and as % of the layer's decode step (its attention with
the write and demotion plus its linear layers, replayed from a CUDA graph by
flashinfer_decode.py).

    python3 report.py OURS.csv FLASHINFER.csv COPY_GBS > table.md
"""
import csv
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


def join(ours_path, fi_path):
    """The two CSVs keyed by (kernel, batch, ctx), FlashInfer's rows as "fi";
    the linear-layer rows by batch; the shapes of our CSV, sorted."""
    ours, fi = load(ours_path), load(fi_path)
    idx = {}
    for r in ours:
        idx[(r["kernel"], int(r["batch"]), int(r["ctx"]))] = r
    linear = {}  # batch -> one layer's linear layers (flashinfer_decode.py time_linear)
    for r in fi:
        if r["kernel"] == "linear":
            linear[int(r["batch"])] = float(r["time_us"])
        else:
            idx[("fi", int(r["batch"]), int(r["ctx"]))] = r
    keys = sorted({(int(r["batch"]), int(r["ctx"])) for r in ours})
    return idx, linear, keys


def main():
    idx, linear, keys = join(sys.argv[1], sys.argv[2])
    copy_gbs = float(sys.argv[3])
    flush = os.environ.get("OSCAR_BENCH_FLUSH", "write")
    how = ("a 256 MB read (clean lines only)" if flush == "read" else
           "a 256 MB memset (its ~50 MB of dirty lines are written back during the timed launch)")
    print(f"Copy bandwidth measured in the same run: {copy_gbs:.0f} GB/s. Times per layer (one decode step of "
          "attention for 32 q heads / 8 KV heads, d=128); x36 for a Qwen3-8B step. L2 emptied before each "
          f"timed launch (ours and FlashInfer alike) by {how}.\n")
    print("| batch | ctx | INT2 us | INT2 GB/s | INT2 % copy | INT2 floor us | INT2 read floor us | INT2 v7 loop us | INT2 v10 loop us | our BF16 us | BF16 % copy "
          "| baseline | baseline us | INT2 vs our BF16 | INT2 vs baseline | write+demote % | linear us "
          "| write+demote % of layer step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b, c in keys:
        i2, bf, f = idx.get(("int2", b, c)), idx.get(("bf16", b, c)), idx.get(("fi", b, c))
        v7 = idx.get(("int2v7", b, c))
        v10 = idx.get(("int2v10", b, c))
        t_i2 = float(i2["time_us"]) if i2 else None
        t_bf = float(bf["time_us"]) if bf else None
        t_fi = float(f["time_us"]) if f else None
        wd, wd_step = "", ""
        t_lin = linear.get(b)
        if i2:
            # The write's cost inside a step (decode with DecodeParams::write, minus
            # the decode alone) when measured; else the write launch by itself.
            w = float(i2.get("write_in_step_us") or i2["write_us"])
            dm = i2.get("demote_in_step_us_per_step")
            dm = float(dm) if dm not in (None, "") else float(i2["demote_us_per_step"])
            wd = "%.2f (%.1f + %.2f us)" % (100.0 * (w + dm) / t_i2, w, dm)
            if t_lin:
                # Of the layer's decode step: its attention with the write and
                # demotion, plus its linear layers.
                wd_step = "%.2f" % (100.0 * (w + dm) / (t_i2 + w + dm + t_lin))
        def fmt(x, spec="%.1f"):
            return spec % x if x is not None else "-"
        rf = float(i2["read_floor_us"]) if i2 and i2.get("read_floor_us") not in (None, "", "0.00") else None
        print("| %d | %dK | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            b, c // 1024, fmt(t_i2), fmt(float(i2["gbs"]) if i2 else None, "%.0f"),
            fmt(float(i2["pct_copy"]) if i2 else None), fmt(float(i2["floor_us"]) if i2 else None), fmt(rf),
            fmt(float(v7["time_us"]) if v7 else None), fmt(float(v10["time_us"]) if v10 else None), fmt(t_bf), fmt(float(bf["pct_copy"]) if bf else None),
            f["kernel"] if f else "-", fmt(t_fi),
            fmt(t_bf / t_i2 if t_bf and t_i2 else None, "%.2fx"),
            fmt(t_fi / t_i2 if t_fi and t_i2 else None, "%.2fx"), wd or "-", fmt(t_lin), wd_step or "-"))


if __name__ == "__main__":
    main()
