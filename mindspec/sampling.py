"""Sampling parameters and logits processing (numpy), shared by the draft and the target reference.

Hugging Face semantics and order: repetition penalty on the raw logits (seen ids: positive logits
divided, negative multiplied), then temperature, then top-k, then top-p. Truncation is by value:
top-k keeps every token whose logit is >= the k-th largest (ties at the boundary all kept); top-p
keeps the smallest set of most probable tokens whose mass reaches top_p (so always >= 1 token),
i.e. token i is kept when the mass of the tokens ranked before it is < top_p. graphs/sampling.py
computes exactly the same thing inside the target's compiled graph.
"""
import math
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .errors import MindspecError, shown


MAX_TEMPERATURE = 100.0  # above this every distribution is flat to float32 precision
MIN_TEMPERATURE = 1e-5  # below this a temperature is greedy (as vLLM's): logits divided by ~0 overflow
PENALTY_RANGE = (0.01, 100.0)  # a penalty outside divides logits by ~0 or ~inf in float32
MAX_TOP_K = 2 ** 31 - 1  # the graph's int32; any k >= the vocabulary means "off"


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below MIN_TEMPERATURE) = greedy. top_k 0 (or vLLM's -1) / top_p 1.0 /
    repetition_penalty 1.0 = off. The draft uses the same processing with `draft_temperature` (None: the target's): it changes q,
    hence the acceptance rate, never the output distribution. `seed` (None: drawn when the request is made) keys every
    uniform draw (see uniforms). Every value is checked against what the float32 graph represents."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    draft_temperature: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of each token the output holds
    frequency_penalty: float = 0.0  # ... times the number of times it holds it

    def __post_init__(self):
        def number(name, v, lo, hi, lo_open=False):
            # (isfinite of an int too large for a float raises: ints compare exactly without it)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or isinstance(v, (float, np.floating)) and not math.isfinite(v) \
                    or not (lo < v if lo_open else lo <= v) or not v <= hi:
                raise MindspecError(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}], got {shown(v)}")
        number("temperature", self.temperature, 0, MAX_TEMPERATURE)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) \
                or not -1 <= self.top_k <= MAX_TOP_K:
            raise MindspecError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 or -1: off), got {shown(self.top_k)}")
        if self.top_k == -1:  # (vLLM's off, in MindIE's OpenAI examples)
            object.__setattr__(self, "top_k", 0)
        number("top_p", self.top_p, 0, 1, lo_open=True)
        number("repetition_penalty", self.repetition_penalty, *PENALTY_RANGE)
        if self.draft_temperature is not None:
            number("draft_temperature", self.draft_temperature, 0, MAX_TEMPERATURE)
        for name in ("presence_penalty", "frequency_penalty"):
            number(name, getattr(self, name), -2, 2)  # (OpenAI's range)
        for name in ("temperature", "draft_temperature"):
            if 0 < (getattr(self, name) or 0) < MIN_TEMPERATURE:
                object.__setattr__(self, name, 0.0)
        # (the range of PyTorch's manual_seed, as vLLM takes it)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
                                      or not -2 ** 63 <= self.seed < 2 ** 64):
            raise MindspecError(f"seed must be an integer in [-2**63, 2**64), got {shown(self.seed)}")

    @property
    def greedy(self):
        return self.temperature == 0

    @property
    def plain_greedy(self):
        """Greedy without a penalty: the target's argmax graphs suffice."""
        return self.greedy and self.repetition_penalty == 1.0 and not self.penalises_output

    @property
    def penalises_output(self):
        """Whether the presence or frequency penalty changes anything (they need the output's counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def truncates(self):
        """Whether top-k or top-p removes anything."""
        return self.top_k > 0 or self.top_p < 1

    def for_draft(self):
        """The same processing at the draft's temperature (what q is computed with)."""
        t = self.temperature if self.draft_temperature is None else self.draft_temperature
        return replace(self, temperature=t, draft_temperature=None)

    def process(self, logits, prev_ids=None, counts=None):
        return process_logits(logits, self.temperature, self.top_k, self.top_p, self.repetition_penalty, prev_ids,
                              self.presence_penalty, self.frequency_penalty, counts)


