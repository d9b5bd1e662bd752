"""End to end through the library: speculative greedy == target-only greedy, token for token."""
import os
import signal
import time

import numpy as np
import pytest

import mindspec
from mindspec import request
from mindspec.checkpoint import Checkpoint
from mindspec.export import DraftSession, export_draft
from mindspec.graphs.runner import TargetModel
from mindspec.reference import reference_logits

PROMPTS = [[5, 6, 7], [100, 3, 250, 17, 9], [42], list(range(10, 50)), [300, 301, 302, 7, 7, 7, 7],
           [9, 8, 7, 6, 5, 4, 3], [200, 100], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]


@pytest.fixture(scope="module")
def self_draft(tiny_target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("drafts") / "self.onnx")
    export_draft(tiny_target[0], path)
    return path


@pytest.fixture(scope="module")
def pipe(tiny_target, noisy_draft):
    return mindspec.load(target=tiny_target[0], draft=noisy_draft, k=4, max_seq=128)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_speculative_greedy_equals_target_only(pipe, k):
    drafted = accepted = 0
    for ids in PROMPTS:
        base = pipe.generate(prompt_ids=ids, max_new_tokens=30, speculate=False)
        spec = pipe.generate(prompt_ids=ids, max_new_tokens=30, k=k)
        assert spec.token_ids == base.token_ids, (ids, k)
        assert spec.text == base.text
        drafted += spec.stats["drafted"]
        accepted += spec.stats["accepted"]
        assert sum(spec.stats["k_used"].values()) + 1 == spec.stats["target_calls"]
    # the draft must disagree often, or this test proves nothing
    assert 0.1 < accepted / drafted < 0.9, accepted / drafted


def test_target_as_its_own_draft_accepts_everything(tiny_target, self_draft):
    p = mindspec.load(target=tiny_target[0], draft=self_draft, k=4, max_seq=128)
    for ids in PROMPTS[:4]:
        res = p.generate(prompt_ids=ids, max_new_tokens=41)
        assert res.stats["acceptance_rate"] == 1.0
        # prefill's token + 8 verify calls x (4 accepted + 1 bonus) = 41 tokens
        assert res.stats["accepted_at"] == [8, 8, 8, 8]
        assert res.stats["target_calls"] == 9 and len(res.token_ids) == 41


def test_draft_target_and_reference_agree_after_rollbacks(tiny_target, self_draft):
    ckpt = Checkpoint(tiny_target[0])
    target, draft = TargetModel(ckpt, max_seq=64, k_buckets=(1,)), DraftSession(self_draft, max_seq=64)
    seq = [int(x) for x in np.random.default_rng(3).integers(3, 300, 20)]
    t1, d1 = target.logits(0, 0, seq[:12]), draft.forward([seq[:12]])[0]
    draft.rollback(0, 8)  # reject 4 positions (the target: feed at position 8 again), take another branch
    alt = seq[12:20]
    t2, d2 = target.logits(0, 8, alt), draft.forward([alt])[0]
    ref = reference_logits(ckpt.config, ckpt.get, seq[:8] + alt)
    assert np.abs(t1[:8] - ref[:8]).max() < 1e-4 and np.abs(d1 - t1[-1]).max() < 1e-4
    assert np.abs(t2 - ref[8:]).max() < 1e-4 and np.abs(d2 - ref[-1]).max() < 1e-4


def test_stops_on_eos_max_new_tokens_and_stop_strings(pipe):
    base = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, speculate=False)
    res = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=7)
    assert res.token_ids == base.token_ids[:7] and res.finish_reason == "length"
    # a stop string taken from the middle of the greedy text: output ends right before it
    text = base.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    res = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, stop=[stop])
    assert res.finish_reason == "stop" and res.text == text[:text.find(stop)]
    assert len(res.token_ids) < len(base.token_ids)
    # EOS: make the greedy continuation's 4th token the EOS id
    eos, pipe.eos = pipe.eos, pipe.eos | {base.token_ids[3]}
    try:
        res = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=30)
    finally:
        pipe.eos = eos
    assert res.token_ids == base.token_ids[:4] and res.finish_reason == "stop"


def test_streamed_text_equals_final_text(pipe):
    parts = []
    res = pipe.generate(prompt="hello", max_new_tokens=20, on_text=parts.append)
    assert "".join(parts) == res.text and len(parts) > 1


def test_dynamic_k_output_equals_target_only(pipe):
    # fixed costs (draft call = 0.1 decode, verify a bit dearer per K) so the K schedule does not
    # depend on timings measured on a busy machine
    pipe.costs, pipe.engine.dynamic = {1: ({k: 0.1 * k for k in (1, 2, 4, 8)},
                                              {0: 1.0, 1: 1.1, 2: 1.15, 4: 1.25, 8: 1.5})}, None
    used = {}
    for i, ids in enumerate(PROMPTS):
        base = pipe.generate(prompt_ids=ids, max_new_tokens=30, speculate=False)
        if i == 0:  # as serve and batch read a request with k="auto" on a pipeline loaded with a fixed k
            # (found: refused there before the costs were measured, though generate and serve measure them)
            _, dyn = request.run(pipe, request.parse({"prompt_ids": ids, "max_new_tokens": 30, "k": "auto"}))
        else:
            dyn = pipe.generate(prompt_ids=ids, max_new_tokens=30, k="auto")
        assert dyn.token_ids == base.token_ids, ids
        for k, n in dyn.stats["k_used"].items():
            used[k] = used.get(k, 0) + n
    assert len(used) >= 2, used  # the policy really moved K on this often-rejected draft


def test_confidence_cut_output_equals_target_only(pipe, monkeypatch):
    """draft_min_conf stops drafting early; the step verifies the smallest bucket that holds the drafts
    it got (or decodes plainly when nothing was drafted; found: it verified all K whatever the cut left)
    and the output stays the target's."""
    used, calls, step = {}, [], pipe.target.step
    monkeypatch.setattr(pipe.target, "step", lambda ids, slots, pos, n_valid, *a, **kw: (
        calls.append((len(ids[0]) - 1, max(n_valid))), step(ids, slots, pos, n_valid, *a, **kw))[1])
    for ids in PROMPTS:
        base = pipe.generate(prompt_ids=ids, max_new_tokens=30, speculate=False)
        pipe.generate(prompt_ids=ids, max_new_tokens=1, k=8)  # (its graphs compiled and run: the calls below are the request's)
        calls.clear()
        cut = pipe.generate(prompt_ids=ids, max_new_tokens=30, k=8, draft_min_conf=0.9)
        assert cut.token_ids == base.token_ids, ids
        for k, n in cut.stats["k_used"].items():
            used[k] = used.get(k, 0) + n
        assert all(K == min([b for b in (0, 1, 2, 4, 8) if b >= n]) for K, n in calls), calls
    assert "8" in used and len(used) >= 3, used  # the cut fired, and not always


def test_confidence_cut_is_checked(pipe):
    with pytest.raises(mindspec.MindspecError, match="draft_min_conf must be between 0 and 1"):
        pipe.generate(prompt_ids=[5, 6], max_new_tokens=4, draft_min_conf=1.5)


