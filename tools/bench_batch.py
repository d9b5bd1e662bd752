"""Batch-job benchmark: lines/s and tokens/s of `mindspec batch` at several --dp (and --max-batch) settings.

Each setting runs the real command line in a fresh process on the same generated input (greedy chat
prompts, no two equal, or token ids with --prompt-ids) into a fresh output, so load, compile and the merge are all in
the wall time; tokens/s is the output's new tokens over that wall time. Settings alternate for --reps
rounds. Reported per setting: wall seconds, lines/s and tokens/s (median of the rounds).

    .venv/bin/python tools/bench_batch.py [--dp 1,2] [--max-batch 8] [--lines 32] [--max-new-tokens 64]
        [--reps 1] [--target DIR --draft X.onnx] [--json OUT.json] [--resume-lines 10000]
        [--repeat-prompts] [--no-prefix-cache]

--resume-lines N also times a resume: an output already holding N finished records of the job and one
line left; reported are the seconds from the start of the command to its first new record (reading and
checking the output, loading, compiling) and to its end, and what reading and checking the output alone
takes (in this process).

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


def write_input(path, lines, prompt_ids, repeat=False):
    """Chat lines that share the system turn only (each user turn led by its line's number; repeat: the
    prompts cycled as they are), or token-id lines."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lines):
            text = PROMPTS[i % len(PROMPTS)] if repeat else f"Line {i}. {PROMPTS[i % len(PROMPTS)]}"
            row = {"prompt_ids": [5 + i % 50, 6, 7]} if prompt_ids else \
                {"messages": [{"role": "user", "content": text}]}
            f.write(json.dumps(row) + "\n")


def batch_command(a, inp, out, dp, max_batch):
    cmd = ["batch", "--input", inp, "--output", out, "--dp", str(dp), "--max-batch", str(max_batch),
           "--max-new-tokens", str(a.max_new_tokens), "-k", str(a.k)]
    cmd += ["--no-prefix-cache"] if a.no_prefix_cache else []
    return cmd + (["--target", a.target] if a.target else []) + (["--draft", a.draft] if a.draft else [])


def run_once(a, inp, out, dp, max_batch):
    """(wall seconds, new tokens) of one batch job; exits on a failed job."""
    cmd = [sys.executable, "-m", "mindspec"] + batch_command(a, inp, out, dp, max_batch)
    t = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        sys.exit(f"bench_batch: --dp {dp} --max-batch {max_batch} failed ({p.returncode}): {p.stderr.strip()[-400:]}")
    with open(out, encoding="utf-8") as f:
        tokens = sum(json.loads(line)["stats"]["new_tokens"] for line in f if line.strip())
    return wall, tokens


def time_resume(a, d, n):
    """(seconds to the first new record, to the end, of reading and checking the output) of a resume with n
    records already written."""
    from mindspec.batch import Output, job_id
    from mindspec.cli import batch_defaults, parser
    inp, out = os.path.join(d, "resume-in.jsonl"), os.path.join(d, "resume-out.jsonl")
    write_input(inp, n + 1, a.prompt_ids)
    argv = batch_command(a, inp, out, 1, 1)
    job = job_id(batch_defaults(parser().parse_args(argv)), a.target)
    stats = {"new_tokens": 1, "target_calls": 1, "drafted": 0, "accepted": 0}
    with open(out, "w", encoding="utf-8") as f:
        for i in range(1, n + 1):
            f.write(json.dumps({"mindspec_batch": 1, "job": job, "id": i, "text": "x", "token_ids": [5],
                                "finish_reason": "length", "prompt_tokens": 3, "stats": stats}) + "\n")
    size = os.path.getsize(out)
    t = time.perf_counter()
    Output(out, job, inp).close()  # what the resume spends reading and checking the output
    scan = time.perf_counter() - t
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "mindspec"] + argv, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    first = None
    while p.poll() is None:
        if first is None and os.path.getsize(out) > size:
            first = time.perf_counter() - t
        time.sleep(0.01)
    end = time.perf_counter() - t
    if p.returncode != 0 or os.path.getsize(out) <= size:
        sys.exit(f"bench_batch: the resume failed ({p.returncode})")
    return first or end, end, scan


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", default="1,2", help="comma-separated --dp values (default 1,2)")
    ap.add_argument("--max-batch", default="8", help="comma-separated --max-batch values (default 8)")
    ap.add_argument("--lines", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-k", default="auto")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--prompt-ids", action="store_true", help="token-id prompts (any vocabulary, e.g. a tiny model)")
    ap.add_argument("--repeat-prompts", action="store_true",
                    help="chat lines cycled as they are (default: each led by its number)")
    ap.add_argument("--no-prefix-cache", action="store_true", help="the job prefills every prompt whole")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--resume-lines", type=int, default=0, help="also time a resume of an output of N records")
    a = ap.parse_args()
    settings = [(int(d), int(b)) for d in a.dp.split(",") for b in a.max_batch.split(",")]
    walls = {s: [] for s in settings}
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as d:
        inp = os.path.join(d, "in.jsonl")
        write_input(inp, a.lines, a.prompt_ids, a.repeat_prompts)
        for rep in range(a.reps):
            for dp, mb in settings:
                out = os.path.join(d, f"out-{dp}-{mb}-{rep}.jsonl")
                wall, tokens = run_once(a, inp, out, dp, mb)
                walls[(dp, mb)].append((wall, tokens))
                print(f"  --dp {dp} --max-batch {mb}: {wall:.1f} s, {tokens} tokens", file=sys.stderr, flush=True)
        resume = time_resume(a, d, a.resume_lines) if a.resume_lines else None
    rows = []
    print(f"{'dp':>3} {'max_batch':>9} {'wall_s':>8} {'lines/s':>8} {'tok/s':>7}")
    for (dp, mb), runs in walls.items():
        wall = statistics.median(w for w, _ in runs)
        tok = statistics.median(t / w for w, t in runs)
        rows.append({"dp": dp, "max_batch": mb, "wall_s": wall, "lines_per_s": a.lines / wall, "tokens_per_s": tok,
                     "lines": a.lines, "max_new_tokens": a.max_new_tokens, "runs": runs})
        print(f"{dp:>3} {mb:>9} {wall:>8.1f} {a.lines / wall:>8.2f} {tok:>7.1f}")
    if resume:
        print(f"resume of {a.resume_lines} records + 1 line: first new record after {resume[0]:.2f} s, "
              f"done after {resume[1]:.2f} s (reading and checking the output: {resume[2]:.3f} s)")
        rows.append({"resume_lines": a.resume_lines, "first_record_s": resume[0], "end_s": resume[1],
                     "output_scan_s": resume[2]})
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
