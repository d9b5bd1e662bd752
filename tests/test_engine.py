"""The batched engine: every row of a continuous batch gives exactly what it gives alone (greedy:
the target-only tokens; seeded sampling: the same text), sampling stays lossless beside other rows,
aborts and failures end only their own rows, and library use works from any entry point."""
import subprocess
import sys
import time

import numpy as np
import pytest
from scipy.stats import chisquare

import mindspec
from mindspec.checkpoint import Checkpoint
from mindspec.errors import MindspecError
from mindspec.reference import reference_logits
from mindspec.sequence import FINISHED, PREFILL

PROMPTS = [[5, 6, 7], [100, 3, 250, 17, 9], [42], list(range(10, 50)), [300, 301, 302, 7, 7, 7, 7],
           [9, 8, 7, 6, 5, 4, 3], [200, 100], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
MAX_NEW = [30, 12, 25, 7, 19, 30, 3, 22]  # rows finish at different steps; the later ones join mid-way


def calls(c):
    """Draft costs {K: K calls} of a draft whose every call costs c (decodes)."""
    return {k: k * c for k in (1, 2, 4, 8)}


@pytest.fixture(scope="module")
def draft(noisy_draft):
    return noisy_draft


@pytest.fixture(scope="module")
def pipe(tiny_target, draft):
    return mindspec.load(target=tiny_target[0], draft=draft, k=4, max_seq=128, max_batch=4, batch_buckets=(1, 2, 4))


@pytest.fixture(scope="module")
def alone(pipe):
    """Each prompt run by itself, target only: what every row of a batch must reproduce."""
    return [pipe.generate(prompt_ids=p, max_new_tokens=n, speculate=False).token_ids
            for p, n in zip(PROMPTS, MAX_NEW)]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_every_row_of_a_continuous_batch_equals_the_target_alone(pipe, alone, k):
    res = pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n, k=k) for p, n in zip(PROMPTS, MAX_NEW)])
    assert [r.token_ids for r in res] == alone
    drafted = sum(r.stats["drafted"] for r in res)
    accepted = sum(r.stats["accepted"] for r in res)
    assert 0.1 < accepted / drafted < 0.9  # the draft disagrees often, or this proves nothing
    assert all(r.stats["queue_s"] >= 0 for r in res) and max(r.stats["queue_s"] for r in res) > 0


def test_slots_follow_the_requests_not_max_batch(pipe, alone):
    """generate_many (and a batch job) sized the cache to max_batch slots however few requests came:
    --max-batch 20000 over 2 lines took 4 GB of the tiny model's memory and 50 s."""
    res = pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n) for p, n in zip(PROMPTS[:2], MAX_NEW)],
                             max_batch=64)
    assert [r.token_ids for r in res] == alone[:2]
    assert pipe.target.max_batch == 4  # the 4 slots it was loaded with: nothing rebuilt for 64


def test_generate_many_runs_at_most_max_batch_rows_at_once(pipe, alone):
    """max_batch below the engine's slots: the rest wait (found: an engine with 4 slots ran every
    request given, whatever max_batch said)."""
    running, step = [], pipe.engine.step

    def counting_step():
        running.append(len(pipe.engine.rows))
        return step()
    pipe.engine.step = counting_step
    try:
        res = pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n, k=2) for p, n in zip(PROMPTS, MAX_NEW)],
                                 max_batch=2)
    finally:
        del pipe.engine.step
    assert [r.token_ids for r in res] == alone
    assert max(running) == 2


@pytest.mark.parametrize("k", [2, "auto"])
def test_a_batch_jobs_driver_runs_at_most_max_batch_rows_at_once(pipe, alone, k):
    """The reviewer's: batch.generate_records drove the engine with a loop of its own and added every line
    at once: 4 slots filled under max_batch 2 (and with dynamic K every line then failed, KeyError: its
    costs measured for up to max_batch rows). It now runs through Pipeline.stream, generate's loop."""
    from mindspec import batch as B
    running, step = [], pipe.engine.step

    def counting_step():
        running.append(len(pipe.engine.rows))
        return step()
    pipe.engine.step = counting_step
    compiled = pipe.target.compile_s
    items = [B.Item(n, n, dict(prompt_ids=p, max_new_tokens=m, k=k))
             for n, (p, m) in enumerate(zip(PROMPTS, MAX_NEW), 1)]
    try:
        got = {item.line: body for item, body in B.generate_records(pipe, items, max_batch=2)}
    finally:
        del pipe.engine.step
    assert not [b["error"] for b in got.values() if "error" in b]  # (with "auto": KeyError: 4 on every line)
    assert [got[n]["token_ids"] for n in range(1, 9)] == alone
    assert max(running) == 2
    assert sum(b["stats"]["compile_s"] for b in got.values()) == pytest.approx(pipe.target.compile_s - compiled, abs=1e-3)


def test_rows_join_only_up_to_the_batches_whose_graphs_are_compiled(pipe, alone, monkeypatch):
    """A server compiles the larger batches' graphs while it serves (TargetModel.load_next): until a
    batch bucket's are in, no more rows run at once than the buckets below it hold, and each row is
    still the target's own."""
    running, step, t = [], pipe.engine.step, pipe.target

    def counting_step():
        n = len(running)  # steps 0-11: as if the 2-row graphs were still to compile, then the 4-row ones
        monkeypatch.setattr(t, "pending", [("prefill", 2, 32)] if n < 12 else [("greedy", 4, 5)] if n < 24 else [])
        out = step()
        running.append(len(pipe.engine.rows))
        return out
    monkeypatch.setattr(pipe.engine, "step", counting_step)
    res = pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n, k=4) for p, n in zip(PROMPTS, MAX_NEW)])
    assert [r.token_ids for r in res] == alone
    assert max(running[:12]) == 1 and max(running[12:24]) == 2 and max(running[24:]) == 4


