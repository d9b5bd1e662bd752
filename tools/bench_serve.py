"""What serving over HTTP costs on top of the loop: starts `mindspec serve` on 127.0.0.1 (default
pair unless --target/--draft), sends the bench prompts to /v1/completions (whole and streamed) and
reports, per request, the client's tokens/s next to the loop's own (the "mindspec" stats in the
response), and the time to the first streamed text.

    .venv/bin/python tools/bench_serve.py [--max-new-tokens 64] [--rounds 2] [--target DIR --draft PATH]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

from mindspec.bench import PROMPT_SETS


def post(url, body):
    stream = body.get("stream", False)
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "mindspec", "serve", "--port", "0", "--max-seq", "512"]
    cmd += ["--target", a.target] if a.target else []
    cmd += ["--draft", a.draft] if a.draft else []
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while "serving" not in line:
            line = srv.stdout.readline()
            if not line:
                sys.exit("the server did not start (its errors are above)")
        base = line.split(" on ")[1].split()[0]
        url = base + "/v1/completions"
        prompts = [p for rows in PROMPT_SETS.values() for p, chat in rows if not chat]
        chats = [p for rows in PROMPT_SETS.values() for p, chat in rows if chat]
        post(url, {"prompt": prompts[0], "max_tokens": 8})  # compile / warm up
        post(url, {"prompt": prompts[0], "max_tokens": 8, "stream": True})
        rows = []
        for _ in range(a.rounds):
            jobs = [(url, {"prompt": t}) for t in prompts]
            jobs += [(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": t}]}) for t in chats]
            for where, body in jobs:
                body["max_tokens"] = a.max_new_tokens
                res, wall, _ = post(where, body)
                _, swall, ttft = post(where, dict(body, stream=True))
                n = res["usage"]["completion_tokens"]
                rows.append(dict(tokens=n, client_s=wall, loop_s=res["mindspec"]["wall_s"], stream_s=swall,
                                 ttft_s=ttft, loop_prefill_s=res["mindspec"]["prefill_s"]))
        tok = sum(r["tokens"] for r in rows)
        client, loop = sum(r["client_s"] for r in rows), sum(r["loop_s"] for r in rows)
        print(f"{len(rows)} requests, {tok} tokens: client {tok / client:.1f} tok/s, loop {tok / loop:.1f} tok/s, "
              f"HTTP + parsing + queue {1000 * (client - loop) / len(rows):.1f} ms per request; "
              f"streamed {tok / sum(r['stream_s'] for r in rows):.1f} tok/s, time to first text "
              f"median {1000 * statistics.median(r['ttft_s'] for r in rows):.0f} ms (loop prefill median "
              f"{1000 * statistics.median(r['loop_prefill_s'] for r in rows):.0f} ms)")
    finally:
        srv.terminate()
        srv.wait(timeout=60)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
