"""Core benchmark: target-only vs speculative tokens/s on the default pair, one process, one run.

For each draft candidate and K in (2, 4, 8), on story / chat / code prompts: tokens/s, acceptance,
tokens per target call, and whether the speculative text equals the target-only text. Also the
verify cost of each K bucket relative to K=1 and to a plain decode step. Runs are interleaved
(target-only, then each candidate) per prompt, so machine noise hits all modes alike.

    .venv/bin/python tools/bench_core.py [--drafts q8,int8,q4] [--max-new-tokens 96] [--out bench-out]
"""
import argparse
import json
import os
import statistics
import sys
import time

import mindspec
from mindspec.default import default_pair
from mindspec.export import export_draft

PROMPTS = {
    "story": ("Once upon a time, in a small village by the sea,", False),
    "chat": ("What are three good habits for staying healthy? Explain briefly.", True),
    "code": ("Write a Python function that returns the n-th Fibonacci number.", True),
}


def candidate(target, name):
    """name: q8 | int8 | q4 | fp32 | layersN (first N layers, fp32); exported once beside the target."""
    path = os.path.join(target, f"draft-{name}.onnx")
    if not os.path.exists(path + ".json"):
        q = None if name == "fp32" or name.startswith("layers") else name
        layers = int(name[6:]) if name.startswith("layers") else None
        print(f"exporting {name} draft", file=sys.stderr)
        export_draft(target, path, quantize=q, layers=layers)
    return path


def verify_costs(pipe, reps=15):
    """Median seconds of decode and verify(K) at ~100 positions of context (one row, slot 0)."""
    from mindspec.graphs.runner import RowSampling
    t = pipe.target
    t.warmup(t.graph_names([1], (0,) + t.k_buckets))
    ctx = list(range(1000, 1100))
    for c in range(0, len(ctx), 32):
        t.prefill([0], [c], [ctx[c:c + 32]], RowSampling.greedy(1))

    def med(f):
        ts = []
        for _ in range(reps):
            s = time.perf_counter()
            f()
            ts.append(time.perf_counter() - s)
        return statistics.median(ts)
    out = {"decode": med(lambda: t.step([[5]], [0], [len(ctx)], [0]))}
    for k in t.k_buckets:
        out[f"verify{k}"] = med(lambda: t.step([[5] + [6] * k], [0], [len(ctx)], [k]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", default="q8,int8,q4")
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default="bench-out")
    a = ap.parse_args()
    target, _ = default_pair()
    drafts = {n: candidate(target, n) for n in a.drafts.split(",")}
    ks = [int(k) for k in a.ks.split(",")]
    pipe = mindspec.load(target=target, draft=False, max_seq=512, prefix_cache=False)  # each run prefills
    runs = []
    for pname, (prompt, chat) in PROMPTS.items():
        pipe.set_draft(None)
        base = pipe.generate(prompt=prompt, chat=chat, max_new_tokens=a.max_new_tokens)  # compiles
        base = pipe.generate(prompt=prompt, chat=chat, max_new_tokens=a.max_new_tokens)
        runs.append({"prompt_set": pname, "mode": "target-only", "draft": None, "k": 0,
                     "tokens_per_s": base.stats["tokens_per_s"], "acceptance_rate": None,
                     "tokens_per_target_call": 1.0, "identical_to_target_only": True})
        for dname, path in drafts.items():
            pipe.set_draft(path)
            for k in ks:
                pipe.generate(prompt=prompt, chat=chat, max_new_tokens=8, k=k)  # compile + warm the draft
                r = pipe.generate(prompt=prompt, chat=chat, max_new_tokens=a.max_new_tokens, k=k)
                s = r.stats
                runs.append({"prompt_set": pname, "mode": "fixed-k", "draft": dname, "k": k,
                             "tokens_per_s": s["tokens_per_s"], "acceptance_rate": s["acceptance_rate"],
                             "tokens_per_target_call": s["tokens_per_target_call"],
                             "draft_ms_per_token": 1000 * s["draft_s"] / max(s["drafted"], 1),
                             "verify_ms_per_call": 1000 * s["verify_s"] / max(s["target_calls"] - 1, 1),
                             "speedup": s["tokens_per_s"] / base.stats["tokens_per_s"],
                             "identical_to_target_only": r.token_ids == base.token_ids})
                print(json.dumps(runs[-1]), file=sys.stderr)
    costs = verify_costs(pipe)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_core.json"), "w") as f:
        json.dump({"runs": runs, "target_costs_s": costs, "max_new_tokens": a.max_new_tokens}, f, indent=1)
    print("| prompt | mode | draft | K | tokens/s | speedup | acceptance | tokens/call | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        acc = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        print(f"| {r['prompt_set']} | {r['mode']} | {r['draft'] or ''} | {r['k'] or ''} | {r['tokens_per_s']:.1f} | "
              f"{r.get('speedup', 1.0):.2f}x | {acc} | {r['tokens_per_target_call']:.2f} | "
              f"{'yes' if r['identical_to_target_only'] else 'NO'} |")
    d = costs["decode"]
    print("\ntarget call cost at ~100 positions (ms, and relative to verify K=1):")
    print(" ".join(f"{n}={1000 * v:.1f}ms ({v / costs['verify1']:.2f}x)" for n, v in costs.items()))


if __name__ == "__main__":
    main()
