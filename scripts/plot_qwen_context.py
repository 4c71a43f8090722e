#!/usr/bin/env python3
"""The Qwen2.5-Coder-1.5B accuracy plot of docs/accuracy.md (KL, Δppl and the attention errors
against context) from the result files in docs/results/, each (file, method) given one label.

    python3 scripts/plot_qwen_context.py -o docs/results/qwen-accuracy.png

Needs matplotlib (through scripts/plot_eval.py).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RES = os.path.join(os.path.dirname(HERE), "docs", "results")

# (label, [(result file, method as stored in it), ...]); bf16 gives each context's reference.
SERIES = [
    ("bf16", [("qwen-2k-all", "bf16"), ("qwen-4k-a", "bf16"), ("qwen-8k", "bf16 (reference)"),
              ("qwen-32k-cuda", "bf16 (reference)")]),
    ("kivi2 (3.0 b/e in the middle)", [("qwen-2k-all", "kivi2"), ("qwen-4k-a", "kivi2"), ("qwen-8k-kivi2", "kivi2")]),
    ("oscar, paper's setting + key transform auto",
     [("qwen-2k-all", "oscar@qwen-paper-auto"), ("qwen-4k-b", "oscar@paper-share"), ("qwen-8k", "oscar@paper-share")]),
    ("oscar offset-heads, the default before 2026-12-04 (simulation)",
     [("qwen-2k-all", "oscar@qwen-rec"), ("qwen-4k-b", "oscar@rec-share"), ("qwen-8k", "oscar@rec-share")]),
    ("oscar offset-heads (engine on the H200, chunks of 256)", [("qwen-8k-cuda", "oscar@rec"), ("qwen-32k-cuda", "oscar@rec")]),
    ("oscar default: auto = every head here (2K simulation; 8K, 32K engine on the H200)",
     [("qwen-2k-transform", "oscar@qwen-rec-cs"), ("qwen-8k-transform", "oscar@rec-cs"), ("qwen-32k-auto", "oscar@rec-auto")]),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    rows = []
    for label, picks in SERIES:
        for f, m in picks:
            found = [r for r in json.load(open(os.path.join(RES, f + ".json")))["results"] if r["method"] == m]
            if not found:
                sys.exit(f"plot_qwen_context.py: no method {m!r} in {f}.json")
            r = dict(found[0])
            r["method"] = label
            rows.append(r)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as t:
        json.dump({"results": rows}, t)
    try:
        subprocess.check_call([sys.executable, os.path.join(HERE, "plot_eval.py"), t.name, "-o", a.output])
    finally:
        os.unlink(t.name)


if __name__ == "__main__":
    main()
