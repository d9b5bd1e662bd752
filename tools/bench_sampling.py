"""Sampling benchmark on the default pair: acceptance, tokens per target call and tokens/s at
target temperature 0.7 and 1.0 for draft temperature 0.8, 1.0, 1.1, 1.3 (fixed K, seeded), plus the
fused sampling verify graph against computing the acceptance in Python from returned logits.

    .venv/bin/python tools/bench_sampling.py [-k 4] [--max-new-tokens 64] [--seeds 3]
"""
import argparse
import statistics
import time

import numpy as np

import mindspec
from mindspec.acceptance import speculative_accept
from mindspec.sampling import SamplingParams

PROMPTS = {"story": ("Once upon a time, in a small village by the sea,", False),
           "chat": ("What are three good habits for staying healthy?", True)}


def fused_vs_python(pipe, k, reps=10):
    """Median ms of one verify step: fused graph (q in, n_accepted/next out) vs logits graph + numpy."""
    from mindspec.graphs.runner import RowSampling
    t, V = pipe.target, pipe.cfg.vocab_size
    params = SamplingParams(temperature=1.0)
    rng = np.random.default_rng(0)
    q = np.full((1, k, V), 1.0 / V, np.float32)
    ctx = list(range(1000, 1064))
    for c in range(0, len(ctx), 32):
        t.prefill([0], [c], [ctx[c:c + 32]], RowSampling.greedy(1))

    def fused_step():
        s = RowSampling(np.ones(1), np.zeros(1, np.int64), np.ones(1), np.ones(1), rng.random((1, k)),
                        rng.random((1, k + 1)), q=q)
        t.step([[5] + [6] * k], [0], [len(ctx)], [k], s)
    fused_step()  # compile
    t.logits(0, len(ctx), [5] + [6] * k)  # compile
    fused, python = [], []
    for _ in range(reps):
        s = time.perf_counter()
        fused_step()
        fused.append(time.perf_counter() - s)
        s = time.perf_counter()
        p = params.process(t.logits(0, len(ctx), [5] + [6] * k))  # [K+1, V] back to Python
        speculative_accept(p, q[0], np.full(k, 6), rng.random(k), rng.random())
        python.append(time.perf_counter() - s)
    return 1000 * statistics.median(fused), 1000 * statistics.median(python)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    pipe = mindspec.load(k=a.k, max_seq=256, prefix_cache=False)  # every run prefills its prompt
    print("| prompt | T | draft T | acceptance | tokens/call | tokens/s | target-only tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for name, (prompt, chat) in PROMPTS.items():
        for temp in (0.7, 1.0):
            kw = dict(prompt=prompt, chat=chat, max_new_tokens=a.max_new_tokens, temperature=temp)
            pipe.generate(**dict(kw, max_new_tokens=4), seed=0, speculate=False)  # compile
            base = [pipe.generate(**kw, seed=s, speculate=False).stats for s in range(a.seeds)]
            base_tps = sum(b["new_tokens"] for b in base) / sum(b["wall_s"] for b in base)
            for dt in (0.8, 1.0, 1.1, 1.3):
                pipe.generate(**dict(kw, max_new_tokens=4), seed=0, draft_temperature=dt)  # compile/warm
                runs = [pipe.generate(**kw, seed=s, draft_temperature=dt).stats for s in range(a.seeds)]
                acc = sum(r["accepted"] for r in runs) / max(sum(r["drafted"] for r in runs), 1)
                tpc = sum(r["new_tokens"] for r in runs) / sum(r["target_calls"] for r in runs)
                tps = sum(r["new_tokens"] for r in runs) / sum(r["wall_s"] for r in runs)
                print(f"| {name} | {temp} | {dt} | {acc:.2f} | {tpc:.2f} | {tps:.1f} | {base_tps:.1f} |", flush=True)
    f, p = fused_vs_python(pipe, a.k)
    print(f"\nverify step, K={a.k}, temperature 1: fused graph {f:.1f} ms, logits to Python + numpy acceptance "
          f"{p:.1f} ms ({p / f:.2f}x)")


if __name__ == "__main__":
    main()
