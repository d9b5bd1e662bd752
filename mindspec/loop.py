"""The speculative decoding loop, shared by generate, serve and batch."""
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Stats:
    new_tokens: int = 0
    target_calls: int = 0  # prefill counts as one: it produces the first token
    drafted: int = 0
    accepted: int = 0
    accepted_at: list = field(default_factory=list)  # [i] = steps whose draft i was accepted
    k_used: dict = field(default_factory=dict)  # K -> target calls after prefill (0: plain decode)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0  # prefill + decoding, after the graphs are compiled
    compile_s: float = 0.0  # graph compilation (or compile-cache loading) this request caused

    def record(self, k, n_accepted):
        self.drafted += k
        self.accepted += n_accepted
        self.k_used[k] = self.k_used.get(k, 0) + 1
        self.accepted_at += [0] * (k - len(self.accepted_at))
        for i in range(n_accepted):
            self.accepted_at[i] += 1

    def as_dict(self):
        return {"new_tokens": self.new_tokens, "target_calls": self.target_calls,
                "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                "tokens_per_target_call": self.new_tokens / max(self.target_calls, 1),
                "accepted_at": self.accepted_at, "k_used": {str(k): v for k, v in sorted(self.k_used.items())},
                "prefill_s": round(self.prefill_s, 4), "draft_s": round(self.draft_s, 4),
                "verify_s": round(self.verify_s, 4),
                "other_s": round(max(self.wall_s - self.prefill_s - self.draft_s - self.verify_s, 0.0), 4),
                "wall_s": round(self.wall_s, 4),
                "compile_s": round(self.compile_s, 4),
                "tokens_per_s": self.new_tokens / self.wall_s if self.wall_s else None}


def decode(target, proposer, prompt_ids, max_new_tokens, policy, stats, params=None):
    """Yield the tokens committed by each target call (1..K+1 of them) until max_new_tokens or the
    cache is full; the caller stops early on EOS / stop strings by closing the generator.
    `policy` (mindspec.policy FixedK / DynamicK) picks K per step: choose(limit), update(k, n).
    `params` (SamplingParams) switches to speculative sampling; its seeded generator draws every
    uniform, so a seeded run with the same K schedule gives the same text.

    Invariant: the target cache holds seq[:-1] (target.pos == len(seq) - 1), so a rejected draft
    is rolled back by moving that integer, never by copying."""
    seq, n_prompt = list(prompt_ids), len(prompt_ids)
    target.rollback(0)  # a new request reuses the cache from position 0
    rng = params.rng() if params is not None else None
    u = lambda n=None: rng.random(n, dtype=np.float32)  # noqa: E731
    t = time.perf_counter()
    seq.append(target.prefill_sample(seq, params, u()) if rng else target.prefill(seq))
    stats.prefill_s += time.perf_counter() - t
    stats.target_calls += 1
    yield seq[-1:]
    if proposer is not None:
        proposer.reset()
        policy.reset()
    while len(seq) - n_prompt < max_new_tokens and target.pos < target.max_seq:
        # near max_new_tokens the caller drops the surplus: cheaper than compiling a smaller bucket
        kk = policy.choose(target.max_seq - target.pos - 1) if proposer else 0
        t0 = time.perf_counter()
        if kk:
            if rng:
                drafts, q = proposer.get_candidates(seq, kk, params, rng)  # [K], [K, V]
            else:
                drafts = proposer.get_candidates(seq, kk)  # [K]
            if len(drafts) < kk:  # the confidence cut stopped early: verify the largest bucket that fits
                kk = max((b for b in target.buckets if b <= len(drafts)), default=0)
                drafts, q = drafts[:kk], q[:kk] if rng else None
            t1 = time.perf_counter()
            stats.draft_s += t1 - t0
            t0 = t1
        if kk == 0:
            new = [target.decode_sample(seq[-1], params, u(), prev_ids=seq) if rng else target.decode(seq[-1])]
            stats.record(0, 0)
            if proposer:
                policy.update(0, 0)
                proposer.update_candidate_strategy(seq + new, 0)  # a cut to 0 drafts ran the draft ahead
        else:
            if rng:
                n, nxt = target.verify_sample(seq[-1], drafts, q, u(kk + 1), params, prev_ids=seq)
            else:
                n, nxt = target.verify(seq[-1], drafts)
            new = drafts[:n] + [nxt]
            stats.record(kk, n)
            policy.update(kk, n)
            proposer.update_candidate_strategy(seq + new, n)
        stats.verify_s += time.perf_counter() - t0
        stats.target_calls += 1
        seq += new
        yield new
