"""Draft proposers. The interface has two methods (as transformers' CandidateGenerator), so other
proposers (n-gram / prompt lookup) can plug into the same loop."""
import numpy as np

from .policy import stop_early
from .sampling import draft_token


class OnnxProposer:
    """Greedy K-token proposals from an ONNX draft (mindspec.export.DraftSession).

    The draft cache holds seq[:session.pos]. After a step where all K drafts were accepted, the
    draft has never seen its own last draft token, so two tokens are fed next time, never lost
    and never counted twice."""

    def __init__(self, session, min_conf=None):
        self.session = session
        self.min_conf = min_conf  # confidence cut: see get_candidates

    def reset(self):
        self.session.reset()

    def get_candidates(self, seq, k, params=None, rng=None):
        """seq: committed token ids (prompt + generated). Greedy: returns up to k draft ids. With
        sampling params + rng: (drafts [n], q [n, V]), each draft sampled from q, the draft's
        distribution at params.draft_temperature with the same top-k/top-p/penalty as the target.

        Confidence cut (llama.cpp's p-min, HF's assistant_confidence_threshold): with min_conf set,
        drafting stops before a token whose top draft probability is below it, so fewer than k
        (maybe 0) drafts come back; such a token is likely rejected and each draft step costs."""
        logits = self.session.forward(seq[self.session.pos:])  # [T, V]
        drafts, qs = [], []
        for i in range(k):
            if params is None:
                tok, q_top = int(np.argmax(logits[-1])), None
                if self.min_conf is not None:
                    z = logits[-1] - logits[-1, tok]
                    q_top = 1.0 / float(np.exp(z).sum())  # softmax at the argmax
            else:
                prev = seq + drafts if params.repetition_penalty != 1.0 else None
                tok, q = draft_token(logits[-1], params, prev, float(rng.random(dtype=np.float32)))
                q_top = float(q.max())
            if stop_early(q_top, self.min_conf):
                break
            drafts.append(tok)
            if params is not None:
                qs.append(q)
            if i < k - 1:
                logits = self.session.forward(drafts[-1:])
        if params is None:
            return drafts
        return drafts, (np.stack(qs).astype(np.float32) if qs else np.zeros((0, logits.shape[-1]), np.float32))

    def update_candidate_strategy(self, seq, n_accepted):
        """Roll the draft cache back to the committed sequence (the last token is fed next step)."""
        self.session.rollback(min(self.session.pos, len(seq) - 1))
