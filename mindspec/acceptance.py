"""The accept/reject step as pure functions: the reference the fused graphs are tested against.

Notation (Leviathan et al. 2023; Chen et al. 2023): p = target probabilities, q = draft
probabilities. A step drafts K tokens; the target scores K+1 positions in one call.
"""
import numpy as np

from .sampling import sample


def greedy_accept(target_argmax, drafts, n_valid=None):
    """target_argmax: [K+1] int, the target's argmax after each verified position;
    drafts: [K] int; n_valid: how many drafts count (default K; a row of a batch may have fewer than
    the bucket). Returns (n_accepted, next_token): next_token is the recovered token at the first
    mismatch, or the bonus token target_argmax[n_valid] when all valid drafts are accepted."""
    target_argmax, drafts = np.asarray(target_argmax), np.asarray(drafts)
    K = drafts.shape[0]
    assert target_argmax.shape == (K + 1,), (target_argmax.shape, K)
    n_valid = K if n_valid is None else n_valid
    match = target_argmax[:n_valid] == drafts[:n_valid]
    n = n_valid if match.all() else int(np.argmin(match))
    return n, int(target_argmax[n])


def _pick(a, index, axis):
    """a[..., index, ...] along `axis`, one index per leading position."""
    return np.take_along_axis(a, np.expand_dims(index, axis), axis).squeeze(axis)


def speculative_accept(p, q, drafts, u_accept, u_sample, n_valid=None):
    """Speculative sampling for one step (Leviathan et al. Alg. 1; Chen et al. Alg. 2).

    p: [K+1, V] target probabilities after each verified position (processed: temperature,
    top-k/top-p, repetition penalty); q: [K, V] draft probabilities the drafts were sampled from;
    drafts: [K] int; u_accept: [K] uniforms in [0, 1); u_sample: one uniform for the emitted token.
    Draft x_i is accepted when u_i * q_i(x) < p_i(x), i.e. with probability min(1, p/q) (q(x)=0 < p(x):
    always accepted; p(x)=0: always rejected). At the first rejection the recovered token is drawn from
    norm(max(0, p_i - q_i)) (from p_i if that is all zero); after K acceptances the bonus from p_K.
    n_valid [..] (default K): drafts past it do not count; after n_valid acceptances the bonus comes
    from p at that position. Returns (n_accepted, next_token). Every argument may carry the same
    leading batch dimensions (then both results are int arrays [..]); graphs/sampling.py is this
    function inside the graph."""
    p, q, drafts = np.asarray(p), np.asarray(q), np.asarray(drafts)
    u_accept, u_sample = np.asarray(u_accept), np.asarray(u_sample)
    K = drafts.shape[-1]
    assert p.shape[-2] == K + 1 and q.shape[-2:] == (K, p.shape[-1]) and u_accept.shape == drafts.shape \
        and u_sample.shape == drafts.shape[:-1], (p.shape, q.shape, drafts.shape, u_accept.shape, u_sample.shape)
    n_valid = np.full(drafts.shape[:-1], K) if n_valid is None else np.asarray(n_valid)
    accept = u_accept * _pick(q, drafts, -1) < _pick(p[..., :K, :], drafts, -1)  # [.., K]
    accept &= np.arange(K) < n_valid[..., None]
    n = np.cumprod(accept, -1).sum(-1)  # [..] accepted prefix length
    p_n = _pick(p, n[..., None], -2)  # [.., V] p at the first rejection, or after n_valid acceptances
    q_pad = np.concatenate([q, np.zeros_like(p[..., :1, :])], -2)  # [.., K+1, V]: row K is 0
    q_n = _pick(q_pad, n[..., None], -2) * (n < n_valid)[..., None]  # no q once every valid draft is kept
    residual = np.maximum(p_n - q_n, 0)  # recovered: norm(max(0, p - q)); bonus: p
    residual = np.where(residual.sum(-1, keepdims=True) > 0, residual, p_n)
    nxt = sample(residual, u_sample)
    return (int(n), int(nxt)) if drafts.ndim == 1 else (n, nxt)
