"""Speculative sampling: logits processing, the pure accept/reject step on hand-built p/q, the fused
MindSpore verify graph against it, and statistical losslessness (chi-square against the target's
exact distribution, with a broken variant proving the test has teeth)."""
import json
import os

import numpy as np
import pytest
from scipy.stats import chisquare, kstest

from mindspec.acceptance import speculative_accept
from mindspec.checkpoint import Checkpoint, write_checkpoint
from mindspec.errors import MindspecError
from mindspec.graphs.exact import redo_step
from mindspec.reference import reference_logits
from mindspec.sampling import SamplingParams, draft_token, process_logits, sample

from conftest import make_tiny_checkpoint

V = 16  # vocabulary of the statistical tests: 256 cells for two tokens
CONTEXT = [3, 7, 11, 5]
CAP = 4  # top-k candidates in the graph: small, so both the fast path and the host's redo of a row run


def _probs(*rows):
    return np.array(rows, dtype=np.float64)


# ---- logits processing -------------------------------------------------------------------------

def test_repetition_penalty_then_temperature():
    x = [2.0, -2.0, 1.0, 0.5]
    got = process_logits(x, 1.0, repetition_penalty=2.0, prev_ids=[0, 1, 1])
    assert np.allclose(got, process_logits([1.0, -4.0, 1.0, 0.5], 1.0))  # positive /2, negative *2
    assert np.allclose(process_logits(x, 0.5), process_logits(np.array(x) * 2, 1.0))
    assert process_logits(x, 0.0).tolist() == [1, 0, 0, 0]  # temperature 0: one-hot argmax
    assert process_logits(x, 0.0, repetition_penalty=4.0, prev_ids=[0]).tolist() == [0, 0, 1, 0]


def test_top_k_keeps_ties_and_top_p_keeps_the_smallest_set():
    assert (process_logits([3.0, 2.0, 2.0, 1.0], 1.0, top_k=2) > 0).tolist() == [True, True, True, False]
    logp = np.log([0.5, 0.3, 0.15, 0.05])
    keep = lambda top_p: (process_logits(logp, 1.0, top_p=top_p) > 0).sum()  # noqa: E731
    assert [keep(1e-9), keep(0.4), keep(0.6), keep(0.9), keep(0.99), keep(1.0)] == [1, 1, 2, 3, 4, 4]
    got = process_logits(logp, 1.0, top_p=0.6)
    assert np.allclose(got, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    # top-k first, then top-p over the renormalised survivors
    assert np.allclose(process_logits(logp, 1.0, top_k=2, top_p=0.6), [1, 0, 0, 0])


def test_top_p_boundary_a_mass_of_exactly_top_p_before_a_token_drops_it():
    """Token i is kept when the mass ranked before it is < top_p, not <=: at a mass of exactly top_p the
    set is already complete (found by mutation testing: <= kept one token too many). The masses are the ones
    the code compares, as this CPU's exp rounds them (0.5 + 0.3 came out exactly 0.8 with AVX-512's numpy, not
    on an AVX2-only CPU); a top_p one float above a mass keeps that token."""
    logp = np.log([0.5, 0.3, 0.15, 0.05])  # ranked already; masses before each token: ~0, 0.5, 0.8, 0.95
    e = np.exp(logp - logp.max())
    ps = e / e.sum()
    before = np.cumsum(ps) - ps  # (process_logits' own arithmetic)
    keep = lambda top_p: (process_logits(logp, 1.0, top_p=top_p) > 0).tolist()  # noqa: E731
    for i in (1, 2, 3):
        assert keep(before[i]) == [j < i for j in range(4)], (i, before[i])
        assert keep(np.nextafter(before[i], 1.0)) == [j <= i for j in range(4)], (i, before[i])


def test_top_k_one_below_the_vocabulary_removes_exactly_one_token():
    """top_k = V - 1 truncates (only k >= V is "off"; found by mutation testing: k = V - 1 kept all)."""
    x = [0.3, -1.0, 2.0, 0.7, 1.1]
    assert (process_logits(x, 1.0, top_k=4) > 0).tolist() == [True, False, True, True, True]
    assert (process_logits(x, 1.0, top_k=5) > 0).all() and (process_logits(x, 1.0, top_k=6) > 0).all()


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_k=-2),
                                dict(top_k=2.5), dict(top_p=0), dict(top_p=1.5), dict(repetition_penalty=0),
                                dict(draft_temperature=-0.1), dict(seed=-2 ** 63 - 1), dict(seed="x"),
                                dict(temperature=True),
                                # values that pass a sign check but overflow or vanish in the float32 graph
                                dict(temperature=1e39), dict(repetition_penalty=1e-46), dict(top_k=2 ** 63),
                                dict(top_p=float("inf")), dict(seed=2 ** 128),
                                dict(seed=2 ** 64),  # (the bound is exclusive: found by mutation testing)
                                # a huge value is not quoted whole (found: 10**2000's 2001 digits, a 100 kB string)
                                dict(temperature=10 ** 2000), dict(seed="x\n" * 50_000)])
def test_bad_sampling_params_raise_one_line(kw):
    with pytest.raises(MindspecError) as e:
        SamplingParams(**kw)
    assert "\n" not in str(e.value) and list(kw)[0] in str(e.value) and len(str(e.value)) <= 1000


def test_sampling_params_draft_and_flags():
    p = SamplingParams(temperature=0.7, top_p=0.9, draft_temperature=1.1, seed=3)
    assert p.for_draft().temperature == 1.1 and p.for_draft().top_p == 0.9
    assert SamplingParams(0.7).for_draft().temperature == 0.7
    assert p.truncates and not SamplingParams(1.0).truncates and SamplingParams(0.0).greedy
    assert SamplingParams(0.0).plain_greedy and not SamplingParams(0.0, repetition_penalty=1.2).plain_greedy
    assert SamplingParams(1e-300).greedy and SamplingParams(1.0, draft_temperature=5e-324).for_draft().greedy
    assert not SamplingParams(1e-5).greedy
    tok, q = draft_token(np.log([0.1, 0.6, 0.3]), SamplingParams(1.0, draft_temperature=0.0), [], 0.99)
    assert tok == 1 and q.tolist() == [0, 1, 0]  # a greedy draft: one-hot q, still lossless


