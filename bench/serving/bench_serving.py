#!/usr/bin/env python3
"""Serving benchmark for OpenAI-compatible /v1/completions servers (e.g. `oscar serve`).

Standard library only (threads + http.client). It sends streaming completion requests with
synthetic token-id prompts at a chosen arrival rate / concurrency and reports latency and
throughput the way vLLM's and SGLang's `bench_serving` define them:

  send      time just before the HTTP request is issued (after any --max-concurrency wait)
  TTFT      time to first token = arrival of the first SSE chunk with non-empty text - send
  ITL       inter-token latency = every gap between successive chunks that carry text
            (pooled over all successful requests)
  TPOT      time per output token = (E2E - TTFT) / (output_tokens - 1), requests with > 1 token
  E2E       end-to-end latency = end of the response stream ('data: [DONE]') - send
  output_tokens = usage.completion_tokens of the final chunk (fallback: number of text chunks);
  input tokens  = usage.prompt_tokens (fallback: prompt length we sent)
  duration  = last request end - first request send (over the timed requests)
  request / input / output / total token throughput = successful requests / token sums / duration

With --disable-stream the whole response arrives at once: TTFT = E2E, no TPOT and no ITL.
A request fails on a non-200 status (message taken from {"error": {"message": ...}}), an
error chunk, a transport error or timeout, a stream without any text or without 'data: [DONE]'.
"""
import argparse
import http.client
import json
import math
import random
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

now = time.perf_counter


@dataclass
class Request:
    """One benchmark request: what we send and what we measure (times from perf_counter)."""
    prompt: list            # token ids (a str also works: it is sent as-is)
    prompt_len: int
    max_tokens: int
    group: int = -1         # shared-prefix group index (-1 for the random dataset)
    send: float = 0.0
    first: float = None     # first chunk with text
    chunks: list = field(default_factory=list)   # arrival time of every chunk with text
    end: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ok: bool = False
    error: str = ""


def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def error_message(status, body):
    """'HTTP 400: <message>' from an OpenAI-style error body (or the raw text)."""
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body.decode("utf-8", "replace").strip()[:200]
    return f"HTTP {status}: {msg}"


class Client:
    """Opens one HTTP connection per request to the server at --base-url."""

    def __init__(self, base_url, api_key, timeout):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            die(f"bad --base-url {base_url!r} (expected e.g. http://127.0.0.1:8080)")
        self.conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self.host, self.port, self.timeout = u.hostname, u.port, timeout
        self.prefix = u.path.rstrip("/")
        if self.prefix.endswith("/v1"):  # accept both http://h:p and http://h:p/v1
            self.prefix = self.prefix[:-3]
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def open(self, method, path, body=None):
        conn = self.conn_cls(self.host, self.port, timeout=self.timeout)
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, self.prefix + path, body=data, headers=self.headers)
        return conn, conn.getresponse()


def resolve_model(client, base_url, model):
    """Checks the server is reachable (GET /v1/models); returns --model or the first model id."""
    try:
        conn, resp = client.open("GET", "/v1/models")
        body = resp.read()
        conn.close()
    except (OSError, http.client.HTTPException) as e:
        die(f"cannot reach server at {base_url}: {e}")
    if model:
        return model
    if resp.status != 200:
        die(f"GET /v1/models failed ({error_message(resp.status, body)}); pass --model")
    try:
        return json.loads(body)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        die("GET /v1/models returned no model; pass --model")


def read_stream(resp, req):
    """Consumes an SSE stream ('data: {json}' lines, ending with 'data: [DONE]')."""
    usage, done = None, False
    for raw in resp:
        t = now()
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, 'event:' lines
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"error chunk: {chunk['error'].get('message', chunk['error'])}")
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                req.first = req.first or t
                req.chunks.append(t)
        usage = chunk.get("usage") or usage
    if not done:  # http.client reports a cut chunked stream as a plain EOF
        raise RuntimeError("stream ended before 'data: [DONE]'")
    if req.first is None:
        raise RuntimeError("stream ended without any text")
    return usage


