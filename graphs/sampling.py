"""Logits processing, sampling and the accept/reject step inside the target's compiled graphs.

Sampling parameters are per row ([B] Tensors) and randomness comes in as pre-drawn uniforms, so one
compiled graph serves any mix of greedy rows (temperature 0) and sampling rows with any top-k /
top-p / repetition-penalty values, and a seeded request is reproducible. Processing matches
mindspec.sampling.process_logits (HF order and semantics), acceptance matches
mindspec.acceptance.speculative_accept. Token ids and counts leave the graph, and from the sampling
graphs the logprobs of the committed tokens (token_logprobs), never whole distributions.

Top-k/top-p without a full sort (a CPU sort of the vocabulary costs ~20x the rest, and sorting float32
is lossy on Ascend): the thresholds come from the `cap` largest logits (ops.topk) and the softmax
normaliser over the whole vocabulary. That is exact whenever the kept set fits in the candidates
(top_k <= cap, or the candidates hold top_p of the mass), and the graph says per row whether it did;
a row where it did not (a flat distribution: a high temperature, top_p near 1) is redone on the host
from the step's logits, which the graph returns too (graphs/exact.py). A graph variant doing it
inside compiled per shape on first need: 15-40 s with every row waiting, and ~0.1-1 GB each.
"""
import mindspore as ms
from mindspore import ops

from mindspec.spec import TOP_LOGPROBS

from .prims import argmax, full_like, iota, largest, one_hot

NEG = -1e9  # finite "minus infinity": exp() underflows to exactly 0 in float32
BIG = 3e38  # "+infinity" for min-reductions
TOPK_CAP = 2048  # topk costs ~6 ms at 1024-2048 on 5 x 49152 (2 CPU cores), a full sort ~55 ms


def wide(a, x):
    """a (e.g. [B, T, 1]) broadcast to x's shape, for an elementwise op with x. On CPU a broadcasting
    elementwise kernel keeps a workspace of its own, ~4x its output, for the life of the graph: in the
    decoder's layers that adds up (elsewhere the copy costs more time than the memory is worth)."""
    return ops.broadcast_to(a, x.shape)


def _cut(s, x, top_k, top_p):
    """Truncation threshold from s [B, T, C], the C largest logits of x [B, T, V] (descending);
    top_k [B, 1, 1] int32 (0: off), top_p [B, 1, 1]. Returns (cut [B, T, 1]: keep x >= cut,
    exact [B] bool: whether the C candidates sufficed for every position of the row)."""
    B, V, C = x.shape[0], x.shape[-1], s.shape[-1]
    k = top_k + (top_k <= 0).astype(ms.int32) * V  # 0 (off) -> V
    k = ops.minimum(k, V)  # [B, 1, 1]
    kk = ops.broadcast_to(ops.minimum(k, C) - 1, s.shape[:-1] + (1,))  # [B, T, 1]
    kth = ops.gather_elements(s, 2, kk)  # [B, T, 1] the k-th largest
    kth = ops.select(ops.broadcast_to(k >= V, kth.shape), full_like(kth, -BIG), kth)
    m = s[..., :1]
    z = (ops.exp(x - m) * (x >= kth).astype(ms.float32)).sum(-1, keepdims=True)  # mass after top-k
    ps = ops.exp(s - m) * (s >= kth).astype(ms.float32) / z  # [B, T, C] probabilities, descending
    incl = ops.cumsum(ps, -1)
    before = incl - ps  # mass of the tokens ranked before each one: kept when < top_p
    cut_p = ops.select(before < top_p, s, full_like(s, BIG)).min(-1, keepdims=True)
    cut_p = ops.minimum(cut_p, m)  # the most likely token always stays, however small top_p
    cut = ops.select(ops.broadcast_to(top_p < 1, kth.shape), ops.maximum(cut_p, kth), kth)
    # exact: the k-th largest is a candidate, or top-k is off and the candidates hold the top-p set (a k
    # between C and V is not: its k-th largest is no candidate, and z summed the candidates only)
    fits = ops.logical_or(k <= C, ops.logical_and(k >= V, ops.logical_or(top_p >= 1, incl[..., C - 1:] >= top_p)))
    return cut, ops.broadcast_to(fits, kth.shape).reshape(B, -1).all(-1)


def process(x, temperature, top_k, top_p, penalty, seen, cap, counts=None, presence=None, frequency=None):
    """logits x [B, T, V] float32 -> (probabilities [B, T, V], exact [B] bool: the `cap` top-k candidates
    held the row's kept set at every position, see _cut; a greedy row always). Per row: temperature [B]
    (0: greedy, the one-hot argmax of the penalised logits), top_k [B] int32 (0: off), top_p [B], penalty
    [B] (1: off); seen [B, T, V] bool (token already in the sequence at that position); counts [B, T, V]
    float32 (how often the output holds each token there) with presence, frequency [B] (0: off), or None."""
    B, V = x.shape[0], x.shape[-1]
    temperature, penalty = temperature.reshape(B, 1, 1), penalty.reshape(B, 1, 1)
    x = ops.select(seen, ops.select(x > 0, x / penalty, x * penalty), x)
    if counts is not None:  # (OpenAI's, after the repetition penalty as vLLM applies them)
        x = x - frequency.reshape(B, 1, 1) * counts - presence.reshape(B, 1, 1) * (counts > 0).astype(ms.float32)
    hot = (temperature > 0).astype(ms.float32)  # [B, 1, 1]: 1 sampling, 0 greedy
    greedy = one_hot(argmax(x), V)
    # greedy rows divide by 1; not (temperature + 1 - hot): 1 + 1e-8 rounds to 1 in float32, a division by 0
    x = x / (temperature * hot + (1.0 - hot))
    cut, exact = _cut(largest(x, min(cap, V))[0], x, top_k.reshape(B, 1, 1), top_p.reshape(B, 1, 1))
    x = ops.select(x >= cut, x, full_like(x, NEG))
    return ops.softmax(x, -1) * hot + greedy * (1.0 - hot), ops.logical_or(exact, temperature.reshape(B) <= 0)