def test_a_request_the_pair_holds_runs_to_the_drafts_last_position(tiny_target, tmp_path):
    """The cache was sized to a request's positions plus the largest K bucket, rounded up, and the draft's
    to that plus K more: a request the pair holds failed ("max_seq 520 is outside 1..256 (the draft was
    exported for 256 positions)"), in a batch job every line with it. A pair holds the smaller of the
    model's and the draft's positions; a request beyond them is its own one-line error."""
    from mindspec.errors import MindspecError
    draft = str(tmp_path / "short.onnx")
    export_draft(tiny_target[0], draft, max_seq=256)
    pipe = mindspec.load(target=tiny_target[0], draft=draft, k=8, buckets=(8,))  # (K=8's graphs only: lean)
    ids = [10 + i % 200 for i in range(200)]
    spec = pipe.generate(prompt_ids=ids, max_new_tokens=56)  # 256 positions: all the draft has
    assert spec.token_ids == pipe.generate(prompt_ids=ids, max_new_tokens=56, speculate=False).token_ids
    assert spec.stats["drafted"] > 0
    with pytest.raises(MindspecError, match="prompt is 256 tokens; it does not fit max_seq 256"):
        pipe.generate(prompt_ids=ids + ids[:56])
    # beside a row that drafts 8, a row 6 positions from the draft's end drafted 8 too: "draft cache full",
    # and the failed call ended both rows with an error. Each row drafts only what it can use.
    # (the short row runs long enough to be beside the long one, whose prompt takes 8 chunks)
    reqs = [dict(prompt_ids=(ids + ids)[:250], max_new_tokens=56), dict(prompt_ids=[5, 6, 7], max_new_tokens=200)]
    both = pipe.generate_many(reqs, max_batch=2)
    assert [r.token_ids for r in both] == [pipe.generate(**r, speculate=False).token_ids for r in reqs]
    assert [r.finish_reason for r in both] == ["length", "length"]  # the first at the cache's end


def test_a_draft_exported_for_fewer_positions_than_the_target_cache_holds(tiny_target, tmp_path):
    """Found: with a draft exported for 40 positions, dynamic K failed every request ("draft cache full: row 0:
    0 cached + 54 new tokens exceed max_seq 40": its costs were measured at the target cache's 64 positions,
    40 rounded up to a prefill chunk), and a request ran on past the pair's 40 positions to the cache's end."""
    draft = str(tmp_path / "s40.onnx")
    export_draft(tiny_target[0], draft, max_seq=40)
    pipe = mindspec.load(target=tiny_target[0], draft=draft)  # dynamic K
    res = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=100)  # its costs measured where the draft fits
    assert len(res.token_ids) == 37 and res.finish_reason == "length" and pipe.costs
    plain = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=100, speculate=False).token_ids
    assert res.token_ids == plain
    # whether the measured costs draft depends on the machine's timings (a busy CI run chose K=0 all
    # the way): costs under which drafting pays make the rows draft up to the draft's end
    pipe.costs, pipe.engine.dynamic = {1: ({k: 0.1 * k for k in (1, 2, 4, 8)},
                                              {0: 1.0, 1: 1.1, 2: 1.15, 4: 1.25, 8: 1.5})}, None
    res = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=100)
    assert res.token_ids == plain and res.finish_reason == "length" and res.stats["drafted"] > 0


def test_compile_s_counts_the_warm_up_a_call_waited_for(tiny_target, noisy_draft):
    """Found: `generate --json` always said compile_s 0 (README: compilation "is reported separately as
    compile_s"): the counter was read after the call's warm-up, where the graphs compile."""
    pipe = mindspec.load(target=tiny_target[0], draft=noisy_draft, k=2, buckets=(2,))  # (lean: K=2's graphs)
    first = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=8)
    again = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=8)
    assert first.stats["compile_s"] > 0 and again.stats["compile_s"] == 0
    assert first.token_ids == again.token_ids
    longer = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=300)  # a larger cache: a new target, new graphs
    assert longer.stats["compile_s"] > 0 and longer.token_ids[:8] == first.token_ids


def test_drafts_never_outrun_the_tokens_a_request_has_left(pipe):
    """A request of 3 new tokens at K=8 (the prefill gives the first) drafted and verified 8 where one
    could be used: wasted work, and an acceptance rate that flattered short requests."""
    base = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=3, speculate=False)
    res = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=3, k=8)
    assert res.token_ids == base.token_ids and res.stats["drafted"] == 1, res.stats
    assert res.stats["k_used"].get("1") == 1 and set(res.stats["k_used"]) <= {"0", "1"}, res.stats  # then K=0


