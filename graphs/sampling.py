"""Speculative sampling fused into the target's compiled graphs.

The sampling parameters come in as 0-d Tensors (one compiled graph serves every temperature /
top-k / top-p / penalty value) and randomness as pre-drawn uniforms, so a seeded run is
reproducible. Processing matches mindspec.sampling.process_logits (HF order and semantics), the
acceptance matches mindspec.acceptance.speculative_accept. Compiled variants (constructor flags):
`penalize` (repetition penalty; also serves temperature 0, i.e. greedy with a penalty: plain greedy
has its own graphs in llama.py) and `truncate` (top-k/top-p), so plain sampling pays for neither.
Only token ids and counts leave the graph: full-vocabulary logits never go back to Python.

Top-k/top-p without a full sort (a CPU sort of the vocabulary costs ~20x the rest): the thresholds
come from the `cap` largest logits (ops.topk) and the softmax normaliser over the whole vocabulary.
That is exact whenever the kept set fits in the candidates (top_k <= cap, or the candidates hold
top_p of the mass); otherwise an in-graph branch recomputes them from a full sort.
"""
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from .llama import NEG

BIG = 3e38  # "+infinity" for min-reductions
TOPK_CAP = 2048  # topk costs ~6 ms at 1024-2048 on 5 x 49152 (2 CPU cores), a full sort ~55 ms


def _cut(s, x, top_k, top_p):
    """Truncation threshold from s [.., C], the C largest logits of x [.., V] (descending).
    Returns (cut [.., 1]: keep x >= cut, exact: 0-d bool, whether the C candidates sufficed)."""
    V, C = x.shape[-1], s.shape[-1]
    k = top_k + (top_k <= 0).astype(ms.int32) * V  # 0 (off) -> V
    k = ops.minimum(k, V)
    kth = ops.gather(s, ops.minimum(k, C) - 1, s.ndim - 1).expand_dims(-1)  # [.., 1] k-th largest
    kth = ops.select(k >= V, ops.full_like(kth, -BIG), kth)
    m = s[..., :1]
    z = (ops.exp(x - m) * (x >= kth).astype(ms.float32)).sum(-1, keepdims=True)  # mass after top-k
    ps = ops.exp(s - m) * (s >= kth).astype(ms.float32) / z  # [.., C] probabilities, descending
    incl = ops.cumsum(ps, -1)
    before = incl - ps  # mass of the tokens ranked before each one: kept when < top_p
    cut_p = ops.select(before < top_p, s, ops.full_like(s, BIG)).min(-1, keepdims=True)
    cut = ops.select(top_p < 1, ops.maximum(cut_p, kth), kth)
    exact = ops.logical_or(k <= C, ops.logical_and(
        k >= V, ops.logical_or(top_p >= 1, (incl[..., C - 1] >= top_p).all())))
    return cut, exact


def process(x, temperature, top_k, top_p, penalty, seen, penalize, truncate, cap):
    """logits x [.., V] float32 -> probabilities [.., V]. 0-d temperature, top_k int32 (0: off), top_p,
    penalty; seen [.., V] bool (token already in the sequence). Without `penalize` the temperature
    must be > 0 (plain greedy has its own graphs); with it, temperature 0 gives the one-hot argmax of
    the penalised logits (greedy with a repetition penalty)."""
    if penalize:
        x = ops.select(seen, ops.select(x > 0, x / penalty, x * penalty), x)
        hot = (temperature > 0).astype(ms.float32)  # 0-d: 1 sampling, 0 greedy
        greedy = ops.one_hot(ops.argmax(x, -1), x.shape[-1], Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
        return _softmax_truncated(x / (temperature + 1.0 - hot), top_k, top_p, truncate, cap) * hot \
            + greedy * (1.0 - hot)
    return _softmax_truncated(x / temperature, top_k, top_p, truncate, cap)


def _softmax_truncated(x, top_k, top_p, truncate, cap):
    """softmax of logits x [.., V] (temperature applied) after top-k / top-p (when `truncate`)."""
    V = x.shape[-1]
    if truncate:
        if cap < V:
            cut, exact = _cut(ops.topk(x, cap, -1, True, True)[0], x, top_k, top_p)
            if not exact:  # the kept set does not fit in the candidates: full sort (rare, slow on CPU)
                cut, exact = _cut(ops.sort(x, -1, True)[0], x, top_k, top_p)
        else:
            cut, exact = _cut(ops.sort(x, -1, True)[0], x, top_k, top_p)
        x = ops.select(x >= cut, x, ops.full_like(x, NEG))
    return ops.softmax(x, -1)


def sample(probs, u):
    """Inverse-CDF draw per row: probs [B, V] (unnormalised ok), u [B] in [0, 1) -> tokens [B] int32.
    The threshold stays below the total, so a zero-probability token is never drawn."""
    V = probs.shape[-1]
    cdf = ops.cumsum(probs, -1)  # [B, V]
    total = cdf[:, V - 1:]
    thr = ops.minimum(u.reshape(-1, 1) * total, total * (1.0 - 2.0 ** -23))
    return (cdf <= thr).astype(ms.int32).sum(-1)


def seen_mask(seen, drafts, V):
    """seen [B, V] float32 (1: committed token), drafts [B, K] -> [B, K+1, V] bool: at position i the
    committed tokens and drafts[:, :i] count as seen (what the repetition penalty looks at)."""
    B = drafts.shape[0]
    d = ops.cumsum(ops.one_hot(drafts, V, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)), 1)  # [B, K, V]
    d = ops.concat((ops.zeros((B, 1, V), ms.float32), d), 1)  # [B, K+1, V]
    return (d + seen.reshape(B, 1, V)) > 0


