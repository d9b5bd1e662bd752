"""K policy: the cost model's argmax, K=0 for a useless draft, EMA reactions, measured costs cached."""
import json
import math
import os

import pytest

import mindspec
from mindspec.export import export_draft
from mindspec.policy import (DynamicK, batch_best_k, expected_tokens, fit, measure_costs, rate,
                             stop_early)

BUCKETS = (1, 2, 4, 8)
V = {1: 1.15, 2: 1.2, 4: 1.3, 8: 1.6}  # verify cost / decode cost, as measured on CPU (docs/design.md)


def calls(c):
    """Draft costs {K: K calls} of a draft whose every call costs c (decodes)."""
    return {k: k * c for k in BUCKETS}


def dynamic(c, alpha0=0.8, **kw):
    return DynamicK(BUCKETS, {1: (calls(c), {0: 1.0, **V})}, alpha0=alpha0, **kw)


class One:
    """One request alone through the batch policy, as the engine runs a lone row."""

    def __init__(self, p):
        self.p, self.est = p, p.start()

    def choose(self, limit=100):
        return fit(BUCKETS, min(self.p.choose([self.est], [limit]), limit))

    def update(self, k, n):
        self.p.update(self.est, k, n)

    def reset(self):
        self.est = self.p.start()

    @property
    def alpha(self):
        return self.est.alpha


def test_expected_tokens():
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.0, 8) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(1 - 1e-12, 4) == pytest.approx(5.0)
    assert expected_tokens(0.9, 0) == 1.0


def best_k(alpha, c, v, buckets):
    """One row's K: argmax over {0} ∪ buckets of E(α, K) / (c[K] + v[K]); ties go to the smaller K."""
    return batch_best_k([alpha], [max(buckets, default=0)], c, v, buckets)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.97, 1.0])
@pytest.mark.parametrize("c", [0.05, 0.2, 0.45, 1.0])
def test_best_k_is_the_formulas_argmax(alpha, c):
    k = best_k(alpha, calls(c), V, BUCKETS)
    rates = {kk: rate(alpha, kk, calls(c), V) for kk in (0,) + BUCKETS}
    assert rates[k] == pytest.approx(max(rates.values()))
    assert rates[0] == 1.0  # plain decode: one token per unit of cost


def test_best_k_hand_computed():
    # α=0.8, c=0.1: E/cost = 1.8/1.25=1.44, 2.44/1.4=1.74, 3.36/1.7=1.98, 4.33/2.4=1.80 -> K=4
    assert best_k(0.8, calls(0.1), V, BUCKETS) == 4
    assert best_k(0.99, calls(0.02), V, BUCKETS) == 8  # a near-perfect cheap draft drafts the most
    assert best_k(0.05, calls(0.3), V, BUCKETS) == 0  # a useless draft is switched off
    assert best_k(0.99, calls(1.5), V, BUCKETS) == 0  # a draft slower than the target is too
    assert best_k(0.9, calls(0.1), V, [1, 2]) == 2  # only the buckets offered


