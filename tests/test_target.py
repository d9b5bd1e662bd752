"""The MindSpore target graph against the numpy reference, and the fused greedy verify step
against the pure acceptance function."""
import numpy as np
import pytest

from mindspec.acceptance import greedy_accept
from mindspec.checkpoint import Checkpoint
from mindspec.graphs.runner import TargetModel, init_mindspore
from mindspec.reference import reference_logits

from conftest import make_tiny_checkpoint


@pytest.fixture(scope="module")
def target(tiny_target):
    init_mindspore()
    ckpt = Checkpoint(tiny_target[0])
    return ckpt, TargetModel(ckpt, max_seq=64)


def test_logits_match_reference_across_chunks_and_rollback(target):
    ckpt, m = target
    rng = np.random.default_rng(0)
    seq = [int(x) for x in rng.integers(3, 300, 40)]
    m.rollback(0)
    got = np.concatenate([m.logits(seq[:33]), m.logits(seq[33:34]), m.logits(seq[34:40])])
    ref = reference_logits(ckpt.config, ckpt.get, seq)
    assert np.abs(got - ref).max() < 1e-4
    # reject the last 5 positions (rollback = move the integer), feed other tokens
    m.rollback(35)
    alt = [7, 8, 9, 10, 11, 12]
    got2 = m.logits(alt)
    ref2 = reference_logits(ckpt.config, ckpt.get, seq[:35] + alt)[35:]
    assert np.abs(got2 - ref2).max() < 1e-4


def test_prefill_pads_to_chunk_and_returns_reference_argmax(target):
    ckpt, m = target
    seq = list(range(5, 5 + 37))  # 37 tokens: a full chunk plus a padded one
    m.rollback(0)
    assert m.prefill(seq) == int(reference_logits(ckpt.config, ckpt.get, seq)[-1].argmax())
    assert m.pos == 37


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_fused_greedy_verify_equals_pure_function(target, k):
    ckpt, m = target
    rng = np.random.default_rng(k)
    for case in range(6):
        prefix = [int(x) for x in rng.integers(3, 300, 6)]
        ref_next = reference_logits(ckpt.config, ckpt.get, prefix)[-1].argmax()
        # draft: the target's own greedy continuation, corrupted at a random position (or not)
        drafts, seq = [], list(prefix)
        for _ in range(k):
            t = int(reference_logits(ckpt.config, ckpt.get, seq)[-1].argmax())
            drafts.append(t)
            seq.append(t)
        if case % 3:
            j = int(rng.integers(0, k))
            drafts[j] = (drafts[j] + 1) % 300
        amax = reference_logits(ckpt.config, ckpt.get, prefix + drafts)[len(prefix) - 1:].argmax(-1)
        m.rollback(0)
        m.prefill(prefix[:-1])
        n, nxt = m.verify(prefix[-1], drafts)
        assert (n, nxt) == greedy_accept(amax, drafts)
        assert m.pos == len(prefix) + n
        assert drafts[0] != ref_next or n >= 1


def test_greedy_accept_pure_function():
    assert greedy_accept([5, 6, 7], [5, 6]) == (2, 7)  # all accepted: bonus token
    assert greedy_accept([5, 6, 7], [4, 6]) == (0, 5)  # first-token mismatch: recovered token
    assert greedy_accept([5, 6, 7], [5, 9]) == (1, 6)
    assert greedy_accept([5], []) == (0, 5)  # empty draft: plain decode


def test_tied_embeddings_and_odd_head_dim(tmp_path):
    d, _ = make_tiny_checkpoint(tmp_path / "t", tie=True, head_dim=24, heads=3, kv_heads=1, seed=3)
    ckpt = Checkpoint(d)
    m = TargetModel(ckpt, max_seq=32)
    seq = [5, 9, 13, 200, 17]
    assert np.abs(m.logits(seq) - reference_logits(ckpt.config, ckpt.get, seq)).max() < 1e-4


def test_logits_after_verify_steps_with_rejections(target):
    """Several fused verify steps (some drafts rejected), then the cache must still be exact."""
    ckpt, m = target
    rng = np.random.default_rng(7)
    seq = [int(x) for x in rng.integers(3, 300, 5)]
    m.rollback(0)
    seq.append(m.prefill(seq))
    rejected = 0
    for step in range(6):
        drafts = [int(x) for x in rng.integers(3, 300, 4)]
        ref = reference_logits(ckpt.config, ckpt.get, seq + drafts)[len(seq) - 1:].argmax(-1)
        if step % 2:  # make some drafts right, so accepted prefixes occur too
            drafts[:2] = [int(ref[0]), int(reference_logits(ckpt.config, ckpt.get, seq + [int(ref[0])])[-1].argmax())]
        n, nxt = m.verify(seq[-1], drafts)
        rejected += n < 4
        seq += drafts[:n] + [nxt]
        assert m.pos == len(seq) - 1
    assert rejected >= 3
    got = m.logits(seq[-1:])
    assert np.abs(got - reference_logits(ckpt.config, ckpt.get, seq)[-1:]).max() < 1e-4