class _Sampler(nn.Cell):
    def __init__(self, decoder, truncate=False, penalize=False, cap=TOPK_CAP):
        super().__init__()
        self.decoder = decoder
        self.truncate, self.penalize, self.cap = truncate, penalize, cap


class SamplingVerify(_Sampler):
    """The fused speculative-sampling verify step for one K bucket.

    ids [B, K+1] int32 (last committed token + K drafts, at positions start..), start 0-d int32,
    q [B, K, V] float32 (the processed draft distributions the drafts were sampled from),
    u [B, K+1] float32 in [0, 1) (K acceptance uniforms + 1 for the recovered/bonus token),
    temperature, top_k (int32), top_p, penalty 0-d, seen [B, V] float32 (1: token committed).
    Returns n_accepted [B] int32, next_token [B] int32, accepted [B, K] int32 (per-position
    acceptance flags; those after the first rejection are not used)."""

    def construct(self, ids, start, q, u, temperature, top_k, top_p, penalty, seen):
        logits = self.decoder(ids, start).astype(ms.float32)  # [B, K+1, V]
        B, K1, V = logits.shape
        K = K1 - 1
        drafts = ids[:, 1:]  # [B, K]
        seen_all = seen_mask(seen, drafts, V) if self.penalize else None
        p = process(logits, temperature, top_k, top_p, penalty, seen_all,
                    self.penalize, self.truncate, self.cap)  # [B, K+1, V]
        pick = ops.concat((drafts, ops.zeros((B, 1), ms.int32)), 1).reshape(B, K1, 1)
        px = ops.gather_elements(p, 2, pick).reshape(B, K1)[:, :K]  # [B, K] p_i(x_i)
        qx = ops.gather_elements(q, 2, drafts.reshape(B, K, 1)).reshape(B, K)  # [B, K] q_i(x_i)
        acc = (u[:, :K] * qx < px).astype(ms.int32)  # [B, K]: accepted with probability min(1, p/q)
        n = ops.cumprod(acc, 1).sum(1).astype(ms.int32)  # [B]
        rows = ops.arange(B, dtype=ms.int32)
        pn = ops.gather(p.reshape(B * K1, V), rows * K1 + n, 0)  # [B, V]: p at the first rejection, or p_K
        qn = ops.gather(q.reshape(B * K, V), rows * K + ops.minimum(n, K - 1), 0) \
            * (n < K).astype(ms.float32).reshape(B, 1)  # [B, V]: q there; 0 after K acceptances
        r = ops.relu(pn - qn)  # recovered: norm(max(0, p - q)); bonus: r = p_K
        r = ops.select(ops.broadcast_to(r.sum(-1, keepdims=True) > 0, (B, V)), r, pn)  # degenerate: p
        return n, sample(r, u[:, K]), acc


class SampleNext(_Sampler):
    """Target-only sampling (prefill chunks, plain decode): ids [B, T] at start, sample the token
    after position `last` (0-d int32, the last real token of a padded chunk) with uniforms u [B];
    other inputs as SamplingVerify. Returns tokens [B] int32."""

    def construct(self, ids, start, last, u, temperature, top_k, top_p, penalty, seen):
        logits = self.decoder(ids, start).astype(ms.float32)  # [B, T, V]
        x = ops.gather(logits, last, 1)  # [B, V]
        p = process(x, temperature, top_k, top_p, penalty, seen > 0, self.penalize, self.truncate, self.cap)
        return sample(p, u)


def scalars(params):
    """SamplingParams -> the 0-d Tensors the graphs take (temperature, top_k, top_p, penalty)."""
    return (Tensor(np.float32(params.temperature)), Tensor(np.int32(params.top_k)),
            Tensor(np.float32(params.top_p)), Tensor(np.float32(params.repetition_penalty)))
