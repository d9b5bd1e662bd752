"""Batch-job benchmark: lines/s and tokens/s of `mindspec batch` at several --dp (and --max-batch) settings.

Each setting runs the real command line in a fresh process on the same generated input (greedy chat
prompts, or token ids with --prompt-ids) into a fresh output, so load, compile and the merge are all in
the wall time; tokens/s is the output's new tokens over that wall time. Settings alternate for --reps
rounds. Reported per setting: wall seconds, lines/s and tokens/s (median of the rounds).

    .venv/bin/python tools/bench_batch.py [--dp 1,2] [--max-batch 8] [--lines 32] [--max-new-tokens 64]
        [--reps 1] [--target DIR --draft X.onnx] [--json OUT.json]

On a 2-core machine expect no speed-up from --dp 2: two replicas share the cores and each compiles its own
graphs; the number to read is the overhead.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?", "Tell me a short story about a cat.",
           "Explain recursion in one paragraph.", "List three uses of a paperclip.", "Why is the sky blue?"]


def write_input(path, lines, prompt_ids):
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lines):
            row = {"prompt_ids": [5 + i % 50, 6, 7]} if prompt_ids else \
                {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
            f.write(json.dumps(row) + "\n")


def run_once(a, inp, out, dp, max_batch):
    """(wall seconds, new tokens) of one batch job; exits on a failed job."""
    cmd = [sys.executable, "-m", "mindspec", "batch", "--input", inp, "--output", out, "--dp", str(dp),
           "--max-batch", str(max_batch), "--max-new-tokens", str(a.max_new_tokens), "-k", str(a.k)]
    cmd += ["--target", a.target] if a.target else []
    cmd += ["--draft", a.draft] if a.draft else []
    t = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        sys.exit(f"bench_batch: --dp {dp} --max-batch {max_batch} failed ({p.returncode}): {p.stderr.strip()[-400:]}")
    with open(out, encoding="utf-8") as f:
        tokens = sum(json.loads(line)["stats"]["new_tokens"] for line in f if line.strip())
    return wall, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", default="1,2", help="comma-separated --dp values (default 1,2)")
    ap.add_argument("--max-batch", default="8", help="comma-separated --max-batch values (default 8)")
    ap.add_argument("--lines", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-k", default="auto")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--prompt-ids", action="store_true", help="token-id prompts (any vocabulary, e.g. a tiny model)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    settings = [(int(d), int(b)) for d in a.dp.split(",") for b in a.max_batch.split(",")]
    walls = {s: [] for s in settings}
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as d:
        inp = os.path.join(d, "in.jsonl")
        write_input(inp, a.lines, a.prompt_ids)
        for rep in range(a.reps):
            for dp, mb in settings:
                out = os.path.join(d, f"out-{dp}-{mb}-{rep}.jsonl")
                wall, tokens = run_once(a, inp, out, dp, mb)
                walls[(dp, mb)].append((wall, tokens))
                print(f"  --dp {dp} --max-batch {mb}: {wall:.1f} s, {tokens} tokens", file=sys.stderr, flush=True)
    rows = []
    print(f"{'dp':>3} {'max_batch':>9} {'wall_s':>8} {'lines/s':>8} {'tok/s':>7}")
    for (dp, mb), runs in walls.items():
        wall = statistics.median(w for w, _ in runs)
        tok = statistics.median(t / w for w, t in runs)
        rows.append({"dp": dp, "max_batch": mb, "wall_s": wall, "lines_per_s": a.lines / wall, "tokens_per_s": tok,
                     "lines": a.lines, "max_new_tokens": a.max_new_tokens, "runs": runs})
        print(f"{dp:>3} {mb:>9} {wall:>8.1f} {a.lines / wall:>8.2f} {tok:>7.1f}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