def token_logprobs(logits, tokens):
    """logits [B, T, V] float32 (the model's, before any processing: vLLM's and OpenAI's logprobs),
    tokens [B, T] int32 -> (logprob of each token [B, T], the TOP_LOGPROBS best (logprobs
    [B, T, N], ids [B, T, N] int32)). One logsumexp and one small top-k per position: computed on
    every sampling call (a separate graph kind would be compiled before a server says ready)."""
    B, T, V = logits.shape
    m = logits.max(-1, keepdims=True)
    lse = m + ops.log(ops.exp(logits - m).sum(-1, keepdims=True))  # [B, T, 1]
    lp = ops.gather_elements(logits, 2, tokens.reshape(B, T, 1)).reshape(B, T) - lse.reshape(B, T)
    top, idx = largest(logits, min(TOP_LOGPROBS, V))
    return lp, top - lse, idx.astype(ms.int32)


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
    return ops.cumsum(ops.concat((seen.reshape(B, 1, V), one_hot(drafts, V)), 1), 1) > 0  # [B, K+1, V]


def output_counts(counts, drafts, V):
    """counts [B, V] float32 (the output's tokens, counted), drafts [B, K] -> [B, K+1, V]: at position i the
    output with drafts[:, :i] (what the presence and frequency penalties look at)."""
    B = drafts.shape[0]
    return ops.cumsum(ops.concat((counts.reshape(B, 1, V), one_hot(drafts, V)), 1), 1)  # [B, K+1, V]


def valid_prefix(flags, n_valid):
    """flags [B, K] int32 (1: accepted), n_valid [B] -> accepted prefix length [B], at most n_valid."""
    K = flags.shape[1]
    within = (iota(K).reshape(1, K) < n_valid.reshape(-1, 1)).astype(ms.int32)
    # in float32, exact for 0s and 1s: MindSpore runs an integer cumprod as int64, which Ascend's CumProd is not
    # documented to take
    return ops.cumprod((flags * within).astype(ms.float32), 1).sum(1).astype(ms.int32)


def greedy_accept(g, ids, n_valid):
    """g [B, K+1] the target's argmax after each fed token, ids [B, K+1] (last token + K drafts),
    n_valid [B] -> (n_accepted [B], next [B]): drafts kept while they equal the argmax (at most
    n_valid of them), then the target's own token (recovered, or bonus after n_valid)."""
    K = ids.shape[1] - 1
    n = valid_prefix((g[:, :K] == ids[:, 1:]).astype(ms.int32), n_valid)
    return n, ops.gather_elements(g, 1, n.reshape(-1, 1)).reshape(-1)


def speculative_accept(p, q, drafts, n_valid, u_acc, u_smp):
    """p [B, K+1, V] target probabilities, q [B, K, V] draft probabilities, drafts [B, K], n_valid [B],
    u_acc [B, K], u_smp [B, K+1] (the sample uniform of each possible stopping point) ->
    (n_accepted [B], next [B]). Draft x_i is kept when u_i * q_i(x) < p_i(x); at the first
    rejection the recovered token comes from norm(max(0, p - q)), after n_valid acceptances the
    bonus from p."""
    B, K1, V = p.shape
    K = K1 - 1
    pick = ops.concat((drafts, ops.zeros((B, 1), ms.int32)), 1).reshape(B, K1, 1)
    px = ops.gather_elements(p, 2, pick).reshape(B, K1)[:, :K]  # [B, K] p_i(x_i)
    qx = ops.gather_elements(q, 2, drafts.reshape(B, K, 1)).reshape(B, K)  # [B, K] q_i(x_i)
    n = valid_prefix((u_acc * qx < px).astype(ms.int32), n_valid)  # [B]
    rows = iota(B)
    pn = ops.gather(p.reshape(B * K1, V), rows * K1 + n, 0)  # [B, V]: p at the first rejection, or after n_valid
    qn = ops.gather(q.reshape(B * K, V), rows * K + ops.minimum(n, K - 1), 0) \
        * (n < n_valid).astype(ms.float32).reshape(B, 1)  # [B, V]: q there; 0 when every valid draft was kept
    r = ops.relu(pn - qn)  # recovered: norm(max(0, p - q)); bonus: r = p
    r = ops.select(ops.broadcast_to(r.sum(-1, keepdims=True) > 0, (B, V)), r, pn)  # degenerate: p
    u = ops.gather_elements(u_smp, 1, n.reshape(-1, 1)).reshape(-1)  # [B]
    return n, sample(r, u)