def test_dynamic_k_and_target_only_rows_in_one_batch(pipe, alone):
    costs = {b: (calls(0.1), {0: 1.0, 1: 1.1, 2: 1.15, 4: 1.25, 8: 1.5}) for b in (1, 2, 4)}
    pipe.costs, pipe.engine.dynamic = costs, None
    kws = [dict(prompt_ids=p, max_new_tokens=n, k="auto" if i % 3 else 2, speculate=i % 4 != 1)
           for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
    res = pipe.generate_many(kws)
    assert [r.token_ids for r in res] == alone
    assert res[1].stats["drafted"] == 0 and res[0].stats["drafted"] > 0


@pytest.mark.parametrize("c, costly, alpha0", [
    (5.0, {0: 1.3, 1: 2.0, 2: 2.5, 4: 3.0, 8: 4.0}, 0.8),  # B >= 2: drafting cannot pay even fully accepted
    (0.5, {0: 1.3, 1: 1.6, 2: 1.9, 4: 2.5, 8: 3.5}, 0.5)])  # full acceptance would pay, the prior does not
def test_rows_skip_the_draft_where_the_policy_would_not_draft_and_catch_up_when_the_batch_shrinks(
        pipe, alone, monkeypatch, c, costly, alpha0):
    """Dynamic-K rows admitted at a batch where the policy would not draft for them (costs: B >= 2) feed
    the draft nothing (found: at B=8, then at B=4, such rows still fed every prompt to the draft and
    waited for it, 0.63-0.86x target-only on a CPU whose 8-bit draft costs ~B times one row). When the
    batch shrinks to one row, where drafting pays, a row far behind catches up DRAFT_CATCHUP tokens a
    step (8 here) and then drafts; every row is still the target's own output."""
    from mindspec.policy import DynamicK
    monkeypatch.setattr("mindspec.engine.DRAFT_CATCHUP", 8)
    pipe.costs = {1: (calls(0.05), {0: 1.0, 1: 1.05, 2: 1.1, 4: 1.2, 8: 1.4}),
                  **{B: (calls(c), costly) for B in (2, 4)}}
    pipe.engine.dynamic = DynamicK((1, 2, 4, 8), pipe.costs, alpha0=alpha0, probe_every=0)
    monkeypatch.setattr(pipe, "_dynamic_for", lambda sizes: None)  # keep these costs
    fed, drafting_at = [], []
    prop = pipe.engine.proposer
    real, propose = prop.prefill, prop.get_candidates
    monkeypatch.setattr(prop, "prefill", lambda chunks, *a: (fed.append((len(pipe.engine.rows), dict(chunks))),
                                                             real(chunks, *a)))
    monkeypatch.setattr(prop, "get_candidates", lambda *a: (drafting_at.append(len(pipe.engine.rows)), propose(*a))[1])
    res = pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n, k="auto") for p, n in zip(PROMPTS, MAX_NEW)])
    assert [r.token_ids for r in res] == alone
    assert drafting_at and set(drafting_at) == {1}  # the draft ran only for a row alone...
    assert {n for n, f in fed if f} == {1}  # ...and was fed only then: the rows beside others skipped their prompts
    assert max(len(c) for _, f in fed for c in f.values()) == 8  # the last row caught up 8 tokens a step


@pytest.mark.parametrize("feed", [0.0, 50.0])
def test_a_rows_prompt_is_fed_to_the_draft_only_if_its_catch_up_pays_back(pipe, alone, monkeypatch, feed):
    """Where drafting pays once a row's draft holds its prompt, a draft whose catch-up costs `feed` decodes
    a token a row: free, every dynamic-K row's prompt is fed and the rows draft; at 50 no row's prompt
    pays back over its tokens (found through the server on a CPU whose draft feeds ~8 ms a token a row:
    at 8 clients each new row fed the draft ~50 uncached prompt tokens for 48 new ones), so the draft
    is fed no prompt and runs only for rows it missed no more of than a step feeds anyway (one or two
    tokens: the prompts [42] and [200, 100]). Every row is still the target's own output."""
    from mindspec.policy import DynamicK
    pipe.costs = {B: (calls(0.05), {0: 1.0, 1: 1.05, 2: 1.1, 4: 1.2, 8: 1.4}) for B in (1, 2, 4)}
    pipe.engine.dynamic = DynamicK((1, 2, 4, 8), pipe.costs, alpha0=0.9, probe_every=0, feed=feed)
    monkeypatch.setattr(pipe, "_dynamic_for", lambda sizes: None)  # keep these costs
    fed, drafted = [], []
    prop = pipe.engine.proposer
    real, propose = prop.prefill, prop.get_candidates
    monkeypatch.setattr(prop, "prefill", lambda chunks, *a: (fed.append(dict(chunks)), real(chunks, *a)))
    monkeypatch.setattr(prop, "get_candidates",
                        lambda who, *a: (drafted.extend(PROMPTS.index(r.prompt_ids) for r in who if r), propose(who, *a))[1])
    res = pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n, k="auto") for p, n in zip(PROMPTS, MAX_NEW)])
    assert [r.token_ids for r in res] == alone
    assert any(fed) == (not feed)
    assert set(drafted) <= {2, 6} if feed else set(drafted) == set(range(8))


def test_seeded_sampling_rows_give_the_same_text_alone_and_in_a_batch(pipe, alone):
    """Greedy rows stay exact beside sampling rows; a seeded sampling row gives, token for token, what it
    gives alone (fixed K: each row draws its uniforms by position from its own seed)."""
    kws = [dict(prompt_ids=p, max_new_tokens=n, k=2) for p, n in zip(PROMPTS, MAX_NEW)]
    for i in (1, 2, 5, 6):
        kws[i].update(temperature=1.5, top_p=0.9, seed=100 + i, draft_temperature=1.7)
    kws[5].update(repetition_penalty=1.3, top_k=40)
    res = pipe.generate_many(kws)
    for i, r in enumerate(res):
        if "seed" in kws[i]:
            assert r.token_ids == pipe.generate(**kws[i]).token_ids, i
        else:
            assert r.token_ids == alone[i], i
    assert res[2].token_ids != alone[2]  # really sampled


def test_logprobs_are_the_targets_own_and_change_no_token(pipe, alone, tiny_target):
    """logprobs=n: each token's logprob under the target's raw logits and its n best alternatives
    (numpy reference), for greedy and seeded sampling rows beside rows that ask none; the tokens are
    those of the same requests without logprobs."""
    kws = [dict(prompt_ids=p, max_new_tokens=n, k=2) for p, n in zip(PROMPTS, MAX_NEW)]
    kws[2].update(temperature=1.5, top_p=0.9, seed=102)
    sampled = pipe.generate(**kws[2]).token_ids
    for i in (0, 2, 3):
        kws[i]["logprobs"] = 3
    kws[4]["logprobs"] = 0
    res = pipe.generate_many(kws)
    ck = Checkpoint(tiny_target[0])
    for i, r in enumerate(res):
        assert r.token_ids == (sampled if i == 2 else alone[i]), i
        if "logprobs" not in kws[i]:
            assert r.logprobs is None
            continue
        assert len(r.logprobs) == len(r.token_ids)
        ref = reference_logits(ck.config, ck.get, PROMPTS[i] + r.token_ids)[len(PROMPTS[i]) - 1:-1]  # [n, V]
        ref = ref - ref.max(-1, keepdims=True)
        ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
        for j, (lp, top) in enumerate(r.logprobs):
            assert lp == pytest.approx(ref[j, r.token_ids[j]], abs=1e-4), (i, j)
            n_top = kws[i]["logprobs"]
            assert [t for t, _ in top] == list(np.argsort(-ref[j], kind="stable")[:n_top]), (i, j)
            assert [x for _, x in top] == pytest.approx(np.sort(ref[j])[::-1][:n_top], abs=1e-4)
            if i != 2 and n_top:
                assert top[0][0] == r.token_ids[j]  # greedy: the token is the best one


