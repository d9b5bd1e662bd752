"""`mindspec batch` as a real subprocess on real files: results equal target-only generation, a bad
line becomes an error record and the job goes on, an interrupted output is resumed without
duplicates, an unusable input exits 2 with one line."""
import json
import os
import subprocess
import sys

import pytest

import mindspec
from mindspec.export import export_draft

MAX_SEQ = 128
LINES = [
    json.dumps({"id": "a", "prompt_ids": [5, 6, 7, 8], "max_new_tokens": 10}),
    json.dumps({"prompt": "hello"}),  # id 2, the default --max-new-tokens
    "{oops",  # id 3: not JSON
    json.dumps({"id": "d", "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 6}),
    json.dumps({"id": "e", "prompt": "x", "temperature": -1}),
    json.dumps({"id": "f", "prompt_ids": [5] * 200}),  # longer than the cache
    "",
    json.dumps({"id": "h", "prompt_ids": [9, 8, 7], "temprature": 1.0}),  # a typo is not ignored
]
EXPECT_ERRORS = {3: "not valid JSON", "e": "temperature must be >= 0", "f": "does not fit",
                 "h": "unknown field(s) temprature"}


@pytest.fixture(scope="module")
def setup(tiny_target, tiny_draft_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    draft = str(d / "draft.onnx")
    export_draft(tiny_draft_ckpt[0], draft)
    inp = d / "in.jsonl"
    inp.write_text("\n".join(LINES) + "\n")
    return tiny_target[0], draft, inp, d


def batch(setup, out, inp=None, extra=()):
    target, draft, default_inp, _ = setup
    p = subprocess.run([sys.executable, "-m", "mindspec", "batch", "--input", str(inp or default_inp),
                        "--output", str(out), "--target", target, "--draft", draft, "-k", "2",
                        "--max-seq", str(MAX_SEQ), "--max-new-tokens", "5", *extra],
                       capture_output=True, text=True, timeout=600)
    return p.returncode, p.stderr


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(setup):
    out = setup[3] / "out.jsonl"
    code, err = batch(setup, out)
    return code, err, out


def test_results_equal_target_only_and_bad_lines_become_errors(setup, first_run):
    code, err, out = first_run
    assert code == 1, err  # some lines failed
    assert "Traceback" not in err
    summary = err.strip().splitlines()[-1]
    assert "3 done, 0 skipped, 4 failed" in summary and "tokens per target call" in summary, summary
    recs = records(out)
    assert [r["id"] for r in recs] == ["a", 2, 3, "d", "e", "f", "h"]
    by_id = {r["id"]: r for r in recs}
    for rid, needle in EXPECT_ERRORS.items():
        assert set(by_id[rid]) == {"id", "error"} and needle in by_id[rid]["error"], by_id[rid]
    pipe = mindspec.load(target=setup[0], draft=setup[1], k=2, max_seq=MAX_SEQ)
    refs = {"a": pipe.generate(prompt_ids=[5, 6, 7, 8], max_new_tokens=10, speculate=False),
            2: pipe.generate(prompt="hello", max_new_tokens=5, speculate=False),
            "d": pipe.generate(prompt="hi", chat=True, max_new_tokens=6, speculate=False)}
    for rid, ref in refs.items():
        r = by_id[rid]
        assert r["token_ids"] == ref.token_ids and r["text"] == ref.text, rid
        assert r["finish_reason"] == ref.finish_reason and r["stats"]["new_tokens"] == len(ref.token_ids)
    assert sum(by_id[r]["stats"]["drafted"] for r in refs) > 0  # the draft really ran


def test_resume_skips_finished_ids_and_redoes_a_half_written_line(setup, first_run):
    _, _, out = first_run
    full = out.read_text().splitlines()
    resumed = setup[3] / "resumed.jsonl"
    resumed.write_text(full[0] + "\n" + full[1][:len(full[1]) // 2])  # killed while writing line 2
    code, err = batch(setup, resumed)
    assert code == 1, err
    assert "2 done, 1 skipped, 4 failed" in err.strip().splitlines()[-1], err
    recs = records(resumed)
    assert [r["id"] for r in recs] == ["a", 2, 3, "d", "e", "f", "h"]  # each id once, in input order
    assert [r.get("token_ids") for r in recs] == [r.get("token_ids") for r in records(out)]
    # everything done: nothing to generate, so nothing is loaded; the earlier failures are not retried
    code, err = batch(setup, resumed)
    assert code == 0 and "0 done, 7 skipped, 0 failed" in err, err
    assert len(records(resumed)) == 7


def _expect_usage_error(setup, out, needle, inp=None):
    code, err = batch(setup, out, inp)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("mindspec: error:") and needle in err, err
    assert "Traceback" not in err


def test_unusable_input_or_output_exits_2_with_one_line(setup, tmp_path):
    _expect_usage_error(setup, tmp_path / "o.jsonl", "cannot read input", inp=tmp_path / "missing.jsonl")
    _expect_usage_error(setup, tmp_path / "o.jsonl", "cannot read input", inp=tmp_path)  # a directory
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    _expect_usage_error(setup, tmp_path / "o.jsonl", "not UTF-8", inp=tmp_path / "bin.jsonl")
    foreign = tmp_path / "notes.txt"
    foreign.write_text("my notes\nmore notes\n")
    _expect_usage_error(setup, foreign, "not a mindspec batch record")
    assert foreign.read_text() == "my notes\nmore notes\n"  # untouched
    assert not os.path.exists(tmp_path / "o.jsonl")


def test_tensor_parallel_batch_equals_tp1(setup, first_run, tmp_path):
    """`batch --tp 2` (msrun, 127.0.0.1): both ranks run the job in lock step, rank 0 alone writes;
    greedy lines equal the TP=1 run, and a sampled line without a seed gets the same drawn seed on
    every rank (else the ranks would accept different drafts and the text would not repeat)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(LINES[0] + "\n" + LINES[3] + "\n" +
                   json.dumps({"id": "s", "prompt_ids": [9, 8, 7], "temperature": 1.0, "max_new_tokens": 8}) + "\n")
    out = tmp_path / "out.jsonl"
    code, err = batch(setup, out, inp, extra=["--tp", "2"])
    assert code == 0, err
    assert "2 done" not in err and "3 done, 0 skipped, 0 failed" in err.strip().splitlines()[-1], err
    recs = records(out)
    assert [r["id"] for r in recs] == ["a", "d", "s"]  # written once, by rank 0
    tp1 = {r["id"]: r for r in records(first_run[2])}
    for r in recs[:2]:
        assert r["token_ids"] == tp1[r["id"]]["token_ids"], r["id"]
    pipe = mindspec.load(target=setup[0], draft=setup[1], k=2, max_seq=MAX_SEQ)
    ref = pipe.generate(prompt_ids=[9, 8, 7], max_new_tokens=8, temperature=1.0, seed=recs[2]["seed"])
    assert recs[2]["token_ids"] == ref.token_ids and recs[2]["stats"]["drafted"] > 0


def test_duplicate_ids_stop_the_job_before_it_starts(setup, tmp_path):
    inp = tmp_path / "dup.jsonl"
    inp.write_text(json.dumps({"id": 2, "prompt": "first"}) + "\n" + json.dumps({"prompt": "second"}) + "\n")
    _expect_usage_error(setup, tmp_path / "o.jsonl", "id 2 is already line 1's", inp=inp)


def test_interrupt_keeps_what_was_written_and_says_so(setup, tmp_path):
    """Ctrl-C or kill after the first records: exit 130 with the summary line, whole records kept.
    (MindSpore's own SIGINT handler, installed while it compiles, turns Ctrl-C into SIGTERM.)"""
    import signal
    import time
    target, draft, _, _ = setup
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt_ids": [5, 6, i], "max_new_tokens": 40}) + "\n" for i in range(40)))
    for sig in (signal.SIGINT, signal.SIGTERM):
        home = tmp_path / f"home{int(sig)}"  # no compile cache: MindSpore compiles, and takes the signals
        p = subprocess.Popen([sys.executable, "-m", "mindspec", "batch", "--input", str(inp), "--output", str(out),
                              "--target", target, "--draft", draft, "-k", "2", "--max-seq", str(MAX_SEQ)],
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ, MINDSPEC_HOME=str(home)))
        before = len(records(out)) if out.exists() else 0
        while not out.exists() or len(out.read_text().splitlines()) < before + 2:
            assert p.poll() is None, p.stderr.read()
            time.sleep(0.05)
        p.send_signal(sig)
        err = p.communicate(timeout=120)[1]
        assert p.returncode == 130, (sig, err)
        assert "Traceback" not in err and " done, " in err.strip().splitlines()[-1], err
        recs = records(out)  # every line whole
        assert len(recs) < 40 and len({r["id"] for r in recs}) == len(recs)
