"""A Request: one sequence's ids, parameters, limits, stop rules, position and stats (as vLLM's
Request). The engine owns the slots and graphs; everything about one sequence lives here."""
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from .sampling import SamplingParams
from .tokenizer import StreamDecoder

WAITING, PREFILL, RUNNING, FINISHED = "waiting", "prefill", "running", "finished"
RUNS_ONCE = "a request runs once: make one per generation (this one has run)"  # (see Request.ran)
_ids = itertools.count()


@dataclass
class Stats:
    new_tokens: int = 0
    target_calls: int = 0  # steps this request took part in; its prefill counts as one
    drafted: int = 0
    accepted: int = 0
    accepted_at: list = field(default_factory=list)  # [i] = steps whose draft i was accepted
    k_used: dict = field(default_factory=dict)  # K -> steps after prefill (0: plain decode)
    prefill_s: float = 0.0
    draft_s: float = 0.0  # time of the steps this request took part in (shared with their other rows)
    verify_s: float = 0.0
    wall_s: float = 0.0  # from its first prefill chunk to its last token, after the graphs are compiled
    compile_s: float = 0.0  # graph compilation (or compile-cache loading) this request waited for
    queue_s: float = 0.0  # waiting for a free slot
    cached_tokens: int = 0  # prompt tokens whose K/V a finished request left in its slot (prefix caching)

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
                "wall_s": round(self.wall_s, 4), "compile_s": round(self.compile_s, 4),
                "queue_s": round(self.queue_s, 4), "cached_tokens": self.cached_tokens,
                "tokens_per_s": self.new_tokens / self.wall_s if self.wall_s else None}


@dataclass
class Result:
    token_ids: list
    text: str
    stats: dict
    finish_reason: str  # "stop" (EOS, stop string or stop token), "length", "abort" or "error"
    error: str = None  # what failed, with finish_reason "error"
    logprobs: list = None  # with logprobs requested: per token (logprob, [(id, logprob)] of the n best)
    stop_reason: object = None  # with finish_reason "stop", vLLM's: the stop string or stop token id; None: EOS