def test_library_calls_refuse_bad_input_naming_it(pipe):
    """Found trying the library as a careless user: stop="ab" stopped at the first "a" or "b" (a string
    iterated as stop strings); generate_many(max_batch=-1) spun forever; floats and booleans passed as
    ids; an unknown keyword, a non-dict entry or a bad value raised TypeError/ValueError, or a one-line
    error that did not say which entry."""
    from mindspec.errors import MindspecError
    text = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, speculate=False).text
    i = next(i for i in range(1, len(text) - 1) if text[i + 1] in text[:i] and text[i:i + 2] not in text[:i])
    one = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, stop=text[i:i + 2])
    assert one.text == text[:i] and one.finish_reason == "stop"
    for kw, words in [(dict(prompt=5), "prompt must be a string"), (dict(prompt="a\ud800"), "not valid Unicode"),
                      (dict(prompt_ids="1,2"), "prompt_ids must be a list"),
                      (dict(prompt_ids=[1.7, 2.2]), "prompt_ids must be a list"),
                      (dict(prompt_ids=[True]), "prompt_ids must be a list"),
                      (dict(prompt_ids=[5], stop=5), "stop must be a string or a list of strings"),
                      # found: an empty stop string was dropped without a word (vLLM refuses it too)
                      (dict(prompt_ids=[5], stop=["x", ""]), "stop cannot contain an empty string"),
                      # the library prober's: numpy's "iteration over a 0-d array" TypeError
                      (dict(prompt_ids=np.array(5)), "prompt_ids must be a list"),
                      # and a fixed K with speculate=False was ignored (the CLI refuses -k with --no-speculate)
                      (dict(prompt_ids=[5], k=4, speculate=False),
                       "k=4 sets the draft tokens of a step: it does not apply with speculate=False")]:
        with pytest.raises(MindspecError, match=words):
            pipe.generate(**kw)
    with pytest.raises(MindspecError, match=r"^requests\[1\]: prompt_ids must be a list"):
        pipe.generate_many([dict(prompt="x"), dict(prompt_ids=np.array(3))])
    good = dict(prompt_ids=[5, 6], max_new_tokens=3)
    for reqs, max_batch, words in [
            ([good, dict(prompt_ids=[5], temperature=-1)], None, r"^requests\[1\]: temperature must be a number"),
            ([good, dict(prompt_ids=[5], bogus=1)], None, r'^requests\[1\]: unknown keyword "bogus"$'),
            ([good, [("prompt", "x")]], None, r"^requests\[1\] must be a dict of generate's keywords, got list$"),
            ([good], -1, r"^max_batch must be an integer >= 1, got -1$"), ([good], 0, "max_batch must be"),
            ([good], "2", "max_batch must be")]:
        with pytest.raises(MindspecError, match=words):
            pipe.generate_many(reqs, max_batch=max_batch)
    # a second careless pass: TypeErrors from deep inside, or values taken that fail every later call
    with pytest.raises(MindspecError, match="requests must be a list of dicts"):
        pipe.generate_many(None)
    with pytest.raises(MindspecError, match="draft_min_conf must be between 0 and 1, got \"0.5\""):
        pipe.generate(prompt_ids=[5], draft_min_conf="0.5")
    with pytest.raises(MindspecError, match="prompt_ids must be a list"):
        pipe.generate(prompt_ids={1: 2})
    # ... while any iterable of them still works, a generator read once (it was "the prompt is empty")
    three = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=3).token_ids
    assert pipe.generate(prompt_ids=(i for i in range(5, 8)), max_new_tokens=3).token_ids == three
    assert [r.token_ids for r in pipe.generate_many(dict(prompt_ids=range(5, 8), max_new_tokens=3)
                                                    for _ in range(2))] == [three, three]
    for flag in ("speculate", "chat"):  # "no" counted as true
        with pytest.raises(MindspecError, match=f"{flag} must be True or False, got \"no\""):
            pipe.generate(prompt="hi", **{flag: "no"})
    # the library prober's: one notation for every keyword's value, and the keywords' own names (not the CLI's)
    for kw, words in [(dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got true"),
                      (dict(logprobs="2"), r'logprobs must be an integer in \[0, \d+\] .*got "2"'),
                      (dict(temperature=1j), "temperature must be a number .*, got 1j$"),
                      (dict(k=3), r'k=3 is not a compiled bucket \[1, 2, 4, 8\] \(or "auto"\)'),
                      (dict(request_id=[1]), r"request_id must be a string or an integer, got \[1\]")]:
        with pytest.raises(MindspecError, match=words):
            pipe.generate(prompt_ids=[5], **kw)
    # a stream's arguments are checked when it is made, not where it is first read
    with pytest.raises(MindspecError, match="run and stream take a list of Requests"):
        pipe.stream(pipe.request(prompt_ids=[5], max_new_tokens=2), 1)
    with pytest.raises(MindspecError, match="max_batch must be an integer >= 1, got 0"):
        pipe.stream([pipe.request(prompt_ids=[5], max_new_tokens=2)], 0)


def test_load_refuses_bad_arguments_before_loading(tiny_target, noisy_draft):
    import pathlib
    from mindspec.errors import MindspecError
    for kw, words in [(dict(max_seq="64"), "max_seq must be an integer >= 1 or None"),
                      (dict(max_seq=0), "max_seq must be an integer >= 1 or None"),
                      (dict(max_seq=-5), "max_seq must be an integer >= 1 or None"),
                      (dict(tp=0), "tp must be an integer >= 1"), (dict(draft=True), "draft must be a path"),
                      (dict(k=0), r'^k must be between 1 and the largest K bucket 8 \(or "auto"\), got 0$'),
                      (dict(device="gpu"), r'^device must be one of auto, cpu, ascend, got "gpu"$'),
                      (dict(device=5), r"^device must be one of auto, cpu, ascend, got 5$"),
                      (dict(dtype="x"), r'^dtype must be one of float32, float16, bfloat16, got "x"$'),
                      (dict(draft=123), "draft must be a path"), (dict(device_mem="64GB"), "device_mem must be")]:
        with pytest.raises(MindspecError, match=words):
            mindspec.load(tiny_target[0], **dict(dict(draft=noisy_draft), **kw))
    p = mindspec.load(pathlib.Path(tiny_target[0]), pathlib.Path(noisy_draft), k=2)  # (a Path draft: TypeError)
    assert p.draft_path == noisy_draft
    p.set_draft(None)
    p.set_draft(pathlib.Path(noisy_draft))
    assert p.draft_path == noisy_draft


def test_a_fixed_k_without_a_draft_is_refused_as_the_cli_does(tiny_target, pipe):
    """Found by a library probe: load(k=4, draft=False) and generate(k=2) on a pipeline without a draft ran
    target-only silently, where generate(k=2, speculate=False) and the CLI's -k without a draft are refused."""
    from mindspec.errors import MindspecError
    with pytest.raises(MindspecError, match="k=4 sets the draft tokens of a step: there is no draft"):
        mindspec.load(tiny_target[0], draft=False, k=4)
    plain = mindspec.load(tiny_target[0], draft=False, max_seq=64)
    for call in (lambda: plain.generate(prompt_ids=[5, 6], max_new_tokens=2, k=2),
                 lambda: plain.generate_many([{"prompt_ids": [5, 6], "max_new_tokens": 2, "k": 2}])):
        with pytest.raises(MindspecError, match="k=2 sets the draft tokens of a step: there is no draft"):
            call()
    assert plain.generate(prompt_ids=[5, 6, 7], max_new_tokens=6, k="auto").token_ids == pipe.generate(
        prompt_ids=[5, 6, 7], max_new_tokens=6, speculate=False).token_ids


def test_prepare_refuses_bad_arguments_naming_them(pipe):
    """Found by a library probe: README's p.prepare([], 8, every_graph=True) given a string, a list of ids or
    None was an AttributeError or TypeError from inside, and max_batch 0 or -1 returned as if done."""
    from mindspec.errors import MindspecError
    for args, words in ((("x",), "prepare takes a list of Requests"), (([1, 2],), "prepare takes a list of Requests"),
                        ((None,), "prepare takes a list of Requests"), (([], "2"), "max_batch must be an integer >= 1"),
                        (([], 0), "max_batch must be an integer >= 1"), (([], -1), "max_batch must be an integer >= 1")):
        with pytest.raises(MindspecError, match=words):
            pipe.prepare(*args)
    with pytest.raises(MindspecError, match="rows_now must be an integer >= 1 or None"):
        pipe.prepare([], 2, rows_now="1")
    assert pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4).token_ids  # (still works)


