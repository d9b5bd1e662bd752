"""Speculative sampling through the real loop (pipeline -> ONNX draft -> fused sampling graph)."""
import numpy as np
import pytest
from scipy.stats import chisquare

import mindspec
from mindspec.checkpoint import Checkpoint
from mindspec.export import export_draft
from mindspec.reference import reference_logits

PROMPT = [5, 6, 7]
T = 3.0  # the tiny target's logits are peaky (std ~8): spread them


@pytest.fixture(scope="module")
def pipe(tiny_target, tiny_draft_ckpt, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sdraft") / "d.onnx")
    export_draft(tiny_draft_ckpt[0], path)
    return mindspec.load(target=tiny_target[0], draft=path, k=2, max_seq=64)


def test_seeded_runs_repeat_and_differ_by_seed(pipe):
    kw = dict(prompt_ids=PROMPT, max_new_tokens=16, temperature=T, top_p=0.95, draft_temperature=1.1 * T)
    a, b = pipe.generate(seed=1, **kw), pipe.generate(seed=1, **kw)
    c = pipe.generate(seed=2, **kw)
    assert a.token_ids == b.token_ids and a.stats["accepted_at"] == b.stats["accepted_at"]
    assert a.token_ids != c.token_ids
    assert a.stats["drafted"] > 0


def test_a_temperature_too_small_to_divide_by_is_greedy(pipe):
    """Found trying the server: temperature 5e-324 passed the range check, the draft's logits divided by it
    overflowed to NaN and every draft was rejected (acceptance 0; the same with draft_temperature 5e-324).
    Below 1e-5 a temperature means greedy, as in vLLM: the target's greedy tokens, a greedy draft."""
    import warnings
    greedy = pipe.generate(prompt_ids=PROMPT, max_new_tokens=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow / invalid-value warnings fail the test
        tiny = pipe.generate(prompt_ids=PROMPT, max_new_tokens=12, temperature=5e-324, seed=1)
        assert tiny.token_ids == greedy.token_ids and tiny.stats["accepted"] == greedy.stats["accepted"] > 0
        hot = pipe.generate(prompt_ids=PROMPT, max_new_tokens=12, temperature=T, draft_temperature=5e-324, seed=1)
        zero = pipe.generate(prompt_ids=PROMPT, max_new_tokens=12, temperature=T, draft_temperature=0.0, seed=1)
    assert hot.token_ids == zero.token_ids and hot.stats["accepted_at"] == zero.stats["accepted_at"]
    assert zero.stats["accepted"] > 0


@pytest.mark.parametrize("min_conf", [None, 0.5])
def test_second_token_follows_the_target_distribution(pipe, tiny_target, min_conf):
    """The second token is the first one decided by accept/reject: its marginal must be the
    target's sum_a p(a) p(b | a), whatever the draft proposed, and however early the confidence
    cut (min_conf) stops drafting."""
    ck = Checkpoint(tiny_target[0])
    soft = lambda x: np.exp(x / T - (x / T).max()) / np.exp(x / T - (x / T).max()).sum()  # noqa: E731
    p1 = soft(reference_logits(ck.config, ck.get, PROMPT)[-1])
    top = np.flatnonzero(p1 > 1e-9)  # every first token that can occur (at T=3 the top 12 hold only 76%)
    p2 = sum(p1[a] * soft(reference_logits(ck.config, ck.get, PROMPT + [int(a)])[-1]) for a in top)
    p2 /= p2.sum()
    n, cuts = 400, 0
    seen = np.zeros(len(p2))
    for s in range(n):
        # 4: three tokens left after the prefill's first, so the step deciding the second may draft 2
        res = pipe.generate(prompt_ids=PROMPT, max_new_tokens=4, temperature=T, seed=1000 + s,
                            draft_min_conf=min_conf)
        seen[res.token_ids[1]] += 1
        cuts += res.stats["k_used"].get("2", 0) == 0
    big = p2 * n >= 5  # pool the rare tokens into one bin
    obs = np.append(seen[big], seen[~big].sum())
    exp = np.append(p2[big], p2[~big].sum())
    exp = exp.astype(np.float64) / exp.sum(dtype=np.float64) * obs.sum()  # float32 rounding trips chisquare
    assert chisquare(obs, exp).pvalue > 0.001, (obs, exp)
    assert (0 < cuts < n) if min_conf else cuts == 0, cuts  # the cut really shortened some steps



@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """(pipeline, checkpoint dir) of a tiny pair with tied embeddings: a model that likes repeating a token it
    was fed, so penalties on the output's tokens move its distribution a long way."""
    from conftest import make_tiny_checkpoint
    target, tensors = make_tiny_checkpoint(tmp_path_factory.mktemp("tied"), tie=True)
    draft_dir, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("tieddraft"), tie=True, base=tensors, noise=0.1, seed=1)
    path = str(tmp_path_factory.mktemp("tdraft") / "d.onnx")
    export_draft(draft_dir, path)
    return mindspec.load(target=target, draft=path, k=2, max_seq=64), target


def test_third_token_under_penalties_follows_the_target_distribution(tied):
    """Sampling with OpenAI's presence and frequency penalties stays lossless: p is penalised by the output's
    counts (the step's drafts counted in at each position, checked position by position in test_engine). The
    third token (decided at the verify's second position when the first draft is kept) must follow
    sum_ab p(a) p(b | a) p(c | a, b), each p penalised by the output before it; unpenalised, it is rejected."""
    from mindspec.sampling import process_logits
    pipe, target = tied
    ck = Checkpoint(target)
    t, pen = 1.5, dict(presence_penalty=2.0, frequency_penalty=2.0)

    def p(prefix, output, **kw):  # the target's p after PROMPT + prefix, `output` the tokens generated
        counts = np.bincount(np.asarray(output, np.int64), minlength=ck.config.vocab_size)
        return process_logits(reference_logits(ck.config, ck.get, PROMPT + prefix)[-1], t, counts=counts, **kw)

    def third(**kw):  # the third token's distribution
        def likely(q):  # the tokens holding all but 1e-4 of q
            order = np.argsort(-q)
            return order[:int(np.searchsorted(np.cumsum(q[order]), 1 - 1e-4)) + 1]
        p1, dist = p([], [], **kw), 0
        for a in likely(p1):
            p2 = p([int(a)], [int(a)], **kw)
            for b in likely(p2):
                dist = dist + p1[a] * p2[b] * p([int(a), int(b)], [int(a), int(b)], **kw)
        return dist / dist.sum()
    n, drafted = 300, 0
    seen = np.zeros(ck.config.vocab_size)
    for s in range(n):
        res = pipe.generate(prompt_ids=PROMPT, max_new_tokens=4, temperature=t, seed=5000 + s, **pen)
        seen[res.token_ids[2]] += 1
        drafted += res.stats["drafted"]
    assert drafted > n  # most runs drafted: the accept/reject step decided their third token

    def pvalue(dist):
        big = dist * n >= 5  # pool the rare tokens into one bin
        obs, exp = np.append(seen[big], seen[~big].sum()), np.append(dist[big], dist[~big].sum())
        return chisquare(obs, exp / exp.sum() * n).pvalue
    assert pvalue(third(**pen)) > 0.001, pvalue(third(**pen))
    assert pvalue(third()) < 0.001, pvalue(third())
