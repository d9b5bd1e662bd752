"""K policy: the cost model's argmax, K=0 for a useless draft, EMA reactions, measured costs cached."""
import json
import math

import pytest

import mindspec
from mindspec.export import export_draft
from mindspec.policy import DynamicK, FixedK, best_k, expected_tokens, measure_costs, rate, stop_early

BUCKETS = (1, 2, 4, 8)
V = {1: 1.15, 2: 1.2, 4: 1.3, 8: 1.6}  # verify cost / decode cost, as measured on CPU (DESIGN.md)


def test_expected_tokens():
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.0, 8) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(1 - 1e-12, 4) == pytest.approx(5.0)
    assert expected_tokens(0.9, 0) == 1.0


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.97, 1.0])
@pytest.mark.parametrize("c", [0.05, 0.2, 0.45, 1.0])
def test_best_k_is_the_formulas_argmax(alpha, c):
    k = best_k(alpha, c, V, BUCKETS)
    rates = {kk: rate(alpha, kk, c, V) for kk in (0,) + BUCKETS}
    assert rates[k] == pytest.approx(max(rates.values()))
    assert rates[0] == 1.0  # plain decode: one token per unit of cost


def test_best_k_hand_computed():
    # α=0.8, c=0.1: E/cost = 1.8/1.25=1.44, 2.44/1.4=1.74, 3.36/1.7=1.98, 4.33/2.4=1.80 -> K=4
    assert best_k(0.8, 0.1, V, BUCKETS) == 4
    assert best_k(0.99, 0.02, V, BUCKETS) == 8  # a near-perfect cheap draft drafts the most
    assert best_k(0.05, 0.3, V, BUCKETS) == 0  # a useless draft is switched off
    assert best_k(0.99, 1.5, V, BUCKETS) == 0  # a draft slower than the target is too
    assert best_k(0.9, 0.1, V, [1, 2]) == 2  # only the buckets offered


def test_best_k_is_monotone_in_alpha():
    ks = [best_k(a / 100, 0.25, V, BUCKETS) for a in range(101)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8


def test_fixed_k_fits_the_room_left():
    p = FixedK(4, BUCKETS)
    assert [p.choose(lim) for lim in (10, 4, 3, 1, 0)] == [4, 4, 2, 1, 0]
    p.update(4, 0)
    assert p.choose(10) == 4
    assert FixedK(8).choose(5) == 0  # no smaller bucket compiled: decode plainly


def test_dynamic_k_lowers_after_rejections_and_raises_after_full_acceptances():
    p = DynamicK(BUCKETS, c=0.1, v=V, alpha0=0.8)
    k0 = p.choose(100)
    assert k0 == 4
    ks = []
    for _ in range(20):  # the draft's first token is rejected every step
        k = p.choose(100)
        p.update(k, 0)
        ks.append(k)
    assert ks[:4] == [4, 2, 1, 0], ks  # each rejection lowers K, down to plain decoding
    assert ks[-6:] == [0] * 6, ks  # once MIN_SEEN drafts failed, even the prior says: do not draft
    low = ks[-1]
    ks = []
    for _ in range(6):
        k = max(p.choose(100), 1)
        p.update(k, k)  # everything accepted
        ks.append(p.choose(100))
    assert ks[-1] > low and ks[-1] == 8 and ks == sorted(ks), ks
    # one rejection after a long accepted run drops α, but not all the way
    a = p.alpha
    p.update(8, 3)
    assert p.alpha < a and p.alpha > 0.5


def test_dynamic_k_switches_a_useless_draft_off_and_probes_now_and_then():
    p = DynamicK(BUCKETS, c=0.3, v=V, alpha0=0.8, probe_every=5)
    seq = []
    for _ in range(40):
        k = p.choose(100)
        p.update(k, 0)
        seq.append(k)
    tail = seq[20:]
    assert tail.count(0) >= 0.75 * len(tail), seq  # mostly plain decoding...
    assert 1 in tail  # ...with a one-token probe every probe_every plain steps
    assert max(tail) == 1


def test_dynamic_k_respects_limit_and_resets():
    p = DynamicK(BUCKETS, c=0.05, v=V, alpha0=0.95)
    assert p.choose(100) == 8 and p.choose(5) == 4 and p.choose(0) == 0
    for _ in range(5):
        p.update(8, 0)
    assert p.alpha < 0.3
    a = p.alpha
    p.update(0, 0)  # a plain step: no news, the estimate drifts back toward the prior (α0 so far)
    assert a < p.alpha < 0.95
    p.reset()  # too little seen yet: a new request starts from α0
    assert p.alpha == pytest.approx(0.95)
    for _ in range(4):
        p.update(8, 2)  # 8 accepted, 4 rejected; with the 5 rejections above: 8 / 17
    p.reset()  # enough seen: the next request starts from the draft's observed acceptance
    assert p.alpha == pytest.approx(8 / 17) and p.choose(100) < 8


def test_dynamic_k_alpha_is_the_pooled_geometric_estimate():
    p = DynamicK(BUCKETS, c=0.1, v=V, alpha0=0.5, decay=1.0, prior_weight=0.0 + 1e-12)
    for k, n in [(4, 4), (4, 2), (2, 0)]:  # 6 accepted, 2 rejections
        p.update(k, n)
    assert p.alpha == pytest.approx(6 / 8)
    with pytest.raises(mindspec.MindspecError):
        DynamicK((1, 16), c=0.1, v=V)  # no cost for bucket 16


def test_stop_early():
    assert stop_early(0.2, 0.5) and not stop_early(0.6, 0.5) and not stop_early(0.01, None)


@pytest.fixture(scope="module")
def pipe(tiny_target, tiny_draft_ckpt, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pdraft") / "d.onnx")
    export_draft(tiny_draft_ckpt[0], path)
    return mindspec.load(target=tiny_target[0], draft=path, k=4, max_seq=128)


def test_measure_costs_and_cache(pipe, tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEC_HOME", str(tmp_path))
    stale = {"fp|/nonexistent/gone.onnx|1|2|s128|CPU": {"c": 0.1, "v": {"1": 1.0}}}
    (tmp_path / "costs.json").write_text(json.dumps(stale))
    c, v = measure_costs(pipe, reps=3)
    assert 0 < c < 50 and set(v) == set(pipe.target.buckets)
    assert all(0 < x < 50 and math.isfinite(x) for x in v.values())
    assert pipe.target.pos == 0 and pipe.proposer.session.pos == 0
    saved = json.loads((tmp_path / "costs.json").read_text())
    assert len(saved) == 1  # the entry of a draft file that no longer exists was dropped
    (entry,) = saved.values()
    entry["c"] = 123.0  # a cached value is returned without measuring again
    (tmp_path / "costs.json").write_text(json.dumps(saved))
    assert measure_costs(pipe)[0] == 123.0
    # the pipeline still generates correctly afterwards
    a = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=10, speculate=False)
    b = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=10, k=2)
    assert a.token_ids == b.token_ids


def test_measured_verify_costs_are_at_least_decode_and_monotone(pipe, tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEC_HOME", str(tmp_path))
    _, v = measure_costs(pipe, reps=1, cache=False)
    ks = sorted(v)
    assert v[ks[0]] >= 1.0 and all(v[a] <= v[b] for a, b in zip(ks, ks[1:]))
