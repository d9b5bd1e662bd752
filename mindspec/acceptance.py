"""The accept/reject step as pure functions: the reference the fused graphs are tested against.

Notation (Leviathan et al. 2023; Chen et al. 2023): p = target probabilities, q = draft
probabilities. A step drafts K tokens; the target scores K+1 positions in one call.
"""
import numpy as np


def greedy_accept(target_argmax, drafts):
    """target_argmax: [K+1] int, the target's argmax after each verified position;
    drafts: [K] int. Returns (n_accepted, next_token): next_token is the recovered token at the
    first mismatch, or the bonus token target_argmax[K] when all K drafts are accepted."""
    target_argmax, drafts = np.asarray(target_argmax), np.asarray(drafts)
    K = drafts.shape[0]
    assert target_argmax.shape == (K + 1,), (target_argmax.shape, K)
    match = target_argmax[:K] == drafts
    n = K if match.all() else int(np.argmin(match))
    return n, int(target_argmax[n])