def test_second_token_is_lossless_beside_other_rows(pipe, tiny_target):
    """The second token of a sampled row (the first one decided by accept/reject) follows the
    target's exact marginal while greedy rows run in the same steps."""
    T, prompt, n = 3.0, [5, 6, 7], 480
    ck = Checkpoint(tiny_target[0])
    soft = lambda x: np.exp(x / T - (x / T).max()) / np.exp(x / T - (x / T).max()).sum()  # noqa: E731
    p1 = soft(reference_logits(ck.config, ck.get, prompt)[-1]).astype(np.float64)
    p2 = sum(p1[a] * soft(reference_logits(ck.config, ck.get, prompt + [int(a)])[-1]) for a in np.flatnonzero(p1 > 1e-9))
    kws = []
    for s in range(n):
        # 3: two tokens left after the prefill's first, so the step deciding the second drafts (capped to 1)
        kws.append(dict(prompt_ids=prompt, max_new_tokens=3, temperature=T, seed=5000 + s, k=2))
        if s % 8 == 0:
            kws.append(dict(prompt_ids=PROMPTS[s % 8], max_new_tokens=6))
    res = pipe.generate_many(kws)
    assert all(r.stats["drafted"] >= 1 for r, kw in zip(res, kws) if "seed" in kw)  # decided by accept/reject
    seen = np.bincount([r.token_ids[1] for r, kw in zip(res, kws) if "seed" in kw], minlength=len(p2)).astype(float)
    big = p2 * n >= 5
    obs, exp = np.append(seen[big], seen[~big].sum()), np.append(p2[big], p2[~big].sum())
    assert chisquare(obs, exp / exp.sum() * obs.sum()).pvalue > 1e-3


def test_abort_ends_only_that_row(pipe, alone):
    eng = pipe.engine
    pipe.prepare([], max_batch=4)
    reqs = [pipe.request(prompt_ids=p, max_new_tokens=n, k=4) for p, n in zip(PROMPTS[:3], MAX_NEW[:3])]
    waiting = pipe.request(prompt_ids=[7, 8], max_new_tokens=5)
    for r in reqs + [waiting]:
        eng.add(r)
    # (a user probe's: the same request added twice ran as two rows of one request, both in prefill for ever, and
    # the next generate spun) a request the engine holds, or one that has run, is refused
    for again in (reqs[0], waiting):
        with pytest.raises(MindspecError, match="the engine holds this request already"):
            eng.add(again)
    ran = pipe.request(prompt_ids=[7], max_new_tokens=1)
    ran.output.append(5)  # (as a request that ran: its output, its position)
    with pytest.raises(MindspecError, match="a request runs once: make one per generation"):
        eng.add(ran)
    eng.abort(waiting.id)  # still queued
    for _ in range(3):
        eng.step()
    eng.abort(reqs[0].id)  # running
    while eng.has_work:
        eng.step()
    assert reqs[0].finish_reason == "abort" and waiting.finish_reason == "abort"
    assert reqs[0].output == alone[0][:len(reqs[0].output)] and len(reqs[0].output) < MAX_NEW[0]
    assert [r.output for r in reqs[1:]] == alone[1:3]
    assert sorted(eng.free_slots) == [0, 1, 2, 3] and not eng.rows


def test_a_request_changed_after_it_was_made_is_checked_again(pipe, alone):
    """A user probe's: a Request's fields changed after pipe.request() ran unchecked: ids outside the vocabulary
    reached MindSpore's Gather (a many-line RuntimeError), an emptied prompt an AssertionError, and a max_new_tokens
    past the cache was cut unsaid. The pipeline stays as it was."""
    room = pipe.max_positions - len(PROMPTS[0])
    for change, words in (
            (lambda r: r.prompt_ids.append(10 ** 6), "prompt token id 1000000 is outside the vocabulary"),
            (lambda r: r.prompt_ids.clear(), "the prompt is empty"),
            (lambda r: setattr(r, "prompt_ids", [5] * pipe.max_positions), "prompt is .* tokens; it does not fit"),
            (lambda r: setattr(r, "max_new_tokens", room + 1), f"max_new_tokens must be an integer from 1 to {room} "),
            (lambda r: setattr(r, "max_new_tokens", 2.0), "max_new_tokens must be an integer from 1 to .*got 2.0")):
        r = pipe.request(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW[0])
        change(r)
        with pytest.raises(MindspecError, match=words):
            pipe.run_one(r)
    assert pipe.generate(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW[0]).token_ids == alone[0]


def test_the_first_token_does_not_wait_for_the_drafts_catch_up(pipe, alone):
    """The step that prefills a prompt's last chunk returns its first token before the draft reads that
    chunk (found through the server: time to the first streamed text 678 ms with speculation, 310 ms
    target-only, the draft's catch-up and the first decode in between); the next step feeds the draft
    and decodes, and the row is still the target's own output."""
    eng = pipe.engine
    pipe.prepare([], max_batch=4)
    eng.cached.clear()
    eng.parked.clear()  # the draft feeds the whole prompt
    r = pipe.request(prompt_ids=PROMPTS[3], max_new_tokens=MAX_NEW[3], k=4)
    eng.add(r)
    events = eng.step()
    while not r.output:
        events = eng.step()
    assert [x for x, _ in events] == [r] and r.output == alone[3][:1]  # the first token alone...
    assert eng.proposer.cached(r.row) < len(PROMPTS[3])  # ...before the draft read the last chunk
    eng.step()
    assert eng.proposer.cached(r.row) >= len(PROMPTS[3]) and len(r.output) > 1
    while eng.has_work:
        eng.step()
    assert r.output == alone[3]


def test_a_new_row_joins_the_next_decode(pipe, alone, monkeypatch):
    """A step that prefills a prompt's last chunk returns its first token and decodes nothing; the next
    step decodes the new row with the running ones. Found profiling 8 rows at once (chat requests of 48
    tokens): a new row sat out the decode of the step that prefilled it, so a decode call carried 6.4 rows
    of 8 on average, at the cost of a full one."""
    real, seen = pipe.target.step, []
    short = [i for i, p in enumerate(PROMPTS) if len(p) <= 32]  # one chunk each
    reqs = [pipe.request(prompt_ids=PROMPTS[i], max_new_tokens=MAX_NEW[i], k=4) for i in short]

    def step(ids, *a, **kw):
        seen.append((len(ids), min(2, sum(not r.done for r in reqs))))  # (rows called, rows there are to run)
        return real(ids, *a, **kw)
    pipe.prepare(reqs, 2)  # (its warm-up runs the graphs too)
    monkeypatch.setattr(pipe.target, "step", step)
    pipe.run(reqs, max_batch=2)
    assert [r.output for r in reqs] == [alone[i] for i in short]
    assert [n for n, _ in seen] == [want for _, want in seen]


