"""Draft proposers. The interface has two methods (as transformers' CandidateGenerator),
get_candidates and update_candidate_strategy, so other proposers (n-gram / prompt lookup) can plug
into the same engine; prefill / release keep a stateful draft's cache in step with the engine's rows."""
import numpy as np

from .policy import stop_early
from .sampling import DRAFT, draft_token, uniforms


class DraftProposer:
    """K-token proposals for a batch of rows from an ONNX draft (mindspec.export.DraftSession, one
    cache row per engine row).

    A row's draft cache holds seq[:pos]. After a step where all K drafts were accepted, the draft has
    never seen its own last draft token, and after plain (K = 0) steps it is further behind: the
    next call feeds every token it has not seen, never losing one nor counting one twice."""

    def __init__(self, session):
        self.session = session
        self.vocab_size = session.vocab_size

    def prefill(self, chunks, aligned=()):
        """Feed prompt tokens to rows' caches: chunks {row: ids} (their logits are not needed: drafting
        starts later); `aligned` rows in calls cut at multiples of the prefill chunk (DraftSession.feed)."""
        if chunks:
            self.session.feed(chunks, aligned)

    def cached(self, row):
        """Tokens of row's sequence the draft's cache holds."""
        return int(self.session.pos[row])

    @property
    def max_seq(self):
        """Positions a row's draft cache holds."""
        return self.session.max_seq

    def get_candidates(self, rows, counts, need_q):
        """rows: the engine's rows in row order, a Request or None (takes no part); counts: the drafts
        each row may make (0 for None), k = max(counts). Greedy rows take the argmax, sampling rows sample
        from q, the draft's distribution processed as the target's (SamplingParams.for_draft) with the
        row's own DRAFT uniforms. A row stops at its count (what the target can verify of it: its cache's
        room, its tokens left; so a row near the draft cache's end never writes past it) or before its
        first draft under its confidence cut, or where its logits are not finite (a float16 draft past its
        range: its q would be NaN, its tokens rejected). Returns (drafts [n, k] int64, q [n, k, V] float32 or None,
        made [n] int: the drafts each row made, zeros past them), n = the Request rows, in order."""
        live = [i for i, r in enumerate(rows) if r is not None]
        m, V, k = len(rows), self.vocab_size, max(counts)
        made = np.array([counts[i] for i in live], np.int64)  # [n]: lowered by a confidence cut
        feed = [r.seq[int(self.session.pos[i]):] if r is not None else [] for i, r in enumerate(rows)]
        # a sampled row's tokens are cut into calls as alone (its draws follow the draft's logits)
        logits = self.session.forward(feed, alone=[i for i in live if not rows[i].params.greedy])[live]  # [n, V]
        drafts = np.zeros((len(live), k), np.int64)
        q = np.zeros((len(live), k, V), np.float32) if need_q else None
        for i in range(k):
            for j, row in enumerate(live):
                if i >= made[j]:
                    continue
                r = rows[row]
                if not np.isfinite(logits[j]).all():
                    made[j] = i
                    continue
                tok, q_i = self._one(r, logits[j], i, drafts[j, :i], need_q)
                if r.draft_min_conf is not None and stop_early(_confidence(r.params, logits[j], q_i),
                                                               r.draft_min_conf):
                    made[j] = i  # the row drafts no further
                    continue
                drafts[j, i] = tok
                if q is not None:
                    q[j, i] = q_i
            step = [[] for _ in range(m)]
            for j, row in enumerate(live):
                if i + 1 < made[j]:
                    step[row] = [int(drafts[j, i])]
            if any(step):
                logits = self.session.forward(step)[live]
        return drafts, q, made

    def _one(self, r, logits, i, prev_drafts, need_q):
        """One draft token of request r at draft position i: (token, q [V] or None)."""
        if r.params.plain_greedy:  # the target keeps only its argmax: a greedy draft matches it best
            tok = int(np.argmax(logits))
            if not need_q:
                return tok, None
            q = np.zeros(len(logits), np.float32)
            q[tok] = 1.0
            return tok, q
        prev = r.seq + [int(t) for t in prev_drafts] if r.params.repetition_penalty != 1.0 else None
        counts = None
        if r.params.penalises_output:  # (the output so far and the drafts before this one)
            V = len(logits)
            counts = r.output_counts(V) + np.bincount(np.asarray(prev_drafts, np.int64), minlength=V)
        # a greedy request has no seed: its draft's draw changes only what is proposed, never the output
        u = float(uniforms(r.params.seed or 0, len(r.seq) + i, 1, DRAFT)[0])
        tok, q = draft_token(logits, r.params, prev, u, counts)
        return tok, q.astype(np.float32)

    def update_candidate_strategy(self, row, r):
        """Roll a row's cache back to request r's committed sequence (its last token is fed next step)."""
        self.session.rollback(row, min(int(self.session.pos[row]), len(r.seq) - 1))

    @property
    def keeps_rows(self):
        """Whether a finished row's cache can be parked for a later request (the host cache; the
        device cache of the ascend profile keeps only the rows its calls cover)."""
        return self.session.device_kv is None

    def release(self, row, last_row, keep):
        """Row `row` left: the engine moves its last row there (rows stay contiguous, so a batch of n
        rows is the cache's first n rows, no copy). keep: the leaving row's cache is parked in
        last_row, now spare (when keeps_rows), else emptied."""
        if keep and self.keeps_rows:
            self.session.swap(row, last_row)
        else:
            if row != last_row:
                self.session.move(last_row, row)
            self.session.reset(last_row)

    def reset(self):
        """Empty every row (the engine starts again)."""
        self.session.reset()

    def adopt(self, row, src, n):
        """A new request takes row `row` (the engine's row count), starting from the first n tokens
        that spare row src holds (n = 0: empty)."""
        if src != row:
            self.session.swap(src, row)
        self.session.rollback(row, n)


def _confidence(params, logits, q):
    """The draft's top probability for the confidence cut: q's (as sampled), or, where the draft takes its argmax
    (q one-hot, or not built), its own softmax's, whether or not the step built q for its neighbours."""
    if q is None or params.plain_greedy or params.for_draft().temperature == 0:
        return _top_prob(logits)
    return float(q.max())


def _top_prob(logits):
    """The draft's own probability of its argmax (softmax at the max)."""
    z = logits - logits.max()
    return 1.0 / float(np.exp(z).sum())