DRAFT, ACCEPT, SAMPLE = 0, 1, 2  # the three uniform streams of a position


def uniforms(seed, start, n, stream):
    """[n] float32 uniforms in [0, 1) for sequence positions start..start+n-1 of one stream (DRAFT:
    the draft's sample, ACCEPT: the accept test of the draft token there, SAMPLE: the target's own
    token there). Counter-based (Philox keyed by the request's seed, counter = position): what a position draws
    does not depend on how the steps were cut, on K, or on the other rows of a batch; a draw that was
    computed but not used (past a rejection) is independent of everything committed, so using it
    again later is still fresh randomness."""
    out = np.empty(n, np.float32)
    for i in range(n):
        g = np.random.Generator(np.random.Philox(key=int(seed) % 2 ** 64, counter=[start + i, stream, 0, 0]))
        out[i] = g.random(dtype=np.float32)
    return out


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def process_logits(logits, temperature, top_k=0, top_p=1.0, repetition_penalty=1.0, prev_ids=None,
                   presence_penalty=0.0, frequency_penalty=0.0, counts=None):
    """logits [.., V] -> probabilities [.., V] (float64), as vLLM orders the steps. prev_ids: token ids already
    in the sequence (one list for every row), penalised when repetition_penalty != 1; counts [V]: how often
    each token is in the output so far, for OpenAI's presence and frequency penalties (subtracted from the
    logits). temperature 0: one-hot argmax."""
    x = np.array(logits, dtype=np.float64)  # [.., V]
    V = x.shape[-1]
    if repetition_penalty != 1.0 and prev_ids is not None and len(prev_ids):
        seen = np.zeros(V, bool)
        seen[np.asarray(prev_ids, np.int64)] = True
        x = np.where(seen, np.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
    if counts is not None and (presence_penalty or frequency_penalty):
        c = np.asarray(counts, np.float64)
        x = x - frequency_penalty * c - presence_penalty * (c > 0)
    if temperature == 0:
        onehot = np.zeros_like(x)
        np.put_along_axis(onehot, x.argmax(-1)[..., None], 1.0, -1)
        return onehot
    x = x / temperature
    if 0 < top_k < V:
        kth = -np.sort(-x, -1)[..., top_k - 1:top_k]  # [.., 1] the k-th largest logit
        x = np.where(x >= kth, x, -np.inf)
    if top_p < 1:
        s = -np.sort(-x, -1)  # [.., V] logits, descending
        ps = _softmax(s)
        before = np.cumsum(ps, -1) - ps  # mass of the tokens ranked before each one
        cut = np.where(before < top_p, s, np.inf).min(-1, keepdims=True)  # [.., 1] smallest kept logit
        x = np.where(x >= cut, x, -np.inf)
    return _softmax(x)


def sample(probs, u):
    """Inverse-CDF draw from probs [.., V] (need not be normalised) with uniforms u [..] in [0, 1):
    the first token whose cumulative mass exceeds u * total. The threshold stays below the total,
    so a zero-probability token is never drawn (graphs/sampling.py does the same).
    Returns an int (or an int array [..] for batched input)."""
    probs, u = np.asarray(probs), np.asarray(u)
    assert u.shape == probs.shape[:-1] and ((0 <= u) & (u < 1)).all(), (probs.shape, u)
    cdf = np.cumsum(probs, -1)
    total = cdf[..., -1:]
    thr = np.minimum(u[..., None] * total, total * (1 - 2.0 ** -23))
    n = (cdf <= thr).sum(-1)
    return int(n) if n.ndim == 0 else n


def draft_token(logits, params, prev_ids, u, counts=None):
    """One draft step: logits [V] of the draft -> (token, q [V]) with q processed at the draft's
    temperature (params: the target's SamplingParams; counts: the output's, see process_logits). A greedy
    draft (draft_temperature 0) gives a one-hot q, which is still lossless."""
    q = params.for_draft().process(logits, prev_ids, counts)
    return sample(q, u), q