def test_a_request_arriving_as_rows_join_decodes_in_that_step(pipe, alone):
    """A step ends early at first tokens only if the step before did not: a request that arrives then is
    prefilled and decodes in the step its predecessors join (found through the server: at 8 clients such
    requests waited out a whole decode, 5.9 rows a decode call)."""
    eng = pipe.engine
    pipe.prepare([], max_batch=4)
    a, b = (pipe.request(prompt_ids=PROMPTS[i], max_new_tokens=MAX_NEW[i], k=4) for i in (0, 1))
    eng.add(a)
    eng.step()
    assert a.output == alone[0][:1]  # the first token alone
    eng.add(b)
    eng.step()
    assert len(a.output) > 1 and len(b.output) > 1  # both decoded
    while eng.has_work:
        eng.step()
    assert [a.output, b.output] == alone[:2]


def test_a_failing_step_ends_its_rows_and_the_engine_goes_on(pipe, alone, monkeypatch):
    calls = {"n": 0}
    real = pipe.target.step

    def flaky(*a, **kw):
        if not kw.get("dry"):  # (the runs, not a warm-up's compiles: the file's first test may be this one)
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("simulated graph failure")
        return real(*a, **kw)

    monkeypatch.setattr(pipe.target, "step", flaky)
    res = pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n, k=2) for p, n in zip(PROMPTS[:2], MAX_NEW[:2])])
    assert res[0].finish_reason == "error" and "simulated graph failure" in res[0].error
    monkeypatch.setattr(pipe.target, "step", real)
    res = pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n, k=2) for p, n in zip(PROMPTS[:2], MAX_NEW[:2])])
    assert [r.token_ids for r in res] == alone[:2]
    assert all(r.state == FINISHED for r in pipe.engine.rows) and not pipe.engine.rows


def test_a_real_graph_error_ends_its_rows_and_the_graph_runs_again(pipe, alone):
    """Found by a user probe: after a kernel error (here a token id past the vocabulary, slipped into a
    request after it was checked), MindSpore refused every later run of that graph ("An error occurred in
    the previous step of this model execution"): the pipeline failed every call after. The graph is now
    made afresh when MindSpore says so, and the run retried. (The pipeline checks a request's ids again when it
    runs: the bad id reaches the graph through the engine's own add.)"""
    bad = pipe.request(prompt_ids=list(PROMPTS[0]), max_new_tokens=MAX_NEW[0])
    bad.prompt_ids[1] = 10 ** 6
    pipe.prepare([bad])
    pipe.engine.add(bad)
    _run_out(pipe.engine)
    assert bad.result().finish_reason == "error" and "input_indices" in bad.result().error
    for _ in range(2):  # (the graph that failed made afresh, then its next run)
        assert pipe.generate(prompt_ids=list(PROMPTS[0]), max_new_tokens=MAX_NEW[0], k=2).token_ids == alone[0]


def _run_out(eng):
    while eng.has_work:
        eng.step()


def _fail_for(monkeypatch, obj, name, hit, words):
    """obj.name raises RuntimeError(words) on a call whose first argument hit() picks."""
    real = getattr(obj, name)

    def failing(first, *args, **kw):
        if hit(first):
            raise RuntimeError(words)
        return real(first, *args, **kw)
    monkeypatch.setattr(obj, name, failing)


def test_a_failing_prompt_chunk_ends_only_the_rows_it_carried(pipe, alone, monkeypatch):
    """The reviewer's: the guard of the prompt call covered every prefilling row, so a row that had its
    first token and waited a step (every new row does) ended with another row's error."""
    eng = pipe.engine
    a = pipe.request(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW[0], k=2)
    b = pipe.request(prompt_ids=PROMPTS[1], max_new_tokens=MAX_NEW[1], k=2)
    eng.add(a)
    eng.step()
    assert len(a.output) == 1 and not a.done  # its first token: it waits for the next decode
    _fail_for(monkeypatch, pipe.target, "prefill", lambda slots: b.slot in slots, "simulated prompt failure")
    eng.add(b)
    _run_out(eng)
    assert b.finish_reason == "error" and "simulated prompt failure" in str(b.error)
    assert a.finish_reason == "length" and a.output == alone[0]


def test_a_failing_prompt_chunk_does_not_cost_the_running_rows_their_decode(pipe, alone, monkeypatch):
    """A review's: a step whose prompt call failed ended before its decode, as one whose prompts gave first
    tokens does (so that they stream at once): the running rows waited a step for another request's error."""
    eng = pipe.engine
    a = pipe.request(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW[0], k=2)
    b = pipe.request(prompt_ids=PROMPTS[1], max_new_tokens=MAX_NEW[1], k=2)
    eng.add(a)
    for _ in range(3):
        eng.step()  # its first token, then decodes
    _fail_for(monkeypatch, pipe.target, "prefill", lambda slots: b.slot in slots, "simulated prompt failure")
    eng.add(b)
    had = len(a.output)
    eng.step()
    assert b.finish_reason == "error" and len(a.output) > had
    _run_out(eng)
    assert a.output == alone[0]


def test_a_failing_draft_catch_up_ends_only_the_rows_it_fed(pipe, alone, monkeypatch):
    """The reviewer's: a failing feed of the draft ended a target-only row still reading its prompt."""
    eng = pipe.engine
    a = pipe.request(prompt_ids=PROMPTS[3], max_new_tokens=MAX_NEW[3], speculate=False)  # 40 tokens: 2 chunks
    b = pipe.request(prompt_ids=PROMPTS[1], max_new_tokens=MAX_NEW[1], k=2)
    _fail_for(monkeypatch, eng.proposer, "prefill", lambda chunks: b.row in chunks, "simulated draft failure")
    eng.add(a)
    eng.add(b)
    _run_out(eng)
    assert b.finish_reason == "error" and "simulated draft failure" in str(b.error)
    assert a.finish_reason == "length" and a.output == alone[3]


def test_a_request_that_already_ran_is_refused_not_run_on_its_old_output(pipe, alone):
    """The reviewer's: a request interrupted by its callback, given to run() again, appended new tokens
    to its old output (a prompt's continuation after a stale one) without a word."""
    r = pipe.request(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW[0], k=2)

    def stop(req, text):
        if len(req.output) >= 5:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        pipe.run([r], stop)
    with pytest.raises(mindspec.MindspecError, match="a request runs once: make one per generation"):
        pipe.run([r])
    done = pipe.run([pipe.request(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW[0], k=2)])[0]
    assert done.output == alone[0]
    with pytest.raises(mindspec.MindspecError, match="a request runs once"):
        pipe.run([done])