def test_a_working_directory_that_is_gone_is_one_line_before_mindspore_loads(tiny_target, noisy_draft, tmp_path):
    """Found by a library probe: from a deleted working directory, MindSpore's import (os.getcwd() at import)
    raised inside, then the interpreter aborted ("Fatal Python error", exit 134), the CLI too."""
    import subprocess
    import sys
    gone = tmp_path / "gone"
    gone.mkdir()
    code = ("import os, sys, mindspec\nos.chdir(sys.argv[3]); os.rmdir(sys.argv[3])\n"
            "try:\n    mindspec.load(sys.argv[1], sys.argv[2], max_seq=64)\n"
            "except mindspec.MindspecError as e:\n    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code, tiny_target[0], noisy_draft, str(gone)], capture_output=True,
                       text=True, timeout=300)
    assert (p.returncode, p.stdout) == (0, "the working directory no longer exists (removed since this process "
                                           "started): cd to one that does\n"), p.stderr[-3000:]
    gone.mkdir()
    p = subprocess.run([os.path.join(os.path.dirname(sys.executable), "mindspec"), "generate", "--target",
                        tiny_target[0], "--draft", noisy_draft, "--prompt-ids", "5,6", "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=300, cwd=gone.parent,
                       preexec_fn=lambda: (os.chdir(gone), os.rmdir(gone)))
    assert (p.returncode, p.stderr) == (2, "mindspec: error: the working directory no longer exists (removed since "
                                           "this process started): cd to one that does\n"), p.stderr[-3000:]


def test_threads_sharing_a_pipeline_take_turns(pipe):
    """Found: two threads calling generate on one pipeline at once crashed the process inside MindSpore
    (a segfault) or hung it. A pipeline runs one call at a time; the others wait their turn."""
    import threading
    solo = [pipe.generate(prompt_ids=p, max_new_tokens=20).token_ids for p in PROMPTS[:3]]
    got = {}

    def ask(i):
        got[i] = pipe.generate(prompt_ids=PROMPTS[i], max_new_tokens=20).token_ids

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [got.get(i) for i in range(3)] == solo


def test_threads_reaching_the_library_at_once_all_get_it():
    """The library probe's: two threads calling mindspec.load at once in a fresh process: one got "partially
    initialized module 'mindspec.pipeline' has no attribute 'load'" (the other's import was under way)."""
    import subprocess
    import sys
    script = ("import threading, mindspec\nout = []\n"
              "def f():\n    try:\n        out.append(mindspec.load is not None)\n"
              "    except Exception as e:\n        out.append(repr(e))\n"
              "ts = [threading.Thread(target=f) for _ in range(4)]\n[t.start() for t in ts]\n[t.join() for t in ts]\n"
              "print(out)\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.stdout.strip() == "[True, True, True, True]", (p.stdout, p.stderr[-2000:])


TWO_PIPELINES_SCRIPT = """
import sys, threading, mindspec
a, b = (mindspec.load(target=sys.argv[1], draft=sys.argv[2], k=4, max_seq=128) for _ in range(2))
want = a.generate(prompt_ids=[5, 6, 7], max_new_tokens=40).token_ids
got = {}
def loop(p, name):
    got[name] = [p.generate(prompt_ids=[5, 6, 7], max_new_tokens=40).token_ids for _ in range(8)]
threads = [threading.Thread(target=loop, args=(p, name)) for p, name in ((a, 0), (b, 1))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(got == {0: [want] * 8, 1: [want] * 8}, flush=True)
"""


def test_two_pipelines_on_two_threads_take_turns(tiny_target, noisy_draft):
    """The library prober's: two pipelines generating at once on two threads deadlocked inside MindSpore's
    executor (each pipeline's own lock let them overlap). Their steps now take turns, process-wide. (In a
    process of its own: a deadlock there holds nothing of this one.)"""
    import subprocess
    p = _script(TWO_PIPELINES_SCRIPT, tiny_target, noisy_draft)
    try:
        out, err = p.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("deadlocked: " + p.communicate()[1][-2000:])
    assert (p.returncode, out.split()) == (0, ["True"]), err[-3000:]


def test_set_draft_while_a_call_runs_is_refused_whatever_its_rows(pipe, noisy_draft):
    """The library prober's: set_draft looked only for running rows, so in a call's warm-up or between its
    requests a swap (from another thread) was accepted, and the call, its rows added to the dropped engine,
    could spin for ever. An open call (here a stream between its two requests: no row running) refuses it."""
    from mindspec.errors import MindspecError
    want = pipe.generate(prompt_ids=[9, 8, 7], max_new_tokens=6).token_ids
    rs = [pipe.request(prompt_ids=[5, 6, 7], max_new_tokens=4), pipe.request(prompt_ids=[9, 8, 7], max_new_tokens=6)]
    s = pipe.stream(rs, max_batch=1)
    try:
        for r, _ in s:
            if r.done:
                break  # the first ended, the second not yet added
        with pytest.raises(MindspecError, match="cannot change the draft while requests are running"):
            pipe.set_draft(None)
        list(s)
    finally:
        s.close()  # (a failure here must not leave the module's pipeline held)
    assert rs[1].result().token_ids == want and pipe.draft_path == noisy_draft


def test_a_stream_left_open_by_a_thread_that_ended_is_named_not_waited_for(pipe):
    """The library probe's: a stream advanced on a worker thread that then ended, and a generate on the main
    thread, hung for ever (the stream held the pipeline's turn; only a call to read it on could free it). And
    a new thread given the ended one's id was told it called from its own callback. Such a call is refused,
    naming the open stream; once it is closed, calls run as ever."""
    import threading
    from mindspec.errors import MindspecError
    want = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=8).token_ids
    rs = [pipe.request(prompt_ids=[9, 8, 7], max_new_tokens=30)]
    s = pipe.stream(rs)
    first = threading.Thread(target=lambda: next(s))
    first.start()
    first.join(300)
    errors = []

    def ask():
        try:
            pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=8)
        except MindspecError as e:
            errors.append(str(e))

    for _ in range(2):  # (threads of their own: a hang fails the test, not the suite; a new thread often gets
        caller = threading.Thread(target=ask, daemon=True)  # the ended one's id)
        caller.start()
        caller.join(60)
        assert not caller.is_alive(), "generate waited for a stream nobody reads"
    assert len(errors) == 2 and all("a stream of this pipeline is open, left half-read by a thread that has ended"
                                    in e for e in errors), errors
    s.close()
    assert rs[0].done and rs[0].result().finish_reason == "abort"
    assert pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=8).token_ids == want
    # the diff review's: a call already waiting when the reading thread ends is refused too (it waited for ever)
    s, release = pipe.stream([pipe.request(prompt_ids=[9, 8, 7], max_new_tokens=30)]), threading.Event()
    reader = threading.Thread(target=lambda: next(s) and release.wait(60))
    reader.start()
    time.sleep(0.5)  # (its first step read)
    errors.clear()
    caller = threading.Thread(target=ask, daemon=True)
    caller.start()
    time.sleep(1)
    release.set()
    reader.join(60)
    caller.join(30)
    assert not caller.is_alive() and len(errors) == 1 and "left half-read by a thread that has ended" in errors[0]
    s.close()


def test_a_pipeline_loaded_in_a_child_forked_after_loading_is_refused_not_hung(tiny_target, noisy_draft, tmp_path):
    """A library prober's: a parent's pipeline used in a forked child was refused, but a new one loaded there hung
    on its first call for ever (MindSpore's threads do not survive a fork), deaf to SIGTERM."""
    import subprocess
    import sys
    code = ("import os, signal, sys, mindspec\n"
            "pipe = mindspec.load(sys.argv[1], sys.argv[2], max_seq=64)\n"
            "pipe.generate(prompt_ids=[5, 6], max_new_tokens=2)\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    signal.alarm(120)  # (a hang ends)\n"
            "    try:\n"
            "        mindspec.load(sys.argv[1], sys.argv[2], max_seq=64).generate(prompt_ids=[5, 6], max_new_tokens=2)\n"
            "        print('the child ran', flush=True)\n"
            "    except mindspec.MindspecError as e:\n"
            "        print(e, flush=True)\n"
            "    os._exit(0)\n"
            "os.waitpid(pid, 0)\n")
    p = subprocess.run([sys.executable, "-c", code, tiny_target[0], noisy_draft], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, MINDSPEC_HOME=str(tmp_path)))
    assert p.returncode == 0 and p.stdout.startswith("MindSpore was set up by process "), (p.stdout, p.stderr[-2000:])
    assert p.stdout.endswith(", and a process forked from it cannot use it again (its threads do not survive a "
                             "fork: it would hang): start children with multiprocessing's \"spawn\" method, or fork "
                             "before loading\n"), p.stdout


