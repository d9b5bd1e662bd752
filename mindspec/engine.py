"""The engine: continuous batching of speculative decoding over KV-cache slots.

add(request) queues a request; step() admits waiting requests into free slots, runs one prompt
chunk of every prefilling request in one call (so a long prompt never stalls the running rows for
more than a chunk, and requests arriving together prefill together), then one draft + one verify
call over every running row — unless a prompt ended in that chunk (and the step before decoded): its
first token streams at once, and its row joins the next step's decode; abort(id) ends a request at the
next step. The front ends (generate, serve, batch) only add, read and abort requests: this is the one
loop they share.

Rows: the active requests in order; row i uses row i of the draft's cache (rows stay contiguous: a
leaving row is replaced by the last one) and its own target cache slot. Ragged acceptance is just
different position moves per row.

Prefix caching: a freed slot keeps the K/V of the tokens its last request fed. A new request takes
the free slot whose tokens share the longest prefix with its prompt and starts its prefill after
them (at least its last prompt token is fed again: its logits give the first token). Chat requests
share their system turn, batch jobs their instructions. The draft (host cache) parks a finished
row's cache among its spare rows, and a new row starts from the spare one sharing the longest prefix
with its prompt (a sampled request: up to a multiple of PREFILL_CHUNK, as the draft reads its prompt
in the same pieces whatever was cached: draft_cut); it feeds the rest, at most DRAFT_CATCHUP tokens a
row per step, so a long uncached prompt never stalls the running rows: the new row waits for its
draft instead. A dynamic-K row admitted where the policy would not draft for it, or where feeding its
draft the prompt would not pay back over the tokens it may commit, skips its draft; should that start
to pay (a smaller batch), it catches up the same way. Anything else that runs the target graphs
(warm-up, cost measurement) writes into slots: the engine then forgets what they held.
"""
import time
from collections import deque

import numpy as np

from .errors import MindspecError, NotFinite
from .policy import fit
from .sampling import ACCEPT, SAMPLE, uniforms
from .sequence import FINISHED, PREFILL, RUNNING, RUNS_ONCE, WAITING
from .spec import DRAFT_CATCHUP, PREFILL_CHUNK
from .tp import same_on_every_rank


