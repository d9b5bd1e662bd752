"""Where an engine's time goes: `tools/bench_serve.py`'s chat requests (each led by its own number, so they
share the system turn only), run in-process through the engine (default pair) with up to --max-batch rows
at once, and the time of each kind of call it makes: the target's prompt chunks, the draft's catch-up (on
prompts, and on tokens a row's draft missed), the draft's proposals and the target's verify (or decode)
steps. Each batch size runs two rounds of new requests; the first pays the first runs of the graphs that
measuring the dynamic-K costs did not run, the second is the one to read.

    .venv/bin/python tools/profile_engine.py [--max-batch 1,8] [--requests 48] [--max-new-tokens 48] [--temperature T]
"""
import argparse
import collections
import time

import mindspec
from mindspec.bench import PROMPT_SETS


def timed(obj, name, spent, calls, label=None):
    """Wrap obj.name so that each call adds its seconds to spent[label] and, when its first argument
    holds anything (the draft's catch-up is called with no rows on most steps), one to calls[label]."""
    f, label = getattr(obj, name), label or name

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return f(*a, **kw)
        finally:
            spent[label] += time.perf_counter() - t
            calls[label] += bool(len(a[0]))
    setattr(obj, name, wrapper)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-batch", default="1,8")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled requests (each its drawn seed)")
    a = ap.parse_args()
    sizes = [int(x) for x in a.max_batch.split(",")]
    pipe = mindspec.load(max_seq=a.max_seq, max_batch=max(sizes))
    texts = [p for rows in PROMPT_SETS.values() for p, _ in rows]

    def requests(first=0):  # (numbered from `first`: no request finds another round's in the prefix cache)
        return [pipe.request(prompt=f"Request {i}. {texts[i % len(texts)]}", chat=True,
                             max_new_tokens=a.max_new_tokens, temperature=a.temperature)
                for i in range(first, first + a.requests)]
    pipe.prepare(requests(), max(sizes), every_graph=True)
    spent, calls = collections.Counter(), collections.Counter()
    timed(pipe.target, "prefill", spent, calls, "target prompt chunks")
    timed(pipe.proposer, "prefill", spent, calls, "draft catch-up")
    timed(pipe.proposer, "get_candidates", spent, calls, "draft proposals")
    timed(pipe.target, "step", spent, calls, "target steps")
    for i, B in enumerate(sizes):
        for rnd in (1, 2):
            spent.clear()
            calls.clear()
            reqs = requests((2 * i + rnd) * a.requests)
            t = time.perf_counter()
            pipe.run(reqs, max_batch=B)
            wall = time.perf_counter() - t
            tokens = sum(len(r.output) for r in reqs)
            parts = ", ".join(f"{k} {v:.1f} s ({100 * v / wall:.0f}%, {calls[k]} calls)" for k, v in spent.items())
            print(f"max_batch {B}, round {rnd}: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s; {parts}",
                  flush=True)


if __name__ == "__main__":
    main()