def test_a_request_runs_on_the_pipeline_that_made_it(pipe, tmp_path):
    """A library prober's: a request made by one pipeline ran on another unchecked, with the first one's tokenizer,
    EOS and vocabulary check (ids of a 320-token vocabulary reached a 260-token model's graph: a raw Gather error
    with MindSpore's C++ stack)."""
    from conftest import make_tiny_checkpoint
    small = make_tiny_checkpoint(tmp_path / "small", vocab=260)[0]
    other = mindspec.load(target=small, draft=False, max_seq=64)
    r = pipe.request(prompt_ids=[300, 310, 319], max_new_tokens=4)
    for call in (lambda: list(other.stream([r])), lambda: other.run([r])):
        with pytest.raises(mindspec.MindspecError, match=r"^a request runs on the pipeline that made it: make it "
                                                         r"with this pipeline's request\(\)$"):
            call()
    assert r.output == [] and len(other.generate(prompt_ids=[5, 6], max_new_tokens=2).token_ids) == 2
    assert pipe.run([r])[0].output  # (its own pipeline runs it)


def test_a_stream_left_half_read_at_the_scripts_end_exits_quietly(tiny_target, noisy_draft, tmp_path):
    """A newcomer's: a script that read one event of a stream and ended printed "Exception ignored in
    <generator ...>" and an ImportError traceback: the stream's requests end aborted as the interpreter shuts
    down, and their pending text (a character cut short) looked up how to spell a byte-level token with an
    import, which shutdown refuses."""
    import subprocess
    import sys
    code = ("import sys, mindspec\npipe = mindspec.load(sys.argv[1], sys.argv[2], k=4, max_seq=64)\n"
            "g = pipe.stream([pipe.request(prompt='hi', max_new_tokens=30)], 1)\nnext(g)\nprint('end of script')\n")
    p = subprocess.run([sys.executable, "-c", code, tiny_target[0], noisy_draft], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, MINDSPEC_HOME=str(tmp_path)))
    assert (p.returncode, p.stdout) == (0, "end of script\n"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr[-3000:]


def test_a_stream_closed_half_way_ends_its_requests_aborted(pipe):
    """The library probe's: the requests of a stream closed half-way (or left by a Ctrl-C) said done False and
    finish_reason "length" (4 of 12 tokens), the one never started too."""
    rs = [pipe.request(prompt_ids=[5, 6, 7], max_new_tokens=30), pipe.request(prompt_ids=[9, 8, 7], max_new_tokens=30)]
    s = pipe.stream(rs, max_batch=1)
    next(s)
    s.close()
    assert [(r.done, r.result().finish_reason) for r in rs] == [(True, "abort"), (True, "abort")]
    assert 0 < len(rs[0].output) < 30 and rs[1].output == []
    # the diff review's: a Ctrl-C after a step that yielded nothing (a prompt's first 32-token chunk) left them
    # half-prefilled, done False, and unable to run again
    rs = [pipe.request(prompt_ids=list(range(5, 45)), max_new_tokens=30), pipe.request(prompt_ids=[9, 8, 7])]
    real = pipe.engine.step

    def step():
        real()
        raise KeyboardInterrupt

    pipe.engine.step = step
    try:
        with pytest.raises(KeyboardInterrupt):
            list(pipe.stream(rs, max_batch=1))
    finally:
        del pipe.engine.step
    assert [(r.done, r.result().finish_reason) for r in rs] == [(True, "abort"), (True, "abort")]
    assert pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4).token_ids  # (the pipeline serves on)


def test_a_call_its_callback_interrupts_leaves_the_pipeline_clean(pipe):
    """Found: Ctrl-C or an on_text callback that raised left the request in the engine, stepped by later
    calls, and a later call needing a larger cache failed ("cannot resize the KV cache while requests are
    running"). A callback that calls generate again is refused (its turn would never come)."""
    from mindspec.errors import MindspecError

    class Stop(Exception):
        pass

    def boom(text):
        raise Stop

    want = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12).token_ids
    for _ in range(2):
        with pytest.raises(Stop):
            pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=40, on_text=boom)
        assert not pipe.engine.has_work
    with pytest.raises(MindspecError, match="from inside its own callback"):
        pipe.generate(prompt_ids=[5, 6], max_new_tokens=3, on_text=lambda t: pipe.generate(prompt_ids=[5]))
    assert pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12).token_ids == want


def _script(code, tiny_target, draft, terminal=False, home=None):
    """A library script (`python -c code TARGET DRAFT`), its stdout and stderr piped (text); terminal: SIGINT at
    its default, as in a terminal's job (not ignored, as a background job's); home: its MINDSPEC_HOME."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, **({"MINDSPEC_HOME": str(home)} if home else {}))
    return subprocess.Popen([sys.executable, "-c", code, tiny_target[0], draft], text=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if terminal else None)


def _ctrl_c(p, first, delay, timeout=120):
    """Wait for the script p's line `first` (None: none), then `delay` s, and send it SIGINT: (its stdout,
    its stderr) once it ended (killed if it has not)."""
    import time
    try:
        if first is not None:
            assert p.stdout.readline().strip() == first, p.stderr.read()[-3000:]
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        return p.communicate(timeout=timeout)
    finally:
        p.kill()


CTRL_C_SCRIPT = """
import sys, time, mindspec
pipe = mindspec.load(target=sys.argv[1], draft=sys.argv[2], k=4, max_seq=128)
want = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12).token_ids
try:  # (each line printed where the Ctrl-C it announces will be caught: the test sends it once it reads it)
    print("ready", flush=True)
    while True:
        pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=100)
except KeyboardInterrupt:
    print("caught while generating", flush=True)
again = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12).token_ids
try:
    print("same" if again == want else "differs", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("caught while idle", flush=True)
"""


def test_ctrl_c_in_a_library_script_raises_keyboard_interrupt(tiny_target, noisy_draft):
    """Found trying the library as a user: once a script had run a generation, Ctrl-C killed the process
    (MindSpore's own SIGINT handler, set on every graph run, sends the process SIGTERM): exit -15, no
    KeyboardInterrupt, whether the script was generating or sleeping."""
    import signal
    import time
    p = _script(CTRL_C_SCRIPT, tiny_target, noisy_draft, terminal=True)
    lines = []

    def until(word):
        while (line := p.stdout.readline().strip()) != word:
            assert line, (lines, p.stderr.read()[-3000:])  # (EOF: the process ended)
            lines.append(line)
        lines.append(line)

    try:
        until("ready")
        time.sleep(0.5)  # inside a generation, most likely inside a graph run
        p.send_signal(signal.SIGINT)
        until("same")
        time.sleep(0.2)  # in time.sleep, after the graph runs
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert lines + out.splitlines() == ["ready", "caught while generating", "same", "caught while idle"], err[-3000:]
    assert p.returncode == 0, err[-3000:]


OWN_HANDLERS_SCRIPT = """
import signal, sys, time, mindspec
got = []
mine = lambda s, f: got.append(s)
signal.signal(signal.SIGINT, mine)  # the script's own
pipe = mindspec.load(target=sys.argv[1], draft=sys.argv[2], k=4, max_seq=128)
pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4)
print("ready", flush=True)


def until(sig, then):
    t = time.monotonic()
    while sig not in got and time.monotonic() - t < 60:
        pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=100)
    signal.signal(signal.SIGTERM, then)  # (in force before the test reads the line and sends the next signal)
    print("ran" if got[-1:] == [sig] else "not run", flush=True)


until(signal.SIGINT, mine)  # then its own SIGTERM handler: a SIGTERM stays one
until(signal.SIGTERM, signal.SIG_IGN)  # then one it ignores
for _ in range(10):
    pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=100)
ok = signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
print("handlers kept" if ok and len(got) == 2 else f"handlers changed {got}", flush=True)
"""


def test_a_scripts_own_or_ignored_signal_handlers_are_its_own_during_library_calls(tiny_target, noisy_draft):
    """Found by a signals probe: a library call replaced a script's own SIGINT handler (KeyboardInterrupt
    instead) and an ignored SIGTERM (KeyboardInterrupt too). A signal during a call now reaches the
    handler the script set, after the step it came in (a reviewer's: a SIGTERM too, where the script
    handles SIGTERM itself, though MindSpore's handler sends a Ctrl-C as SIGTERM)."""
    import signal
    import time
    p = _script(OWN_HANDLERS_SCRIPT, tiny_target, noisy_draft)
    try:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()[-3000:]
        for sig in (signal.SIGINT, signal.SIGTERM):
            time.sleep(0.5)  # inside a generation
            p.send_signal(sig)
            assert p.stdout.readline().strip() == "ran", (sig, p.stderr.read()[-3000:])
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)  # ignored now
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert (p.returncode, out.split()) == (0, ["handlers", "kept"]), err[-3000:]


THREAD_SCRIPT = """
import sys, threading, time, mindspec
pipe = mindspec.load(target=sys.argv[1], draft=sys.argv[2], k=4, max_seq=128)
t = threading.Thread(target=lambda: pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12))
t.start()
t.join()
try:
    print("ready", flush=True)
    time.sleep(60)
except KeyboardInterrupt:
    print("caught while idle", flush=True)
"""


def test_ctrl_c_after_a_generation_on_another_thread_raises_keyboard_interrupt(tiny_target, noisy_draft):
    """Found by a signals probe: after a generation on a thread other than the main one (a web app's
    worker), Ctrl-C killed the script with SIGTERM (MindSpore's handler, which Python cannot reset from
    there). The kernel's SIGINT action is now put back after every call, from any thread."""
    p = _script(THREAD_SCRIPT, tiny_target, noisy_draft, terminal=True)
    out, err = _ctrl_c(p, "ready", 0.2)
    assert (p.returncode, out.strip()) == (0, "caught while idle"), (p.returncode, err[-3000:])


LOAD_SCRIPT = """
try:
    import sys, time
    print("started", flush=True)  # Python's own start-up (site, .pth files) is over: a Ctrl-C is the script's now
    import mindspec
    pipe = mindspec.load(target=sys.argv[1], draft=sys.argv[2], k=4, max_seq=128)
    print("loaded", flush=True)
    time.sleep(60)  # (a busy machine may take longer than the delay to import MindSpore, or less)
except KeyboardInterrupt:
    print("caught", flush=True)
"""


@pytest.mark.parametrize("delay", [0.5, 1.0])
def test_ctrl_c_while_a_script_first_loads_raises_keyboard_interrupt(tiny_target, noisy_draft, delay):
    """Found by a signals probe: a Ctrl-C while `mindspec.load` first imported MindSpore broke the import
    half-way (ImportError or a lost signal; at exit `Fatal Python error`, exit 134). It now waits for the
    import's end and then raises in the caller."""
    p = _script(LOAD_SCRIPT, tiny_target, noisy_draft, terminal=True)
    out, err = _ctrl_c(p, "started", delay)  # (MindSpore's import: ~0.2 to 2 s; a busy machine's start-up up to 1)
    assert (p.returncode, out.split()[-1:], err) == (0, ["caught"], ""), (p.returncode, out, err[-3000:])


IMPORT_SCRIPT = """
import signal, sys
sent = []
def trace(frame, event, arg):  # the Ctrl-C lands in the first exec() of a string dataclasses makes
    if not sent and event == "call" and frame.f_code.co_filename == "<string>" and frame.f_back is not None \
            and frame.f_back.f_code.co_filename.endswith("dataclasses.py"):
        return ctrl_c
def ctrl_c(frame, event, arg):  # (a local tracer: raised, if it is, inside that exec's code)
    if not sent:
        sent.append(print("sent", flush=True))
        signal.raise_signal(signal.SIGINT)
import mindspec
try:
    sys.settrace(trace)
    mindspec.load(target=sys.argv[1], draft=sys.argv[2], k=4, max_seq=128)
except KeyboardInterrupt:
    print("caught", flush=True)
"""


def test_ctrl_c_during_the_librarys_first_import_is_raised_after_it(tiny_target, noisy_draft):
    """Found chasing a rare failure of the test above: a Ctrl-C during the library's own first imports
    (numpy, dataclasses, tokenizers: before MindSpore's) raised inside them. Inside an exec() of a
    string (dataclasses, namedtuple) the script that caught it was then killed by SIGINT at its exit
    (-2: the interpreter remembers the KeyboardInterrupt as unhandled); inside numpy's it became an
    ImportError. The whole of `load`, its imports included, now holds the Ctrl-C and raises it after."""
    p = _script(IMPORT_SCRIPT, tiny_target, noisy_draft, terminal=True)
    out, err = p.communicate(timeout=300)
    assert (p.returncode, out.split(), err) == (0, ["sent", "caught"], ""), (p.returncode, out, err[-3000:])