class Engine:
    def __init__(self, target, proposer, spec, dynamic=None, prefix_cache=True):
        """target: graphs.runner.TargetModel; proposer: DraftProposer or None (target only); spec:
        SpecConfig; dynamic: policy.DynamicK for requests with k="auto" (None: measured later);
        prefix_cache: reuse a free slot's cached prompt prefix (see the module's docstring)."""
        self.target, self.proposer, self.spec, self.dynamic = target, proposer, spec, dynamic
        self.prefix_cache = prefix_cache
        self._empty()
        self.writes = target.writes  # the target's graph runs when this engine last ran one
        self.decodes = 0  # draft + verify calls that worked (a server's health: serve.App._account)

    def _empty(self):
        """No request, every slot free, nothing cached."""
        self.waiting, self.rows = deque(), []
        self._ended_early = False  # the last step ended at first tokens, before its decode (see step)
        self.free_slots = list(range(self.target.max_batch))  # least recently freed first
        self.cached = {}  # free slot -> the tokens its K/V positions hold
        self.parked = {}  # spare draft row -> the tokens its cache holds (a prefix: see proposer.cached)

    @property
    def has_work(self):
        return bool(self.waiting or self.rows)

    def add(self, req, arrived=None):
        """Queue req; arrived: when it reached the caller (a server's), its queue_s counted from then. A request
        held already, or one that has run, is refused (a user probe's: added twice, it ran as two rows of one
        request, both in prefill for ever)."""
        if any(r is req for r in list(self.waiting) + self.rows):
            raise MindspecError("the engine holds this request already: make one per generation")
        if req.ran:
            raise MindspecError(RUNS_ONCE)
        req.state, req.added = WAITING, time.perf_counter() if arrived is None else arrived
        self.waiting.append(req)

    def abort(self, req_id):
        """End a request at the next step (a client went away); unknown or finished ids are ignored."""
        for r in list(self.waiting) + self.rows:
            if r.id == req_id:
                r.cancelled = True

    def step(self):
        """One engine step: waiting requests are admitted and every prefilling row reads a prompt chunk, then
        the draft catches up and one draft + verify call runs over the running rows. A step whose chunks gave
        first tokens ends before the decode, so that they stream at once, unless the step before ended so
        too: a new row joins the next decode, and a decode waits for at most one prompt call. Returns
        [(request, text)] for every request that committed tokens or ended (text: what can be streamed now;
        request.done tells whether it ended)."""
        events = {}
        try:
            self._reap(events)
            self._admit()
            pre = [r for r in self.rows if r.state == PREFILL]
            fed = [r for r in pre if r.pos < len(r.prompt_ids)]  # rows whose target still has prompt to read
            if fed:
                self._guard(fed, events, lambda: self._prefill_chunk(fed, pre, events))
            first = any(r in events and r.error is None for r in pre)  # (a failed prompt call gave none)
            self._ended_early = first and not self._ended_early
            if not self._ended_early:
                pre = [r for r in self.rows if r.state == PREFILL]
                if pre:
                    self._catch_up(pre, events)
                running = [r for r in self.rows if r.state == RUNNING]
                if running and self._guard(running, events, lambda: self._decode(running, events)):
                    self.decodes += 1
            self._release()
        except Exception as e:  # noqa: BLE001 - bookkeeping between the calls failed: see _restart
            self._restart(e, events)
        self.writes = self.target.writes
        return list(events.items())

    def _restart(self, e, events):
        """After a failure outside the graph calls (which _guard keeps to their rows) the rows' state is
        unknown: every request ends with the error and the engine starts again from empty slots and rows."""
        _fail(list(self.waiting) + self.rows, e, events)
        self.reset()

    def reset(self):
        """No request, nothing cached, the draft's rows empty (after a failure, or a caller that left
        between two graph calls)."""
        self._empty()
        if self.proposer is not None:
            self.proposer.reset()

    # ---- scheduling

    def _reap(self, events):
        for r in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(r)
            events[r] = r.finish("abort")
        for r in self.rows:
            if r.cancelled and r.state != FINISHED:
                events[r] = r.finish("abort")
        self._release()

    def _admit(self):
        """Waiting requests enter prefill while slots are free (and the graphs of a batch that size are
        compiled: a warm server loads the larger batches' while it serves)."""
        if self.target.writes != self.writes:  # graphs ran outside the engine: slots hold their dummy K/V
            self.cached.clear()
            self.parked.clear()  # (cost measurement also resets the draft's rows)
        while self.waiting and self.free_slots and len(self.rows) < self.target.ready_rows():
            r = self.waiting.popleft()
            r.row, r.state = len(self.rows), PREFILL
            self.rows.append(r)  # (first: a failure below ends it with the others, _restart)
            r.slot, r.pos = self._slot_for(r.prompt_ids)
            r.stats.cached_tokens = r.pos
            if self.proposer is not None:
                self._draft_row_for(r)
            r.stats.queue_s = time.perf_counter() - r.added
            r.started = time.perf_counter()
            if r.k == "auto" and self.dynamic is not None:
                r.policy = self.dynamic.start()

    def _slot_for(self, prompt):
        """(a free slot, prompt tokens its cache already holds): the slot sharing the longest prefix
        with `prompt`, the least recently freed of those (what the others hold stays cached longest);
        the last prompt token always goes through prefill again."""
        slot, hit = self.free_slots[0], 0
        if self.prefix_cache:
            for s in self.free_slots:
                n = common_prefix(self.cached.get(s, ()), prompt)
                if n > hit:
                    slot, hit = s, n
        self.free_slots.remove(slot)
        self.cached.pop(slot, None)
        return slot, min(hit, len(prompt) - 1)

    def _draft_row_for(self, r):
        """Give new request r (row r.row) the parked draft row sharing the longest prefix with its
        prompt (the draft needs no logits from its prompt: all of it may come from there)."""
        best, hit = r.row, 0
        if self.prefix_cache:
            for j, (toks, aligned) in self.parked.items():  # aligned: the prompt row j read in draft_cut's pieces
                n = min(common_prefix(toks, r.prompt_ids), self.proposer.cached(j))
                if not r.params.greedy:  # only the pieces a fresh feed would read too
                    n = min(n, aligned)
                    n = n if n == aligned == len(r.prompt_ids) else draft_cut(n)
                if n > hit:
                    best, hit = j, n
        self.proposer.adopt(r.row, best, hit)
        r.draft_read = hit  # (a sampled row's hit: draft_cut's pieces)
        self.parked.pop(best, None)
        if r.row in self.parked:  # what row r.row held moved to `best`
            self.parked[best] = self.parked.pop(r.row)

    def _release(self):
        """Free the slots of finished rows; the last row moves into each freed row. A slot keeps the
        tokens whose K/V its positions hold: seq[:pos] (the last committed token was never fed), but not
        max_seq - 1, where padding rows of a batch bucket write, nor anything after a failed call."""
        for r in sorted((r for r in self.rows if r.state == FINISHED), key=lambda r: -r.row):
            last = len(self.rows) - 1
            if self.proposer is not None:
                keep = self.prefix_cache and r.finish_reason != "error" and self.proposer.keeps_rows
                self.proposer.release(r.row, last, keep)
                if keep:
                    self.parked[last] = r.seq[:self.proposer.cached(last)], 0 if r.params.greedy else r.draft_read
            moved = self.rows.pop()
            if moved is not r:
                self.rows[r.row], moved.row = moved, r.row
            self.free_slots.append(r.slot)
            if r.finish_reason != "error":
                self.cached[r.slot] = r.seq[:min(r.pos, self.target.max_seq - 1)]
            r.stats.wall_s = time.perf_counter() - r.started

    def _guard(self, reqs, events, fn):
        """A failing call (a graph error) ends the requests it carried, with the error; the engine
        and the other requests go on. Returns whether the call worked."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported to those requests' callers
            _fail(reqs, e, events)
            return False
        return True

    # ---- the work of a step

    def _prefill_chunk(self, fed, pre, events):
        """The next prompt chunk of each row in fed, in one call; a row whose prompt ends here gets its
        first token (the call's time is counted in the prefill_s of every prefilling row: pre)."""
        t0 = time.perf_counter()
        chunks = [r.prompt_ids[r.pos:r.pos + PREFILL_CHUNK] for r in fed]
        want_lp = any(r.logprobs is not None for r in fed)
        out = self.target.prefill([r.slot for r in fed], [r.pos for r in fed], chunks,
                                  self._sampling(fed, 0, prefill=True), logprobs=want_lp)
        toks, lps = out if want_lp else (out, None)
        for i, (r, chunk) in enumerate(zip(fed, chunks)):
            r.pos += len(chunk)
            if toks[i] < 0:  # (any chunk's: its K/V stay for what follows)
                self._not_finite(r, f"in prompt positions {r.pos - len(chunk)}-{r.pos - 1}", events)
                continue
            if r.pos == len(r.prompt_ids):  # the last chunk: its token is the first one generated
                r.stats.target_calls += 1
                lp = [lps.at(i, 0, r.logprobs)] if r.logprobs is not None else None
                events[r] = events.get(r, "") + r.commit([int(toks[i])], lp)
        for r in pre:
            r.stats.prefill_s += time.perf_counter() - t0

    def _catch_up(self, pre, events):
        """The draft's catch-up on the prompts of prefilling rows, from its own position up to the target's (at
        most DRAFT_CATCHUP tokens a row); a row whose target and draft both hold its prompt starts running."""
        t0 = time.perf_counter()
        may_draft = self._may_draft()
        if self.proposer is not None:
            catch, aligned = {}, set()
            for r in (r for r in pre if r.speculate and may_draft(r)):
                d = self.proposer.cached(r.row)
                stop = min(r.pos, d + DRAFT_CATCHUP)
                if not r.params.greedy:
                    stop = draft_cut(stop, len(r.prompt_ids))
                    aligned.add(r.row)
                if stop > d:
                    catch[r.row] = r.prompt_ids[d:stop]
            if catch:  # (a guard over no row would swallow an error unsaid)
                self._guard([r for r in pre if r.row in catch], events,
                            lambda: _on_every_rank("a prompt's catch-up", self.proposer.prefill, catch, aligned))
            for r in (r for r in pre if r.row in aligned):  # (a prompt its draft skips is read later, in other pieces)
                r.draft_read = self.proposer.cached(r.row)
        for r in pre:
            r.stats.prefill_s += time.perf_counter() - t0
            drafted_up = not r.speculate or self.proposer is None or self.proposer.cached(r.row) >= r.pos \
                or not may_draft(r)
            if r.state == PREFILL and r.pos == len(r.prompt_ids) and drafted_up:
                r.state = RUNNING

    def _decode(self, running, events):
        """One draft + verify call over the running rows (K = 0: a plain decode call)."""
        t0 = time.perf_counter()
        # drafts that still fit the caches (the target's; the draft's may be shorter), and that the row may
        # still commit (a step commits up to K + 1)
        room = self.target.max_seq if self.proposer is None else min(self.target.max_seq, self.proposer.max_seq)
        caps = [min(room - r.pos, r.max_new_tokens - len(r.output)) - 1 for r in running]
        n_valid = self._choose(running, caps)
        want_lp = any(r.logprobs is not None for r in running)  # only the sampling graph has whole logits
        need_q = any(r.graph_kind != "greedy" for r in running)  # (a sampling graph's step: it takes q)
        try:
            drafts, q, n_valid = self._propose(running, n_valid, need_q)
            failed = None
        except Exception as e:  # noqa: BLE001 - raised below, once every rank has heard (under TP)
            drafts, q, failed = np.zeros((len(running), 0), np.int64), None, e
        K = drafts.shape[1]
        t1 = time.perf_counter()
        ids = np.concatenate([np.array([[r.seq[-1]] for r in running]), drafts], 1)  # [n, K+1]
        slots, pos = [r.slot for r in running], [r.pos for r in running]
        same_on_every_rank("the tokens to verify", ids, slots, pos, n_valid, failed=failed)  # (under TP)
        s = self._sampling(running, K, q=q) if need_q else None
        acc, nxt, *lps = self.target.step(ids, slots, pos, n_valid, s, logprobs=want_lp)
        t2 = time.perf_counter()
        for i, r in enumerate(running):
            n = int(acc[i])
            r.pos += 1 + n
            r.stats.target_calls += 1
            r.stats.record(n_valid[i], n)
            r.stats.draft_s += t1 - t0
            r.stats.verify_s += t2 - t1
            if r.policy is not None:
                self.dynamic.update(r.policy, n_valid[i], n)
            if nxt[i] < 0:
                self._not_finite(r, f"at position {len(r.seq) + n}", events)
                continue
            lp = [lps[0].at(i, t, r.logprobs) for t in range(n + 1)] if r.logprobs is not None else None
            events[r] = events.get(r, "") + r.commit([int(t) for t in drafts[i, :n]] + [int(nxt[i])], lp)
            if self.proposer is not None and r.speculate:
                self.proposer.update_candidate_strategy(r.row, r)
            if not r.done and r.pos >= self.target.max_seq:
                events[r] += r.finish("length")  # the cache is full

    def _propose(self, running, n_valid, need_q):
        """The draft's proposals for the running rows, each up to its n_valid [n]: (drafts [n, K] int64, q [n, K,
        V] float32 or None, n_valid [n], lowered by confidence cuts and for rows that catch up first); K the
        smallest bucket that holds them (0: a plain decode)."""
        K = max(n_valid) if self.proposer is not None else 0
        if K:
            # a drafting row whose draft fell far behind (a skipped prompt whose catch-up now pays) sits this
            # step out and catches up, at most DRAFT_CATCHUP tokens a step, as a new row does
            lag = {r.row: r.seq[self.proposer.cached(r.row):] for r, n in zip(running, n_valid) if n}
            behind = {row: toks[:DRAFT_CATCHUP] for row, toks in lag.items() if len(toks) > DRAFT_CATCHUP}
            self.proposer.prefill(behind)
            n_valid = [0 if r.row in behind else n for r, n in zip(running, n_valid)]
            K = max(n_valid)
        drafts = np.zeros((len(running), K), np.int64)
        q = None
        if K:
            who, counts = [None] * len(self.rows), [0] * len(self.rows)
            for r, n in zip(running, n_valid):
                who[r.row], counts[r.row] = (r, n) if n else (None, 0)
            drafting = [r for r in running if who[r.row] is not None]
            d, dq, made = self.proposer.get_candidates(who, counts, need_q)
            q = np.zeros((len(running), K, self.proposer.vocab_size), np.float32) if need_q else None
            for j, r in enumerate(drafting):
                i = running.index(r)
                drafts[i] = d[j]
                n_valid[i] = int(made[j])  # (fewer after a confidence cut)
                if need_q:
                    q[i] = dq[j]
            # after confidence cuts: verify the smallest bucket that holds what is left (none: a plain decode)
            K = next((b for b in self.target.k_buckets if b >= max(n_valid)), K) if max(n_valid) else 0
            drafts, q = drafts[:, :K], (q[:, :K] if q is not None and K else None)
        return drafts, q, n_valid

    def _not_finite(self, r, where, events):
        """End r: the target's activations `where` (at a position, in prompt positions) are not finite (found:
        a float16 model whose activations overflow generated token 0 for ever, as the argmax of NaN)."""
        dtype = self.target.dtype
        fix = " (run it in float32: --dtype float32)" if dtype != "float32" else ""
        _fail([r], NotFinite(f"the target's activations are not finite {where}: they leave {dtype}'s range{fix}"),
              events)

    def _may_draft(self):
        """request -> whether its draft may be fed its prompt now: not when it takes dynamic K and the policy
        would not draft for it at the current batch, or its prompt's catch-up would not pay back over the
        tokens it may commit (DynamicK.feeds_new_row). Then the draft catches up later if drafting starts
        to pay for it (a smaller batch, a probe; see _choose)."""
        n, B = len(self.rows), self.spec.batch_bucket(len(self.rows))
        if self.dynamic is None:
            return lambda r: True
        return lambda r: r.k != "auto" or self.dynamic.feeds_new_row(
            B, n, len(r.prompt_ids) - self.proposer.cached(r.row), r.max_new_tokens)

    def _choose(self, running, caps):
        """Each row's valid drafts this step: fixed-K rows their K, auto rows the K the dynamic policy
        picks for the whole batch, target-only rows 0; each capped to the largest bucket that fits. An
        auto row whose draft fell behind (plain steps, a skipped prompt) sits out unless feeding it what
        it missed pays back (DynamicK.catch_ups_pay)."""
        if self.proposer is None:
            return [0] * len(running)
        caps = list(caps)
        auto = [i for i, r in enumerate(running) if r.speculate and r.k == "auto"]
        k_auto = 0
        if auto:
            B, rows = self.spec.batch_bucket(len(running)), [running[i] for i in auto]
            # per row: what its draft missed beyond a step's usual one or two tokens, tokens it may still commit
            behind = [(max(0, len(r.seq) - self.proposer.cached(r.row) - 2), r.max_new_tokens - len(r.output))
                      for r in rows]
            pays = self.dynamic.catch_ups_pay(B, [r.policy.alpha for r in rows], [caps[i] for i in auto], behind)
            for i, ok in zip(auto, pays):
                caps[i] = caps[i] if ok else 0  # sits out: no drafts, nothing fed
            k_auto = self.dynamic.choose([r.policy for r in rows], [caps[i] for i in auto], B)
        want = [0 if not r.speculate else (k_auto if r.k == "auto" else r.k) for r in running]
        return [fit(self.target.k_buckets, min(w, c)) for w, c in zip(want, caps)]

    def _sampling(self, rows, K, q=None, prefill=False):
        """RowSampling for rows at a step of K drafts (prefill: the first token after the prompt).
        Uniforms are keyed by each row's seed and the sequence positions they decide."""
        from mindspec.graphs.runner import RowSampling
        p = [r.params for r in rows]
        seeds = [x.seed or 0 for x in p]  # plain greedy rows draw nothing that matters
        start = [len(r.prompt_ids) if prefill else len(r.seq) for r in rows]
        seen = counts = None
        V = self.target.cfg.vocab_size
        if any(x.repetition_penalty != 1.0 for x in p):
            seen = np.zeros((len(rows), V), np.float32)
            for i, r in enumerate(rows):
                seen[i, r.seq] = 1.0
        if not prefill and any(x.penalises_output for x in p):  # (a prompt's first token: no output yet)
            counts = np.stack([r.output_counts(V) for r in rows]).astype(np.float32)
        return RowSampling(
            temperature=np.array([x.temperature for x in p], np.float32),
            top_k=np.array([x.top_k for x in p], np.int64), top_p=np.array([x.top_p for x in p], np.float32),
            penalty=np.array([x.repetition_penalty for x in p], np.float32),
            u_acc=np.stack([uniforms(sd, st, max(K, 1), ACCEPT) for sd, st in zip(seeds, start)]),
            u_smp=np.stack([uniforms(sd, st, K + 1, SAMPLE) for sd, st in zip(seeds, start)]),
            seen=seen, q=q, counts=counts, presence=np.array([x.presence_penalty for x in p], np.float32),
            frequency=np.array([x.frequency_penalty for x in p], np.float32))


def _on_every_rank(what, fn, *args):
    """fn(*args), a failure of it raised on every tensor-parallel rank (one AllReduce under TP): one rank alone
    ending its requests would skip the collectives the others then wait in."""
    try:
        fn(*args)
        failed = None
    except Exception as e:  # noqa: BLE001 - raised once every rank has heard
        failed = e
    same_on_every_rank(what, failed=failed)


def _fail(reqs, e, events):
    """End the unfinished requests of reqs with error e (one the call had already finished keeps its result)."""
    for r in reqs:
        if not r.done:
            r.error = e
            events[r] = events.get(r, "") + r.finish("error")


def draft_cut(n, end=None):
    """Where a sampled row's draft may stop reading its prompt, at most n: a multiple of PREFILL_CHUNK
    or the prompt's end. Its calls (DraftSession.feed) are cut at those multiples too, so a sampled
    prompt is read in the same pieces whatever the target's cache or a parked row held: the q8 draft's
    logits depend on how tokens were cut into calls, and a seeded text follows them (a greedy row's
    tokens are the target's whatever the draft computes: its prompt is read in the fewest calls)."""
    return n if n == end else n // PREFILL_CHUNK * PREFILL_CHUNK


def common_prefix(a, b):
    """How many leading tokens the id lists a and b share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n
