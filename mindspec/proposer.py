"""Draft proposers. The interface has two methods (as transformers' CandidateGenerator), so other
proposers (n-gram / prompt lookup) can plug into the same loop."""
import numpy as np


class OnnxProposer:
    """Greedy K-token proposals from an ONNX draft (mindspec.export.DraftSession).

    The draft cache holds seq[:session.pos]. After a step where all K drafts were accepted, the
    draft has never seen its own last draft token, so two tokens are fed next time, never lost
    and never counted twice."""

    def __init__(self, session):
        self.session = session

    def reset(self):
        self.session.reset()

    def get_candidates(self, seq, k):
        """seq: committed token ids (prompt + generated). Returns k draft token ids."""
        logits = self.session.forward(seq[self.session.pos:])  # [T, V]
        drafts = []
        for i in range(k):
            drafts.append(int(np.argmax(logits[-1])))
            if i < k - 1:
                logits = self.session.forward(drafts[-1:])
        return drafts

    def update_candidate_strategy(self, seq, n_accepted):
        """Roll the draft cache back to the committed sequence (the last token is fed next step)."""
        self.session.rollback(min(self.session.pos, len(seq) - 1))
