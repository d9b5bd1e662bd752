"""Draft proposers. The interface has two methods (as transformers' CandidateGenerator), so other
proposers (n-gram / prompt lookup) can plug into the same loop."""
import numpy as np

from .sampling import draft_token


class OnnxProposer:
    """Greedy K-token proposals from an ONNX draft (mindspec.export.DraftSession).

    The draft cache holds seq[:session.pos]. After a step where all K drafts were accepted, the
    draft has never seen its own last draft token, so two tokens are fed next time, never lost
    and never counted twice."""

    def __init__(self, session):
        self.session = session

    def reset(self):
        self.session.reset()

    def get_candidates(self, seq, k, params=None, rng=None):
        """seq: committed token ids (prompt + generated). Greedy: returns k draft ids. With sampling
        params + rng: (drafts [k], q [k, V]), each draft sampled from q, the draft's distribution
        at params.draft_temperature with the same top-k/top-p/penalty as the target."""
        logits = self.session.forward(seq[self.session.pos:])  # [T, V]
        drafts, qs = [], []
        for i in range(k):
            if params is None:
                drafts.append(int(np.argmax(logits[-1])))
            else:
                prev = seq + drafts if params.repetition_penalty != 1.0 else None
                tok, q = draft_token(logits[-1], params, prev, float(rng.random(dtype=np.float32)))
                drafts.append(tok)
                qs.append(q)
            if i < k - 1:
                logits = self.session.forward(drafts[-1:])
        return drafts if params is None else (drafts, np.stack(qs).astype(np.float32))

    def update_candidate_strategy(self, seq, n_accepted):
        """Roll the draft cache back to the committed sequence (the last token is fed next step)."""
        self.session.rollback(min(self.session.pos, len(seq) - 1))
