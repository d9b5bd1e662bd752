"""Tensor-parallel benchmark: tokens/s of the default pair at TP=1 and TP=2 on CPU, and what the target
sends between ranks per step.

Each TP size runs in fresh processes (TP=1: one plain process, TP=N: msrun via mindspec.tp.launch) with
the same prompt: compile (not timed), then target-only and speculative (K fixed) generation, interleaved
`--reps` times. Reported per TP size: tokens/s of both modes, tokens per target call, and the
communication of the target: AllReduces and AllGathers per target call (counted from the graph: one
AllReduce after the vocab-parallel embedding and after each row-parallel matmul, 2 per layer, one
AllGather of the greedy (max, index) pairs), the bytes each rank sends per call (ring algorithms) and
per generated token, and the measured latency of one AllReduce of the hidden state here.

    .venv/bin/python tools/bench_tp.py [--tp 1,2] [--max-new-tokens 48] [--reps 2] [--target DIR --draft X.onnx]

Expect no speed-up on a 2-core machine: TP=2 runs two ranks on the same two cores and adds ~2L+1
collectives over loopback TCP per target call; the point is that the tokens are identical and the
communication per step is small and counted.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

PROMPT = "Once upon a time, in a small village by the sea,"


def allreduce_latency(d, rows, reps=20):
    """Median seconds of one AllReduce of [rows, d] float32 in a compiled graph (a chain of 8)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    class Chain(nn.Cell):
        def __init__(self):
            super().__init__()
            self.ar = ops.AllReduce()

        def construct(self, x):
            for _ in range(8):
                x = self.ar(x) * 0.5
            return x

    cell, x = Chain(), Tensor(np.ones((rows, d), np.float32))
    cell(x).asnumpy()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        cell(x).asnumpy()
        ts.append((time.perf_counter() - t) / 8)
    return statistics.median(ts)


def worker(a):
    """One TP size, one process per rank; rank 0 writes the results to a.out."""
    import mindspec
    from mindspec.graphs.tp import comm_per_call, tp_rank, tp_size
    n = tp_size()
    if a.ms_threads:
        import mindspore as ms
        ms.set_context(runtime_num_threads=a.ms_threads)
    pipe = mindspec.load(target=a.target, draft=a.draft, k=a.k, buckets=(a.k,), max_seq=256,
                         prefix_cache=False)  # every run prefills its prompt
    ids = pipe.encode(PROMPT)
    pipe.generate(prompt_ids=ids, max_new_tokens=a.k + 2)  # compile prefill, decode, verify(K)
    runs = {"target_only": [], "speculative": []}
    for _ in range(a.reps):
        for mode, spec in (("target_only", False), ("speculative", True)):
            r = pipe.generate(prompt_ids=ids, max_new_tokens=a.max_new_tokens, speculate=spec)
            runs[mode].append(r)
    cfg = pipe.cfg
    res = {"tp": n, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size}
    for mode, rs in runs.items():
        s = [r.stats for r in rs]
        calls = statistics.median(x["target_calls"] for x in s)
        per_call = comm_per_call(cfg, n, tokens=1 if mode == "target_only" else a.k + 1)
        tokens = s[0]["new_tokens"]
        res[mode] = {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in s),
                     "tokens": tokens, "target_calls": calls,
                     "tokens_per_target_call": tokens / calls,
                     "acceptance_rate": s[0]["acceptance_rate"],
                     "token_ids": rs[0].token_ids,
                     "allreduces_per_call": per_call[0], "allgathers_per_call": per_call[1],
                     "bytes_sent_per_call": per_call[2],
                     "bytes_sent_per_token": per_call[2] * calls / tokens}
    res["same_tokens"] = res["target_only"]["token_ids"] == res["speculative"]["token_ids"]
    if n > 1:
        res["allreduce_ms"] = {f"{rows}x{cfg.hidden_size}": 1e3 * allreduce_latency(cfg.hidden_size, rows)
                               for rows in (1, a.k + 1)}
    if tp_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(res, f)
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="1,2")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--ms-threads", type=int, default=0, help="MindSpore runtime threads per rank (0: default)")
    p.add_argument("--json", default=None, help="also write all results here")
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)  # worker: where rank 0 writes
    a = p.parse_args()
    from mindspec import tp
    if a.out:  # a worker
        return tp.run_worker(lambda: worker(a)) if tp.is_worker() else worker(a)
    if a.target is None:
        from mindspec.default import default_pair
        a.target, default_draft = default_pair()
        a.draft = a.draft or default_draft
    results, tmp = [], tempfile.mkdtemp(prefix="bench-tp-")
    # a private MINDSPEC_HOME: no compile cache shared between TP sizes (compiling is not timed anyway)
    os.environ["MINDSPEC_HOME"] = tmp
    for n in [int(x) for x in a.tp.split(",")]:
        out = os.path.join(tmp, f"tp{n}.json")
        argv = ["--max-new-tokens", str(a.max_new_tokens), "--reps", str(a.reps), "-k", str(a.k),
                "--target", a.target, "--draft", a.draft, "--out", out, "--ms-threads", str(a.ms_threads)]
        t = time.perf_counter()
        if n == 1:
            import subprocess
            rc = subprocess.call([sys.executable, os.path.abspath(__file__)] + argv)
        else:
            rc = tp.launch(argv, n, script=os.path.abspath(__file__))
        if rc:
            print(f"TP={n} failed (exit {rc})", file=sys.stderr)
            return rc
        with open(out) as f:
            r = json.load(f)
        r["job_s"] = time.perf_counter() - t
        results.append(r)
        report(r)
    if len(results) > 1:
        same = all(r[m]["token_ids"] == results[0][m]["token_ids"]
                   for r in results for m in ("target_only", "speculative"))
        print(f"identical tokens at every TP size: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report(r):
    print(f"TP={r['tp']} (job {r['job_s']:.0f} s incl. start-up and compile)")
    for mode in ("target_only", "speculative"):
        m = r[mode]
        acc = f", acceptance {m['acceptance_rate']:.2f}" if m["acceptance_rate"] is not None else ""
        print(f"  {mode:12s} {m['tokens_per_s']:6.1f} tok/s, "
              f"{m['tokens_per_target_call']:.2f} tokens/target call{acc}; "
              f"per target call {m['allreduces_per_call']} AllReduce + {m['allgathers_per_call']} AllGather, "
              f"{m['bytes_sent_per_call'] / 1e3:.1f} kB sent per rank = {m['bytes_sent_per_token'] / 1e3:.1f} kB/token")
    if "allreduce_ms" in r:
        print("  one AllReduce here: " + ", ".join(f"[{k}] {v:.2f} ms" for k, v in r["allreduce_ms"].items()))


if __name__ == "__main__":
    sys.exit(main())