def test_a_failure_between_calls_ends_the_requests_and_the_engine_starts_clean(pipe, alone, monkeypatch):
    """Bookkeeping outside the graph calls (a draft row swap when a row leaves) that raises leaves the
    rows' state unknown: every request then ends with the error, the engine starts from empty slots
    and rows, and the next requests are exact (before: the exception left step() and ended the
    server's worker loop)."""
    real = pipe.engine.proposer.release

    def broken(*a, **kw):
        raise RuntimeError("simulated row swap failure")

    monkeypatch.setattr(pipe.engine.proposer, "release", broken)
    res = pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n, k=2) for p, n in zip(PROMPTS[:3], MAX_NEW[:3])])
    # the first to end (12 tokens) ended whole before its row's swap failed; the others end with the error
    assert [r.finish_reason for r in res] == ["error", "length", "error"] and res[1].token_ids == alone[1]
    assert all("simulated row swap failure" in res[i].error for i in (0, 2))
    eng = pipe.engine
    assert not eng.rows and not eng.waiting and sorted(eng.free_slots) == list(range(4)) and not eng.cached
    monkeypatch.setattr(pipe.engine.proposer, "release", real)
    res = pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n, k=2) for p, n in zip(PROMPTS[:3], MAX_NEW[:3])])
    assert [r.token_ids for r in res] == alone[:3]


