"""How many tokens to draft per target call: a fixed K, or the K that maximises expected tokens per
unit of time under a measured cost model (DESIGN.md, "Dynamic K").

Costs are in units of one plain target decode call:  c = one draft step,  v[K] = one verify call of
bucket K.  K = 0 means "do not speculate": 1 token for cost 1.
"""
import json
import os
import statistics
import time

from mindspec.graphs.tp import tp_size

from .errors import MindspecError
from .tp import is_rank0

COST_CONTEXT = 64  # positions of context at which costs are measured (a typical mid-request state)


def expected_tokens(alpha, k):
    """E[tokens per target call] = 1 + α + ... + α^K when each draft token is kept with prob. α."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0 - 1e-9:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def step_cost(k, c, v):
    return 1.0 if k == 0 else k * c + v[k]


def rate(alpha, k, c, v):
    """Expected tokens per unit of time (one target decode = 1) of drafting K tokens."""
    return expected_tokens(alpha, k) / step_cost(k, c, v)


def best_k(alpha, c, v, buckets):
    """argmax over {0} ∪ buckets of E(α, K) / (K·c + v[K]); ties go to the smaller (cheaper) K."""
    best, best_rate = 0, 1.0
    for k in sorted(buckets):
        r = rate(alpha, k, c, v)
        if k > 0 and r > best_rate * (1 + 1e-9):
            best, best_rate = k, r
    return best


def stop_early(q_top, threshold):
    """Confidence cut (HF / llama.cpp p-min): stop drafting once the draft's own top probability
    falls below `threshold`; such a token is likely to be rejected and costs a draft step anyway."""
    return threshold is not None and q_top < threshold


class FixedK:
    """Always K (the largest bucket <= min(K, limit) near the end of the budget; 0 if none fits)."""

    def __init__(self, k, buckets=None):
        self.k = int(k)
        self.buckets = tuple(sorted(buckets or (self.k,)))

    def reset(self):
        pass

    def choose(self, limit):
        fit = [b for b in self.buckets if b <= min(self.k, limit)]
        return fit[-1] if fit else 0

    def update(self, k, n_accepted):
        pass


class DynamicK:
    """K from an exponential moving estimate of the per-token acceptance α, per request.

    A step that drafted k and kept n is a run of Bernoulli(α) trials cut at the first rejection:
    n successes and one failure when n < k (none when all k were kept). The geometric MLE pools
    them: α = accepted / (accepted + rejections); both counts decay by `decay` per step, so the
    estimate follows the text (code accepts long runs, prose does not). Averaging n/k per step
    instead would undercount (a full acceptance at k=1 says little, n=0 at k=8 says a lot).
    A rejection lowers α and so K; a full acceptance raises both (best_k is monotone in α).

    Each request starts from the acceptance seen over this policy's past requests (α0 before any),
    so a short request does not spend its first steps re-learning how good the draft is.

    A plain (K=0) step brings no evidence, so the estimate decays toward that prior instead: a few
    unlucky rejections do not switch drafting off for the rest of the request. When even the prior
    makes K=0 best (a useless draft), every `probe_every` plain steps one step drafts the smallest
    bucket to see whether the text became predictable again.
    """

    MIN_SEEN = 8  # draft tokens judged before past acceptance replaces α0 as the prior

    def __init__(self, buckets, c, v, alpha0=0.8, decay=0.7, prior_weight=2.0,
                 probe_every=16):
        self.buckets = tuple(sorted(b for b in buckets if b > 0))
        missing = [b for b in self.buckets if b not in v]
        if missing:
            raise MindspecError(f"no measured verify cost for K buckets {missing}")
        self.c, self.v = float(c), {int(k): float(x) for k, x in v.items()}
        self.alpha0, self.decay, self.prior_weight = alpha0, decay, prior_weight
        self.probe_every = probe_every
        self.seen_acc = self.seen_trials = 0  # over all requests, undecayed
        self.reset()

    def reset(self):
        """Start a new request from the prior (worth `prior_weight` draft tokens): the acceptance
        of past requests once there is enough of it, else α0."""
        self.acc, self.trials = self._prior() * self.prior_weight, self.prior_weight
        self.plain_steps = 0

    def _prior(self):
        return self.seen_acc / self.seen_trials if self.seen_trials >= self.MIN_SEEN else self.alpha0

    @property
    def alpha(self):
        return self.acc / self.trials

    def choose(self, limit):
        fit = [b for b in self.buckets if b <= limit]
        k = best_k(self.alpha, self.c, self.v, fit)
        if k == 0 and fit and self.probe_every and self.plain_steps >= self.probe_every:
            k = fit[0]
        self.plain_steps = self.plain_steps + 1 if k == 0 else 0
        return k

    def update(self, k, n_accepted):
        if k == 0:  # no news: forget toward the prior, as the EMA forgets toward new evidence
            w = (1 - self.decay) * self.prior_weight
            self.acc = self.decay * self.acc + w * self._prior()
            self.trials = self.decay * self.trials + w
            return
        rejected = 1 if n_accepted < k else 0
        self.acc = self.decay * self.acc + n_accepted
        self.trials = self.decay * self.trials + n_accepted + rejected
        self.seen_acc += n_accepted
        self.seen_trials += n_accepted + rejected


# -- cost measurement ------------------------------------------------------------------------------

def _cost_key(pipe):
    st = os.stat(pipe.draft_path)
    return (f"{pipe.ckpt.fingerprint()}|{os.path.abspath(pipe.draft_path)}|{st.st_size}|{st.st_mtime_ns}|"
            f"s{pipe.target.max_seq}|{pipe.device}|tp{tp_size()}")


def _costs_path():
    from .default import home
    return os.path.join(home(), "costs.json")


def _read_costs():
    try:
        with open(_costs_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_costs(key, entry):
    path = _costs_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = _read_costs()  # re-read: another process may have added its own pair meanwhile
    # forget pairs whose draft file is gone (temporary test drafts), so the file stays small
    data = {k: e for k, e in data.items() if len(k.split("|")) > 1 and os.path.exists(k.split("|")[1])}
    data[key] = entry
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)  # readers never see a half-written file


def measure_costs(pipe, reps=5, cache=True):
    """(c, v) measured on rank 0 and shared, so every tensor-parallel rank picks the same K."""
    from .tp import share
    return share(_measure_costs(pipe, reps, cache))


def _measure_costs(pipe, reps=5, cache=True):
    """(c, v): the draft step cost and the verify cost of each K bucket, relative to one target
    decode call, measured on the loaded pipeline at ~COST_CONTEXT positions, median of `reps`.

    Draft and target calls alternate as in the loop (on 2 cores their thread pools interfere: a
    draft step measured alone is cheaper than inside the loop). Cached on disk per (target weights,
    draft file, max_seq, device) in home()/costs.json. Leaves both caches at position 0."""
    if pipe.proposer is None:
        raise MindspecError("measuring the draft/target cost ratio needs a draft")
    if pipe.target is None:
        pipe._capacity(COST_CONTEXT, 1)  # sizes and builds the target as a first request would
    t, s = pipe.target, pipe.proposer.session
    key = _cost_key(pipe)
    hit = _read_costs().get(key) if cache else None
    if hit and all(str(k) in hit["v"] for k in t.buckets):
        return hit["c"], {int(k): x for k, x in hit["v"].items()}
    kmax = max(t.buckets)
    ctx = max(1, min(COST_CONTEXT, t.max_seq - kmax - 2, s.max_seq - 2))
    prompt = [i % t.cfg.vocab_size for i in range(7, 7 + ctx)]  # [ctx]; content does not change the cost
    t.warmup(t.buckets)
    t.rollback(0)
    t.prefill(prompt)
    s.reset()
    s.forward(prompt)
    base_t, base_s = t.pos, s.pos

    def timed(f, rollback, base):
        rollback(base)
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    times = {"draft": [], "decode": [], **{k: [] for k in t.buckets}}
    for _ in range(reps + 1):  # the first round only warms ORT and the graphs' memory
        times["draft"].append(timed(lambda: s.forward([5]), s.rollback, base_s))
        times["decode"].append(timed(lambda: t.decode(5), t.rollback, base_t))
        for k in t.buckets:
            times["draft"].append(timed(lambda: s.forward([5]), s.rollback, base_s))
            times[k].append(timed(lambda: t.verify(5, [6] * k), t.rollback, base_t))
    med = {n: statistics.median(x[1:] if n != "draft" else x[len(t.buckets) + 1:]) for n, x in times.items()}
    t.rollback(0)
    s.reset()
    c = med["draft"] / med["decode"]
    # verifying K+1 tokens costs at least a decode and at least a smaller bucket: on a shared machine
    # a burst of load can make single medians break that, and a v(K) < 1 would make K look free
    v, floor = {}, 1.0
    for k in sorted(t.buckets):
        v[k] = floor = max(floor, med[k] / med["decode"])
    if cache and is_rank0():
        _write_costs(key, {"c": c, "v": {str(k): x for k, x in v.items()}, "decode_s": med["decode"],
                           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    return c, v