def test_best_k_is_monotone_in_alpha():
    ks = [best_k(a / 100, calls(0.25), V, BUCKETS) for a in range(101)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 8


def test_a_rows_k_is_the_largest_bucket_that_fits_its_room():
    assert [fit(BUCKETS, min(4, lim)) for lim in (10, 4, 3, 1, 0)] == [4, 4, 2, 1, 0]
    assert fit((8,), 5) == 0  # no smaller bucket compiled: decode plainly


def test_batch_k_switches_speculation_off_where_verify_stops_paying():
    """At batch 8 a verify of K+1 positions per row costs much more than a decode of one (measured
    shape on CPU); at batch 1 it barely does: the same acceptance drafts at B=1 and not at B=8."""
    costs = {1: (calls(0.3), {0: 1.0, 1: 1.15, 2: 1.2, 4: 1.3, 8: 1.6}),
             8: (calls(0.6), {0: 1.8, 1: 2.6, 2: 3.4, 4: 5.0, 8: 8.0})}
    p = DynamicK(BUCKETS, costs, alpha0=0.6)
    rows = [p.start() for _ in range(8)]
    assert p.choose(rows[:1], [100], B=1) > 0
    assert p.choose(rows, [100] * 8, B=8) == 0
    # a batch's K maximises the summed expected tokens over the cost of the step
    alphas, caps = [0.9, 0.2, 0.6], [100, 100, 1]
    c, v = costs[8]
    k = batch_best_k(alphas, caps, c, v, BUCKETS)
    rates = {kk: sum(expected_tokens(a, fit(BUCKETS, min(kk, cap))) for a, cap in zip(alphas, caps))
             / (v[0] if kk == 0 else c[kk] + v[kk]) for kk in (0,) + BUCKETS}
    assert rates[k] == pytest.approx(max(rates.values()))


def test_a_batchs_plain_decode_is_costed_at_its_measured_v0():
    """K = 0 costs v[0], the measured plain decode of the batch, not one batch-1 decode (found by mutation
    testing: with 1.0 for it, a batch of 8 whose decode costs 1.8 never drafted where drafting pays)."""
    c, v = calls(0.2), {0: 1.8, 1: 2.0, 2: 2.4, 4: 3.2, 8: 5.0}
    # α = 0.8, K = 1: 8 · 1.8 / 2.2 = 6.5 tokens a unit against 8 / 1.8 = 4.4 plain (8 / 1.0 were the decode 1)
    assert rate(0.8, 0, c, v) == pytest.approx(1 / 1.8)
    assert batch_best_k([0.8] * 8, [1] * 8, c, v, BUCKETS) == 1
    p = DynamicK(BUCKETS, {8: (c, v)}, alpha0=0.8)
    assert p.choose([p.start() for _ in range(8)], [1] * 8, B=8) == 1


def test_ties_go_to_the_smaller_k():
    """Within a relative 1e-9 two rates are a tie, and the smaller K wins it: drafting that gains nothing
    is not done (found by mutation testing: r >= best * (1 - 1e-9) gave ties to the larger K)."""
    c, v = {1: 0.25, 2: 1.0}, {0: 1.0, 1: 1.25, 2: 2.0}
    assert rate(0.5, 1, c, v) == rate(0.5, 0, c, v) == 1.0  # E = 1.5 for a cost of 1.5: exactly a tie
    assert batch_best_k([0.5], [2], c, v, (1, 2)) == 0
    # K = 2 ahead of K = 1 by a relative 1e-12: still a tie, K = 1; ahead by 1e-6: K = 2
    c, v = {1: 0.1, 2: 0.5}, {0: 1.0, 1: 1.15}
    r1 = rate(0.5, 1, c, v)
    for ahead, k in ((1e-12, 1), (1e-6, 2)):
        v[2] = expected_tokens(0.5, 2) / (r1 * (1 + ahead)) - c[2]
        assert batch_best_k([0.5], [2], c, v, (1, 2)) == k, ahead


def test_dynamic_k_lowers_after_rejections_and_raises_after_full_acceptances():
    p = One(dynamic(0.1, alpha0=0.8))
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
    p = One(dynamic(0.3, alpha0=0.8, probe_every=5))
    seq = []
    for _ in range(40):
        k = p.choose(100)
        p.update(k, 0)
        seq.append(k)
    tail = seq[20:]
    assert tail.count(0) >= 0.75 * len(tail), seq  # mostly plain decoding...
    assert 1 in tail  # ...with a one-token probe every probe_every plain steps
    assert max(tail) == 1


def test_a_probe_comes_after_exactly_probe_every_plain_steps():
    """A useless draft: probe_every plain steps, then one probe of the smallest bucket, and again (found by
    mutation testing: plain_steps > probe_every probed a step late)."""
    for every in (16, 3):
        p = dynamic(0.3, alpha0=0.0, probe_every=every)
        est = p.start()
        assert [p.choose([est], [100]) for _ in range(2 * (every + 1))] == ([0] * every + [1]) * 2, every


def test_no_probe_where_even_full_acceptance_would_not_pay():
    """A batch too large for the draft's cost (found: at B=8 a draft costing ~B times one row's call ran
    K=0 and still probed every 16 steps, each probe feeding every row's 16-token lag): no probes there;
    the same draft probes at a batch where drafting could pay."""
    costly = DynamicK(BUCKETS, {8: (calls(3.0), {0: 1.25, 1: 1.5, 2: 1.8, 4: 2.4, 8: 3.6}),
                                1: (calls(0.3), {0: 1.0, **V})},
                      alpha0=0.9, probe_every=4)
    assert not costly.can_pay(8, 8) and costly.can_pay(1, 1)
    rows = [costly.start() for _ in range(8)]
    assert [costly.choose(rows, [100] * 8, B=8) for _ in range(20)] == [0] * 20
    one = [costly.start()]
    for e in one:
        e.acc = 0.0  # a lone row whose estimate says useless: plain steps, then a probe
    assert 1 in [costly.choose(one, [100], B=1) for _ in range(10)]
    # a probe first feeds each row the probe_every tokens it missed, one call a row (found on that CPU, where
    # its draft feeds ~8 ms a token a row: B=8 probes fed rows that had skipped their prompts, 0.69-0.76x
    # target-only): where full acceptance would pay but not after that catch-up, no probes either
    costs = {8: (calls(0.5), {0: 1.25, 1: 1.5, 2: 1.8, 4: 2.4, 8: 3.6}), 1: (calls(0.3), {0: 1.0, **V})}
    assert DynamicK(BUCKETS, costs, probe_every=4).can_pay(8, 8)
    fed = DynamicK(BUCKETS, costs, alpha0=0.9, probe_every=4, feed=0.2)
    assert not fed.can_pay(8, 8) and fed.can_pay(1, 1)
    rows = [fed.start() for _ in range(8)]
    for e in rows:
        e.acc = 0.0
    assert [fed.choose(rows, [100] * 8, B=8) for _ in range(20)] == [0] * 20


def test_a_row_whose_draft_fell_behind_is_fed_only_if_the_catch_up_pays_back():
    """Drafting after plain steps or a skipped prompt first feeds a row what its draft missed, a call a row
    (found on a CPU whose draft feeds ~8 ms a token a row: at B=8 one K=2 step fed 8 rows their prompts,
    0.84x target-only). Per row: its catch-up must pay back over the tokens it has left at the batch's
    rates; rows that do not pay sit out (the engine gives them no room)."""
    costs = {8: (calls(0.2), {0: 1.6, 1: 1.7, 2: 1.8, 4: 2.0, 8: 2.6})}
    p = DynamicK(BUCKETS, costs, alpha0=0.9, probe_every=0, feed=0.1)
    rows = [p.start() for _ in range(8)]
    a, caps = [e.alpha for e in rows], [100] * 8
    assert p.choose(rows, caps, B=8) > 0  # drafting pays once caught up
    assert p.catch_ups_pay(8, a, caps, [(0, 40)] * 8) == [True] * 8  # nothing missed
    assert p.catch_ups_pay(8, a, caps, [(60, 40)] * 8) == [False] * 8  # 60 tokens a row for 40 left: no
    assert p.catch_ups_pay(8, a, caps, [(60, 2000)] * 8) == [True] * 8  # for 2000 left: yes
    assert p.catch_ups_pay(8, a, caps, [(0, 40)] * 6 + [(60, 40), (60, 2000)]) == [True] * 6 + [False, True]
    assert p.choose(rows, [100] * 6 + [0, 100], B=8) > 0  # the row that sits out does not stop the others
    assert p.choose(rows, [0] * 8, B=8) == 0
    free = DynamicK(BUCKETS, costs, alpha0=0.9, probe_every=0)  # catch-up cost unknown (0): always fed
    assert free.catch_ups_pay(8, a, caps, [(60, 40)] * 8) == [True] * 8
    # where the batch would not draft anyway there is nothing to sit out of (a probe prices its own catch-up)
    assert DynamicK(BUCKETS, costs, alpha0=0.1, feed=0.1).catch_ups_pay(8, [0.1] * 8, caps, [(60, 40)] * 8) == [True] * 8


def test_a_new_rows_prompt_is_fed_to_the_draft_only_if_its_catch_up_pays_back():
    """A new dynamic-K row's draft is fed its prompt if the batch would draft for it and its catch-up pays
    back over the tokens it may commit, were every row like it (found through the server on that CPU: at
    8 clients every new row fed the draft ~50 uncached prompt tokens for 48 new ones, 29 tok/s vs 37
    target-only); a cached prompt costs nothing to feed."""
    costs = {8: (calls(0.2), {0: 1.6, 1: 1.7, 2: 1.8, 4: 2.0, 8: 2.6}),
             1: (calls(0.2), {0: 1.0, **V})}
    p = DynamicK(BUCKETS, costs, alpha0=0.9, probe_every=0, feed=0.1)
    assert p.feeds_new_row(8, 8, 0, 48) and p.feeds_new_row(8, 8, 80, 2000)
    assert not p.feeds_new_row(8, 8, 80, 48)
    assert p.feeds_new_row(1, 1, 80, 48)  # alone, drafting gains more per token: it pays there
    assert not DynamicK(BUCKETS, costs, alpha0=0.1, feed=0.1).feeds_new_row(1, 1, 0, 48)  # would not draft


def test_a_batch_drafts_by_the_prior_a_new_request_starts_from():
    """would_draft: what the policy's first step would choose for n new rows (found: at B=4, where full
    acceptance pays and the acceptance seen does not, new rows fed their prompts to a draft the policy
    never ran). It follows the prior as acceptance is seen; can_pay is the same at full acceptance."""
    p = DynamicK(BUCKETS, {4: (calls(0.5), {0: 1.3, 1: 1.6, 2: 1.9, 4: 2.5, 8: 3.5})}, alpha0=0.5)
    assert p.can_pay(4, 4) and not p.would_draft(4, 4)
    assert p.choose([p.start() for _ in range(4)], [100] * 4, B=4) == 0  # what would_draft foresaw
    est = p.start()
    for _ in range(4):
        p.update(est, 8, 8)  # the draft turns out good: the prior a new request starts from rises
    assert p.would_draft(4, 4) and p.choose([p.start() for _ in range(4)], [100] * 4, B=4) > 0


def test_dynamic_k_respects_limit_and_resets():
    p = One(dynamic(0.05, alpha0=0.95))
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
    p = One(dynamic(0.1, alpha0=0.5, decay=1.0, prior_weight=0.0 + 1e-12))
    for k, n in [(4, 4), (4, 2), (2, 0)]:  # 6 accepted, 2 rejections
        p.update(k, n)
    assert p.alpha == pytest.approx(6 / 8)
    with pytest.raises(mindspec.MindspecError):
        DynamicK((1, 16), {1: (calls(0.1), V)})  # no cost for bucket 16


def test_stop_early():
    assert stop_early(0.2, 0.5) and not stop_early(0.6, 0.5) and not stop_early(0.01, None)
    assert not stop_early(0.5, 0.5)  # strictly below (found by mutation testing: <= stopped at it)


@pytest.fixture(scope="module")
def pipe(tiny_target, tiny_draft_ckpt, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pdraft") / "d.onnx")
    export_draft(tiny_draft_ckpt[0], path)
    return mindspec.load(target=tiny_target[0], draft=path, k=4, max_seq=128, buckets=(1, 2, 4), max_batch=2,
                         batch_buckets=(1, 2))


def test_processes_measuring_at_once_keep_each_others_costs(tmp_path):
    """Found by a review of the suite: costs.json's update (read, add its pair, replace) was not locked, so two
    processes measuring at once (a server and a batch job started together) dropped each other's pairs,
    measured again at their next start."""
    import subprocess
    import sys
    draft = tmp_path / "d.onnx"
    draft.write_bytes(b"")  # (a pair is kept while its draft file exists)
    code = ("import sys\nfrom mindspec.policy import _write_costs\n"
            "for i in range(40):\n"
            f"    _write_costs({{f'fp{{sys.argv[1]}}-{{i}}|{draft}|0|0': {{'c': {{}}, 'v': {{}}}}}})\n")
    env = dict(os.environ, MINDSPEC_HOME=str(tmp_path))
    ps = [subprocess.Popen([sys.executable, "-c", code, str(w)], env=env) for w in range(4)]
    assert [p.wait(timeout=120) for p in ps] == [0] * 4
    assert len(json.loads((tmp_path / "costs.json").read_text())) == 4 * 40


def test_measure_costs_and_cache(pipe, tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEC_HOME", str(tmp_path))
    stale = {"fp|/nonexistent/gone.onnx|1|2|s128|CPU": {"c": 0.1, "v": {"1": 1.0}}}
    (tmp_path / "costs.json").write_text(json.dumps(stale))
    costs = measure_costs(pipe, (1, 2), reps=3)
    assert set(costs) == {1, 2}
    for c, v in costs.values():
        assert set(c) == set(pipe.target.k_buckets) and set(v) == {0} | set(pipe.target.k_buckets)
        assert all(0 < x < 50 and math.isfinite(x) for x in list(c.values()) + list(v.values()))
        # K draft calls, the first of them feeding two tokens a row: c[1] = that call, each further K one call
        call = c[2] - c[1]
        assert 0 < call <= c[1] and c[4] == pytest.approx(c[1] + 3 * call)
    assert costs[1][1][0] == 1.0  # batch 1's decode is the unit
    assert 0 < costs.feed < 10  # a row's catch-up per token
    assert list(pipe.proposer.session.pos) == [0, 0]
    saved = json.loads((tmp_path / "costs.json").read_text())
    assert len(saved) == 2  # one entry per batch size; the entry of a draft file that is gone was dropped
    # a float16 prober's: the key had no dtype, and a float16 target took a float32 one's costs (ratios ~3x off)
    assert all(f"|{pipe.dtype}|" in key for key in saved) and pipe.dtype == "float32"
    for entry in saved.values():
        entry["c"] = {k: 123.0 for k in entry["c"]}  # a cached value is returned without measuring again
        entry["feed"] = 0.5
        entry["others_cpu"] = 0.0  # measured quietly (the suite's other worker may have been busy)
    (tmp_path / "costs.json").write_text(json.dumps(saved))
    again = measure_costs(pipe, (2,))
    assert again[2][0] == {1: 123.0, 2: 123.0, 4: 123.0} and again.feed == 0.5
    assert list(pipe.proposer.session.pos) == [0, 0]
    for entry in saved.values():
        entry["c"] = 0.5  # the format before: one draft call's cost, not each K's; measured again
    (tmp_path / "costs.json").write_text(json.dumps(saved))
    assert set(measure_costs(pipe, (2,), reps=1)[2][0]) == {1, 2, 4}
    # the pipeline still generates correctly afterwards
    a = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=10, speculate=False)
    b = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=10, k=2)
    assert a.token_ids == b.token_ids


def test_measured_verify_costs_are_at_least_decode_and_monotone(pipe, tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEC_HOME", str(tmp_path))
    for _, v in measure_costs(pipe, (1, 2), reps=1, cache=False).values():
        ks = sorted(v)
        assert ks[0] == 0 and all(v[a] <= v[b] for a, b in zip(ks, ks[1:]))


def test_a_costs_file_that_cannot_be_written_is_said_once_and_the_costs_are_used(pipe, tmp_path, monkeypatch, capfd):
    """Found by a user probe: with MINDSPEC_HOME on a full disk, saving the measured costs ended the command with
    an OSError traceback (ENOSPC) and left an empty costs.json.PID.tmp behind. The file is a cache: one warning
    line, the tmp file removed, and the costs measured are used. (The full disk: the tmp file's name is a link
    to /dev/full, every write to which fails with ENOSPC.)"""
    from mindspec import policy
    monkeypatch.setenv("MINDSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(policy, "_warned", set(), raising=False)  # (a fresh process: nothing said yet)
    tmp = tmp_path / f"costs.json.{os.getpid()}.tmp"
    (tmp_path / "costs.json").write_text("{}")
    for _ in range(2):
        os.symlink("/dev/full", tmp)
        policy._write_costs({f"fp|{tmp_path}|0|0": {"c": {}, "v": {}}})
        assert not os.path.lexists(tmp) and (tmp_path / "costs.json").read_text() == "{}"
    os.symlink("/dev/full", tmp)
    costs = measure_costs(pipe, (1,), reps=1)  # measured, not saved: used all the same
    assert set(costs) == {1} and set(costs[1][1]) == {0} | set(pipe.target.k_buckets)
    assert not os.path.lexists(tmp) and (tmp_path / "costs.json").read_text() == "{}"
    out, err = capfd.readouterr()
    assert err == (f"mindspec: warning: cannot save the measured costs to {tmp_path / 'costs.json'} (No space left "
                   "on device); they are measured again at the next start\n"), err  # once
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")


def test_others_share_counts_the_cpu_time_of_other_processes_only():
    """The share of the CPUs' time other processes took between two samples: the CPUs' busy time less this
    process's (and its tensor-parallel siblings', counted alike), over the CPUs' whole time."""
    from mindspec.policy import others_share
    # (monotonic s, busy s of the CPUs, this process's CPU s, number of CPUs)
    assert others_share((0.0, 10.0, 1.0, 2), (2.0, 13.6, 4.6, 2)) == 0.0  # all of it ours
    assert others_share((0.0, 10.0, 1.0, 2), (2.0, 14.0, 2.0, 2)) == pytest.approx(0.75)  # 3 of 4 CPU s
    assert others_share((0.0, 10.0, 1.0, 2), (2.0, 14.0, 2.0, 2), procs=2) == pytest.approx(0.5)  # a sibling rank
    assert others_share((0.0, 0.0, 0.0, 2), (1.0, 0.0, 0.5, 2)) == 0.0  # tick rounding: never below 0
    assert others_share(None, (1.0, 0.0, 0.5, 2)) is None and others_share((1.0, 0, 0, 2), (1.0, 0, 0, 2)) is None


def test_a_cpu_quota_counts_its_cgroup_not_the_host(tmp_path):
    """Found by a review: a container's /proc/stat is the whole host's, so two busy processes beside this one
    under a 2-CPU quota on a 64-CPU host were 3% of it and their costs kept as quiet. Under a quota (cgroup v2's
    cpu.max or v1's cfs_quota_us, on this cgroup or an ancestor) the cgroup's own use is counted, per quota CPU."""
    from mindspec.policy import cgroup_cpu
    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    (root / "a" / "b").mkdir(parents=True)
    proc.write_text("0::/a/b\n")
    (root / "a" / "b" / "cpu.max").write_text("max 100000\n")  # no quota here: its parent's
    (root / "a" / "cpu.max").write_text("200000 100000\n")
    (root / "a" / "cpu.stat").write_text("usage_usec 5000000\nuser_usec 4000000\n")
    assert cgroup_cpu(str(proc), str(root)) == (5.0, 2.0)
    (root / "a" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu(str(proc), str(root)) is None  # no quota anywhere: /proc/stat's CPUs
    proc.write_text("4:memory:/x\n3:cpu,cpuacct:/c\n0::/\n")  # cgroup v1
    (root / "cpu" / "c").mkdir(parents=True)
    (root / "cpuacct" / "c").mkdir(parents=True)
    (root / "cpu" / "c" / "cpu.cfs_quota_us").write_text("150000\n")
    (root / "cpu" / "c" / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpuacct" / "c" / "cpuacct.usage").write_text("2500000000\n")
    assert cgroup_cpu(str(proc), str(root)) == (2.5, 1.5)
    (root / "cpu" / "c" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu(str(proc), str(root)) is None
    assert cgroup_cpu(str(tmp_path / "none"), str(root)) is None


def _spinning():
    """A busy process for each CPU this process may run on."""
    import subprocess
    import sys
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in os.sched_getaffinity(0)]


def test_cpu_sample_sees_other_processes_busy():
    import time
    from mindspec.policy import cpu_sample, others_share
    procs = _spinning()
    try:
        time.sleep(0.3)
        before = cpu_sample()
        time.sleep(1.0)
        after = cpu_sample()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert others_share(before, after) >= 0.4, (before, after)  # a busy loop for each CPU


def test_costs_measured_while_other_processes_load_the_cpu_are_measured_again_at_the_next_start(pipe, tmp_path,
                                                                                                 monkeypatch):
    """Found by measuring: the default pair's costs measured while two busy processes shared this 2-core CPU put a
    plain decode of 8 rows at 27.9 batch-1 decodes (1.6 quiet) and a verify of K=8 at one row at 26.6 (1.4), so K=8
    won at any acceptance; kept in costs.json, every later start used them (a server run at 8 clients on costs
    measured while tests ran: 1.94x one client, 2.15x with costs measured again). Such costs serve the command that
    measured them but are not trusted by the next; costs measured quietly are reused."""
    import time
    monkeypatch.setenv("MINDSPEC_HOME", str(tmp_path))
    procs = _spinning()
    try:
        time.sleep(0.3)
        measure_costs(pipe, (1, 2), reps=3)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    saved = json.loads((tmp_path / "costs.json").read_text())
    assert len(saved) == 2 and all(e["others_cpu"] >= 0.25 for e in saved.values()), saved
    for e in saved.values():
        e["c"] = {k: 123.0 for k in e["c"]}  # what a reuse would return
    (tmp_path / "costs.json").write_text(json.dumps(saved))
    assert measure_costs(pipe, (2,), reps=1)[2][0] != {1: 123.0, 2: 123.0, 4: 123.0}  # measured again
    for others, reused in ((0.0, True), (None, True), ("missing", False)):  # None: a host without /proc/stat
        for e in saved.values():
            e["c"] = {k: 123.0 for k in e["c"]}
            e.pop("others_cpu", None)
            if others != "missing":  # (costs of an earlier version: not known to be quiet)
                e["others_cpu"] = others
        (tmp_path / "costs.json").write_text(json.dumps(saved))
        assert (measure_costs(pipe, (2,), reps=1)[2][0] == {1: 123.0, 2: 123.0, 4: 123.0}) == reused, others
    for e in saved.values():  # a host busy all the time: $MINDSPEC_COSTS_NOISY 1 keeps every measurement
        e["c"], e["others_cpu"] = {k: 123.0 for k in e["c"]}, 0.6
    (tmp_path / "costs.json").write_text(json.dumps(saved))
    monkeypatch.setenv("MINDSPEC_COSTS_NOISY", "1")
    assert measure_costs(pipe, (2,), reps=1)[2][0] == {1: 123.0, 2: 123.0, 4: 123.0}
    monkeypatch.setenv("MINDSPEC_COSTS_NOISY", "lots")
    with pytest.raises(mindspec.MindspecError, match=r"\$MINDSPEC_COSTS_NOISY must be a share of the CPUs' time between 0 "
                                            r'and 1, got "lots"'):
        measure_costs(pipe, (2,), reps=1)