@pytest.mark.parametrize("how", ["-c", "stdin", "-c, host cache", "file, host cache"])
def test_library_use_from_python_c_and_stdin(tiny_target, draft, how, tmp_path):
    """MindSpore's compile cache opens sys.argv[0] as the entry script: `python -c` and `python -` must
    still generate (sampling included). A host's MS_COMPILER_CACHE_ENABLE=1 turned MindSpore's cache on for
    every graph (found: that `python -c` crashed on FileNotFoundError '-c'; and MindSpore maps cached files
    to graphs by compile order): mindspec's graphs use its own cache alone, the host's path stays unwritten."""
    code = (f"import mindspec; p = mindspec.load(target={tiny_target[0]!r}, draft={draft!r}, k=1, max_seq=64); "
            "print(p.generate(prompt_ids=[5, 6], max_new_tokens=4, temperature=0.8, seed=1).token_ids)")
    env = {"MINDSPEC_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    host = tmp_path / "host"
    if "host cache" in how:
        env.update(MS_COMPILER_CACHE_ENABLE="1", MS_COMPILER_CACHE_PATH=str(host))
    script = tmp_path / "script.py"
    script.write_text(code)
    args = {"s": [sys.executable, "-"], "f": [sys.executable, str(script)]}.get(how[0], [sys.executable, "-c", code])
    outs = [subprocess.run(args, input=code if how == "stdin" else None, capture_output=True, text=True, env=env,
                           timeout=300) for _ in range(1 + how.startswith("file"))]  # (a file's: cached, then read)
    for out in outs:
        assert out.returncode == 0, out.stderr[-2000:]
    assert len(eval(outs[0].stdout.strip().splitlines()[-1])) == 4
    assert len({out.stdout for out in outs}) == 1 and not host.exists()


def test_dynamic_k_decides_by_the_measured_costs_whatever_its_steps_took(tiny_target, draft, tmp_path,
                                                                         monkeypatch):
    """Timed in the loop, every (B, K) costs the same fraction of its measured cost (the machine's speed
    drifts, the ratios keep). Costs learnt from the steps moved only the K that ran, so a slower hour made
    it look dearer than the rest: here the engine's clock makes every step seem to take seconds, and the
    Ks chosen must not change (the batch bench's later cells drafted at B=8 where a fresh process did not)."""
    import types
    monkeypatch.setenv("MINDSPEC_HOME", str(tmp_path))
    p = mindspec.load(target=tiny_target[0], draft=draft, k="auto", max_seq=64, max_batch=1)
    kw = dict(prompt_ids=PROMPTS[1], max_new_tokens=24)
    p.generate(**kw)  # the costs measured, every graph run once
    measured = {1: (calls(0.1), {0: 1.0, 1: 1.05, 2: 1.1, 4: 1.2, 8: 1.4})}  # costs under which drafting pays
    p.costs.clear()
    p.costs.update(measured)
    runs = []
    for clock in (time.perf_counter, lambda: 1000 * time.perf_counter()):
        monkeypatch.setattr("mindspec.engine.time", types.SimpleNamespace(perf_counter=clock))
        p.engine.dynamic = None  # a new policy: no acceptance carried over from the run before
        runs.append(p.generate(**kw))
    assert runs[1].token_ids == runs[0].token_ids
    assert runs[1].stats["k_used"] == runs[0].stats["k_used"] and set(runs[0].stats["k_used"]) != {"0"}
    assert p.engine.dynamic.costs == measured

@pytest.mark.parametrize("catchup", [128, 32])
def test_a_prompt_sharing_a_finished_requests_prefix_prefills_only_the_rest(pipe, catchup, monkeypatch):
    """Prefix caching: a free slot keeps the K/V of what its last request fed; a prompt starting with
    those tokens skips them (a whole cached prompt: all but its last token; a follow-up turn: all but
    the last token generated, never fed), and every token equals the same request's with the cache
    off, greedy or seeded sampling (whose drafts, hence tokens, depend on the draft's catch-up). The
    draft catches up at most DRAFT_CATCHUP tokens a row per step (32: spread over several steps)."""
    monkeypatch.setattr("mindspec.engine.DRAFT_CATCHUP", catchup)
    fed = []
    real = pipe.engine.proposer.prefill
    monkeypatch.setattr(pipe.engine.proposer, "prefill", lambda chunks, *a: (fed.extend(map(len, chunks.values())),
                                                                              real(chunks, *a)))
    base = list(range(10, 80))  # 70 tokens: longer than two prefill chunks
    first_turn = dict(prompt_ids=base, max_new_tokens=6, speculate=False)  # a token a step: all but the last fed
    answer = pipe.generate(**first_turn).token_ids
    kws = [dict(prompt_ids=base[:36] + [7, 8, 9], max_new_tokens=12, k=4),
           dict(prompt_ids=base[:5] + [300, 301] * 20, max_new_tokens=10, k=2),  # the rest spans two chunks
           dict(prompt_ids=base, max_new_tokens=9, temperature=0.9, seed=3, k=4),
           dict(prompt_ids=base + answer + [5, 6], max_new_tokens=8, k=4)]
    eng = pipe.engine
    eng.prefix_cache = False
    try:
        ref = [pipe.generate(**kw) for kw in kws]
    finally:
        eng.prefix_cache = True
    assert [r.stats["cached_tokens"] for r in ref] == [0, 0, 0, 0]
    for kw, shared, want in zip(kws, (36, 5, 69, 75), ref):
        eng.cached.clear()
        eng.parked.clear()  # the draft feeds the whole prompt (the first turn never feeds it)
        pipe.generate(**first_turn)  # leaves base + its answer in a free slot
        got = pipe.generate(**kw)
        assert got.stats["cached_tokens"] == shared
        assert got.token_ids == want.token_ids
    # the follow-up turn has the longest catch-up: its whole 78-token prompt (the target's slot held 75; the
    # draft reads the prompt in the step after the target's last chunk, so that the first token streams at once)
    assert max(fed) == min(catchup, 78)


def test_a_new_row_starts_from_the_parked_draft_row_sharing_its_prefix(pipe, monkeypatch):
    """A finished row's draft cache is parked; a prompt sharing its prefix feeds the draft only the
    rest (the same prompt: nothing), and drafts exactly what a draft fed the whole prompt drafts (same
    acceptance, same tokens)."""
    fed = []
    real = pipe.engine.proposer.prefill
    monkeypatch.setattr(pipe.engine.proposer, "prefill", lambda chunks, *a: (fed.extend(map(len, chunks.values())),
                                                                              real(chunks, *a)))
    eng, base = pipe.engine, list(range(60, 130))
    kws = [dict(prompt_ids=base[:66] + [7, 8, 9], max_new_tokens=12, k=4),
           dict(prompt_ids=base + [5], max_new_tokens=10, k=2), dict(prompt_ids=base, max_new_tokens=10, k=4)]
    runs = {}
    for on in (False, True):
        eng.prefix_cache = on
        try:
            runs[on] = []
            for kw in kws:
                eng.cached.clear()
                eng.parked.clear()
                # base (row 1) ends first and is parked in row 1, the decoy in row 0: the new row 0 takes row 1's
                pipe.generate_many([dict(prompt_ids=[3] * 12, max_new_tokens=20, k=4),
                                    dict(prompt_ids=base, max_new_tokens=3, k=4)])
                fed.clear()
                runs[on].append((pipe.generate(**kw), sum(fed)))
        finally:
            eng.prefix_cache = True
    assert [n for _, n in runs[False]] == [69, 71, 70]
    assert [n for _, n in runs[True]] == [3, 1, 0]
    for (a, _), (b, _) in zip(runs[False], runs[True]):
        assert a.token_ids == b.token_ids
        assert (a.stats["drafted"], a.stats["accepted"]) == (b.stats["drafted"], b.stats["accepted"])


def _one_row_calls(monkeypatch):
    """[(first position, tokens)] of the draft's one-row calls from here on."""
    from mindspec.export import DraftSession
    pieces, real = [], DraftSession._run

    def spy(self, tokens, start):
        if len(tokens) == 1:
            pieces.append((int(self.pos[start]), len(tokens[0])))
        return real(self, tokens, start)
    monkeypatch.setattr(DraftSession, "_run", spy)
    return pieces


@pytest.mark.parametrize("parked", ["greedy", "sampled"])
def test_a_sampled_prompt_is_read_in_the_same_pieces_whatever_was_cached(pipe, monkeypatch, parked):
    """Found trying seeded sampling with the default (q8) draft, whose logits depend on how a row's tokens
    were cut into calls: after a prefix-cache hit the draft read a prompt in other pieces (from where the
    target's cache ended) than fresh, so a seeded text changed with what had run before. A sampled prompt
    is read in pieces cut at multiples of the prefill chunk and at its end, fresh or from a parked row
    (a greedy one read its prompt in other pieces: nothing of it is reused)."""
    pieces = _one_row_calls(monkeypatch)
    eng, base = pipe.engine, list(range(60, 105))  # 45 tokens
    kw = dict(prompt_ids=base[:40] + list(range(7, 14)), max_new_tokens=8, temperature=0.9, seed=5, k=1)
    runs = []
    sampling = dict(temperature=0.7, seed=1) if parked == "sampled" else {}
    for before in ([], [dict(prompt_ids=base, max_new_tokens=4, k=4, **sampling)]):
        eng.cached.clear()
        eng.parked.clear()
        pipe.generate_many(before)
        pieces.clear()
        got = pipe.generate(**kw)
        runs.append((got, [p for p in pieces if p[0] < 47]))
        decode = [n for p, n in pieces if p >= 47]
    (fresh, fresh_pieces), (after, after_pieces) = runs
    # after all its drafts were accepted, a row's two unseen tokens go in one call, as a one-row session's
    # (a greedy row's are split: the draft's call of one token a row, GroupQueryAttention's batched form)
    assert 2 in decode, (decode, fresh.stats)
    assert after.stats["cached_tokens"] == 40
    assert fresh_pieces == [(0, 32), (32, 15)]
    # 40 tokens shared: the parked row is reused up to 32
    assert after_pieces == ([(32, 15)] if parked == "sampled" else fresh_pieces)
    assert after.token_ids == fresh.token_ids


def test_graphs_run_outside_the_engine_void_the_prefix_cache(pipe, alone):
    """Warm-up runs and cost measurements write dummy K/V into slots: a prompt a slot held before
    is then prefilled whole, and its tokens stay exact."""
    first = pipe.generate(prompt_ids=PROMPTS[3], max_new_tokens=MAX_NEW[3], speculate=False)
    again = pipe.generate(prompt_ids=PROMPTS[3], max_new_tokens=MAX_NEW[3], speculate=False)
    assert first.token_ids == again.token_ids == alone[3] and again.stats["cached_tokens"] == len(PROMPTS[3]) - 1
    pipe.target.step(np.ones((4, 5)), np.arange(4), np.zeros(4), np.full(4, 4))  # positions 0..4 of every slot
    after = pipe.generate(prompt_ids=PROMPTS[3], max_new_tokens=MAX_NEW[3], speculate=False)
    assert after.stats["cached_tokens"] == 0 and after.token_ids == alone[3]


def test_a_repetition_penalty_sees_the_generated_tokens_too(pipe, tiny_target):
    """Found by mutation testing: the penalty's seen ids taken from the prompt alone (generated tokens
    repeated freely) kept every test green. Greedy rows with repetition_penalty 1.3, beside a row without,
    give token for token the numpy reference stepped a token at a time, penalising prompt + generated."""
    from mindspec.sampling import process_logits
    ck = Checkpoint(tiny_target[0])

    def reference(prompt, n, prev):
        seq = list(prompt)
        for _ in range(n):
            x = reference_logits(ck.config, ck.get, seq)[-1]
            seq.append(int(np.argmax(process_logits(x, 0.0, repetition_penalty=1.3, prev_ids=prev(seq)))))
        return seq[len(prompt):]
    kws = [dict(prompt_ids=PROMPTS[i], max_new_tokens=20, k=k, repetition_penalty=1.3) for i, k in ((0, 4), (5, 2))]
    res = pipe.generate_many(kws + [dict(prompt_ids=PROMPTS[1], max_new_tokens=12, k=4)])
    for kw, r in zip(kws, res):
        p = kw["prompt_ids"]
        want = reference(p, 20, lambda seq: seq)
        assert r.token_ids == want, p
        assert want != reference(p, 20, lambda seq: p)  # the generated tokens' penalty changes the text
        assert r.token_ids != pipe.generate(prompt_ids=p, max_new_tokens=20, speculate=False).token_ids
    assert res[2].token_ids == pipe.generate(prompt_ids=PROMPTS[1], max_new_tokens=12, speculate=False).token_ids


def test_presence_and_frequency_penalties_count_the_output_alone(pipe, tiny_target):
    """OpenAI's presence and frequency penalties (refused before; in MindIE's examples): greedy rows with them,
    speculating at K = 4 and 2 beside a row without, give token for token the numpy reference stepped a token at
    a time with the output's counts (not the prompt's: a reference counting the prompt too differs)."""
    from mindspec.sampling import process_logits
    ck = Checkpoint(tiny_target[0])
    # negative: a pull towards what the output holds (this model's logits spread ~8 wide: penalties within
    # OpenAI's range rarely move its argmax down; test_sampling checks them against the graph on small logits)
    pf = dict(presence_penalty=-2.0, frequency_penalty=-1.5)

    def reference(prompt, n, counted):
        seq = list(prompt)
        for _ in range(n):
            x = reference_logits(ck.config, ck.get, seq)[-1]
            c = np.bincount(counted(seq), minlength=ck.config.vocab_size)
            seq.append(int(np.argmax(process_logits(x, 0.0, counts=c, **pf))))
        return seq[len(prompt):]
    # prompts ending in what the model says unpenalised (PROMPTS[0]'s 5th token repeats its 1st): counting the
    # prompt would change the text
    likes = [PROMPTS[i] + pipe.generate(prompt_ids=PROMPTS[i], max_new_tokens=4, speculate=False).token_ids
             for i in (0, 5)]
    kws = [dict(prompt_ids=p, max_new_tokens=20, k=k, **pf) for p, k in zip(likes, (4, 2))]
    res = pipe.generate_many(kws + [dict(prompt_ids=PROMPTS[1], max_new_tokens=12, k=4)])
    for kw, r in zip(kws, res):
        p = kw["prompt_ids"]
        want = reference(p, 20, lambda seq: seq[len(p):])
        assert r.token_ids == want == pipe.generate(**dict(kw, speculate=False, k=None)).token_ids, p
        assert r.token_ids != pipe.generate(prompt_ids=p, max_new_tokens=20, speculate=False).token_ids
    assert reference(likes[0], 20, lambda seq: seq) != res[0].token_ids  # the prompt is not counted
    assert res[2].token_ids == pipe.generate(prompt_ids=PROMPTS[1], max_new_tokens=12, speculate=False).token_ids


def test_a_request_names_the_one_decode_graph_its_steps_run(pipe):
    """Found timing the suite: a request with presence/frequency penalties compiled the sampling graphs of
    every batch and K as well as its own "penal" ones (a third of its graphs), and never ran them: a decode
    step with such a row always runs the penal graph (its output's counts are its input). A step runs the
    graph of its most demanding row, greedy < sample < penal, so a request needs its own kind alone."""
    kinds = {name: pipe.request(prompt_ids=[5], **kw).graph_kind for name, kw in {
        "plain": {}, "sampled": dict(temperature=0.8), "logprobs": dict(logprobs=0),
        "repetition": dict(repetition_penalty=1.2), "presence": dict(presence_penalty=0.5),
        "sampled frequency": dict(temperature=0.8, frequency_penalty=0.5, logprobs=2)}.items()}
    assert kinds == {"plain": "greedy", "sampled": "sample", "logprobs": "sample", "repetition": "sample",
                     "presence": "penal", "sampled frequency": "penal"}


def test_abort_ends_a_row_still_reading_its_prompt(pipe):
    """Found by mutation testing: aborts reaped only running rows, so a row still prefilling a long prompt
    read it to the end (and got its first token) before it ended. Aborted mid-prompt, it ends at the next
    step with no output, and its slot is free."""
    eng = pipe.engine
    pipe.prepare([], max_batch=4)
    eng.cached.clear()  # (an earlier test's same prompt, cached, prefilled at once: found running a subset)
    eng.parked.clear()
    r = pipe.request(prompt_ids=list(range(10, 110)), max_new_tokens=10, k=4)  # 100 tokens: 4 prompt chunks
    eng.add(r)
    eng.step()
    assert r.state == PREFILL and 0 < r.pos < len(r.prompt_ids)
    eng.abort(r.id)
    events = eng.step()
    assert r.finish_reason == "abort" and r.output == [] and [x for x, _ in events] == [r]
    assert not eng.rows and not eng.has_work and sorted(eng.free_slots) == [0, 1, 2, 3]


def test_a_failed_rows_slot_is_not_offered_as_a_cached_prefix(pipe, alone, monkeypatch):
    """Found by mutation testing: a slot whose request ended with an error kept its tokens as a cached
    prefix (after a failed call its K/V are unknown). The same prompt after the failure prefills whole and
    gives the tokens it gives alone (and a prompt after a request that ended well is cached)."""
    eng = pipe.engine
    failed = pipe.request(prompt_ids=PROMPTS[3], max_new_tokens=MAX_NEW[3], k=2)
    pipe.prepare([failed], max_batch=4)  # (its graphs warmed up: the engine's calls below are the requests')
    eng.cached.clear()
    eng.parked.clear()
    _fail_for(monkeypatch, pipe.target, "step", lambda ids: True, "simulated graph failure")
    eng.add(failed)
    _run_out(eng)
    assert failed.finish_reason == "error" and len(failed.output) == 1  # its prompt was read, then the step failed
    monkeypatch.undo()
    assert not eng.cached
    for cached in (0, len(PROMPTS[3]) - 1):
        again = pipe.request(prompt_ids=PROMPTS[3], max_new_tokens=MAX_NEW[3], k=2)
        eng.add(again)
        _run_out(eng)
        assert again.stats.cached_tokens == cached and again.output == alone[3]


def test_a_failure_while_admitting_ends_that_request_too(pipe, alone, monkeypatch):
    """A review's: admitting took a request off the queue before it was a row, so a failure then (the draft
    row's swap) ended every request but that one, and generate_many waited for it for ever."""
    real = pipe.engine.proposer.adopt

    def broken(*a, **kw):
        raise RuntimeError("simulated adopt failure")

    monkeypatch.setattr(pipe.engine.proposer, "adopt", broken)
    eng = pipe.engine
    reqs = [pipe.request(prompt_ids=p, max_new_tokens=n, k=2) for p, n in zip(PROMPTS[:3], MAX_NEW[:3])]
    for r in reqs:
        eng.add(r)
    for _ in range(3):  # (a few steps: the lost request never ended, and generate_many spun for ever)
        eng.step()
    assert [r.finish_reason for r in reqs] == ["error"] * 3
    assert all("simulated adopt failure" in str(r.error) for r in reqs)
    assert not eng.rows and not eng.waiting and sorted(eng.free_slots) == list(range(4))
    monkeypatch.setattr(pipe.engine.proposer, "adopt", real)
    assert [r.token_ids for r in pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n, k=2) for p, n in
                                                      zip(PROMPTS[:3], MAX_NEW[:3])])] == alone[:3]