def test_a_compile_cache_that_cannot_be_made_is_done_without(tiny_target, noisy_draft, pipe, tmp_path):
    """Found by a user probe: a MINDSPEC_HOME on a read-only or full disk failed the load with a traceback
    (OSError from making the compile cache); the graphs now compile without the cache, with a warning."""
    import subprocess
    import sys
    (tmp_path / "compile_cache").write_text("")  # (as root nothing is read-only: a file where the dir goes)
    script = tmp_path / "run.py"  # (a script file: `python -c` runs without the compile cache at all)
    script.write_text("import sys, mindspec\n"
                      "pipe = mindspec.load(target=sys.argv[1], draft=sys.argv[2], k=4, max_seq=128)\n"
                      "print(pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12).token_ids)\n")
    p = subprocess.run([sys.executable, str(script), tiny_target[0], noisy_draft], capture_output=True,
                       text=True, env=dict(os.environ, MINDSPEC_HOME=str(tmp_path)), timeout=600)
    want = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12).token_ids
    assert (p.returncode, p.stdout.strip()) == (0, str(want)), p.stderr[-3000:]
    assert [line for line in p.stderr.splitlines() if "compile cache" in line] == [
        f"mindspec: warning: no compile cache in {tmp_path / 'compile_cache'} (File exists): graphs compile "
        f"afresh in each process"], p.stderr[-3000:]


@pytest.mark.parametrize("frees, said", [
    ("100000000", "has under 256 MB free (95 MB free)"),  # full before the warm-up: nothing written
    ("1000000000000,1000", "came within 16 MB of full as graphs were saved (0 MB free)")])  # after its first graph
def test_a_compile_cache_on_a_full_disk_is_not_written_nor_marked_whole(tiny_target, noisy_draft, pipe, tmp_path,
                                                                        frees, said):
    """Found by a user probe: with MINDSPEC_HOME's disk full, MindSpore logged two [ERROR] lines per graph it could
    not save, and the entry cut short was marked whole, so every later start logged three more per graph loading
    it (and compiled them all the same). Under 256 MB free a warm-up writes no entry; a disk that comes within
    16 MB of full as graphs are saved drops the entry being written. One warning line either way. (The disk's
    free space is what cache_budget.free_bytes reports: each call the next of `frees`, the last repeated.)"""
    import subprocess
    import sys
    script = tmp_path / "run.py"  # (a script file: `python -c` runs without the compile cache at all)
    script.write_text("import sys, mindspec\n"
                      "from mindspec.graphs import cache_budget\n"
                      "frees = [int(x) for x in sys.argv[3].split(',')]\n"
                      "cache_budget.free_bytes = lambda path: frees.pop(0) if len(frees) > 1 else frees[0]\n"
                      "pipe = mindspec.load(target=sys.argv[1], draft=sys.argv[2], k=4, max_seq=128)\n"
                      "print(pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12).token_ids)\n")
    p = subprocess.run([sys.executable, str(script), tiny_target[0], noisy_draft, frees], capture_output=True,
                       text=True, env=dict(os.environ, MINDSPEC_HOME=str(tmp_path)), timeout=600)
    want = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12).token_ids
    assert (p.returncode, p.stdout.strip()) == (0, str(want)), p.stderr[-3000:]
    assert [line for line in p.stderr.splitlines() if "compile cache" in line] == [
        f"mindspec: warning: the disk of {tmp_path / 'compile_cache'} {said}: graphs compile afresh in each process, "
        "not saved to the compile cache"], p.stderr[-3000:]
    assert [e for e in os.listdir(tmp_path / "compile_cache") if not e.endswith(".lock")] == []


RESENT_SCRIPT = """
import os, signal, sys
from mindspec import signals
if sys.argv[1] == "unknown":  # the kernel's handler cannot be read: counted as MindSpore's
    signals._os_handler = lambda sig: None
s = signals.Signals(True).__enter__()
if sys.argv[1] == "replaced":  # a graph run put MindSpore's SIGINT handler in place of ours
    s.ours = -1
os.kill(os.getpid(), signal.SIGTERM)  # (what MindSpore's handler sends on a Ctrl-C)
try:
    s.check()
except KeyboardInterrupt:
    print("caught", flush=True)
"""


@pytest.mark.parametrize("how", ["replaced", "unknown"])
def test_a_ctrl_c_mindspore_resent_as_sigterm_is_a_keyboard_interrupt(how):
    """Mutation testing's: a script's Ctrl-C during a graph run reaches us as SIGTERM (MindSpore's SIGINT
    handler sends it); where the script leaves SIGTERM alone it is passed on as the Ctrl-C it was. Mutants
    that passed it on as SIGTERM (or took an unreadable handler for ours) killed the script (-15)."""
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", RESENT_SCRIPT, how], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stdout, p.stderr) == (0, "caught\n", "")


IGNORING_SCRIPT = """
import signal, sys, mindspec
signal.signal(signal.SIGINT, signal.SIG_IGN)
pipe = mindspec.load(target=sys.argv[1], draft=sys.argv[2], k=4, max_seq=128)
print("loaded", flush=True)
print(len(pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12).token_ids), flush=True)
"""


def test_an_ignored_ctrl_c_while_a_call_compiles_is_ignored(tiny_target, noisy_draft, tmp_path):
    """A reviewer's: a library call's stop check before each graph compile raised KeyboardInterrupt in a
    script that ignores SIGINT; it now passes the signal on too (here: to nothing)."""
    p = _script(IGNORING_SCRIPT, tiny_target, noisy_draft, home=tmp_path)  # (its graphs compile: seconds)
    out, err = _ctrl_c(p, "loaded", 1.0)
    assert (p.returncode, out.split()) == (0, ["12"]), err[-3000:]


