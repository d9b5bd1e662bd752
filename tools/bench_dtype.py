"""float32 against float16 on the default pair: target-only and speculative tokens/s, peak memory (RSS),
and how many prompts float16 reproduces exactly against float32 (greedy).

Speed: both pipelines in one process, prompt by prompt in turn (float32 then float16, target-only then
speculative), so machine noise hits both alike; tokens/s over all prompts after a warm-up. Memory: peak
RSS of a separate process per dtype that loads the pair and generates once. The draft of each dtype
is the default model's q8 draft exported in it.

    .venv/bin/python tools/bench_dtype.py [--prompts 10] [--max-new-tokens 64] [--out docs/bench-dtype.json]
"""
import argparse
import json
import os
import subprocess
import sys

PROMPTS = ["Once upon a time, in a small village by the sea,", "The three primary colors are",
           "Write a Python function that reverses a string.", "What is the capital of France? Answer in one word.",
           "List five fruits that are red.", "Explain photosynthesis to a ten-year-old.",
           "The quick brown fox", "def fibonacci(n):", "In 1969, the first humans landed on",
           "Give me a haiku about autumn leaves."]
DTYPES = ("float32", "float16")
MODES = {"target-only": dict(speculate=False), "speculative": {}}


def drafts():
    """(target dir, {dtype: the default model's q8 draft exported in it}), exported once, before any
    measurement."""
    from mindspec.default import default_pair
    from mindspec.export import export_draft
    target, default = default_pair()
    out = {"float32": default, "float16": os.path.join(target, "draft-q8-float16.onnx")}
    if not os.path.exists(out["float16"] + ".json"):
        print("exporting the q8 draft in float16", file=sys.stderr)
        export_draft(target, out["float16"], quantize="q8", dtype="float16")
    return target, out


def peak_rss(dtype):
    """A child's peak RSS in GB: load the pair in `dtype`, generate 16 tokens."""
    code = ("import resource, sys; sys.path.insert(0, sys.argv[1]); import bench_dtype as b, mindspec; "
            "t, d = b.drafts(); p = mindspec.load(target=t, draft=d[sys.argv[2]], max_seq=256, dtype=sys.argv[2]); "
            "p.generate(prompt=b.PROMPTS[0], chat=True, max_new_tokens=16); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20)")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), dtype],
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import mindspec
    target, paths = drafts()
    rss = {d: peak_rss(d) for d in DTYPES}
    pipes = {d: mindspec.load(target=target, draft=paths[d], max_seq=256, dtype=d, prefix_cache=False)
             for d in DTYPES}  # every run prefills its prompt
    res = {d: {m: {"tokens": 0, "wall_s": 0.0, "token_ids": []} for m in MODES} for d in DTYPES}
    for d in DTYPES:
        for kw in MODES.values():
            pipes[d].generate(prompt=PROMPTS[0], chat=True, max_new_tokens=8, **kw)  # compile
    for p in PROMPTS[:a.prompts]:
        for d in DTYPES:
            for m, kw in MODES.items():
                r = pipes[d].generate(prompt=p, chat=True, max_new_tokens=a.max_new_tokens, **kw)
                acc = res[d][m]
                acc["tokens"] += r.stats["new_tokens"]
                acc["wall_s"] += r.stats["wall_s"]
                acc["token_ids"].append(r.token_ids)
        print(".", end="", file=sys.stderr, flush=True)
    for d in DTYPES:
        for m in MODES:
            res[d][m]["tokens_per_s"] = res[d][m]["tokens"] / res[d][m]["wall_s"]
        res[d]["max_rss_gb"] = rss[d]
    f32, f16 = res["float32"], res["float16"]
    same = sum(x == y for x, y in zip(f32["target-only"]["token_ids"], f16["target-only"]["token_ids"]))
    exact = {d: sum(x == y for x, y in zip(res[d]["target-only"]["token_ids"], res[d]["speculative"]["token_ids"]))
             for d in DTYPES}
    print("\n| dtype | target-only tok/s | speculative tok/s | peak RSS GB |")
    print("|---|---|---|---|")
    for d in DTYPES:
        r = res[d]
        print(f"| {d} | {r['target-only']['tokens_per_s']:.1f} | {r['speculative']['tokens_per_s']:.1f} | "
              f"{r['max_rss_gb']:.2f} |")
    print(f"\nfloat16 greedy == float32 greedy on {same} of {a.prompts} prompts x {a.max_new_tokens} tokens; "
          f"speculative == target-only of the same dtype: float32 {exact['float32']}/{a.prompts}, "
          f"float16 {exact['float16']}/{a.prompts}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"max_new_tokens": a.max_new_tokens, "prompts": a.prompts, "identical_prompts": same,
                       "speculative_equals_target_only": exact, **res}, f, indent=1)


if __name__ == "__main__":
    main()
