"""`mindspec serve` under load: starts the server on 127.0.0.1 (default pair unless --target/--draft)
twice and reports the time from launch to ready of each (the first start compiles every graph
unless MindSpore's compile cache already holds them, and runs until it has; the second start reads
them from the warm cache), the first request's latency against the tenth's, then sends the same
requests (the bench prompts as chat turns, each led by the request's own number so that no two are
equal, whole completions) with 1, 4 and 8 concurrent clients and reports aggregate tokens/s and
p50/p95 latency for each, the time to the first streamed text, and the server's own /metrics
figures (acceptance, tokens per target call, time to first token). The throughput passes start once
the idle server has run each compiled graph once (a graph's first run is slower).

    .venv/bin/python tools/bench_serve.py [--max-new-tokens 64] [--requests 16] [--clients 1,4,8]
                                          [--max-batch 8] [--max-seq 512] [--target DIR --draft PATH]
                                          [--no-prefix-cache] [--repeat-prompts] [--no-speculate | -k K]
                                          [--max-queue-delay-us US]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from mindspec.bench import PROMPT_SETS


def post(url, body):
    """(response, seconds, seconds to the first streamed text or None)."""
    stream = body.get("stream", False)
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1200) as r:
        if not stream:
            return json.loads(r.read()), time.perf_counter() - t0, None
        first, last = None, None
        for line in r:
            if line.startswith(b"data: {"):
                last = json.loads(line[6:])
                c = last["choices"][0] if last.get("choices") else {}
                if c.get("text") or (c.get("delta") or {}).get("content"):  # not the role-only chunk
                    first = first or time.perf_counter() - t0
        return last, time.perf_counter() - t0, first


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def start(cmd):
    """(process, base URL, seconds from launch to the "serving" line)."""
    t0 = time.perf_counter()
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = ""
    while "serving" not in line:
        line = srv.stdout.readline()
        if not line:
            sys.exit("the server did not start (its errors are above)")
    return srv, line.split(" on ")[1].split()[0], time.perf_counter() - t0


def stop(srv):
    srv.terminate()
    srv.wait(timeout=60)


def wait_warm(base, timeout=600):
    """Seconds until the server has run every graph once (mindspec_graphs_cold 0: an idle server runs
    one per idle tick), so the throughput passes time steady-state steps, not first runs."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
            cold = [ln for ln in r.read().decode().splitlines() if ln.startswith("mindspec_graphs_cold ")]
        if cold and float(cold[0].split()[1]) == 0:
            return time.perf_counter() - t0
        time.sleep(1)
    sys.exit(f"the server still had cold graphs after {timeout} s")


def server_figures(base):
    """The speculative and latency figures of the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}

    def total(name, suffix="_total"):
        return sum(s.value for s in fams[name].samples if s.name == name + suffix)

    drafted, accepted = total("mindspec_spec_draft_tokens"), total("mindspec_spec_accepted_tokens")
    tokens, calls = total("mindspec_generation_tokens"), total("mindspec_spec_target_calls")
    ttft = total("mindspec_time_to_first_token_seconds", "_sum") / max(
        total("mindspec_time_to_first_token_seconds", "_count"), 1)
    prompt, cached = total("mindspec_prompt_tokens"), total("mindspec_prompt_tokens_cached")
    ks = {s.labels["k"]: int(s.value) for s in fams["mindspec_spec_k_steps"].samples if s.name.endswith("_total")}
    return (f"server /metrics: acceptance {accepted / max(drafted, 1):.3f} ({int(accepted)}/{int(drafted)}), "
            f"{tokens / max(calls, 1):.2f} tokens per target call, mean time to first token {1000 * ttft:.0f} ms, "
            f"steps by K {dict(sorted(ks.items()))}, "
            f"prompt tokens from the prefix cache {int(cached)} of {int(prompt)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--no-prefix-cache", action="store_true", help="the server prefills every prompt whole")
    ap.add_argument("--repeat-prompts", action="store_true",
                    help="send the bench prompts as they are, cycled (default: each request's own number first)")
    ap.add_argument("--no-speculate", action="store_true", help="the server decodes target-only (the baseline)")
    ap.add_argument("-k", help="the server's K (a bucket, or auto: the default)")
    ap.add_argument("--max-queue-delay-us", help="the server's wait for a request after a row frees (default: its own)")
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "mindspec", "serve", "--port", "0", "--max-seq", str(a.max_seq),
           "--max-batch", str(a.max_batch)]
    cmd += ["--target", a.target] if a.target else []
    cmd += ["--draft", a.draft] if a.draft else []
    cmd += ["--no-prefix-cache"] if a.no_prefix_cache else []
    cmd += ["--no-speculate"] if a.no_speculate else []
    cmd += ["-k", a.k] if a.k else []
    cmd += ["--max-queue-delay-us", a.max_queue_delay_us] if a.max_queue_delay_us else []
    srv, base, first_start = start(cmd)
    all_in = first_start + wait_warm(base)  # the larger batches' graphs compile after ready: all into the cache
    stop(srv)
    srv, base, ready_s = start(cmd)
    print(f"start to ready: first start {first_start:.1f} s (cold unless the compile cache held the graphs; every "
          f"graph compiled and run {all_in:.1f} s after launch), second start {ready_s:.1f} s (warm compile cache)")
    try:
        url = base + "/v1/chat/completions"
        texts = [p for rows in PROMPT_SETS.values() for p, _ in rows]
        # no two prompts equal (as a server's traffic): they share the chat template's system turn only
        bodies = [{"messages": [{"role": "user", "content": texts[i % len(texts)] if a.repeat_prompts else
                                 f"Request {i}. {texts[i % len(texts)]}"}], "max_tokens": a.max_new_tokens}
                  for i in range(a.requests)]
        first = post(url, bodies[0])[1]
        tenth = [post(url, bodies[i % len(bodies)])[1] for i in range(9)][-1]
        print(f"first request {first:.2f} s, tenth {tenth:.2f} s")
        _, _, ttft = post(url, dict(bodies[0], stream=True))
        print(f"time to first streamed text {1000 * ttft:.0f} ms")
        print(f"every graph run once (idle warm-up) {wait_warm(base):.1f} s later")
        results = {}
        for c in [int(x) for x in a.clients.split(",")]:
            t = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                done = list(pool.map(lambda b: post(url, b), bodies))
            wall = time.perf_counter() - t
            tokens = sum(r["usage"]["completion_tokens"] for r, _, _ in done)
            lat = [s for _, s, _ in done]
            results[c] = tokens / wall
            print(f"{c} clients: {len(done)} requests, {tokens} tokens in {wall:.1f} s = {tokens / wall:.2f} tok/s; "
                  f"latency p50 {statistics.median(lat):.2f} s, p95 {pct(lat, 0.95):.2f} s")
        print(server_figures(base))
        if 1 in results:
            print("aggregate tokens/s vs one client at a time: " +
                  ", ".join(f"{c} clients {v / results[1]:.2f}x" for c, v in results.items() if c != 1))
    finally:
        stop(srv)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