def test_careless_library_calls_are_one_line_errors_and_change_nothing(pipe, tiny_target, noisy_draft, tmp_path):
    """Found by a careless user of the library: each of these hung, ran something else than asked, or
    failed from deep inside."""
    from mindspec.errors import MindspecError
    want = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12)
    assert want.stats["drafted"] > 0
    # set_draft from a callback swapped the engine under the running request: spun at 100% CPU for ever
    with pytest.raises(MindspecError, match="cannot change the draft while requests are running"):
        pipe.generate(prompt_ids=[5, 6], max_new_tokens=20, on_text=lambda t: pipe.set_draft(None))
    # a refused draft left the pipeline naming it and running target-only
    short = str(tmp_path / "d64.onnx")
    export_draft(tiny_target[0], short, max_seq=64)
    with pytest.raises(MindspecError, match="more than the 64 positions the draft was exported for"):
        pipe.set_draft(short)
    assert pipe.draft_path == noisy_draft
    again = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12)
    assert again.token_ids == want.token_ids and again.stats["drafted"] == want.stats["drafted"]
    # chat=True beside prompt_ids was ignored (the CLI refuses --chat with --prompt-ids)
    with pytest.raises(MindspecError, match="chat=True wraps a text prompt in the chat template"):
        pipe.generate(prompt_ids=[5, 6], chat=True)
    with pytest.raises(MindspecError, match=r"requests\[0\]: chat=True wraps a text prompt"):
        pipe.generate_many([{"prompt_ids": [5, 6], "chat": True}])
    # run(): max_batch 0 and one request given twice hung; a string was an AttributeError
    r = pipe.request(prompt_ids=[5, 6], max_new_tokens=3)
    # (the library prober's: a generator, a lone Request or None, and a non-callable on_event, raised TypeErrors)
    for args, words in ((([r], None, 0)), "max_batch must be an integer >= 1, got 0"), \
            (([r, r],), "the same request is given twice"), ((["hello"],), "run and stream take a list of Requests"), \
            (((x for x in [r]),), "take a list of Requests"), ((r,), "take a list of Requests"), \
            ((None,), "take a list of Requests"), (([r], 5), "on_event must be a callable"):
        with pytest.raises(MindspecError, match=words):
            pipe.run(*args)
    assert r.state == "waiting" and not r.output  # (none of them ran it)
    # a callback that is not callable failed after the prompt ran; an unknown keyword named request()
    with pytest.raises(MindspecError, match="on_text must be a callable"):
        pipe.generate(prompt_ids=[5], on_text=5)
    with pytest.raises(MindspecError, match='unknown keyword "foo"'):
        pipe.generate(prompt_ids=[5], foo=1)
    with pytest.raises(MindspecError, match='unknown keyword "foo"'):  # (the library probe's: Python's TypeError)
        pipe.request(prompt_ids=[5], foo=1)
    # numpy integers: refused with messages that read "must be an integer ..., got 3"
    got = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=np.int64(12), k=np.int64(4))
    assert got.token_ids == want.token_ids and type(got.stats["drafted"]) is int
    r = pipe.request(prompt_ids=[5], logprobs=np.int64(2), max_new_tokens=np.uint8(3))
    assert (r.logprobs, r.max_new_tokens) == (2, 3) and type(r.logprobs) is type(r.max_new_tokens) is int
    assert [x.token_ids for x in pipe.generate_many([{"prompt_ids": [5, 6, 7], "max_new_tokens": 12}],
                                                    max_batch=np.int64(1))] == [want.token_ids]
    # load: tp=2 ran on one device; prefix_cache="no" kept caching; buckets=4 was a TypeError
    for kw, words in ((dict(tp=2), "tp=2 needs one process per rank"),
                      (dict(prefix_cache="no"), "prefix_cache must be True or False, got \"no\""),
                      (dict(buckets=4), "K buckets must be integers >= 1, got 4"),
                      (dict(batch_buckets=4), "batch buckets must be integers >= 1, got 4"),
                      (dict(foo=1), 'unknown keyword "foo"')):
        with pytest.raises(MindspecError, match=words):
            mindspec.load(target=tiny_target[0], draft=noisy_draft, **kw)


def test_signals_after_a_commands_stop_exit_quietly_and_a_ranks_command_keeps_library_calls_out():
    """Signals(final=True) (batch, serve): after a recorded stop a later signal exits at once (os._exit(130);
    it raised in MindSpore's Cell.__del__ during the teardown), and with none recorded it goes on recording until
    the command's exit code is known (stopping(code); a Ctrl-C there raised KeyboardInterrupt). A command's inactive Signals (a tensor-parallel rank: its launcher handles signals) counts as in
    force, so a library call inside it installs no handler of its own."""
    from mindspec import signals
    before = {s: signal.getsignal(s) for s in signals.SIGNALS}
    try:
        with signals.Signals(True, lambda: None, final=True) as sig:
            pass
        assert all(signal.getsignal(s) == sig._record for s in signals.SIGNALS)
        for s, h in before.items():
            signal.signal(s, h)
        with signals.Signals(True, lambda: None, final=True) as sig:
            sig._record(signal.SIGINT, None)
        assert all(signal.getsignal(s).code == 130 for s in signals.SIGNALS)
        for s, h in before.items():
            signal.signal(s, h)
        with signals.Signals(True, lambda: None) as sig:  # a library call's: its handlers back, whatever happened
            sig._record(signal.SIGINT, None)
        assert {s: signal.getsignal(s) for s in signals.SIGNALS} == before
        with signals.Signals(False, lambda: None):
            assert signals.active() and {s: signal.getsignal(s) for s in signals.SIGNALS} == before
        assert not signals.active()
        signals.stopping()
        assert all(signal.getsignal(s).code == 130 for s in signals.SIGNALS)
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_a_stop_string_given_second_stops_too(pipe):
    """Found by mutation testing: only the first stop string given was honoured."""
    text = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, speculate=False).text
    s = text[len(text) // 2:len(text) // 2 + 2]
    res = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, stop=["zzz-not-there", s])
    assert res.finish_reason == "stop" and res.text == text[:text.find(s)] and len(res.token_ids) < 30


def test_of_two_stop_strings_matching_at_once_the_earlier_cuts(pipe):
    """Found by mutation testing: of two stop strings completed by the same token, the text was cut before
    the one starting later. Two ending at the same character (where neither ended before), given
    later-first: the text ends before the earlier one."""
    text = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, speculate=False).text
    e = next(e for e in range(4, len(text)) if text[e - 4:e] not in text[:e - 1] and text[e - 2:e] not in text[:e - 1]
             and "\ufffd" not in text[e - 4:e])  # (whole characters: not bytes held back and flushed later)
    res = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, stop=[text[e - 2:e], text[e - 4:e]])
    assert res.finish_reason == "stop" and res.text == text[:e - 4]


def test_acceptance_rate_is_none_without_drafts(pipe):
    """Found by mutation testing: a target-only request's acceptance rate read 0.0 (nothing drafted is
    not nothing accepted: the CLI, metrics and bench show "-" for None)."""
    plain = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12, speculate=False)
    assert plain.stats["drafted"] == 0 and plain.stats["acceptance_rate"] is None
    spec = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=12, k=4)
    assert spec.stats["drafted"] > 0
    assert spec.stats["acceptance_rate"] == spec.stats["accepted"] / spec.stats["drafted"]


def test_a_script_ends_without_mindspores_teardown_tracebacks(tiny_target, noisy_draft, tmp_path):
    """The library prober's: a script that imported multiprocessing (many libraries do) and left a pipeline
    alive printed six "Exception ignored in: Cell.__del__ ... TypeError: 'NoneType' object is not callable" at
    exit (its graphs freed in the interpreter's teardown, weakref's functions gone). They are freed at exit now,
    before it."""
    import subprocess
    import sys
    code = f"""if 1:
        import multiprocessing, mindspec
        p = mindspec.load(target={tiny_target[0]!r}, draft={noisy_draft!r}, max_seq=64)
        print(p.generate(prompt_ids=[5, 6, 7], max_new_tokens=4).token_ids)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("[") and r.stderr == "", r.stderr[-3000:]


def test_a_forked_child_is_refused_not_hung(pipe):
    """The library prober's: generate in a process forked after the pipeline had run hung for ever (MindSpore's
    and onnxruntime's threads are not in the child). The child gets one error at once; the parent runs on."""
    import multiprocessing as mp
    want = pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4).token_ids
    q = mp.get_context("fork").SimpleQueue()

    def child():
        try:
            pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4)
            q.put("ran")
        except mindspec.MindspecError as e:
            q.put(str(e))
    proc = mp.get_context("fork").Process(target=child)
    proc.start()
    proc.join(60)
    alive = proc.is_alive()
    if alive:
        proc.kill()
    assert not alive and proc.exitcode == 0 and not q.empty(), (alive, proc.exitcode)
    assert q.get().startswith(f"this pipeline was loaded by process {os.getpid()}, and a process forked from it "
                              "cannot run it")
    assert pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4).token_ids == want
