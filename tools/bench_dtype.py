"""float32 against float16 on the default pair: target-only and speculative tokens/s, peak memory (RSS),
and how many prompts float16 reproduces exactly against float32 (greedy).

Each dtype runs in its own process (peak RSS is per process): the target in that dtype, the default
8-bit draft exported in that dtype. One run each; tokens/s over all prompts after a warm-up.

    .venv/bin/python tools/bench_dtype.py [--prompts 10] [--max-new-tokens 64] [--out docs/bench-dtype.json]
"""
import argparse
import json
import os
import resource
import subprocess
import sys

PROMPTS = ["Once upon a time, in a small village by the sea,", "The three primary colors are",
           "Write a Python function that reverses a string.", "What is the capital of France? Answer in one word.",
           "List five fruits that are red.", "Explain photosynthesis to a ten-year-old.",
           "The quick brown fox", "def fibonacci(n):", "In 1969, the first humans landed on",
           "Give me a haiku about autumn leaves."]


def drafts():
    """{dtype: the default model's q8 draft exported in it} (exported once, before any measurement)."""
    from mindspec.default import default_pair
    from mindspec.export import export_draft
    target, default = default_pair()
    out = {"float32": default, "float16": os.path.join(target, "draft-q8-float16.onnx")}
    if not os.path.exists(out["float16"] + ".json"):
        print("exporting the q8 draft in float16", file=sys.stderr)
        export_draft(target, out["float16"], quantize="q8", dtype="float16")
    return target, out


def child(dtype, n, max_new):
    import mindspec
    target, paths = drafts()
    draft = paths[dtype]
    pipe = mindspec.load(target=target, draft=draft, max_seq=256, dtype=dtype)
    prompts = PROMPTS[:n]
    out = {"dtype": dtype}
    for mode, kw in (("target-only", dict(speculate=False)), ("speculative", {})):
        pipe.generate(prompt=prompts[0], chat=True, max_new_tokens=8, **kw)  # compile
        tokens, wall, ids = 0, 0.0, []
        for p in prompts:
            r = pipe.generate(prompt=p, chat=True, max_new_tokens=max_new, **kw)
            tokens, wall = tokens + r.stats["new_tokens"], wall + r.stats["wall_s"]
            ids.append(r.token_ids)
        out[mode] = {"tokens_per_s": tokens / wall, "token_ids": ids}
    out["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.prompts, a.max_new_tokens)
    drafts()
    res = {}
    for dtype in ("float32", "float16"):
        p = subprocess.run([sys.executable, __file__, "--child", dtype, "--prompts", str(a.prompts),
                            "--max-new-tokens", str(a.max_new_tokens)], stdout=subprocess.PIPE, text=True, check=True)
        res[dtype] = json.loads(p.stdout.strip().splitlines()[-1])
    f32, f16 = res["float32"], res["float16"]
    same = sum(x == y for x, y in zip(f32["target-only"]["token_ids"], f16["target-only"]["token_ids"]))
    exact = {d: sum(x == y for x, y in zip(res[d]["target-only"]["token_ids"], res[d]["speculative"]["token_ids"]))
             for d in res}
    print("| dtype | target-only tok/s | speculative tok/s | peak RSS GB |")
    print("|---|---|---|---|")
    for d in ("float32", "float16"):
        r = res[d]
        print(f"| {d} | {r['target-only']['tokens_per_s']:.1f} | {r['speculative']['tokens_per_s']:.1f} | "
              f"{r['max_rss_gb']:.2f} |")
    print(f"\nfloat16 greedy == float32 greedy on {same} of {a.prompts} prompts x {a.max_new_tokens} tokens; "
          f"speculative == target-only of the same dtype: float32 {exact['float32']}/{a.prompts}, "
          f"float16 {exact['float16']}/{a.prompts}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"max_new_tokens": a.max_new_tokens, "identical_prompts": same, "prompts": a.prompts,
                       "speculative_equals_target_only": exact,
                       **{d: {k: v for k, v in r.items() if k != "dtype"} for d, r in res.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