def test_sampling_params_normalise_tiny_temperatures_vllm_top_k_and_the_seed_bound():
    """Found by mutation testing: a draft_temperature below MIN_TEMPERATURE is stored as 0.0 like the
    target's (not only once for_draft() re-checks it), top_k -1 (vLLM's off) is stored as 0, and the
    seeds accepted are those of PyTorch's manual_seed (vLLM's), OpenAI's int64 and TGI's u64: [-2**63, 2**64)
    (found: -1 refused on OpenAI's routes), a negative one its 64-bit two's complement (2**64 is refused: see
    test_bad_sampling_params_raise_one_line)."""
    from mindspec.sampling import MIN_TEMPERATURE
    p = SamplingParams(1.0, draft_temperature=MIN_TEMPERATURE / 10)
    assert p.draft_temperature == 0.0 and p.temperature == 1.0
    assert SamplingParams(1.0, draft_temperature=MIN_TEMPERATURE).draft_temperature == MIN_TEMPERATURE
    assert SamplingParams(MIN_TEMPERATURE / 10).temperature == 0.0
    off = SamplingParams(1.0, top_k=-1)
    assert off.top_k == 0 and not off.truncates
    assert SamplingParams(seed=2 ** 64 - 1).seed == 2 ** 64 - 1 and SamplingParams(seed=-2 ** 63).seed == -2 ** 63
    from mindspec.sampling import ACCEPT, uniforms
    assert list(uniforms(-1, 5, 3, ACCEPT)) == list(uniforms(2 ** 64 - 1, 5, 3, ACCEPT)) \
        != list(uniforms(2 ** 63 - 1, 5, 3, ACCEPT))


def test_uniforms_are_keyed_by_seed_position_and_stream():
    from mindspec.sampling import ACCEPT, DRAFT, SAMPLE, uniforms
    a = uniforms(7, 10, 6, SAMPLE)
    assert a.dtype == np.float32 and ((0 <= a) & (a < 1)).all()
    assert (uniforms(7, 12, 3, SAMPLE) == a[2:5]).all()  # however the steps are cut
    assert not np.isin(uniforms(8, 10, 6, SAMPLE), a).any()  # another seed
    assert not np.isin(uniforms(7, 10, 6, ACCEPT), a).any() and not np.isin(uniforms(7, 10, 6, DRAFT), a).any()
    many = np.concatenate([uniforms(s, 0, 50, SAMPLE) for s in range(40)])
    assert abs(many.mean() - 0.5) < 0.02 and kstest(many, "uniform").pvalue > 1e-3


def test_sample_inverse_cdf_never_draws_a_zero_probability_token():
    probs = [0.0, 0.25, 0.0, 0.75, 0.0]
    assert sample(probs, 0.0) == 1 and sample(probs, 0.2499) == 1 and sample(probs, 0.25) == 3
    assert sample(probs, float(np.nextafter(np.float32(1), np.float32(0)))) == 3
    assert sample([0.0, 2.0, 6.0], 0.3) == 2  # unnormalised


# ---- the pure accept/reject step -----------------------------------------------------------------

def test_perfect_match_accepts_all_and_samples_the_bonus():
    p = _probs([0.2, 0.5, 0.3], [0.6, 0.2, 0.2], [0.1, 0.1, 0.8])
    for u in (0.0, 0.5, 0.999):
        assert speculative_accept(p, p[:2], [1, 0], [u, u], 0.95) == (2, 2)  # bonus from p_K
    assert speculative_accept(p, p[:2], [1, 0], [0.9, 0.9], 0.05) == (2, 0)


def test_first_position_rejection_samples_the_residual():
    p = _probs([0.1, 0.9, 0.0], [1 / 3] * 3)
    q = _probs([0.8, 0.1, 0.1])
    # accept x=0 with probability p/q = 0.125
    assert speculative_accept(p, q, [0], [0.12], 0.5) == (1, 1)  # accepted; bonus from p_1
    for us in (0.0, 0.5, 0.999):  # rejected; residual max(0, p - q) = [0, 0.8, 0]: always token 1
        assert speculative_accept(p, q, [0], [0.13], us) == (0, 1)


def test_partial_acceptance():
    p = _probs([0.5, 0.5, 0.0], [0.0, 0.3, 0.7], [0.0, 0.0, 1.0])
    q = _probs([0.4, 0.3, 0.3], [0.0, 0.9, 0.1])
    # draft 0: p/q = 1.25 -> accepted; draft 1: p/q = 1/3 rejected at u = 0.5; residual [0, 0, 0.6]
    assert speculative_accept(p, q, [0, 1], [0.99, 0.5], 0.0) == (1, 2)
    assert speculative_accept(p, q, [0, 1], [0.99, 0.3], 0.0) == (2, 2)  # accepted: bonus from p_2


NV_P = _probs([0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0])  # (p, q, drafts): both drafts would be
NV_Q = _probs([0.5, 0.5, 0.0], [0.5, 0.0, 0.5])  # accepted at any u (p >= q at x); p_1 - q_1 = [0, .5, 0]
NV_DRAFTS = [0, 1]