def test_a_greedy_rows_confidence_cut_does_not_follow_its_neighbours(pipe, alone):
    """A review's: with q built for the step (a sampled row beside it, or its own logprobs), a greedy row's q is
    one-hot, and the cut read its top probability 1.0 from it: the row drafted as without a cut."""
    ids, n = PROMPTS[5], MAX_NEW[5]
    kw = dict(prompt_ids=ids, max_new_tokens=n, k=4)
    uncut = pipe.generate(**kw).stats["drafted"]
    cut = pipe.generate(**kw, draft_min_conf=0.5)
    assert cut.token_ids == alone[5] and cut.stats["drafted"] < uncut, (cut.stats, uncut)
    with_lp = pipe.generate(**kw, draft_min_conf=0.5, logprobs=1)
    assert with_lp.stats["drafted"] == cut.stats["drafted"]
    beside = pipe.generate_many([dict(kw, draft_min_conf=0.5),
                                 dict(prompt_ids=PROMPTS[1], max_new_tokens=4, temperature=1.0, seed=1)])[0]
    assert beside.token_ids == alone[5] and beside.stats["drafted"] == cut.stats["drafted"], beside.stats


def test_a_parked_row_whose_draft_read_its_prompt_in_other_pieces_is_not_reused_by_a_sampled_request(
        pipe, monkeypatch):
    """A review's: a dynamic-K sampled row whose prompt the draft skipped at admission caught it up later in
    one call, yet was parked as read in draft_cut's pieces; a seeded fixed-K request sharing its prefix took it,
    and its draft read its prompt in other pieces than fresh (the q8 draft's logits follow them, and so does a
    seeded request's text)."""
    from mindspec.policy import DynamicK
    pieces = _one_row_calls(monkeypatch)
    pipe.costs = {B: (calls(0.05), {0: 1.0, 1: 1.05, 2: 1.1, 4: 1.2, 8: 1.4}) for B in (1, 2, 4)}
    pipe.engine.dynamic = DynamicK((1, 2, 4, 8), pipe.costs, alpha0=0.9, probe_every=0)
    monkeypatch.setattr(pipe, "_dynamic_for", lambda sizes: None)  # keep these costs
    eng, base = pipe.engine, list(range(60, 130))  # 70 tokens
    kw = dict(prompt_ids=base + [5], max_new_tokens=6, temperature=1.0, seed=7, k=4)
    eng.cached.clear()
    eng.parked.clear()
    pieces.clear()
    fresh = pipe.generate(**kw)
    fresh_pieces = [p for p in pieces if p[0] < 71]
    assert fresh_pieces == [(0, 32), (32, 32), (64, 7)]
    monkeypatch.setattr(eng.dynamic, "feeds_new_row", lambda *a: False)  # its prompt skipped at admission
    eng.cached.clear()
    eng.parked.clear()
    first = pipe.generate(prompt_ids=base, max_new_tokens=4, temperature=1.0, seed=3, k="auto")
    assert first.stats["drafted"]  # it caught up and drafted
    pieces.clear()
    got = pipe.generate(**kw)
    assert [p for p in pieces if p[0] < 71] == fresh_pieces and got.token_ids == fresh.token_ids


