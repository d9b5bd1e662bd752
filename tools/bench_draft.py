"""What a draft costs on this CPU: one draft call (one token a row, 60 positions cached) at several batch
sizes, and a prompt's catch-up (one row fed T tokens, no logits), for each exported draft given (default:
the embedded q8 draft). The drafts run one after another in this process; median of --reps calls after
five unmeasured ones. Re-export the same model with `mindspec export --quantize int8|q8|q4` (or none) to
compare formats: which one is cheapest depends on the CPU's int8 instructions (`mindspec doctor`,
"CPU int8 dot product").

    .venv/bin/python tools/bench_draft.py [DRAFT.onnx ...] [--batch-sizes 1,4,8] [--catchup 32,128] [--reps 35]
"""
import argparse
import os
import statistics
import time

from mindspec.export import DraftSession, read_manifest

CACHED = 60  # positions each row holds before the timed calls


def call_ms(path, B, reps, max_batch):
    """Median milliseconds of one draft call over B rows, one token a row."""
    s = DraftSession(path, max_seq=CACHED + 8, max_batch=max_batch)
    for row in range(B):
        s.feed({row: list(range(100, 100 + CACHED))})
    times = []
    for _ in range(reps + 5):
        t = time.perf_counter()
        s.forward([[5]] * B)
        times.append(time.perf_counter() - t)
        s.pos[:B] -= 1  # the next call writes the same position again
    return 1000 * statistics.median(times[5:])


def catchup_ms(path, T, reps):
    """Median milliseconds of feeding one row T prompt tokens."""
    s = DraftSession(path, max_seq=T + 1, max_batch=1)
    times = []
    for _ in range(max(3, reps // 8) + 1):
        s.reset(0)
        t = time.perf_counter()
        s.feed({0: list(range(100, 100 + T))})
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("drafts", nargs="*")
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--catchup", default="32,128", help="prompt lengths of the catch-up timing")
    ap.add_argument("--reps", type=int, default=35)
    a = ap.parse_args()
    if not a.drafts:
        from mindspec.default import default_pair
        a.drafts = [default_pair()[1]]
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    lengths = [int(x) for x in a.catchup.split(",")]
    print("| draft | quantize | " + " | ".join(f"call B={B} ms" for B in sizes) + " | "
          + " | ".join(f"catch-up {T} ms" for T in lengths) + " |")
    print("|---|---|" + "---|" * (len(sizes) + len(lengths)))
    for path in a.drafts:
        calls = [call_ms(path, B, a.reps, max(sizes)) for B in sizes]
        feeds = [catchup_ms(path, T, a.reps) for T in lengths]
        q = read_manifest(path).get("quantize") or "none"
        print(f"| {os.path.basename(path)} | {q} | " + " | ".join(f"{x:.1f}" for x in calls) + " | "
              + " | ".join(f"{x:.0f}" for x in feeds) + " |", flush=True)


if __name__ == "__main__":
    main()
