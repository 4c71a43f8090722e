#!/usr/bin/env python3
"""Runs `oscar serve` under several configurations and benchmarks each with
bench_serving.py, in one run on one machine, and prints one table.

Each case: start the server (its own port), wait for /health, run the
benchmark, read /metrics (preemptions, prefix-cache hits, peak KV use is not
kept by the server, so the table shows what the cache holds), stop the server
with SIGTERM. Standard library only.

  python3 bench/serving/run_matrix.py --preset memory   # BF16 vs 2-bit at the same KV bytes
  python3 bench/serving/run_matrix.py --preset prefix   # shared-prefix data, prefix cache on/off
  python3 bench/serving/run_matrix.py --preset burst    # shared prefixes arriving at once
  # on a GPU: longer prompts, more of them, the server on the device
  python3 bench/serving/run_matrix.py --preset memory --model M.gguf --calib C.safetensors --mem 4096 \
      --bf16-running 128 --oscar-running 128 --extra-server "--device cuda --max-batch-tokens 8192" \
      --extra-bench "--num-prompts 128 --input-len 2048 --output-len 2048 --max-concurrency 128"
(--extra-bench arguments come after the preset's, so they override them.)
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def start(oscar, model, args):
    p = subprocess.Popen([oscar, "serve", "-m", model, "--port", "0"] + args,
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    port, banner = None, []
    deadline = time.time() + 300
    while time.time() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        banner.append(line.rstrip())
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        p.kill()
        sys.exit("server did not start:\n" + "\n".join(banner))
    # Keep draining stderr so the server never blocks on a full pipe.
    import threading
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    return p, port, banner[0] if banner else ""


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


CASES = {
    # Same KV memory, long prompts: how many requests run at once and what that buys.
    "memory": {
        "bench": ["--dataset", "random", "--num-prompts", "16", "--input-len", "3072",
                  "--output-len", "64", "--range-ratio", "0", "--max-concurrency", "16"],
        "cases": [
            ("bf16", ["--kv", "bf16", "--kv-memory-mb", "{mem}", "--max-running", "{bf16_running}"]),
            ("oscar", ["--kv", "oscar", "--calib", "{calib}", "--kv-memory-mb", "{mem}",
                       "--max-running", "{oscar_running}"]),
        ],
    },
    # Shared prefixes: prefix cache on and off.
    "prefix": {
        "bench": ["--dataset", "shared-prefix", "--num-groups", "4", "--prompts-per-group", "8",
                  "--prefix-len", "1024", "--suffix-len", "64", "--output-len", "32",
                  "--max-concurrency", "8"],
        "cases": [
            ("bf16 prefix-cache", ["--kv", "bf16"]),
            ("bf16 no-cache", ["--kv", "bf16", "--no-prefix-caching"]),
            ("oscar prefix-cache", ["--kv", "oscar", "--calib", "{calib}"]),
            ("oscar no-cache", ["--kv", "oscar", "--calib", "{calib}", "--no-prefix-caching"]),
        ],
    },
    # Requests sharing a prefix arrive at once (no warm cache): in-batch prefix sharing.
    "burst": {
        "bench": ["--dataset", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "8",
                  "--prefix-len", "1024", "--suffix-len", "64", "--output-len", "32",
                  "--max-concurrency", "16"],
        "cases": [
            ("bf16 prefix-cache", ["--kv", "bf16"]),
            ("oscar prefix-cache", ["--kv", "oscar", "--calib", "{calib}"]),
        ],
    },
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(CASES), required=True)
    ap.add_argument("--oscar", default=os.path.join(ROOT, "build", "oscar"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--calib", default=os.path.join(ROOT, "out", "calib.safetensors"))
    ap.add_argument("--mem", default="192", help="KV MiB for the memory preset")
    ap.add_argument("--oscar-running", default="12", help="--max-running of the 2-bit case (memory preset)")
    ap.add_argument("--bf16-running", default="16", help="--max-running of the BF16 case (memory preset)")
    ap.add_argument("--extra-server", default="", help="extra `oscar serve` arguments for every case")
    ap.add_argument("--output-json", help="write every case's numbers here")
    ap.add_argument("--extra-bench", default="", help="extra bench_serving.py arguments")
    ap.add_argument("--cases", help="comma-separated names of the preset's cases to run (default: all)")
    a = ap.parse_args()
    preset = CASES[a.preset]
    names = [c[0] for c in preset["cases"]]
    wanted = a.cases.split(",") if a.cases else names
    if unknown := [c for c in wanted if c not in names]:
        ap.error(f"--cases: {', '.join(unknown)} not in preset {a.preset} ({', '.join(names)})")
    rows = []
    for name, server_args in preset["cases"]:
        if name not in wanted:
            continue
        server_args = [s.format(calib=a.calib, mem=a.mem, oscar_running=a.oscar_running,
                                bf16_running=a.bf16_running) for s in server_args] + a.extra_server.split()
        p, port, banner = start(a.oscar, a.model, server_args)
        print(f"== {name}: {banner}", file=sys.stderr)
        out = f"/tmp/oscar_matrix_{os.getpid()}.json"
        cmd = [sys.executable, os.path.join(HERE, "bench_serving.py"), "--base-url",
               f"http://127.0.0.1:{port}", "--output-json", out, "--seed", "1"] + preset["bench"] + a.extra_bench.split()
        rc = subprocess.call(cmd, stdout=sys.stderr)
        m = metrics(port)
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)
        if rc != 0:
            sys.exit(f"benchmark of {name} failed (exit {rc})")
        r = json.load(open(out))["metrics"]
        r["case"] = name
        r["server_args"] = server_args
        r["server"] = banner
        r["preemptions"] = m.get("oscar_preemptions_total", 0)
        r["prefix_hit_rate"] = m.get("oscar_prefix_cache_hit_rate", 0)
        r["prefill_tokens"] = m.get("oscar_prefill_tokens_total", 0)
        # The engine's forward steps and the time inside them: busy_s against duration_s says
        # whether the engine or something around it (HTTP, tokenizing, the client) bounds the run.
        r["engine_steps"] = m.get("oscar_engine_steps_total", 0)
        r["engine_busy_s"] = m.get("oscar_engine_busy_seconds_total", 0)
        for kind in ("decode", "mixed"):  # steps of decode rows only / with a prompt chunk
            n = m.get(f"oscar_{kind}_step_seconds_count", 0)
            r[f"{kind}_steps"] = n
            r[f"{kind}_step_ms"] = 1e3 * m.get(f"oscar_{kind}_step_seconds_sum", 0) / n if n else 0.0
        r["bf16_pages"] = m.get('oscar_kv_pages_total{dtype="bf16"}', 0)
        r["quant_pages"] = m.get('oscar_kv_pages_total{dtype="quant"}', 0)
        rows.append(r)
    def get(r, key):
        v = r
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        return v

    cols = [("case", "case", "{}"), ("req/s", "request_throughput", "{:.2f}"),
            ("out tok/s", "output_token_throughput", "{:.1f}"),
            ("total tok/s", "total_token_throughput", "{:.1f}"),
            ("TTFT mean ms", "ttft_ms.mean", "{:.0f}"), ("TTFT p99 ms", "ttft_ms.p99", "{:.0f}"),
            ("TPOT mean ms", "tpot_ms.mean", "{:.1f}"), ("ITL p99 ms", "itl_ms.p99", "{:.0f}"),
            ("max in flight", "max_concurrent_requests", "{}"), ("preemptions", "preemptions", "{:.0f}"),
            ("prefix hit rate", "prefix_hit_rate", "{:.2f}"), ("prefill tokens", "prefill_tokens", "{:.0f}"),
            ("steps", "engine_steps", "{:.0f}"), ("engine busy", "engine_busy", "{}"),
            ("decode steps (mean ms)", "decode_steps_ms", "{}"), ("mixed steps (mean ms)", "mixed_steps_ms", "{}"),
            ("KV pages bf16 / 2-bit", "pages", "{}"), ("failed", "failed_requests", "{}")]
    for r in rows:
        r["pages"] = f"{r['bf16_pages']:.0f} / {r['quant_pages']:.0f}"
        r["decode_steps_ms"] = f"{r['decode_steps']:.0f} ({r['decode_step_ms']:.1f})"
        r["mixed_steps_ms"] = f"{r['mixed_steps']:.0f} ({r['mixed_step_ms']:.1f})"
        r["engine_busy"] = f"{r['engine_busy_s']:.1f} s ({100 * r['engine_busy_s'] / r['duration_s']:.0f} %)"
    print("| " + " | ".join(c[0] for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for _, k, f in cols:
            v = get(r, k)
            cells.append("n/a" if v is None else f.format(v))
        print("| " + " | ".join(cells) + " |")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"preset": a.preset, "bench_args": preset["bench"] + a.extra_bench.split(), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