def test_a_row_whose_logits_are_not_finite_ends_alone_and_its_slot_is_not_cached(pipe, alone, monkeypatch):
    """A review's: the decode's side of the float16 refusal (test_float16 reaches the prompt's): a verify call
    whose `next` is -1 for one row (the graphs' word for logits that are not finite) ends that row with one
    line naming the position, offers its slot as no cached prefix, and the other rows give their own tokens."""
    eng = pipe.engine
    real = pipe.target.step
    hit = []

    def overflowing(ids, slots, pos, n_valid, s=None, **kw):
        out = real(ids, slots, pos, n_valid, s, **kw)
        if out is None:  # (a compile)
            return out
        acc, nxt, *rest = out
        if not hit and len(ids) > 1:  # the first call of several rows: its first row's position overflows
            hit.append((int(pos[0]) + 1 + int(acc[0]), slots[0]))
            nxt = np.array(nxt)
            nxt[0] = -1
        return (acc, nxt, *rest)

    monkeypatch.setattr(pipe.target, "step", overflowing)
    eng.cached.clear()
    eng.parked.clear()
    res = pipe.generate_many([dict(prompt_ids=p, max_new_tokens=n, k=2) for p, n in zip(PROMPTS[:3], MAX_NEW[:3])])
    monkeypatch.undo()
    bad = [i for i, r in enumerate(res) if r.finish_reason == "error"]
    assert len(bad) == 1 and hit, [r.finish_reason for r in res]
    assert res[bad[0]].error == (f"NotFinite: the target's activations are not finite at position {hit[0][0]}: they "
                                 "leave float32's range")
    assert [r.token_ids for i, r in enumerate(res) if i != bad[0]] == [a for i, a in enumerate(alone[:3]) if i != bad[0]]
    assert hit[0][1] not in eng.cached  # (its K/V past the overflow are not the model's)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_draft_whose_logits_are_not_finite_drafts_nothing(pipe, alone, monkeypatch, bad):
    """A review's: a float16 draft that overflows gives NaN (or inf) logits. The output stayed the target's, but
    only through NaN comparing false inside the acceptance graph (a backend where it compared true would
    have accepted the draft's token 0 every time); the confidence cut never stopped such a row (NaN < t is
    false), so it drafted and was rejected K times a step; and numpy warned on stderr. Now such a row makes
    no draft: greedy rows give the target's tokens, a seeded row its own text, with nothing said on stderr."""
    import warnings
    session = pipe.engine.proposer.session
    real = session.forward

    def overflowing(*a, **kw):
        out = real(*a, **kw).copy()
        out[:, 3] = bad
        return out

    kw = [dict(prompt_ids=PROMPTS[0], max_new_tokens=MAX_NEW[0], k=4, draft_min_conf=0.1),
          dict(prompt_ids=PROMPTS[1], max_new_tokens=MAX_NEW[1], k=4, temperature=1.0, seed=5)]
    sampled = pipe.generate(**dict(kw[1], k=None), speculate=False)
    monkeypatch.setattr(session, "forward", overflowing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = pipe.generate_many(kw)
    assert got[0].token_ids == alone[0] and got[1].token_ids == sampled.token_ids
    assert [g.stats["drafted"] for g in got] == [0, 0], [g.stats for g in got]