def test_n_valid_below_k_stops_there_and_draws_the_bonus_from_p():
    """A row of a batch drafting fewer than the bucket's K (n_valid = 1 of K = 2): draft 1 does not count
    even where it would be accepted, and the token after draft 0 is a bonus drawn from p_1 itself, not
    from the residual p_1 - q_1 (found by mutation testing: arange(K) <= n_valid accepted 2; dropping
    the n < n_valid mask on q drew from the residual; greedy_accept with K for n_valid accepted 2)."""
    from mindspec.acceptance import greedy_accept
    for us, tok in ((0.1, 0), (0.9, 1)):  # from p_1 = [.5, .5, 0] (the residual would give 1 both times)
        assert speculative_accept(NV_P, NV_Q, NV_DRAFTS, [0.5, 0.5], us, n_valid=1) == (1, tok)
    assert speculative_accept(NV_P, NV_Q, NV_DRAFTS, [0.5, 0.5], 0.1) == (2, 2)  # all K valid: bonus from p_2
    assert speculative_accept(NV_P, NV_Q, NV_DRAFTS, [0.5, 0.5], 0.1, n_valid=0) == (0, 0)  # none valid: from p_0
    # batched, one n_valid per row
    n, nxt = speculative_accept(np.stack([NV_P] * 3), np.stack([NV_Q] * 3), [NV_DRAFTS] * 3, [[0.5, 0.5]] * 3,
                                [0.1] * 3, n_valid=[0, 1, 2])
    assert n.tolist() == [0, 1, 2] and nxt.tolist() == [0, 0, 2]
    assert greedy_accept([5, 6, 7], [5, 6], n_valid=1) == (1, 6)  # the bonus after n_valid drafts
    assert greedy_accept([5, 6, 7], [5, 6], n_valid=0) == (0, 5)
    assert greedy_accept([5, 6, 7], [5, 6]) == (2, 7) and greedy_accept([5, 9, 7], [5, 6], n_valid=2) == (1, 9)


def test_q_zero_where_p_positive_is_accepted_and_p_zero_is_rejected():
    p = _probs([0.3, 0.7, 0.0], [0.2, 0.2, 0.6])
    q = _probs([0.0, 0.5, 0.5])
    assert speculative_accept(p, q, [0], [0.999], 0.0) == (1, 0)  # q(x) = 0 < p(x): ratio infinite
    assert speculative_accept(p, q, [2], [0.0], 0.0) == (0, 0)  # p(x) = 0: rejected even at u = 0
    assert speculative_accept(p, q, [2], [0.0], 0.999) == (0, 1)  # residual [0.3, 0.2, 0] / 0.5


def test_degenerate_residual_falls_back_to_p():
    p = _probs([0.5, 0.5, 0.0], [1.0, 0.0, 0.0])
    # x = 2 was not drawn from q (q(x) = 0 = p(x)): rejected, and p - q has no positive mass
    assert speculative_accept(p, p[:1], [2], [0.0], 0.7) == (0, 1)


def test_acceptance_probability_is_min_one_p_over_q():
    p, q = _probs([0.2, 0.8], [0.5, 0.5]), _probs([0.5, 0.5])
    us = (np.arange(1000) + 0.5) / 1000
    assert sum(speculative_accept(p, q, [0], [u], 0.5)[0] for u in us) == 400  # 0.2 / 0.5
    assert sum(speculative_accept(p, q, [1], [u], 0.5)[0] for u in us) == 1000  # 0.8 / 0.5 > 1


def test_truncation_applies_to_p_so_outside_tokens_never_come_out():
    logits = np.log([[0.4, 0.3, 0.2, 0.1]] * 2)
    p = process_logits(logits, 1.0, top_k=2)  # [2, 4]: tokens 2, 3 impossible
    q = process_logits(logits, 1.0)
    assert speculative_accept(p, q[:1], [2], [0.0], 0.5)[0] == 0  # p(x) = 0 after top-k
    outs = {speculative_accept(p, q[:1], [d], [u], us)[1]
            for d in range(4) for u in (0.0, 0.6) for us in np.linspace(0, 0.999, 50)}
    assert outs <= {0, 1}
    p = process_logits(logits, 1.0, top_p=0.5)  # keeps {0, 1}: 0.4 alone is not enough
    assert (p[0] > 0).tolist() == [True, True, False, False]


# ---- graphs/sampling.py's functions on hand-built inputs -------------------------------------------

@pytest.fixture(scope="module")
def graph_fns():
    """(process, accept): graphs/sampling.py's processing (with seen_mask) and accept steps, each compiled
    alone in a graph of its own, called with numpy arrays: tensors of hand-built values, no model."""
    from mindspore import Tensor, nn
    from mindspec.graphs import sampling as gs
    from mindspec.graphs.runner import init_mindspore
    init_mindspore()

    class Process(nn.Cell):
        def construct(self, x, temperature, top_k, top_p, penalty, seen, drafts, counts, presence, frequency):
            mask, c = gs.seen_mask(seen, drafts, x.shape[-1]), gs.output_counts(counts, drafts, x.shape[-1])
            return gs.process(x, temperature, top_k, top_p, penalty, mask, 8, c, presence, frequency) + (mask,)

    class Accept(nn.Cell):
        def construct(self, p, q, drafts, n_valid, u_acc, u_smp, g, ids):
            return gs.speculative_accept(p, q, drafts, n_valid, u_acc, u_smp) + gs.greedy_accept(g, ids, n_valid)

    def run(cell):
        cell.set_train(False)
        def conv(a):  # ints as int32, the rest float32
            a = np.asarray(a)
            return Tensor(np.ascontiguousarray(a, np.int32 if a.dtype.kind in "iu" else np.float32))
        return lambda *args: [x.asnumpy() for x in cell(*map(conv, args))]
    return run(Process()), run(Accept())


