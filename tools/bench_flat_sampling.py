"""Sampling where the graph's top-k candidates cannot hold the kept set (a flat distribution: a high
temperature, top_p near 1): such rows are redone on the host (graphs/exact.py). 8 seeded chat requests at
once through generate_many on the default pair, K = 4; the second of two runs timed (the first compiles).
Reports tokens/s and the rows redone on the host (both runs).

    .venv/bin/python tools/bench_flat_sampling.py [--temperature 1.0] [--top-p 0.99] [--max-new-tokens 48]
"""
import argparse
import time

import mindspec

TOPICS = ["a cat", "the sea", "a robot", "winter", "a king", "music", "a tree", "rain"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.99)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    a = ap.parse_args()
    pipe = mindspec.load(max_batch=8, max_seq=256)
    reqs = [dict(prompt=f"Tell me a story about {w}.", chat=True, max_new_tokens=a.max_new_tokens, seed=i, k=4,
                 temperature=a.temperature, top_p=a.top_p) for i, w in enumerate(TOPICS)]
    pipe.generate_many(reqs, max_batch=8)  # compiles, measures the costs
    t = time.perf_counter()
    res = pipe.generate_many(reqs, max_batch=8)
    dt = time.perf_counter() - t
    n = sum(r.stats["new_tokens"] for r in res)
    print(f"{n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s; rows redone on the host: {pipe.target.host_rows}")


if __name__ == "__main__":
    main()