def run_request(client, req, model, args):
    """Sends one completion request and fills in req's measurements."""
    stream = not args.disable_stream
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0, "stream": stream, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(args.extra_body)
    conn, usage = None, None
    req.send = now()
    try:
        conn, resp = client.open("POST", "/v1/completions", body)
        if resp.status != 200:
            req.error = error_message(resp.status, resp.read())
        elif stream:
            usage = read_stream(resp, req)
        else:
            obj = json.loads(resp.read())
            if "error" in obj:
                raise RuntimeError(f"error in response: {obj['error']}")
            usage = obj.get("usage")
            req.chunks = [now()] if obj["choices"][0].get("text") else []
    except Exception as e:  # transport errors, bad JSON/shape, error chunks: all count as failed
        req.error = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
    finally:
        req.end = now()
        if conn is not None:
            conn.close()
    if req.error:
        return
    if not stream:
        req.first = req.end  # TTFT = E2E without streaming
    usage = usage or {}
    req.output_tokens = usage.get("completion_tokens") or len(req.chunks)
    req.prompt_tokens = usage.get("prompt_tokens") or req.prompt_len
    req.ok = True


def arrival_times(n, args, rng):
    """Offsets (s) from the start at which each request is released; the first is at 0.
    Gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate, Poisson when 1."""
    if math.isinf(args.request_rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        if args.fixed_rate:
            t += 1.0 / args.request_rate
        else:
            t += rng.gammavariate(args.burstiness, 1.0 / (args.request_rate * args.burstiness))
    return out


def run_all(client, reqs, model, args, arrivals, progress):
    """Releases requests at their arrival times (a thread each) under the concurrency limit.
    Returns the maximum number of requests observed in flight at once."""
    sem = threading.Semaphore(args.max_concurrency) if args.max_concurrency else None
    lock = threading.Lock()
    state = {"inflight": 0, "max": 0, "done": 0, "failed": 0}
    step = max(1, math.ceil(len(reqs) / 10))
    t0 = now()

    def worker(req):
        try:
            with lock:
                state["inflight"] += 1
                state["max"] = max(state["max"], state["inflight"])
            run_request(client, req, model, args)
            with lock:
                state["inflight"] -= 1
                state["done"] += 1
                state["failed"] += not req.ok
                if progress and (state["done"] % step == 0 or state["done"] == len(reqs)):
                    print(f"[bench] {state['done']}/{len(reqs)} done ({state['failed']} failed), "
                          f"{now() - t0:.1f} s", file=sys.stderr, flush=True)
        finally:
            if sem:
                sem.release()

    threads = []
    for req, at in zip(reqs, arrivals):
        delay = t0 + at - now()
        if delay > 0:
            time.sleep(delay)
        if sem:  # a request that arrives while the limit is reached waits here (FIFO, like vLLM)
            sem.acquire()
        th = threading.Thread(target=worker, args=(req,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return state["max"]


# ---------------------------------------------------------------- datasets

def rand_tokens(rng, n, args):
    return [rng.randrange(args.token_min, args.token_max) for _ in range(n)]


def rand_len(rng, n, ratio):
    """Uniform integer in [n*(1-ratio), n*(1+ratio)], at least 1."""
    lo = max(1, int(n * (1 - ratio)))
    return rng.randint(lo, max(lo, int(n * (1 + ratio))))


def make_dataset(args):
    rng = random.Random(args.seed)
    reqs = []
    if args.dataset == "random":
        for _ in range(args.num_prompts):
            n = rand_len(rng, args.input_len, args.range_ratio)
            reqs.append(Request(rand_tokens(rng, n, args), n,
                                rand_len(rng, args.output_len, args.range_ratio)))
    else:  # shared-prefix: num_groups prefixes, each shared by prompts_per_group prompts
        for g in range(args.num_groups):
            prefix = rand_tokens(rng, args.prefix_len, args)
            for _ in range(args.prompts_per_group):
                prompt = prefix + rand_tokens(rng, args.suffix_len, args)
                reqs.append(Request(prompt, len(prompt), args.output_len, group=g))
        rng.shuffle(reqs)  # interleave the groups, like SGLang's generated-shared-prefix
    return reqs


# ---------------------------------------------------------------- report

def percentile(xs, p):
    """Linear-interpolated percentile (numpy's default method); xs sorted."""
    k = (len(xs) - 1) * p / 100
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def stats_ms(values):
    if not values:
        return {k: None for k in ("mean", "median", "p90", "p99", "max")}
    xs = sorted(v * 1000 for v in values)
    return {"mean": statistics.fmean(xs), "median": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "max": xs[-1]}


def summarize(reqs, max_inflight, stream):
    ok = [r for r in reqs if r.ok]
    tpot_reqs = [r for r in ok if r.output_tokens > 1] if stream else []  # n/a without streaming
    start = min(r.send for r in reqs)
    duration = max(r.end for r in reqs) - start
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    metrics = {
        "successful_requests": len(ok), "failed_requests": len(reqs) - len(ok),
        "duration_s": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": per_s(len(ok)), "input_token_throughput": per_s(n_in),
        "output_token_throughput": per_s(n_out), "total_token_throughput": per_s(n_in + n_out),
        "max_concurrent_requests": max_inflight,
        "ttft_ms": stats_ms([r.first - r.send for r in ok]),
        "tpot_ms": stats_ms([(r.end - r.first) / (r.output_tokens - 1) for r in tpot_reqs]),
        "itl_ms": stats_ms([b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]),
        "e2e_latency_ms": stats_ms([r.end - r.send for r in ok]),
        "errors": dict(Counter(r.error for r in reqs if not r.ok).most_common()),
    }
    per_request = {
        "send_time_s": [r.send - start for r in reqs],
        "prompt_len": [r.prompt_len for r in reqs], "max_tokens": [r.max_tokens for r in reqs],
        "group": [r.group for r in reqs], "success": [r.ok for r in reqs],
        "error": [r.error for r in reqs],
        "prompt_tokens": [r.prompt_tokens for r in reqs], "output_tokens": [r.output_tokens for r in reqs],
        "ttft_ms": [(r.first - r.send) * 1000 if r.ok else None for r in reqs],
        "e2e_latency_ms": [(r.end - r.send) * 1000 for r in reqs],
        "itl_ms": [[(b - a) * 1000 for a, b in zip(r.chunks, r.chunks[1:])] for r in reqs],
    }
    return metrics, per_request


def print_table(m):
    def row(name, value, fmt="{:.2f}"):
        print(f"{name:<40}{'n/a' if value is None else fmt.format(value):>12}")
    print("{s:{c}^52}".format(s=" Serving Benchmark Result ", c="="))
    row("Successful requests:", m["successful_requests"], "{}")
    row("Failed requests:", m["failed_requests"], "{}")
    row("Max concurrent requests observed:", m["max_concurrent_requests"], "{}")
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"], "{}")
    row("Total generated tokens:", m["total_output_tokens"], "{}")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Input token throughput (tok/s):", m["input_token_throughput"])
    row("Output token throughput (tok/s):", m["output_token_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for key, short, title in [("ttft_ms", "TTFT", "Time to First Token"),
                              ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
                              ("itl_ms", "ITL", "Inter-token Latency"),
                              ("e2e_latency_ms", "E2E Latency", "End-to-end Latency")]:
        print("{s:{c}^52}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {short} (ms):",
                m[key][stat])
    if m["errors"]:
        print("{s:{c}^52}".format(s=" Errors ", c="-"))
        for msg, count in list(m["errors"].items())[:5]:
            print(f"{count:>6} x {msg[:140]}")
    print("=" * 52)


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8080", help="server URL (requests go to /v1/completions)")
    a("--model", default=None, help="model name (default: first id from GET /v1/models)")
    a("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    a("--dataset", choices=["random", "shared-prefix"], default="random")
    a("--num-prompts", type=int, default=100, help="random: number of requests")
    a("--input-len", type=int, default=1024, help="random: prompt length in tokens")
    a("--output-len", type=int, default=128, help="max_tokens per request (both datasets)")
    a("--range-ratio", type=float, default=0.0,
      help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    a("--num-groups", type=int, default=8, help="shared-prefix: number of distinct prefixes")
    a("--prompts-per-group", type=int, default=16, help="shared-prefix: prompts sharing a prefix")
    a("--prefix-len", type=int, default=1024, help="shared-prefix: shared prefix length")
    a("--suffix-len", type=int, default=128, help="shared-prefix: unique suffix length")
    a("--token-min", type=int, default=1000, help="random token ids are in [min, max)")
    a("--token-max", type=int, default=20000)
    a("--seed", type=int, default=0)
    a("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    a("--burstiness", type=float, default=1.0,
      help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more uniform")
    a("--fixed-rate", action="store_true", help="constant gaps of 1/rate instead of random ones")
    a("--max-concurrency", type=int, default=None, help="max requests in flight (default: no limit)")
    a("--warmup", type=int, default=0, help="untimed requests sent before the benchmark")
    a("--disable-stream", action="store_true", help="non-streaming requests (TTFT = E2E, no ITL)")
    a("--extra-body", type=json.loads, default={}, help="JSON object merged into every request body")
    a("--timeout", type=float, default=1800.0, help="socket timeout per request (s)")
    a("--output-json", default=None, help="write aggregate metrics and per-request arrays here")
    a("--fail-on-error", action="store_true",
      help="exit with status 1 if any request failed (warmup included); default: 1 only if none succeeded")
    args = p.parse_args(argv)
    if not 0 <= args.range_ratio < 1:
        p.error("--range-ratio must be in [0, 1)")
    if not 0 <= args.token_min < args.token_max:
        p.error("need 0 <= --token-min < --token-max")
    if args.request_rate <= 0 or args.burstiness <= 0:
        p.error("--request-rate and --burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not isinstance(args.extra_body, dict):
        p.error("--extra-body must be a JSON object")
    return args


def main(argv=None):
    args = parse_args(argv)
    client = Client(args.base_url, args.api_key, args.timeout)
    model = resolve_model(client, args.base_url, args.model)
    reqs = make_dataset(args)
    if not reqs:
        die("the dataset is empty")
    print(f"[bench] model={model} dataset={args.dataset} requests={len(reqs)} "
          f"rate={args.request_rate} max_concurrency={args.max_concurrency}", file=sys.stderr)

    warmup_failed = 0
    if args.warmup > 0:
        warm = [Request(r.prompt, r.prompt_len, r.max_tokens, r.group)
                for r in (reqs[i % len(reqs)] for i in range(args.warmup))]
        run_all(client, warm, model, args, [0.0] * len(warm), progress=False)
        failed = [r for r in warm if not r.ok]
        warmup_failed = len(failed)
        print(f"[bench] warmup: {len(warm)} requests, {len(failed)} failed", file=sys.stderr)
        if len(failed) == len(warm):
            die(f"all warmup requests failed: {failed[0].error}")

    arrivals = arrival_times(len(reqs), args, random.Random(args.seed + 1))
    max_inflight = run_all(client, reqs, model, args, arrivals, progress=True)
    metrics, per_request = summarize(reqs, max_inflight, not args.disable_stream)
    print_table(metrics)

    if args.output_json:
        config = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                  for k, v in vars(args).items()}
        config["model"] = model
        with open(args.output_json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": config,
                       "metrics": metrics, "per_request": per_request}, f, indent=1)
        print(f"[bench] wrote {args.output_json}", file=sys.stderr)
    if args.fail_on_error and (metrics["failed_requests"] or warmup_failed):
        print(f"[bench] --fail-on-error: {metrics['failed_requests']} of {len(reqs)} requests failed"
              + (f", {warmup_failed} warmup requests failed" if warmup_failed else ""), file=sys.stderr)
        return 1
    return 0 if metrics["successful_requests"] else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