def test_graph_processing_equals_the_pure_function_on_hand_built_logits(graph_fns):
    """graphs/sampling.py's process and seen_mask against process_logits, where the answer turns on a
    detail (found by mutation testing, each survived the model-based tests): a seen token's negative
    logit is multiplied by the penalty (pushed down), not divided; a draft counts as seen at every later
    position of the step; top-p's boundary (a mass of exactly top_p before a token drops it; the masses
    of [.5, .25, .125, .125] are exact in float32)."""
    process, _ = graph_fns
    K, Vs = 2, 4
    pf = dict(presence_penalty=0.5, frequency_penalty=0.75)
    rows = [  # (logits [V], params, committed ids, drafts [K], the output's part of the committed ids)
        ([2.0, -2.0, 1.0, 0.5], SamplingParams(1.0, repetition_penalty=4.0), [0, 1], [3, 3], []),
        ([-1.0, -2.0, -3.0, -3.5], SamplingParams(0.0, repetition_penalty=4.0), [0], [1, 2], []),  # greedy: 1, 2, 3
        ([1.0, 0.5, 2.0, 0.0], SamplingParams(1.0, repetition_penalty=100.0), [], [2, 2], []),  # a repeated draft
        (np.log([0.5, 0.25, 0.125, 0.125]), SamplingParams(1.0, top_p=0.5), [], [0, 1], []),
        (np.log([0.5, 0.25, 0.125, 0.125]), SamplingParams(1.0, top_p=0.75), [], [0, 1], []),
        # presence and frequency: the output's counts, the drafts before each position counted in; a prompt
        # token (3) is not the output's; a negative penalty pulls a token up
        ([2.0, 1.0, 0.0, 1.5], SamplingParams(1.0, **pf), [3, 0, 0], [0, 1], [0, 0]),
        ([2.0, 1.6, 1.0, 0.5], SamplingParams(0.0, **pf), [0], [1, 2], [0]),  # greedy: 1, 2, 0 (below)
        ([0.0, 1.0, 0.5, 0.2], SamplingParams(1.0, presence_penalty=-2.0, repetition_penalty=2.0), [2], [2, 0], [2]),
    ]
    seen, counts = np.zeros((len(rows), Vs)), np.zeros((len(rows), Vs))
    for r, (_, _, prev, _, out) in enumerate(rows):
        seen[r, prev] = 1
        np.add.at(counts[r], out, 1)
    probs, exact, mask = process(np.array([np.tile(x, (K + 1, 1)) for x, *_ in rows]),
                                 [p.temperature for _, p, *_ in rows], [p.top_k for _, p, *_ in rows],
                                 [p.top_p for _, p, *_ in rows], [p.repetition_penalty for _, p, *_ in rows],
                                 seen, [d for *_, d, _ in rows], counts, [p.presence_penalty for _, p, *_ in rows],
                                 [p.frequency_penalty for _, p, *_ in rows])
    assert exact.all()
    for r, (x, params, prev, drafts, out) in enumerate(rows):
        for i in range(K + 1):
            ids, c = prev + drafts[:i], np.bincount(out + drafts[:i], minlength=Vs)
            assert mask[r, i].tolist() == [t in ids for t in range(Vs)], (r, i)
            assert np.allclose(probs[r, i], params.process(x, ids, c), atol=1e-6), (r, i, probs[r, i])
    assert [probs[1, i].argmax() for i in range(K + 1)] == [1, 2, 3]  # each seen -x * 4 fell below the next
    assert (probs[3] > 0).sum(-1).tolist() == [1] * (K + 1) and (probs[4] > 0).sum(-1).tolist() == [2] * (K + 1)
    # 2 - 1.25 < 1.6; then 1.6 - 1.25 < 1.0; then 1.0 - 1.25 < 0.75: each token the output took falls back
    assert [probs[6, i].argmax() for i in range(K + 1)] == [1, 2, 0]
    assert not np.allclose(probs[5, 0], SamplingParams(1.0).process(rows[5][0]))  # (the penalties bite)


def test_graph_accept_with_n_valid_below_k_equals_the_pure_function(graph_fns):
    """graphs/sampling.py's speculative_accept and greedy_accept with per-row n_valid (0, 1 and 2 of K = 2)
    against mindspec.acceptance on test_n_valid_below_k_stops_there_and_draws_the_bonus_from_p's p/q."""
    from mindspec.acceptance import greedy_accept
    _, accept = graph_fns
    n_valid, u_smp = [0, 1, 2, 1, 0, 2], [0.1, 0.1, 0.1, 0.9, 0.9, 0.9]
    B, g, ids = len(n_valid), [[5, 6, 7]] * 6, [[4, 5, 6]] * 6
    n, nxt, gn, gnxt = accept(np.stack([NV_P] * B), np.stack([NV_Q] * B), [NV_DRAFTS] * B, n_valid,
                              [[0.5, 0.5]] * B, np.tile(np.array(u_smp)[:, None], (1, 3)), g, ids)
    want = [speculative_accept(NV_P, NV_Q, NV_DRAFTS, [0.5, 0.5], u, n_valid=nv) for nv, u in zip(n_valid, u_smp)]
    assert list(zip(n.tolist(), nxt.tolist())) == want == [(0, 0), (1, 0), (2, 2), (1, 1), (0, 1), (2, 2)]
    assert list(zip(gn.tolist(), gnxt.tolist())) == [greedy_accept(g[0], ids[0][1:], nv) for nv in n_valid]
    assert gn.tolist() == n_valid


# ---- shared tiny models for the graph and statistical tests --------------------------------------

