#!/usr/bin/env python3
"""`oscar bench` end to end on the tiny test model (tests/data/model/tiny-llama, CPU): both
tables come out, as JSON too, with a row per cache and context (batch), positive finite step
times, sequence counts that fit the page budget as kv::sequences_for_bytes says (the unit test
of that count is QuantMethods.SequencesForBytesFillTheCache), and bad options give one clear
error and exit status 1.

  bench_cli.py --oscar build/oscar
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(SRC, "tests", "data", "model", "tiny-llama")


def run(oscar, *args):
    return subprocess.run([oscar, "bench", "-m", TINY, "--threads", "1", *args], capture_output=True, text=True,
                          timeout=300)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oscar", required=True)
    a = ap.parse_args()
    failures = []

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        # The tiny model's positions end at 256, below the 2-bit cache's windows (sink 64, recent
        # 256): its rows here time the BF16 windows only; the CLI's path is what is tested.
        p = run(a.oscar, "--kv", "bf16,int2-hadamard", "--kv-gib", "0.001", "--ctx", "120,200", "--batch", "1,3",
                "--batch-ctx", "200", "--steps", "2", "--page-size", "16", "--json", out)
        if p.returncode != 0:
            print(p.stdout, p.stderr, sep="\n")
            failures.append(f"exit status {p.returncode}")
        else:
            for title in ("equal KV memory", "equal batch"):
                if title not in p.stdout:
                    failures.append(f"no '{title}' table in the output")
            j = json.load(open(out))
            eq, eb = j["equal_memory"], j["equal_batch"]
            if [(r["ctx"], r["cache"]) for r in eq] != [(120, "bf16"), (120, "int2-hadamard"), (200, "bf16"),
                                                        (200, "int2-hadamard")]:
                failures.append(f"equal-memory rows: {[(r['ctx'], r['cache']) for r in eq]}")
            if [(r["batch"], r["cache"]) for r in eb] != [(1, "bf16"), (1, "int2-hadamard"), (3, "bf16"),
                                                          (3, "int2-hadamard")]:
                failures.append(f"equal-batch rows: {[(r['batch'], r['cache']) for r in eb]}")
            for r in eq + eb:
                if r["batch"] > 0 and not (math.isfinite(r["step_ms"]) and r["step_ms"] > 0 and r["tok_s"] > 0
                                           and r["bytes"] > j["weight_bytes"] and r["roofline_ms"] > 0):
                    failures.append(f"row {r}: step, bytes or roofline not positive")
            # 1 MiB of pages: BF16 pages are 2 layers x 2 (K, V) x 1 head x 16 x 64 x 2 bytes = 8 KiB,
            # so 128 pages, 13 of 200 tokens each: 9 sequences (the count rounds 200 + the steps'
            # margin up to 14 pages).
            bf = {r["ctx"]: r["batch"] for r in eq if r["cache"] == "bf16"}
            if bf.get(200) != 9:
                failures.append(f"bf16 sequences of 200 tokens in 1 MiB: {bf.get(200)}, expected 9")
            if j["copy_gbps"] <= 0:
                failures.append("copy bandwidth not positive")

        # A batch no cache can hold (2^30 - 1 sequences: pages past the pools' int32 ids) gets a row
        # that says so; the rows before and after it still run and the command succeeds.
        p = run(a.oscar, "--kv", "bf16,int2-hadamard", "--kv-gib", "0.001", "--ctx", "120", "--batch",
                "1,1073741823,2", "--batch-ctx", "200", "--steps", "2", "--page-size", "16", "--json", out)
        if p.returncode != 0:
            print(p.stdout, p.stderr, sep="\n")
            failures.append(f"a batch that does not fit: exit status {p.returncode}")
        else:
            eb = json.load(open(out))["equal_batch"]
            big = [r for r in eb if r["batch"] == 1073741823]
            ok = [r for r in eb if r["batch"] in (1, 2)]
            if len(big) != 2 or any("does not fit" not in r.get("error", "") for r in big):
                failures.append(f"rows of a batch that does not fit: {big}")
            if len(ok) != 4 or any("error" in r or not r["step_ms"] > 0 for r in ok):
                failures.append(f"rows beside a batch that does not fit: {ok}")
            if "does not fit" not in p.stdout:
                failures.append("the table does not say the batch does not fit")

    # Bad options: one error line, exit status 1.
    for args, words in [(["--ctx", "1000"], "positions end at 256"),
                        (["--kv", "bf16,nope"], "nope"),
                        (["--steps", "0"], "--steps"),
                        (["--preset", "qwen3-8b"], "not both")]:
        p = run(a.oscar, *args)
        last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
        if p.returncode != 1 or words not in last:
            failures.append(f"{args}: exit {p.returncode}, last stderr line {last!r} (expected '{words}')")

    p = subprocess.run([a.oscar, "bench", "--preset", "nope"], capture_output=True, text=True, timeout=60)
    last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    if p.returncode != 1 or "unknown model shape preset 'nope'" not in last:
        failures.append(f"--preset nope: exit {p.returncode}, last stderr line {last!r}")

    for f in failures:
        print("FAIL:", f)
    print("bench_cli:", "ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
