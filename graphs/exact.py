"""The rows of a sampling step whose kept set the graph's top-k candidates did not hold (graphs/sampling.py:
a flat distribution, e.g. a high temperature or top_p near 1), redone on the host from the step's
logits with the reference functions (mindspec.sampling, mindspec.acceptance) and the row's own
uniforms: the same draw rule (inverse CDF, u_smp at the stopping point), so still the target's
distribution exactly and reproducible per seed. Rare, and ~16 ms a row (K = 4, 49,152 tokens, 2 cores):
no graph to compile."""
import numpy as np

from mindspec.acceptance import speculative_accept
from mindspec.sampling import process_logits, sample


def _p(logits, prev, temperature, top_k, top_p, penalty, upto=None, counts=None, presence=0.0, frequency=0.0):
    """p [T, V] of one row: logits [T, V], position i seeing prev[i] (the seen tokens and what the row fed
    before it) and counts[i] (the output's, see process_logits; None: no counts); positions past `upto` (none
    of the step's outcomes can reach them) left 0."""
    p = np.zeros(logits.shape)
    for i, (x, seen) in enumerate(zip(logits[:None if upto is None else upto + 1], prev)):
        p[i] = process_logits(x, float(temperature), int(top_k), float(top_p), float(penalty), seen,
                              float(presence), float(frequency), None if counts is None else counts[i])
    return p


def _logprob(logits, tokens):
    """logits [T, V], tokens [T] -> the tokens' logprobs [T] (as token_logprobs in the graph)."""
    x = logits.astype(np.float64)
    m = x.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[:, 0]
    return (x[np.arange(len(tokens)), tokens] - lse).astype(np.float32)


def redo_step(rows, logits, ids, n_valid, q, u_acc, u_smp, temperature, top_k, top_p, penalty, seen, counts, presence,
              frequency, out):
    """SampleStep's outputs out = [n [B], next [B], lp [B, T], top_lp, top_id] (numpy, changed in place)
    for rows, from logits [B, T, V] and the step's inputs (as SampleStep's, numpy). As the graph, next = -1
    where the position it would come from has logits that are not finite (a float16 overflow: the graph's
    check covers its own n, which the host's may pass); drafts from there on are not verified."""
    T = ids.shape[1]
    for b in rows:
        drafts, prev = ids[b, 1:], list(np.flatnonzero(seen[b]))
        fin = np.isfinite(logits[b]).all(-1)  # [T]
        bad = int(np.argmin(fin)) if not fin.all() else T  # the first position that is not finite
        upto = min(int(n_valid[b]), bad)
        x = np.where(fin[:, None], logits[b], 0.0)  # (from `bad` on nothing committed reads them: not NaN's warnings)
        fed = np.zeros((T, counts.shape[1]))  # [T, V]: the output's counts at each position, drafts included
        fed[np.arange(1, T), drafts] = 1
        fed = np.cumsum(fed, 0) + counts[b]
        p = _p(x, [prev + list(drafts[:i]) for i in range(T)], temperature[b], top_k[b], top_p[b],
               penalty[b], upto=upto, counts=fed, presence=presence[b],
               frequency=frequency[b])  # (a one-row decode, widened to dummy drafts: position 0 alone)
        if T == 1:
            n, nxt = 0, sample(p[0], u_smp[b, 0])
        else:  # (n does not depend on the sample uniform, which is the one of the stopping point n)
            n, _ = speculative_accept(p, q[b], drafts, u_acc[b], u_smp[b, 0], upto)
            n, nxt = speculative_accept(p, q[b], drafts, u_acc[b], u_smp[b, n], upto)
        if n == bad:
            out[0][b], out[1][b] = n, -1
            continue
        committed = np.concatenate([drafts, ids[b, :1]]) if T > 1 else np.array([nxt])
        committed[n] = nxt
        out[0][b], out[1][b], out[2][b] = n, nxt, _logprob(x, committed)


def redo_prefill(rows, logits, u, temperature, top_k, top_p, penalty, seen, out):
    """Prefill's outputs out = [next [B], lp [B, 1], top_lp, top_id] (numpy, changed in place) for rows,
    from logits [B, 1, V] and the chunk's inputs (as Prefill's, numpy)."""
    for b in rows:
        p = _p(logits[b], [list(np.flatnonzero(seen[b]))], temperature[b], top_k[b], top_p[b], penalty[b])
        nxt = sample(p[0], u[b])
        out[0][b], out[1][b] = nxt, _logprob(logits[b], [nxt])