class Request:
    """prompt_ids [n]; params: SamplingParams (its seed set); max_new_tokens; stop: strings; eos: token
    ids that end the sequence; k: a K bucket, "auto" or None (the engine's); speculate: False runs
    the target alone. `pos` = positions of the target cache this request has filled: after prefill
    the cache holds seq[:-1] (the last token is fed next step), so a rejected draft is rolled back by
    moving this integer."""

    def __init__(self, prompt_ids, params: SamplingParams, max_new_tokens, stop=(), eos=(), k=None,
                 speculate=True, tokenizer=None, draft_min_conf=None, request_id=None):
        self.id = next(_ids) if request_id is None else request_id
        self.prompt_ids, self.params = list(prompt_ids), params
        self.max_new_tokens, self.k, self.speculate = max_new_tokens, k, speculate
        self.stops, self.eos, self.draft_min_conf = [s for s in (stop or []) if s], frozenset(eos), draft_min_conf
        self.min_tokens = 0  # neither EOS nor a stop string ends the request before this many tokens (vLLM's)
        self.stop_tokens = frozenset()  # ids in eos that are the request's own stop tokens (not EOS)
        self.unshown = frozenset()  # ids kept as tokens but left out of the text (EOS under ignore_eos)
        self.stop_reason = None  # the stop string or stop token that ended it
        self.logprobs = None  # n: each token's logprob and its n best alternatives (0..TOP_LOGPROBS)
        self.token_logprobs = []  # per output token, when logprobs is set: (logprob, [(id, logprob)])
        self.output = []  # generated ids
        self.ends = []  # ends[i]: len(text) once output[i] was decoded (per-token text for streams)
        self.state, self.finish_reason, self.cancelled, self.error = WAITING, None, False, None
        self.pos = 0
        self.slot = self.row = None  # the engine's: target cache slot, draft row
        self.draft_read = 0  # the engine's: prompt tokens its draft row holds as read in draft_cut's pieces
        self.policy = None  # the engine's per-request acceptance estimate (dynamic K)
        self.stats = Stats()
        self.added = self.started = time.perf_counter()
        self.first_at = None  # when its first token came (time to the first token: text or not)
        self._stream = StreamDecoder(tokenizer) if tokenizer else None
        self.text, self._shown, self._cut = "", 0, False
        self._pushed = 0  # output tokens when the last one went to the stream decoder (min_tokens at the end)
        self._hold = max((len(s) for s in self.stops), default=1) - 1  # never stream a half-seen stop string

    @property
    def seq(self):
        return self.prompt_ids + self.output

    @property
    def ran(self):
        """Whether an engine has taken it: a request runs once (run again, it went on after its old output)."""
        return self.state != WAITING or bool(self.output) or bool(self.pos)

    @property
    def graph_kind(self):
        """The decode graph this request's steps need: "greedy" (the target's argmax), "sample" (a sampled row,
        a repetition penalty or logprobs) or "penal" (presence/frequency penalties: the output's counts are an
        input, and they are never absent after the prompt). A step runs its most demanding row's kind
        (greedy < sample < penal), so the graphs of a set of requests are their kinds' alone."""
        p = self.params
        return "penal" if p.penalises_output else "greedy" if p.plain_greedy and self.logprobs is None else "sample"

    def output_counts(self, V):
        """[V]: how often the output holds each token (the presence and frequency penalties')."""
        return np.bincount(np.asarray(self.output, np.int64), minlength=V)[:V]

    @property
    def done(self):
        return self.state == FINISHED

    def commit(self, tokens, logprobs=None):
        """Append the tokens a step committed (1..K+1), stopping at EOS, a stop string or
        max_new_tokens (the last step may overshoot: the surplus is dropped); logprobs: one entry per
        token (see token_logprobs). Returns the text that can be streamed now."""
        self.first_at = self.first_at or time.perf_counter()
        for i, tok in enumerate(tokens[:self.max_new_tokens - len(self.output)]):
            self.output.append(int(tok))
            if logprobs is not None:
                self.token_logprobs.append(logprobs[i])
            self.ends.append(len(self.text))
            early = len(self.output) <= self.min_tokens
            if tok in self.eos:
                if not early:
                    self.stop_reason = int(tok) if tok in self.stop_tokens else None
                    return self.finish("stop")
                continue  # too early to end: kept as a token, left out of the text
            if tok in self.unshown:
                continue
            if self._stream is not None:
                was, self.text = len(self.text), self.text + self._stream.push([int(tok)])
                self.ends[-1], self._pushed = len(self.text), len(self.output)
                if not early and self._cut_at_stop(was):
                    return self.finish("stop")
        if len(self.output) >= self.max_new_tokens:
            return self.finish("length")
        return self._delta(self._hold)

    def _cut_at_stop(self, was):
        """Cut the text before the first stop string that ends past its first `was` characters."""
        found = [(i, s) for s in self.stops if (i := self.text.find(s, max(was - len(s) + 1, 0))) >= 0]
        hit, stop = min(found, key=lambda f: f[0], default=(-1, None))  # (stop: the stop_reason)
        if hit >= 0:
            self.text, self._cut, self.stop_reason = self.text[:hit], True, stop
        return hit >= 0

    def finish(self, reason):
        """End the request (reason "stop", "length", "abort" or "error"); returns the text not yet streamed.
        The text the stream decoder held (a character's first bytes, and what came before them in the
        same token) is searched for stop strings too."""
        if self.state != FINISHED:
            self.state, self.finish_reason = FINISHED, reason
            if self._stream is not None and not self._cut:
                was, self.text = len(self.text), self.text + self._stream.flush()
                if self._pushed > self.min_tokens and self._cut_at_stop(was) and reason == "length":
                    self.finish_reason = "stop"
        return self._delta(0)

    def _delta(self, hold):
        end = len(self.text) - hold
        if end <= self._shown:
            return ""
        out, self._shown = self.text[self._shown:end], end
        return out

    def result(self):
        self.stats.new_tokens = len(self.output)
        return Result(list(self.output), self.text, self.stats.as_dict(), self.finish_reason or "length",
                      None if self.error is None else f"{type(self.error).__name__}: {self.error}",
                      list(self.token_logprobs) if self.logprobs is not None else None,
                      self.stop_reason if self.finish_reason == "stop" else None)