def _small_checkpoint(path, seed, base=None, noise=0.0):
    d, t = make_tiny_checkpoint(path, vocab=V, hidden=32, layers=1, heads=2, kv_heads=1, inter=64,
                                seed=seed, base=base, noise=noise)
    if base is None:  # the conftest head gives logits of std ~8 (nearly one-hot): shrink it
        t["lm_head.weight"] = t["lm_head.weight"] * 0.3
        with open(os.path.join(d, "config.json")) as f:
            write_checkpoint(d, json.load(f), t)
    return d, t


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target Checkpoint, draft Checkpoint): a small-vocabulary target with spread-out logits and a
    noisy copy that disagrees with it (first-token acceptance ~0.5 at temperature 1)."""
    root = tmp_path_factory.mktemp("sampling")
    td, tt = _small_checkpoint(root / "target", seed=0)
    dd, _ = _small_checkpoint(root / "draft", seed=1, base=tt, noise=0.4)
    return Checkpoint(td), Checkpoint(dd)


@pytest.fixture(scope="module")
def logit_tables(pair):
    """Reference logits after CONTEXT + 0, 1, 2 more tokens, for target and draft:
    ([V], [V, V], [V, V, V]) each."""
    out = []
    for ck in pair:
        rows = np.stack([np.stack([reference_logits(ck.config, ck.get, CONTEXT + [a, b])[len(CONTEXT) - 1:]
                                   for b in range(V)]) for a in range(V)])  # [a, b, 3, V]
        out.append((rows[0, 0, 0], rows[:, 0, 1], rows[:, :, 2]))
    return out


class Batch:
    """The fused sampling step called directly over B rows (one independent sample per row, each in
    its own cache slot, each with its own sampling parameters): the cell TargetModel uses, so
    thousands of samples cost a few graph calls."""

    def __init__(self, ckpt, rows):
        from mindspec.graphs.llama import LlamaDecoder, SampleStep
        self.decoder = LlamaDecoder(ckpt.config, ckpt.get, max_seq=32, slots=rows)
        # (the graph of rows with presence/frequency penalties is another cell, as TargetModel's "penal" kind)
        self.B, self.cells = rows, {pen: SampleStep(self.decoder, cap=CAP, penalties=pen) for pen in (False, True)}
        for cell in self.cells.values():
            cell.set_train(False)
        self.reruns, self.redone = 0, []  # calls with rows whose candidates did not hold their kept set; the
        # last call's rows, redone on the host

    def verify(self, ids, start, q, u, params, seen=None, n_valid=None, counts=None):
        """ids [B, K+1], q [B, K, V], u [B, K+1] (the last column: the sample uniform), params: one
        SamplingParams or a list, row r taking params[r % len], n_valid [B] (None: K every row) ->
        (n_accepted [B], next_token [B])."""
        from mindspore import Tensor
        B, K = self.B, len(ids[0]) - 1
        ps = params if isinstance(params, list) else [params]
        row = [ps[r % len(ps)] for r in range(B)]
        f32 = lambda a: Tensor(np.ascontiguousarray(a, np.float32))  # noqa: E731
        i32 = lambda a: Tensor(np.ascontiguousarray(a, np.int32))  # noqa: E731
        u = np.asarray(u, np.float32)
        n_valid = np.full(B, K) if n_valid is None else n_valid
        args = (i32(ids), i32(np.arange(B)), i32(np.full(B, start)), i32(n_valid), f32(q), f32(u[:, :K]),
                f32(np.repeat(u[:, K:], K + 1, 1)), f32([p.temperature for p in row]),
                i32([p.top_k for p in row]), f32([p.top_p for p in row]), f32([p.repetition_penalty for p in row]),
                f32(np.zeros((B, V)) if seen is None else seen), f32(np.zeros((B, V)) if counts is None else counts),
                f32([p.presence_penalty for p in row]), f32([p.frequency_penalty for p in row]), i32(np.arange(32)))
        *out, exact, logits = self.cells[counts is not None](*args)
        out = [np.array(x.asnumpy()) for x in out]
        rows = self.redone = np.flatnonzero(~exact.asnumpy())
        self.reruns += len(rows) > 0
        if len(rows):  # as TargetModel does
            redo_step(rows, logits.asnumpy(), *[a.asnumpy() for a in args[:1] + args[3:-1]], out)
        return out[0], out[1]

    def fill(self, ids):
        """Write ids [B, T] into the cache at positions 0..T-1 (two at a time, through the K=1 step;
        a padded last position is overwritten by the next call)."""
        ids = np.concatenate([ids, np.zeros((self.B, len(ids[0]) % 2), int)], 1)
        q, u = np.full((self.B, 1, V), 1.0 / V), np.full((self.B, 2), 0.5)
        for c in range(0, ids.shape[1], 2):
            self.verify(ids[:, c:c + 2], c, q, u, SamplingParams(1.0))


ROWS = 2000  # samples per fused-graph call in the statistical tests


@pytest.fixture(scope="module")
def batch(pair):
    from mindspec.graphs.runner import init_mindspore
    init_mindspore()
    return Batch(pair[0], ROWS)


# ---- the fused graph equals the pure function ----------------------------------------------------

GRAPH_CASES = [  # (K, params of the rows, in turn): one graph, any mix of rows; fast top-k path when
    # top_k <= CAP and top-p sets within CAP, else the row redone on the host
    (1, [SamplingParams(1.0), SamplingParams(0.6), SamplingParams(0.0)]),
    (2, [SamplingParams(0.8, top_k=3, top_p=0.9), SamplingParams(0.8, top_k=6, top_p=0.9),
         SamplingParams(1.3, top_p=0.6), SamplingParams(1.0, top_k=2), SamplingParams(0.0)]),
    (2, [SamplingParams(1.2, top_k=3, top_p=0.8, repetition_penalty=1.5),
         SamplingParams(0.9, top_p=0.7, repetition_penalty=0.7),
         SamplingParams(0.0, repetition_penalty=1.5),  # greedy + penalty
         SamplingParams(1.0, top_p=1e-30), SamplingParams(1.0, top_k=2 ** 31 - 1)]),  # extremes stay sane
    # top_k above the candidates, alone in its call: kept only the CAP candidates, exact by the graph's word
    (1, [SamplingParams(1.0, top_k=CAP + 2)]),
    (1, [SamplingParams(1.0, top_k=CAP + 2, presence_penalty=1.0, frequency_penalty=0.5)]),  # (the host's redo too)
    # OpenAI's presence and frequency penalties (the prefix taken as the output: counted), with the others
    (2, [SamplingParams(1.0, presence_penalty=1.5, frequency_penalty=0.7),
         SamplingParams(0.0, frequency_penalty=2.0),  # greedy + penalty
         SamplingParams(0.8, top_k=4, presence_penalty=-1.0, repetition_penalty=1.3)]),
]
CHECKED = 24  # rows per call compared with the pure function (the numpy reference is the slow part)


def test_fused_verify_graph_equals_pure_function(pair, batch):
    ckpt = pair[0]
    rng = np.random.default_rng(7)
    outcomes, reruns = set(), batch.reruns
    for k, param_list in GRAPH_CASES:
        prefix = rng.integers(0, V, (ROWS, 5))  # [B, 5]: the last one is fed with the drafts
        batch.fill(prefix[:, :-1])
        q = SamplingParams(float(rng.uniform(0.5, 2.0))).process(rng.normal(0, 2, (ROWS, k, V))).astype(np.float32)
        drafts = sample(q, rng.random((ROWS, k)))  # [B, K]
        drafts[3::4, -1] = q[3::4, -1].argmin(-1)  # robustness: a draft q gives (next to) no mass
        u = rng.random((ROWS, k + 1), dtype=np.float32)
        seen, counts = np.zeros((ROWS, V)), np.zeros((ROWS, V))
        np.put_along_axis(seen, prefix, 1, 1)
        for r in range(ROWS):
            np.add.at(counts[r], prefix[r], 1)
        # some rows draft fewer than the bucket (found by mutation testing: every call passed n_valid = K)
        n_valid = np.where(np.arange(ROWS) % 3 == 1, np.arange(ROWS) % k, k)
        penal = any(p.penalises_output for p in param_list)  # (the plain graph for the others, as TargetModel)
        n, nxt = batch.verify(np.concatenate([prefix[:, -1:], drafts], 1), 4, q, u, param_list, seen, n_valid,
                              counts if penal else None)
        assert {r for r in range(ROWS) if CAP < param_list[r % len(param_list)].top_k < V} <= set(batch.redone)
        for r in range(CHECKED):
            params = param_list[r % len(param_list)]
            seq = list(prefix[r]) + list(drafts[r])
            logits = reference_logits(ckpt.config, ckpt.get, seq)[4:]  # [K+1, V]
            p = np.stack([params.process(logits[i], seq[:5 + i], np.bincount(seq[:5 + i], minlength=V) if penal
                                         else None) for i in range(k + 1)])
            want = speculative_accept(p, q[r], drafts[r], u[r, :k], u[r, k], n_valid[r])
            assert (n[r], nxt[r]) == want, (params, r, seq)
            outcomes.add((n[r] == n_valid[r], n_valid[r] < k))
    assert outcomes == {(True, False), (False, False), (True, True), (False, True)}  # both the recovered and
    # the bonus path were compared, with every draft valid and with fewer
    assert batch.reruns - reruns == 4  # the cases with top_k > CAP (or top-p sets past it) went through the host


# ---- statistical losslessness --------------------------------------------------------------------

def _tables(logit_tables, params):
    """Processed p (target) and q (draft, at the draft temperature, float32 like the graph's input)
    after CONTEXT + 0, 1, 2 tokens."""
    t, d = logit_tables
    return [params.process(x) for x in t], [params.for_draft().process(x).astype(np.float32) for x in d]


def _at(table, ctx):
    """Rows of a (P or Q) table after CONTEXT + ctx [N, depth] -> [N, V]."""
    N, depth = ctx.shape
    return np.broadcast_to(table[0], (N, V)) if depth == 0 else table[depth][tuple(ctx.T)]


def _step(Q, ctx, k, u, verify):
    """One speculative step for N rows after CONTEXT + ctx [N, d]: draft k tokens from q with the
    uniforms u[:, :k], verify with u[:, k:]. Returns (n_accepted [N], next_token [N], drafts [N, k])."""
    drafts, q = np.zeros((len(ctx), 0), int), []
    for i in range(k):
        q.append(_at(Q, np.concatenate([ctx, drafts], 1)))
        drafts = np.concatenate([drafts, sample(q[-1], u[:, i])[:, None]], 1)
    n, nxt = verify(ctx, drafts, np.stack(q, 1), u[:, k:])
    return n, nxt, drafts


def _two_tokens(Q, ks, U, verify):
    """The first two tokens a speculative loop emits after CONTEXT, for N rows of uniforms U: a step
    drafting ks[0] tokens, then, for rows where it emitted only the recovered token, a step drafting
    ks[1]. Returns [N, 2]."""
    k1, k2 = ks
    n, nxt, drafts = _step(Q, np.zeros((len(U), 0), int), k1, U[:, :2 * k1 + 1], verify)
    first = np.where(n >= 1, drafts[:, 0], nxt)
    n2, nxt2, drafts2 = _step(Q, first[:, None], k2, U[:, 2 * k1 + 1:2 * (k1 + k2) + 2], verify)
    second = np.where(n == 0, np.where(n2 >= 1, drafts2[:, 0], nxt2),
                      np.where(n >= 2, drafts[:, min(1, k1 - 1)], nxt))
    return np.stack([first, second], 1)


def _pure_verify(P, recover_from_p=False):
    def verify(ctx, drafts, q, u):
        p = np.stack([_at(P, np.concatenate([ctx, drafts[:, :i]], 1)) for i in range(drafts.shape[1] + 1)], 1)
        n, nxt = speculative_accept(p, q, drafts, u[:, :-1], u[:, -1])
        if recover_from_p:  # the classic bug: the recovered token drawn from p instead of the residual
            redo = sample(np.take_along_axis(p, n[:, None, None], 1)[:, 0], u[:, -1])
            nxt = np.where(n < drafts.shape[1], redo, nxt)
        return n, nxt
    return verify


def _graph_verify(batch, params):
    def verify(ctx, drafts, q, u):
        last = ctx[:, -1:] if ctx.shape[1] else np.full((len(ctx), 1), CONTEXT[-1])
        return batch.verify(np.concatenate([last, drafts], 1), len(CONTEXT) - 1 + ctx.shape[1], q, u, params)
    return verify


def _chi2_pvalue(pairs, P):
    """Chi-square of the observed (first, second) token pairs against the target's exact joint
    distribution P(a) * P(b | a); cells expected < 5 times are pooled."""
    exact = (P[0][:, None] * P[1]).ravel()  # [V * V]
    obs = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    exp = exact / exact.sum() * len(pairs)
    assert obs[exp == 0].sum() == 0, "produced a token pair the target gives probability 0"
    small = exp < 5
    obs, exp = np.append(obs[~small], obs[small].sum()), np.append(exp[~small], exp[small].sum())
    keep = exp > 0
    return chisquare(obs[keep], exp[keep]).pvalue


STAT_CASES = {  # name: (params, (K of the first step, K of the second))
    "t1": (SamplingParams(1.0), (1, 1)),
    "top_p+draft_t": (SamplingParams(1.0, top_p=0.8, draft_temperature=1.5), (2, 1)),
    "top_k_past_the_candidates": (SamplingParams(1.2, top_k=CAP + 3), (2, 1)),  # every row redone on the host
}


@pytest.mark.parametrize("name", list(STAT_CASES))
def test_speculative_sampling_is_lossless_and_the_test_has_teeth(logit_tables, name):
    params, ks = STAT_CASES[name]
    P, Q = _tables(logit_tables, params)
    U = np.random.default_rng(1).random((20000, 2 * sum(ks) + 2), dtype=np.float32)
    assert _chi2_pvalue(_two_tokens(Q, ks, U, _pure_verify(P)), P) > 1e-3
    assert _chi2_pvalue(_two_tokens(Q, ks, U, _pure_verify(P, recover_from_p=True)), P) < 1e-3


@pytest.mark.parametrize("name", list(STAT_CASES))
def test_fused_graph_is_lossless(logit_tables, batch, name):
    params, ks = STAT_CASES[name]
    P, Q = _tables(logit_tables, params)
    ks = (ks[0], ks[0])  # the graph scores its own rows: no table depth limit, and no second K to compile
    batch.fill(np.tile(CONTEXT[:-1], (ROWS, 1)))
    U = np.random.default_rng(2).random((ROWS, 2 * sum(ks) + 2), dtype=np.float32)
    assert _chi2_pvalue(_two_tokens(Q, ks, U, _graph_verify(batch, params)), P) > 1e-3


# ---- TargetModel's host side: prefill and step with per-row sampling -----------------------------

@pytest.fixture(scope="module", params=["in the graph", "on the host"])
def target(pair, request):
    """A TargetModel; "on the host": its graphs' top-k candidates (4) cannot hold a row's top_k 6, so
    every sampling row is redone on the host from the logits (graphs/exact.py)."""
    from mindspec.graphs import runner
    runner.init_mindspore()
    cap = runner.TOPK_CAP
    runner.TOPK_CAP = 4 if request.param == "on the host" else cap
    try:
        m = runner.TargetModel(pair[0], max_seq=32, k_buckets=(1, 2), batch_buckets=(2,), max_batch=2)
    finally:
        runner.TOPK_CAP = cap
    return m, dict(top_k=6) if request.param == "on the host" else {}


def _rows(params_list, u_acc, u_smp, q=None, seen=None, counts=None):
    from mindspec.graphs.runner import RowSampling
    return RowSampling(np.array([p.temperature for p in params_list]), np.array([p.top_k for p in params_list]),
                       np.array([p.top_p for p in params_list]),
                       np.array([p.repetition_penalty for p in params_list]), np.asarray(u_acc), np.asarray(u_smp),
                       seen=seen, q=q, counts=counts, presence=np.array([p.presence_penalty for p in params_list]),
                       frequency=np.array([p.frequency_penalty for p in params_list]))


def test_target_model_sampling_matches_the_pure_functions(pair, target):
    (m, kw), ckpt = target, pair[0]
    rng = np.random.default_rng(11)
    ref = lambda seq: reference_logits(ckpt.config, ckpt.get, seq)[-1]  # noqa: E731
    for case in range(6):
        params = SamplingParams(float(rng.uniform(0.5, 1.5)), **kw)
        prefix = [int(x) for x in rng.integers(0, V, int(rng.integers(2, 7)))]
        u = rng.random(5, dtype=np.float32)
        first = int(m.prefill([0], [0], [prefix], _rows([params], [[0.5]], [[u[0]]]))[0])
        assert first == sample(params.process(ref(prefix)), u[0])
        seq = prefix + [first]
        q = params.for_draft().process(rng.normal(0, 2, V))[None].astype(np.float32)  # [1, V]
        drafts = [sample(q[0], float(rng.random()))]
        p = np.stack([params.process(ref(seq)), params.process(ref(seq + drafts))])
        # the other row is a greedy row beside it, in the same call
        n, nxt = m.step([[first] + drafts, [first, 3]], [0, 1], [len(seq) - 1, 0], [1, 1],
                        _rows([params, SamplingParams(0.0)], [[u[1]], [0.5]], [[u[2], u[2]], [0.5, 0.5]],
                              q=np.stack([q, np.full((1, V), 1 / V)])))
        assert (int(n[0]), int(nxt[0])) == speculative_accept(p, q, drafts, u[1:2], u[2])
        seq += drafts[:n[0]] + [int(nxt[0])]
        n, nxt, lps = m.step([[seq[-1]]], [0], [len(seq) - 1], [0], _rows([params], [[0.5]], [[u[3]]]),
                             logprobs=True)
        x = ref(seq)
        assert int(nxt[0]) == sample(params.process(x), u[3])
        assert abs(lps.lp[0, 0] - (x[nxt[0]] - x.max() - np.log(np.exp(x - x.max()).sum()))) < 1e-4  # its logprob
    assert m.host_rows == (18 if kw else 0)  # each case's prefill, verify and decode: its sampling row
    # the soak prober's: a graph variant did this inside, compiled per shape on first need while serving
    # (15-40 s with every row waiting, +0.1-1 GB each): the host needs no graph of its own
    assert {key.split("(")[0] for key in m.compiled} == {"prefill", "sample"}


def test_target_model_penalised_rows_match_the_pure_functions(pair, target):
    """Rows with presence/frequency penalties through TargetModel (its "penal" graphs: runner.step's inputs in
    their order, and on the host runner._sampled's redo; the review's: only a test harness of its own had run
    them): each verify's outcome is the pure functions', the output's counts and the drafts before each
    position counted in."""
    (m, kw), ckpt = target, pair[0]
    rng = np.random.default_rng(12)
    ref = lambda seq: reference_logits(ckpt.config, ckpt.get, seq)[-1]  # noqa: E731
    host = m.host_rows
    for case in range(4):
        params = SamplingParams(float(rng.uniform(0.5, 1.5)), presence_penalty=1.5, frequency_penalty=-0.8, **kw)
        seq = [int(x) for x in rng.integers(0, V, 6)]
        m.prefill([0], [0], [seq[:-1]], _rows([params], [[0.5]], [[0.5]]))  # (the cache: positions 0..4)
        counts = np.bincount(seq[2:], minlength=V).astype(np.float32)  # the output: seq[2:]; seq[:2] the prompt
        q = params.for_draft().process(rng.normal(0, 2, (2, V))).astype(np.float32)  # [K, V]
        drafts = [int(sample(q[i], float(rng.random()))) for i in range(2)]
        u = rng.random(3, dtype=np.float32)
        n, nxt = m.step([[seq[-1]] + drafts], [0], [len(seq) - 1], [2],
                        _rows([params], [u[:2]], [[u[2]] * 3], q=q[None], counts=counts[None]))
        p = np.stack([params.process(ref(seq + drafts[:i]), None, counts + np.bincount(drafts[:i], minlength=V))
                      for i in range(3)])
        assert (int(n[0]), int(nxt[0])) == speculative_accept(p, q, drafts, u[:2], u[2]), case
    assert m.host_rows - host == (8 if kw else 0)  # each case's prefill and verify: redone on the host
    assert any(key.startswith("penal(") for key in m.compiled)


def test_values_are_quoted_in_jsons_notation_cut_and_numpy_too():
    """The review's: an array of numpy's (a library caller's top_k) raised inside the quoting, a traceback."""
    import numpy as np
    from mindspec.errors import MindspecError, shown
    from mindspec.sampling import SamplingParams
    assert [shown(v) for v in (True, None, "x", [1, None], np.int64(3), np.float32(0.5))] == \
        ["true", "null", '"x"', "[1, null]", "3", "0.5"]
    assert shown("a" * 200) == '"' + "a" * 78 + "\u2026" and len(shown("a" * 200)) == 80
    with pytest.raises(MindspecError, match=r"top_k must be an integer .*, got array\(\[1, 2\]\)$"):
        SamplingParams(top_k=np.array([1, 2]))
    # the library prober's: what JSON lacks read as a string given ("1j", "{'a'}")
    assert [shown(v) for v in (1j, {"a"}, [1, {2}])] == ["1j", "{'a'}", "[1, {2}]"]


def test_min_tokens_names_the_limit_the_request_set():
    """The batch prober's: a line with max_new_tokens 2 and min_tokens 3 was told "[0, max_tokens]", a field it
    did not set."""
    from mindspec.request import RequestError, parse
    for req, words in [({"prompt": "Hi", "min_tokens": 3, "max_new_tokens": 2}, r"in \[0, 2\] \(max_new_tokens\), got 3$"),
                       ({"prompt": "Hi", "min_tokens": 3, "max_tokens": 2}, r"in \[0, 2\] \(max_tokens\), got 3$"),
                       ({"prompt": "Hi", "min_tokens": 9}, r"in \[0, 8\] \(the default max tokens\), got 9$"),
                       ({"prompt": "Hi", "min_tokens": -1}, r"in \[0, 8\] \(the default max tokens\), got -1$")]:
        with pytest.raises(RequestError, match="^min_tokens must be an integer " + words):
            parse(req, {"max_new_tokens": 8})
    with pytest.raises(RequestError, match=r"^min_tokens must be an integer in \[0, 2147483648\], got -1$"):
        parse({"prompt": "Hi", "min_tokens": -1})
    assert parse({"prompt": "Hi", "min_tokens": 2, "max_tokens": 2})["min_tokens"] == 2


def test_host_redo_gives_minus_one_where_its_committed_position_is_not_finite():
    """A review's: the host redo (rows the graph's top-k candidates could not hold) read positions past the
    graph's own n, and sampled token 0 from NaN there (with numpy's warnings on the server's stderr). As the
    graph: next = -1 where the position it comes from is not finite; from finite positions, as before."""
    import warnings
    V, T = 6, 3
    logits = np.tile(np.array([[0.0, 2.0, 1.0, 0.5, 0.1, 0.2]]), (1, T, 1))  # [1, T, V]
    logits[0, 2] = np.nan  # the position after two drafts

    def redo(drafts, n_valid, bad=None):
        x = logits.copy()
        if bad is not None:
            x[0, :] = logits[0, 0]
            x[0, bad] = np.nan
        q = np.full((1, T - 1, V), 1.0 / V)
        out = [np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros((1, T), np.float32), None, None]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (numpy's invalid-value warnings: none)
            redo_step([0], x, np.array([[1] + drafts]), np.array([n_valid]), q, np.zeros((1, T - 1)),
                      np.full((1, T), 0.5), np.array([1.0]), np.array([0]), np.array([1.0]), np.array([1.0]),
                      np.zeros((1, V)), np.zeros((1, V)), np.zeros(1), np.zeros(1), out)
        return int(out[0][0]), int(out[1][0])

    assert redo([1, 2], 2) == (2, -1)  # both drafts kept (u = 0): next would come from the NaN position
    n, nxt = redo([1, 2], 1)  # one valid draft: next from position 1, finite
    assert n == 1 and nxt >= 0
    assert redo([1, 2], 2, bad=0)[1] == -1
    n, nxt = redo([1, 2], 2, bad=1)  # the first draft kept, the second position not finite
    assert (n, nxt) == (1, -1)
