"""`mindspec batch` as a real subprocess on real files: results equal target-only generation, a bad
line becomes an error record (with its line number) and the job goes on, an interrupted or disk-full
output is resumed without duplicates, a second job on the same output is refused (lock), a file that
is not this job's output is never touched, failed lines are retried, progress is shown, signals at
any moment exit 130 with the summary. A few in-process tests with a stand-in pipeline cover what a
real model cannot provoke cheaply (records finishing out of input order, a write cut short)."""
import errno
import fcntl
import json
import os
import shutil
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

import mindspec
from mindspec import batch as B
from mindspec.errors import MindspecError
from mindspec.export import export_draft

from conftest import wait_for

MAX_SEQ = 128
LINES = [
    json.dumps({"id": "a", "prompt_ids": [3, 5, 6, 7, 8], "max_new_tokens": 10, "truncate_prompt_tokens": 4}),
    json.dumps({"prompt": "hello"}),  # id 2, the default --max-new-tokens
    "{oops",  # id 3: not JSON
    json.dumps({"id": "d", "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 6, "logprobs": 2}),
    json.dumps({"id": "e", "prompt": "x", "temperature": -1}),
    json.dumps({"id": "f", "prompt_ids": [5] * 200}),  # longer than the cache
    "",
    json.dumps({"id": "h", "prompt_ids": [9, 8, 7], "temprature": 1.0}),  # a typo is not ignored
    # raw U+2028 and U+0085 inside a JSON string (str.splitlines would split there), and a CRLF ending
    json.dumps({"id": "u", "prompt": "x\u2028y\u0085z", "max_new_tokens": 3}, ensure_ascii=False) + "\r",
]
IDS = ["a", 2, 3, "d", "e", "f", "h", "u"]
EXPECT_ERRORS = {3: "line 3: not valid JSON", "e": "line 5: temperature", "f": "line 6: ",
                 "h": "line 8: unknown field(s) temprature"}


def test_lines_nested_too_deep_with_a_key_twice_or_a_huge_number_are_their_own_errors():
    """Found reviewing the server's fixes: a line nested deeper than Python's stack stopped the whole job
    with a RecursionError traceback; a key given twice ran its last value (the server refuses it); a
    number past int()'s digit limit quoted sys.set_int_max_str_digits()."""
    assert B._row(4, "[" * 100000 + "]" * 100000, "i") == (None, None, "line 4: not valid JSON: nested deeper than "
                                                               "Python's stack")
    assert B._row(5, '{"prompt": "a", "prompt": "b"}', "i") == (None, None, 'line 5: the key "prompt" is given twice')
    assert B._row(6, '{"seed": 1' + "0" * 5000 + "}", "i") == (None, None, "line 6: not valid JSON: a number of more "
                                                                   "than 4300 digits")


def test_chat_of_the_job_wraps_only_its_text_prompts():
    """The docs prober's: `batch --chat` made every "prompt_ids" line an error record ("chat=True wraps a
    text prompt ...: it does not apply to prompt_ids"), retried and failed on every re-run. The flag wraps
    "prompt" lines (its help says so); ids and messages lines are left alone; a line's own "chat" stands."""
    from mindspec.request import parse
    job = {"chat": True, "max_new_tokens": 4}
    assert parse({"prompt": "hi"}, job)["chat"] is True
    assert "chat" not in parse({"prompt_ids": [1, 2]}, job)
    assert "chat" not in parse({"messages": [{"role": "user", "content": "hi"}]}, job)
    assert parse({"prompt_ids": [1, 2], "chat": True}, job)["chat"] is True  # (refused by name when it runs)


@pytest.fixture(scope="module")
def setup(tiny_target, tiny_draft_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    draft = str(d / "draft.onnx")
    export_draft(tiny_draft_ckpt[0], draft)
    inp = d / "in.jsonl"
    inp.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return tiny_target[0], draft, inp, d


def command(setup, out, inp=None, extra=()):
    target, draft, default_inp, _ = setup
    return [sys.executable, "-m", "mindspec", "batch", "--input", str(inp or default_inp), "--output", str(out),
            "--target", target, "--draft", draft, "-k", "2", "--max-seq", str(MAX_SEQ), "--max-new-tokens", "5",
            "--max-batch", "2", *extra]  # one set of graphs for every job of this file (see TP_GRAPHS)


def batch(setup, out, inp=None, extra=(), env=None, cwd=None):
    p = subprocess.run(command(setup, out, inp, extra), capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, **(env or {})), cwd=cwd)
    return p.returncode, p.stderr


def records(path):
    return [json.loads(line) for line in path.read_bytes().split(b"\n") if line]


def by_id(path):
    first = {}
    for r in records(path):
        if r["id"] not in first or ("error" in first[r["id"]] and "error" not in r):
            first[r["id"]] = r  # the first result wins over earlier errors
    return first


def last(err):
    return err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def pipe(setup):
    """The in-process reference (target-only runs) of this file's jobs."""
    return mindspec.load(target=setup[0], draft=setup[1], k=2, max_seq=MAX_SEQ)


@pytest.fixture(scope="module")
def first_run(setup):
    out = setup[3] / "out.jsonl"
    code, err = batch(setup, out, env={"MINDSPEC_PROGRESS_S": "0"}, cwd=setup[3])
    return code, err, out


def test_results_equal_target_only_and_bad_lines_become_errors(setup, first_run, pipe):
    code, err, out = first_run
    assert code == 1, err  # some lines failed
    assert "Traceback" not in err
    summary = last(err)
    assert "8 lines: 4 done, 4 failed, 0 left" in summary and "this run: 4 done, 4 failed, 0 skipped" in summary \
        and "tokens per target call" in summary, summary
    assert re.search(r"mindspec batch: \d+/8 lines \(\d+ failed\), .* tok/s, acceptance .*, ETA", err), err  # progress
    recs = records(out)
    assert sorted(map(str, (r["id"] for r in recs))) == sorted(map(str, IDS))  # each id once, in finishing order
    assert all(list(r)[:3] == ["mindspec_batch", "job", "id"] and r["mindspec_batch"] == 1 for r in recs)
    assert len({r["job"] for r in recs}) == 1
    got = by_id(out)
    for rid, needle in EXPECT_ERRORS.items():
        assert set(got[rid]) == {"mindspec_batch", "job", "id", "error"} and needle in got[rid]["error"], got[rid]
    assert "does not fit" in got["f"]["error"]
    refs = {"a": pipe.generate(prompt_ids=[5, 6, 7, 8], max_new_tokens=10, speculate=False),  # (the last 4)
            2: pipe.generate(prompt="hello", max_new_tokens=5, speculate=False),
            "d": pipe.generate(prompt="hi", chat=True, max_new_tokens=6, speculate=False, logprobs=2),
            "u": pipe.generate(prompt="x\u2028y\u0085z", max_new_tokens=3, speculate=False)}
    for rid, ref in refs.items():
        r = got[rid]
        assert r["token_ids"] == ref.token_ids and r["text"] == ref.text, rid
        assert r["finish_reason"] == ref.finish_reason and r["stats"]["new_tokens"] == len(ref.token_ids)
        assert ("logprobs" in r) == (rid == "d")
    assert [lp for lp, _ in got["d"]["logprobs"]] == pytest.approx([lp for lp, _ in refs["d"].logprobs], abs=1e-5)
    assert [[t for t, _ in top] for _, top in got["d"]["logprobs"]] == [[t for t, _ in top] for _, top in refs["d"].logprobs]
    assert sum(got[r]["stats"]["drafted"] for r in refs) > 0  # the draft really ran
    assert not (setup[3] / "rank_0").exists()


def test_resume_redoes_a_half_written_line_and_retries_failed_lines(setup, first_run):
    _, _, out = first_run
    lines = {json.loads(line)["id"]: line for line in out.read_bytes().split(b"\n") if line}
    resumed = setup[3] / "resumed.jsonl"
    resumed.write_bytes(lines["a"] + b"\n" + lines["d"][:len(lines["d"]) // 2])  # killed while writing "d"
    code, err = batch(setup, resumed)
    assert code == 1, err
    assert "8 lines: 4 done, 4 failed, 0 left" in last(err) and "this run: 3 done, 4 failed, 1 skipped" in last(err)
    recs = records(resumed)
    assert sorted(map(str, (r["id"] for r in recs))) == sorted(map(str, IDS))  # "d" once: the torn line was cut
    first = by_id(out)
    assert all(r.get("token_ids") == first[r["id"]].get("token_ids") for r in recs)
    # a re-run retries the failed lines: "f" fits a larger cache now (the job is the same: --max-seq is not part
    # of it); the others fail again in the same words, which are not written twice. Counts cover the whole file.
    code, err = batch(setup, resumed, extra=["--max-seq", "256"])
    assert code == 1 and "8 lines: 5 done, 3 failed, 0 left" in last(err), err
    assert "this run: 1 done, 3 failed, 4 skipped" in last(err), err
    assert len(records(resumed)) == 9 and "token_ids" in by_id(resumed)["f"]
    assert "Traceback" not in err


def _expect_usage_error(setup, out, needle, inp=None, extra=()):
    before = out.read_bytes() if os.path.isfile(out) else None
    code, err = batch(setup, out, inp, extra)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("mindspec: error:") and needle in err, err
    assert "Traceback" not in err
    if before is not None:
        assert out.read_bytes() == before  # not appended to, not truncated


def test_input_dash_is_standard_input(setup, first_run, tmp_path):
    """The batch prober's: `--input -` (as `generate -` reads its prompt) was a file named "-"."""
    out = tmp_path / "dash.jsonl"
    with open(setup[2], "rb") as f:
        p = subprocess.run(command(setup, out, "-"), stdin=f, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stderr  # (the input's bad lines)
    strip = lambda recs: sorted((json.dumps(r["id"]), r.get("token_ids"), r.get("error")) for r in recs)  # noqa: E731
    assert strip(records(out)) == strip(records(first_run[2]))


def test_unusable_input_or_output_exits_2_with_one_line_and_touches_nothing(setup, first_run, tmp_path):
    _expect_usage_error(setup, tmp_path / "o.jsonl", "cannot read input", inp=tmp_path / "missing.jsonl")
    _expect_usage_error(setup, tmp_path / "o.jsonl", "cannot read input", inp=tmp_path)  # a directory
    (tmp_path / "bin.jsonl").write_bytes(LINES[0].encode() + b"\n\xff\xfe\x00garbage\n")
    _expect_usage_error(setup, tmp_path / "o.jsonl", "line 2 is not UTF-8", inp=tmp_path / "bin.jsonl")
    _expect_usage_error(setup, tmp_path / "no" / "o.jsonl", "cannot write output")
    assert not os.path.exists(tmp_path / "o.jsonl")
    foreign = tmp_path / "notes.txt"
    foreign.write_text("my notes\nmore notes\n")
    _expect_usage_error(setup, foreign, "notes.txt:1 is not a mindspec batch record")
    # input == output, also through a symlink or a hard link
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(setup[2].read_bytes())
    os.symlink(inp, tmp_path / "sym.jsonl")
    os.link(inp, tmp_path / "hard.jsonl")
    for out in (inp, tmp_path / "sym.jsonl", tmp_path / "hard.jsonl"):
        _expect_usage_error(setup, out, "--input and --output are the same file", inp=inp)
    # JSONL with "id"s is not our output: another copy of the input, results of another tool, a torn line
    (tmp_path / "copy.jsonl").write_bytes(setup[2].read_bytes())
    _expect_usage_error(setup, tmp_path / "copy.jsonl", "copy.jsonl:1 is not a mindspec batch record")
    (tmp_path / "other.jsonl").write_bytes(b'{"id": "a", "text": "hi"}\n{"id": 2, "text": "par')
    _expect_usage_error(setup, tmp_path / "other.jsonl", "other.jsonl:1 is not a mindspec batch record")
    (tmp_path / "torn.jsonl").write_bytes(b'{"id": ')
    _expect_usage_error(setup, tmp_path / "torn.jsonl", "torn.jsonl:1 is not a mindspec batch record")
    (tmp_path / "word.txt").write_bytes(b"hello")
    _expect_usage_error(setup, tmp_path / "word.txt", "word.txt:1 is not a mindspec batch record")
    # our records, but of another job (other request defaults)
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_bytes(first_run[2].read_bytes())
    _expect_usage_error(setup, theirs, "holds the results of another job", extra=["--max-new-tokens", "6"])


def test_an_output_that_is_stdout_a_pipe_gets_the_records(setup, tmp_path):
    """Found by a batch probe: `--output /dev/stdout | cat` was "cannot write output /dev/stdout: No such file or
    directory" (its real path, /proc/PID/fd/pipe:[N], is no file), though a pipe is written as /dev/null is: no
    lock, nothing to resume."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt_ids": [5, 6, i]}) + "\n" for i in range(3)))
    p = subprocess.run(command(setup, "/dev/stdout", inp), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       timeout=600)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    assert sorted(json.loads(line)["id"] for line in p.stdout.splitlines()) == [1, 2, 3]


def test_an_output_pipe_whose_reader_left_is_a_broken_pipe(tmp_path):
    """Found by a review: the pipe behind /dev/stdout opened for reading and writing held a read end itself, so
    after `| head -1` left, writes filled the pipe's 64 kB and then blocked for ever (no EPIPE)."""
    inp = _input(tmp_path / "in.jsonl", 1)
    r, w = os.pipe()
    out = B.Output(f"/dev/fd/{w}", B.job_id(DEFAULTS), str(inp))
    try:
        os.close(r)  # the reader leaves
        with pytest.raises(BrokenPipeError):
            os.write(out.fd, b"x")
    finally:
        out.close()
        os.close(w)


def test_a_second_job_on_the_same_output_is_refused(setup, tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_bytes(b"")
    with open(out, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # as a running job holds it
        _expect_usage_error(setup, out, f"o.jsonl is in use by another job (pid {os.getpid()})")
        # the batch prober's: beside a running --dp 2 job's parts, a job without --dp (or with another N) was
        # told to finish that run or --merge it, while it ran
        (tmp_path / "o.jsonl.part0of2").write_bytes(b"")
        for extra in ((), ("--dp", "3")):
            _expect_usage_error(setup, out, f"o.jsonl is in use by another job (pid {os.getpid()})", extra=extra)


def _read_all(fd, buf):
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the other side is closed
            return
        if not chunk:
            return
        buf.append(chunk)


def test_two_jobs_on_one_output_write_each_id_once_and_a_terminal_gets_a_progress_bar(setup, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt_ids": [5, 6, i], "max_new_tokens": 8}) + "\n" for i in range(12)))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    first = subprocess.Popen(command(setup, out, inp), stderr=slave, cwd=tmp_path)
    os.close(slave)
    buf = []
    reader = threading.Thread(target=_read_all, args=(master, buf))
    reader.start()
    while not out.exists():  # the first job holds the lock from here on (it is loading the model)
        assert first.poll() is None
        time.sleep(0.02)
    code, err = batch(setup, out, inp)
    assert code == 2 and f"is in use by another job (pid {first.pid})" in err and len(err.splitlines()) == 1, err
    assert first.wait(timeout=600) == 0
    reader.join()
    os.close(master)
    screen = b"".join(buf).decode("utf-8", "replace")
    assert "\r" in screen and "12/12" in screen and "tok/s" in screen and "acceptance" in screen, screen
    assert "12 lines: 12 done, 0 failed, 0 left" in screen.strip().splitlines()[-1], screen
    assert sorted(r["id"] for r in records(out)) == list(range(1, 13))


@pytest.fixture
def small_disk(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True, text=True)
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip() or p.returncode}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


def test_full_disk_stops_with_one_line_an_honest_count_and_a_file_that_resumes(setup, small_disk, tmp_path):
    inp, out, filler = tmp_path / "in.jsonl", small_disk / "o.jsonl", small_disk / "filler"
    inp.write_text("".join(json.dumps({"prompt_ids": [5, 6, i], "max_new_tokens": 24}) + "\n" for i in range(30)))
    filler.write_bytes(b"x" * (56 * 1024))  # 8 KiB left: room for a few records
    code, err = batch(setup, out, inp)
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1] == f"mindspec: error: cannot write output {out}: No space left on device", err
    m = re.search(r"30 lines: (\d+) done, 0 failed, (\d+) left", lines[-2])
    assert m, err
    done, left = int(m[1]), int(m[2])
    assert 0 < done == len(records(out)) and done + left == 30  # what it says is what is in the file
    assert out.read_bytes().endswith(b"\n")  # no torn record
    filler.unlink()
    with open(out, "ab") as f:
        f.write(b'{"mi')  # and if one is there (a crash mid-write), shorter than anything recognisable: cut
    code, err = batch(setup, out, inp)
    assert code == 0, err
    assert "30 lines: 30 done, 0 failed, 0 left" in last(err) and f"this run: {left} done, 0 failed, {done} skipped" \
        in last(err), err
    assert sorted(r["id"] for r in records(out)) == list(range(1, 31))


# TP_GRAPHS: the jobs of this file run one set of graphs (batch buckets 1 and 2, greedy and sampling rows,
# K <= 2) per layout (TP=1, TP=2), so the first job of each compiles them and the others load them from the
# compile cache (a cold compile is most of a job's time here). ONE_ROW: a job compiles only the graphs its
# lines need, so replicas given few lines compile sets of their own: one row at a time keeps those small.


def test_tensor_parallel_batch_equals_tp1(setup, first_run, pipe, tmp_path):
    """`batch --tp 2` (msrun, 127.0.0.1): both ranks run the job in lock step, rank 0 alone writes;
    greedy lines equal the TP=1 run, and a sampled line without a seed gets the same drawn seed on
    every rank (else the ranks would accept different drafts and the text would not repeat)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(LINES[0] + "\n" + LINES[3] + "\n" +
                   json.dumps({"id": "s", "prompt_ids": [9, 8, 7], "temperature": 1.0, "max_new_tokens": 8}) + "\n")
    out = tmp_path / "out.jsonl"
    code, err = batch(setup, out, inp, extra=["--tp", "2"])  # (TP_GRAPHS)
    assert code == 0, err
    assert "3 lines: 3 done, 0 failed, 0 left" in last(err), err
    recs = records(out)
    assert sorted(r["id"] for r in recs) == ["a", "d", "s"]  # written once, by rank 0 (in finishing order)
    tp1, recs = by_id(first_run[2]), {r["id"]: r for r in recs}
    for rid in ("a", "d"):
        assert recs[rid]["token_ids"] == tp1[rid]["token_ids"], rid
    ref = pipe.generate(prompt_ids=[9, 8, 7], max_new_tokens=8, temperature=1.0, seed=recs["s"]["seed"])
    assert recs["s"]["token_ids"] == ref.token_ids and recs["s"]["stats"]["drafted"] > 0


def test_a_line_edited_since_its_result_stops_a_tensor_parallel_job_with_one_line(setup, first_run, tmp_path):
    """Under --tp 2 only rank 0 reads the output: its refusal of an edited line (see
    test_a_line_edited_since_its_result_is_refused_not_given_the_old_result) ends the whole job with
    that one line and exit 2, the output untouched, the other rank not left waiting."""
    out, inp = tmp_path / "out.jsonl", tmp_path / "in.jsonl"
    out.write_bytes(first_run[2].read_bytes())
    inp.write_text(json.dumps({"id": "a", "prompt_ids": [5, 6, 7, 9], "max_new_tokens": 10}) + "\n")
    _expect_usage_error(setup, out, "in.jsonl:1: this line (id \"a\") changed since", inp=inp, extra=["--tp", "2"])


def test_duplicate_ids_stop_the_job_before_it_starts(setup, tmp_path):
    inp = tmp_path / "dup.jsonl"
    inp.write_text(json.dumps({"id": 2, "prompt": "first"}) + "\n" + json.dumps({"prompt": "second"}) + "\n")
    _expect_usage_error(setup, tmp_path / "o.jsonl", "dup.jsonl:2: its line number 2 is already line 1's id", inp=inp)
    # an id that cannot be one (a list) gives the line its number: said "id 1 is already line 1's" (line 1 had [1])
    inp.write_text(json.dumps({"id": [1], "prompt": "first"}) + "\n" + json.dumps({"id": 1, "prompt": "second"}) + "\n")
    _expect_usage_error(setup, tmp_path / "o.jsonl", "dup.jsonl:2: its id 1 is already line 1's line number; ids must "
                        "be unique (a line without a usable \"id\", a string or an integer, has its line number)", inp=inp)
    assert B._row(3, '{"id": null, "prompt": "x"}', "i") == (None, None, "line 3: id must be a string or an "
                                                                          "integer, got null")


def test_an_openai_batch_file_is_refused_before_anything_loads(setup, tmp_path):
    """The batch prober's: a line of OpenAI's Batch API ({custom_id, method, url, body}) loaded the model, then
    got an error record ("unknown field(s) body, custom_id, method, url"), as every other line did: now the
    job stops at once, saying what the line is and how to turn the file into requests."""
    inp = tmp_path / "openai.jsonl"
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
             for i in range(2)]
    inp.write_text(json.dumps({"id": "mine", "prompt": "x"}) + "\n" + "".join(json.dumps(x) + "\n" for x in lines))
    _expect_usage_error(setup, tmp_path / "o.jsonl", "openai.jsonl:2: an OpenAI Batch API request (custom_id, method, "
                        "url, body): mindspec batch reads the request itself", inp=inp)
    assert not (tmp_path / "o.jsonl").exists()
    # the conversion the message gives makes lines this reads
    rows = B._rows([(n, json.dumps({"id": x["custom_id"]} | {k: v for k, v in x["body"].items() if k != "model"}))
                    for n, x in enumerate(lines, 1)], "converted.jsonl")
    assert [(r.rid, r.err) for r in rows] == [("r0", None), ("r1", None)]


def _interrupt(setup, tmp_path, inp, out, sig, wait):
    """Start a job, its home the test's (its first job: no compile cache, MindSpore compiles), `wait()`, send
    `sig`: (exit code, stderr)."""
    env = dict(os.environ, MINDSPEC_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"),
               MINDSPEC_PROGRESS_S="3600")  # compiling takes long enough for a progress line: not tested here
    p = subprocess.Popen(command(setup, out, inp, ["--max-new-tokens", "40"]),
                         stderr=subprocess.PIPE, text=True,
                         env=env, cwd=tmp_path)
    wait(p)
    for s in sig:
        p.send_signal(s)
        time.sleep(0.05)
    return p.wait(timeout=120), p.stderr.read()


def _check_interrupted(tmp_path, out, code, err):
    assert code == 130, err
    assert len(err.strip().splitlines()) == 1 and " lines: " in last(err) and " left -> " in last(err), err
    assert not (tmp_path / "rank_0").exists()  # no analyze_fail.ir from an interrupted compile
    assert not os.listdir(tmp_path / "tmp")  # nor MindSpore's temporary om directory
    recs = records(out) if out.exists() else []  # every line whole, each id once
    assert len(recs) < 40 and len({r["id"] for r in recs}) == len(recs)


def test_interrupt_keeps_what_was_written_and_says_so(setup, tmp_path):
    """Ctrl-C or kill after the first records: exit 130 with the summary line, whole records kept, a re-run
    goes on. (MindSpore's own SIGINT handler, installed on every graph run, turns Ctrl-C into SIGTERM.)"""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt_ids": [5, 6, i]}) + "\n" for i in range(40)))
    (tmp_path / "tmp").mkdir()

    def after_two_more(p):
        before = len(records(out)) if out.exists() else 0
        while not out.exists() or len(records(out)) < before + 2:
            assert p.poll() is None, p.stderr.read()
            time.sleep(0.05)

    # (one home for the five: the first compiles, the others load what it compiled; each is stopped after records)
    for sig in (signal.SIGINT, signal.SIGTERM):
        code, err = _interrupt(setup, tmp_path, inp, out, [sig], after_two_more)
        _check_interrupted(tmp_path, out, code, err)
    # the dp prober's: Ctrl-C twice (50 ms apart) printed "Exception ignored in: <function Cell.__del__ ...>
    # KeyboardInterrupt" tracebacks after the summary in 5 of 8 runs (the second landed in the shutdown)
    for n in range(3):
        code, err = _interrupt(setup, tmp_path, inp, out, [signal.SIGINT] * 2, after_two_more)
        _check_interrupted(tmp_path, out, code, err)


def test_an_output_removed_while_the_job_runs_stops_it_with_one_line(setup, tmp_path):
    """Found by a launcher probe: the output (or its directory) removed mid-job, the job went on appending to
    the unlinked file and ended "40 done -> out.jsonl", a path that no longer existed. It now stops at its
    next record, exit 2, saying so; the same command then writes every record anew."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt_ids": [5, 6, i]}) + "\n" for i in range(40)))
    p = subprocess.Popen(command(setup, out, inp, ["--max-new-tokens", "40"]), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    while not out.exists() or len(records(out)) < 2:
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.05)
    p.send_signal(signal.SIGSTOP)  # (so that the job cannot end first)
    assert p.poll() is None, p.stderr.read()
    out.unlink()
    p.send_signal(signal.SIGCONT)
    err = p.communicate(timeout=300)[1]
    assert p.returncode == 2 and last(err) == (
        f"mindspec: error: output {out} was removed, replaced or moved while this job wrote it; run the same "
        "command again to write its records there anew"), err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_an_input_fifo_waits_for_its_writer_exits_130_at_once(setup, tmp_path, sig):
    """Found by a batch probe: with --input a FIFO that no writer had opened, the first Ctrl-C was recorded for
    the next safe point while the read went on waiting (10 minutes, until a second one, which exited 130
    without a word). Nothing has run there: the first signal ends the job, exit 130, no output made."""
    inp, out = tmp_path / "in.fifo", tmp_path / "out.jsonl"
    os.mkfifo(inp)
    p = subprocess.Popen(command(setup, out, inp), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    start = time.monotonic()

    def waits():  # blocked opening the FIFO (the kernel's fifo_open); where wchan is hidden ("0"), after 5 s
        try:
            with open(f"/proc/{p.pid}/wchan") as f:
                wchan = f.read()
        except OSError:
            wchan = "0"
        return wchan == "wait_for_partner" or (wchan == "0" and time.monotonic() - start > 5)

    try:
        assert wait_for(waits, 60), p.poll()
        p.send_signal(sig)
        assert p.wait(timeout=30) == 130
    finally:
        p.kill()
    assert p.stderr.read() == "" and not out.exists()


@pytest.mark.parametrize("delay,sigs", [(0.0, "INT"), (0.5, "TERM"), (1.2, "INT"), (3.0, "TERM"), (0.3, "TERM TERM")])
def test_a_signal_while_loading_or_compiling_exits_130_with_the_summary(setup, tmp_path, delay, sigs):
    """Signals while MindSpore is imported or compiles used to abort the interpreter (`Fatal Python error:
    PyThreadState_Get`, exit 134), be swallowed (the job ran on) or leave rank_0/om/analyze_fail.ir behind.
    Now they wait for a safe point; a second one stops at once."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt_ids": [5, 6, i]}) + "\n" for i in range(40)))
    (tmp_path / "tmp").mkdir()

    def begun(p):  # the output exists once the job has begun (then it loads MindSpore)
        while not out.exists():
            assert p.poll() is None, p.stderr.read()
            time.sleep(0.01)
        time.sleep(delay)

    code, err = _interrupt(setup, tmp_path, inp, out, [getattr(signal, "SIG" + s) for s in sigs.split()], begun)
    _check_interrupted(tmp_path, out, code, err)


# ---- in process, with a stand-in driver ----
# batch.py reaches the engine only through generate_records(pipe, items, check, max_batch, ready), which yields
# (item, record body) as lines finish, in any order: these tests stand in for it (and for the pipeline).

STATS = {"new_tokens": 2, "target_calls": 1, "drafted": 2, "accepted": 1, "wall_s": 0.01, "compile_s": 0.0}
OK = {"text": "ok", "token_ids": [7, 8], "finish_reason": "length", "prompt_tokens": 1, "stats": STATS}
DEFAULTS = {"max_new_tokens": 5, "temperature": 0.0, "chat": False}


def driver(monkeypatch, fail=(), order=list, stop_after=None):
    """Replace generate_records: lines whose first prompt id is in `fail` fail, `order` reorders the items,
    a KeyboardInterrupt comes after `stop_after` results. Returns the list of prompt ids run."""
    ran = []

    def drive(pipe, items, check=lambda: None, max_batch=1, ready=lambda: None):
        for n, item in enumerate(order(items)):
            if n == stop_after:
                raise KeyboardInterrupt
            check()
            ran.append(item.kw["prompt_ids"][0])
            yield item, {"error": f"line {item.line}: nope"} if ran[-1] in fail else dict(OK)

    monkeypatch.setattr(B, "generate_records", drive)
    return ran


def _batch(inp, out, **kw):
    return B.run_batch(lambda: "pipe", DEFAULTS, inp, str(out), **kw)


def _input(path, n):
    path.write_text("".join(json.dumps({"prompt_ids": [i]}) + "\n" for i in range(1, n + 1)))
    return str(path)


def _rec(rid, job, **body):
    return (json.dumps({"mindspec_batch": 1, "job": job, "id": rid, **body}) + "\n").encode()


def test_the_job_is_another_when_the_tokenizer_template_or_eos_change(tiny_target, tmp_path):
    """The job's hash covered the config and weights only: a job resumed with another tokenizer (same
    weights) mixed its lines with the old one's under one job."""
    model = tmp_path / "m"
    shutil.copytree(tiny_target[0], model)
    ids = {B.job_id(DEFAULTS, str(model))}
    def swap_two_ids(text):
        tok = json.loads(text)
        vocab = tok["model"]["vocab"]
        a, b = sorted(vocab)[10:12]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        return json.dumps(tok)

    for name, edit in [("tokenizer.json", swap_two_ids),
                       ("tokenizer_config.json", lambda t: json.dumps(dict(json.loads(t), chat_template="{{ x }}"))),
                       ("generation_config.json", lambda t: json.dumps(dict(json.loads(t), eos_token_id=3)))]:
        path = model / name
        before = path.read_text()
        path.write_text(edit(before))
        assert path.read_text() != before
        ids.add(B.job_id(DEFAULTS, str(model)))
    assert len(ids) == 4 and B.job_id(DEFAULTS, str(model)) == B.job_id(DEFAULTS, str(model))
    # the template transformers saves apart: a --chat job's, not the others' (whose ids were made without it),
    # and not when it is tokenizer_config.json's own (the id holds that one already)
    chat, plain = B.job_id(dict(DEFAULTS, chat=True), str(model)), B.job_id(DEFAULTS, str(model))
    (model / "chat_template.jinja").write_text("{{ y }}")
    assert B.job_id(dict(DEFAULTS, chat=True), str(model)) != chat and B.job_id(DEFAULTS, str(model)) == plain
    (model / "chat_template.jinja").write_text("{{ x }}")  # (tokenizer_config.json's, above)
    assert B.job_id(dict(DEFAULTS, chat=True), str(model)) == chat


def test_duplicate_records_first_result_wins_and_failed_lines_are_retried(tmp_path, capsys, monkeypatch):
    inp, out, job = _input(tmp_path / "in.jsonl", 4), tmp_path / "o.jsonl", B.job_id(DEFAULTS)
    out.write_bytes(_rec(1, job, error="line 1: boom") + _rec(1, job, **OK) + _rec(1, job, **dict(OK, text="later")) +
                    _rec(2, job, **OK) + _rec(2, job, **OK) + _rec(3, job, error="line 3: nope") +
                    _rec(4, job, error="line 4: boom"))
    ran = driver(monkeypatch, fail={3})
    assert _batch(inp, out) == 1
    assert sorted(ran) == [3, 4]  # 1 and 2 have a result; 3 and 4 had failed: retried
    summary = last(capsys.readouterr().err)
    assert "4 lines: 3 done, 1 failed, 0 left" in summary and "this run: 1 done, 1 failed, 2 skipped" in summary
    recs = records(out)
    assert len(recs) == 8 and recs[-1]["id"] == 4 and recs[-1]["text"] == "ok"  # 3's same error: not written again


def test_the_summary_times_the_generation_not_the_warm_up(tmp_path, capsys, monkeypatch):
    """Found: the summary's "N tokens in T s" subtracted graph compilation only, so a machine's first job
    counted the measurement of dynamic K's costs (seconds, once) as generation: 24 tokens in 28.57 s,
    0.8 tok/s, while each line took 1.5-1.9 s. The clock now starts when the warm-up is done."""
    inp, out = _input(tmp_path / "in.jsonl", 2), tmp_path / "o.jsonl"
    clock = [1000.0]  # batch's clock, moved by hand (a busy machine's stall between two readings failed "< 0.3 s")
    monkeypatch.setattr(B, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))

    def drive(pipe, items, check=lambda: None, max_batch=1, ready=lambda: None):
        clock[0] += 60  # the warm-up: compiling, measuring costs
        ready()
        for item in items:
            clock[0] += 1.5
            yield item, dict(OK)

    monkeypatch.setattr(B, "generate_records", drive)
    assert _batch(inp, out) == 0
    assert "4 tokens in 3.00 s" in last(capsys.readouterr().err)

    def stopped(pipe, items, check=lambda: None, max_batch=1, ready=lambda: None):
        clock[0] += 6  # Ctrl-C while compiling (the batch prober's: "0 tokens in 6.19 s")
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(B, "generate_records", stopped)
    with pytest.raises(KeyboardInterrupt):
        _batch(inp, tmp_path / "o2.jsonl")
    assert "0 tokens in 0.00 s" in last(capsys.readouterr().err)


def test_a_second_signal_after_the_summary_does_not_print_it_again(tmp_path, capfd, monkeypatch):
    """Found by a signals probe: a second Ctrl-C landing between a stopped job's summary and its exit (here:
    while the output closes) printed the summary twice."""
    inp, out = _input(tmp_path / "in.jsonl", 4), tmp_path / "o.jsonl"

    def drive(pipe, items, check=lambda: None, max_batch=1, ready=lambda: None):
        yield items[0], dict(OK)
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: recorded, raised at the next safe point
        check()

    close, sent = B.Output.close, []

    def close_after_a_second_signal(self, failed=False):
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        close(self, failed)

    def exit_now(code):
        raise SystemExit(code)
    monkeypatch.setattr(B, "generate_records", drive)
    monkeypatch.setattr(B.Output, "close", close_after_a_second_signal)
    monkeypatch.setattr(os, "_exit", exit_now)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as e:
            _batch(inp, out)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    err = capfd.readouterr().err
    assert e.value.code == 130 and err.count("4 lines: 1 done, 0 failed, 3 left") == 1, err
    assert [r["id"] for r in records(out)] == [1]


def test_records_finishing_out_of_input_order_resume_by_id(tmp_path, capsys, monkeypatch):
    inp, out = _input(tmp_path / "in.jsonl", 6), tmp_path / "o.jsonl"
    driver(monkeypatch, order=lambda items: items[::-1], stop_after=3)  # many at a time, killed half-way
    with pytest.raises(KeyboardInterrupt):
        _batch(inp, out)
    assert "6 lines: 3 done, 0 failed, 3 left" in last(capsys.readouterr().err)
    assert [r["id"] for r in records(out)] == [6, 5, 4]
    ran = driver(monkeypatch)
    assert _batch(inp, out) == 0
    assert ran == [1, 2, 3] and [r["id"] for r in records(out)] == [6, 5, 4, 1, 2, 3]
    assert "6 lines: 6 done, 0 failed, 0 left" in last(capsys.readouterr().err)


def _disk_with_room(job, records):
    """An os.write whose disk fills up after `records` (a float: half of one fits) of these records."""
    one = len(B._dump({"mindspec_batch": 1, "job": job, "id": 1, **OK}))
    real, room = os.write, [int(one * records)]

    def full_disk(fd, data):
        if room[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real(fd, bytes(data[:room[0]]))
        room[0] -= n
        return n
    return full_disk


def test_a_write_cut_short_leaves_whole_records_only(tmp_path, capsys, monkeypatch):
    inp, out = _input(tmp_path / "in.jsonl", 5), tmp_path / "o.jsonl"
    real = os.write
    driver(monkeypatch)
    monkeypatch.setattr(B.os, "write", _disk_with_room(B.job_id(DEFAULTS), 2.5))  # two records and half a third
    with pytest.raises(MindspecError, match="cannot write output .*: No space left on device"):
        _batch(inp, out)
    monkeypatch.setattr(B.os, "write", real)
    m = re.search(r"5 lines: (\d) done, 0 failed, (\d) left", last(capsys.readouterr().err))
    assert m and int(m[1]) == len(records(out)) == 2 and out.read_bytes().endswith(b"\n")
    assert _batch(inp, out) == 0
    assert sorted(r["id"] for r in records(out)) == [1, 2, 3, 4, 5]


def test_a_merge_cut_short_by_a_full_disk_says_what_the_output_holds_first(tmp_path, capsys, monkeypatch):
    """The batch prober's: a --dp merge that hit a full disk printed only the error, where a job without --dp
    prints the summary of what the file holds first (docs/batch.md); the parts are kept and merge again."""
    from mindspec import dp
    inp, out, job = _input(tmp_path / "in.jsonl", 5), tmp_path / "o.jsonl", B.job_id(DEFAULTS)
    driver(monkeypatch)
    assert _batch(inp, out, part=(0, 2)) == 0 and _batch(inp, out, part=(1, 2)) == 0
    capsys.readouterr()
    real = os.write
    monkeypatch.setattr(B.os, "write", _disk_with_room(job, 2.5))
    with pytest.raises(MindspecError, match="cannot write output .*: No space left on device"):
        dp.merge_command(inp, str(out), job)
    monkeypatch.setattr(B.os, "write", real)
    assert last(capsys.readouterr().err) == f"mindspec batch: 5 lines: 2 done, 0 failed, 3 left -> {out} " \
                                            "(a merge of 2 parts cut short; they are kept)"
    assert len(list(tmp_path.glob("o.jsonl.part*"))) == 2
    assert dp.merge_command(inp, str(out), job) == 0
    assert [r["id"] for r in records(out)] == [1, 2, 3, 4, 5]


def test_a_torn_last_line_is_cut_only_when_the_file_is_ours(tmp_path, monkeypatch):
    inp, out, job = _input(tmp_path / "in.jsonl", 2), tmp_path / "o.jsonl", B.job_id(DEFAULTS)
    driver(monkeypatch)
    for torn in (b"{", b'{"mi', b'{"mindspec_batch": 1, "job": "', _rec(2, job, **OK)[:-1]):
        out.write_bytes(_rec(1, job, **OK) + torn)
        assert _batch(inp, out) == 0
        assert [r["id"] for r in records(out)] == [1, 2], torn
    # found trying it carelessly: a whole last record whose newline was lost ($(cat ...), an editor) was cut
    # as torn — its result run again, and another job's record replaced by this one's without a word; a
    # blank line refused the file; a hand-edited record (an error that is a list) or one nested past
    # Python's stack was a traceback
    out.write_bytes(_rec(1, job, **OK) + _rec(2, job, **dict(OK, text="kept"))[:-1])
    assert _batch(inp, out) == 0
    assert [r["text"] for r in records(out)] == ["ok", "kept"] and out.read_bytes().endswith(b"}\n")
    out.write_bytes(_rec(1, job, **OK) + b"\n" + _rec(2, job, **OK) + b"\n")
    assert _batch(inp, out) == 0 and [r["id"] for r in records(out)] == [1, 2]
    # found by a batch probe: a power cut's zero-filled tail (ext4, XFS: the length written, not the data) after
    # whole records refused the file as "o.jsonl:3 is not a mindspec batch record", a line no editor shows
    for zeros in (b"\0" * 4096, _rec(2, job, **OK)[:20] + b"\0" * 100):
        out.write_bytes(_rec(1, job, **OK) + zeros)
        assert _batch(inp, out) == 0 and [r["id"] for r in records(out)] == [1, 2], zeros
    out.write_bytes(_rec(1, job, **OK) + _rec(2, job, **dict(OK, text="kept"))[:-1] + b"\0" * 100)  # (a review's)
    assert _batch(inp, out) == 0
    assert [r["text"] for r in records(out)] == ["ok", "kept"] and out.read_bytes().endswith(b"}\n")
    # found by mutation testing: a last line of blanks without its newline refused the file (with it: fine)
    for blank in (b"  ", b"\r", b"\t"):
        out.write_bytes(_rec(1, job, **OK) + _rec(2, job, **OK) + blank)
        assert _batch(inp, out) == 0 and [r["id"] for r in records(out)] == [1, 2], blank
    other = _rec(1, "0123456789ab", **OK)[:-1]
    for foreign, words in ((other, "holds the results of another job"),
                           (_rec(1, job, error=["x"]), "o.jsonl:1 is not a mindspec batch record"),
                           (_rec(1, job, **OK) + b"[" * 100000 + b"]" * 100000 + b"\n",
                            "o.jsonl:2 is not a mindspec batch record")):
        out.write_bytes(foreign)
        with pytest.raises(MindspecError, match=words):
            _batch(inp, out)
        assert out.read_bytes() == foreign
    # found by mutation testing: such a hand-edited record as the last line, its newline lost, was cut as torn
    for last in (_rec(2, job, error=["x"])[:-1], _rec(True, job, **OK)[:-1]):
        foreign = _rec(1, job, **OK) + last
        out.write_bytes(foreign)
        with pytest.raises(MindspecError, match="o.jsonl:2 is not a mindspec batch record"):
            _batch(inp, out)
        assert out.read_bytes() == foreign
    for foreign in (b'{"id": 1, "text": "ok"}\n{"mi', b"hello", b'{"mindspec_batch": 1}\n'):
        out.write_bytes(foreign)
        with pytest.raises(MindspecError, match="is not a mindspec batch record"):
            _batch(inp, out)
        assert out.read_bytes() == foreign


def test_the_job_fingerprint_covers_the_target_and_the_request_defaults(tiny_target, tiny_draft_ckpt, tmp_path,
                                                                       monkeypatch):
    job = B.job_id(DEFAULTS, tiny_target[0])
    assert job == B.job_id(dict(DEFAULTS), tiny_target[0]) == B.job_id(DEFAULTS, tiny_target[0], "float32")
    # found: a float16 job (Ascend's default) resumed in float32 mixed the two precisions' texts under one job
    assert B.job_id(DEFAULTS, tiny_target[0], "float16") != job
    from mindspec import cli
    a = cli.parse(["batch", "--input", "i", "--output", "o", "--target", tiny_target[0], "--device", "cpu",
                   "--max-new-tokens", "5"])
    assert cli.batch_job(a) == B.job_id(cli.batch_defaults(a), tiny_target[0])
    assert cli.batch_job(cli.parse(["batch", "--input", "i", "--output", "o", "--target", tiny_target[0],
                                    "--device", "cpu", "--dtype", "float16"])) != cli.batch_job(a)
    others = (B.job_id(DEFAULTS, tiny_draft_ckpt[0]), B.job_id(dict(DEFAULTS, max_new_tokens=6), tiny_target[0]),
              B.job_id(DEFAULTS))
    assert job not in others
    inp, out = _input(tmp_path / "in.jsonl", 2), tmp_path / "o.jsonl"
    driver(monkeypatch)
    assert _batch(inp, out, model=tiny_target[0]) == 0
    with pytest.raises(MindspecError, match="holds the results of another job"):
        _batch(inp, out, model=tiny_draft_ckpt[0])
    # the float16 user's: a resume in another dtype was "another target model or other request defaults"
    out16 = tmp_path / "o16.jsonl"
    assert _batch(inp, out16, model=tiny_target[0], dtype="float16") == 0
    for dtype, ran in ((None, "float32"), ("bfloat16", "bfloat16")):
        with pytest.raises(MindspecError, match=f"o16.jsonl holds this job's results in float16, this run is {ran}: "
                                                "run it with --dtype float16 or give another --output$"):
            _batch(inp, out16, model=tiny_target[0], dtype=dtype)
    with pytest.raises(MindspecError, match="o.jsonl holds this job's results in float32, this run is float16"):
        _batch(inp, out, model=tiny_target[0], dtype="float16")


def _job_processes(marker):
    """pids of live processes whose command line holds `marker`."""
    pids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(p))
            except OSError:
                pass
    return pids


def test_kill_9_of_a_tensor_parallel_launcher_ends_the_whole_job(setup, tmp_path):
    """A rank killed mid-job (the batch prober's: exit 1, which says "some lines failed") stops the job with one
    line naming it, exit 2, and its records kept. msrun starts every rank in its own session: killing the
    launcher's process group with SIGKILL must still end the ranks and msrun's scheduler (they watch the
    launcher), leave no job directory, and a resume then writes every id exactly once."""
    import signal
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt_ids": [5 + i, 6, 7], "max_new_tokens": 40,
                                       **({"temperature": 0.7} if i == 0 else {})}) + "\n" for i in range(12)))
    out, tmp = tmp_path / "out.jsonl", tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), MINDSPEC_PROGRESS_S="3600")
    tp = ["--tp", "2", "--max-new-tokens", "40"]  # TP_GRAPHS (a sampled line: line 0)
    p = subprocess.Popen(command(setup, out, inp, tp), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=env)
    while not (out.exists() and records(out)):
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.05)
    rank1 = [pid for pid in _job_processes(str(out)) if b"RANK_ID=1\x00" in _proc(pid, "environ")
             and b"MS_ROLE=MS_WORKER\x00" in _proc(pid, "environ")]
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGKILL)
    code, err = p.wait(timeout=120), p.stderr.read()
    assert code == 2 and re.fullmatch(r"mindspec: error: tensor-parallel rank 1 of 2 died \(killed by signal 9\); "
                                      r"the job was stopped \(logs: .*\); what it wrote is kept: run the same "
                                      r"command again to resume", last(err)), err
    written = len(records(out))
    assert 1 <= written < 12
    shutil.rmtree(tmp)  # (the failed job's logs)
    tmp.mkdir()
    p = subprocess.Popen(command(setup, out, inp, tp),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and len(records(out)) == written:
        time.sleep(0.2)
    assert len(records(out)) > written, "the job never wrote a record"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    deadline = time.time() + 30
    while time.time() < deadline and _job_processes(str(out)):
        time.sleep(0.5)
    left = {pid: open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:4] for pid in _job_processes(str(out))}
    assert not left, f"ranks outlived their launcher: {left}"
    assert not [d for d in os.listdir(tmp) if d.startswith("mindspec-tp-")]
    code, err = batch(setup, out, inp, extra=["--max-new-tokens", "40"])  # the same job
    assert code == 0, err
    ids = [r["id"] for r in records(out)]
    assert sorted(ids) == list(range(12)), ids  # every id exactly once


def test_a_tensor_parallel_job_over_two_nodes_on_one_machine_equals_tp1(setup, first_run, pipe, tmp_path):
    """`--tp 2 --nodes 2`, one rank per "machine", both here (master 127.0.0.1: msrun starts a scheduler on
    both, node 1's steps aside): one cluster, rank 0 (node 0) writes; the greedy lines equal the TP=1 run,
    and a sampled line without a seed repeats from its recorded seed (rank 0's seed base for both nodes)."""
    from mindspec.tp import free_port
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(LINES[0] + "\n" + LINES[3] + "\n" +
                   json.dumps({"id": "s", "prompt_ids": [9, 8, 7], "temperature": 1.0, "max_new_tokens": 8}) + "\n")
    nodes = ["--tp", "2", "--nodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    procs = [subprocess.Popen(command(setup, out, inp, nodes + ["--node-rank", str(r)]), stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    (code0, err0), (code1, err1) = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    assert code0 == 0 and "3 lines: 3 done, 0 failed, 0 left" in last(err0), err0
    assert code1 == 0 and "mindspec" not in err1, err1  # node 1 has no rank 0: it streams nothing
    recs, tp1 = {r["id"]: r for r in records(out)}, by_id(first_run[2])
    assert sorted(recs) == ["a", "d", "s"] and len(records(out)) == 3
    assert all(recs[rid]["token_ids"] == tp1[rid]["token_ids"] for rid in ("a", "d"))
    ref = pipe.generate(prompt_ids=[9, 8, 7], max_new_tokens=8, temperature=1.0, seed=recs["s"]["seed"])
    assert recs["s"]["token_ids"] == ref.token_ids


# ---- data parallel: --dp N replicas, each into its own part, merged into the output ----

def test_data_parallel_equals_dp1_in_input_order(setup, first_run):
    """`--dp 2`: two replicas (separate processes) run every other line into their own part files; the parts
    are merged into the output in input order, record for record what the DP=1 run wrote (greedy lines,
    error records), and removed. A re-run retries the failed lines, which fail in the same words: the
    output is left byte for byte as it was."""
    out = setup[3] / "dp2.jsonl"
    code, err = batch(setup, out, extra=["--dp", "2"])
    assert code == 1, err
    assert "Traceback" not in err
    assert last(err) == f"mindspec batch: 8 lines: 4 done, 4 failed, 0 left -> {out} (merged from 2 parts)", err
    # each replica's own summary: every other line (a, 3, e, h and 2, d, f, u)
    assert f"4 lines: 1 done, 3 failed, 0 left -> {out}.part0of2" in err
    assert f"4 lines: 3 done, 1 failed, 0 left -> {out}.part1of2" in err
    recs = records(out)
    assert [r["id"] for r in recs] == IDS  # input order
    dp1 = by_id(first_run[2])
    for r in recs:
        want = dp1[r["id"]]
        assert set(r) == set(want) and r.get("token_ids") == want.get("token_ids") and r.get("error") == \
            want.get("error") and r["job"] == want["job"], r["id"]
    assert not list(setup[3].glob("dp2.jsonl.part*"))
    before = out.read_bytes()
    code, err = batch(setup, out, extra=["--dp", "2"])
    assert code == 1 and last(err).startswith("mindspec batch: 8 lines: 4 done, 4 failed, 0 left"), err
    assert out.read_bytes() == before


def _replica(out, i):
    """pid of --dp replica i of the job writing `out` (None before it has exec'd)."""
    for pid in _job_processes(str(out)):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f"\0--dp-replica\0{i}\0".encode() in f.read():
                    return pid
        except OSError:
            pass
    return None


def _in_parts(parts):
    """Records written to the part files so far (a part may vanish: a merge removes it)."""
    n = 0
    for q in parts:
        try:
            n += len(records(q))
        except FileNotFoundError:
            pass
    return n


@pytest.mark.parametrize("moment", [0, 2])
def test_kill_9_of_a_data_parallel_launcher_then_resume_writes_each_id_once(setup, pipe, tmp_path, moment):
    """SIGKILL to the launcher alone (it cannot clean up) while its replicas load (moment 0) or once they
    wrote 2 records: its replicas die with it (no process left), their parts keep what they wrote; the
    same command then finishes only what is missing and merges: every id exactly once, in input order,
    with the texts of an uninterrupted run."""
    lines = [{"id": i, "prompt_ids": [5 + i, 6, 7], "max_new_tokens": 100} for i in range(24)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = command(setup, out, inp, ["--dp", "2", "--max-new-tokens", "100"])
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=dict(os.environ, MINDSPEC_PROGRESS_S="3600"), start_new_session=True)
    parts = [tmp_path / f"out.jsonl.part{i}of2" for i in range(2)]
    deadline = time.time() + 240
    while time.time() < deadline and (len(_job_processes(str(out))) < 3 or not _replica(out, 1)):
        assert p.poll() is None  # the launcher and both replicas are up, loading
        time.sleep(0.05)
    if moment:  # replica 1 held, so the job cannot end before the kill (polling alone lost that race on a busy
        os.kill(_replica(out, 1), signal.SIGSTOP)  # machine); a stopped replica still dies with its launcher
        while time.time() < deadline and _in_parts(parts) < moment:
            assert p.poll() is None
            time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    deadline = time.time() + 15
    while time.time() < deadline and _job_processes(str(out)):
        time.sleep(0.2)
    assert not _job_processes(str(out)), "replicas outlived their launcher"
    written = sum(len(records(q)) for q in parts if q.exists())  # killed while loading: maybe no part yet
    assert moment <= written < 24 and not records(out)  # nothing merged yet
    code, err = batch(setup, out, inp, extra=["--dp", "2", "--max-new-tokens", "100"])
    assert code == 0, err
    recs = records(out)
    assert [r["id"] for r in recs] == list(range(24)) and not any(q.exists() for q in parts)
    for r, x in zip(recs, lines):
        assert r["token_ids"] == _alone(pipe, x["prompt_ids"], 100), r["id"]


_ALONE = {}  # (prompt, max_new_tokens) -> the target's own tokens (the moments' jobs share their lines)


def _alone(pipe, prompt_ids, n):
    key = (tuple(prompt_ids), n)
    if key not in _ALONE:
        _ALONE[key] = pipe.generate(prompt_ids=prompt_ids, max_new_tokens=n, speculate=False).token_ids
    return _ALONE[key]


def test_merge_in_input_order_once_and_only_when_complete(tmp_path, capsys, monkeypatch):
    """Parts written by replicas (a stand-in driver), merged by --merge: input order, a result over an
    earlier error, nothing the output already holds written again (a merge cut short is merged again);
    incomplete parts or parts of another --dp run are refused with one line and change nothing."""
    from mindspec import dp
    inp, out, job = _input(tmp_path / "in.jsonl", 5), tmp_path / "o.jsonl", B.job_id(DEFAULTS)
    driver(monkeypatch, fail={4}, order=lambda items: items[::-1])
    assert _batch(inp, out, part=(0, 2)) == 0  # lines 1, 3, 5
    capsys.readouterr()
    with pytest.raises(MindspecError, match="2 of 5 lines have no record in .* or its --dp 2 parts yet"):
        dp.merge_command(inp, str(out), job)
    assert _batch(inp, out, part=(1, 2)) == 1  # lines 2, 4 (4 fails)
    part1 = tmp_path / "o.jsonl.part1of2"
    with open(part1, "rb") as f:  # a replica (started by hand, or on another machine) still writes it
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(MindspecError, match="part1of2 is being written by a running replica"):
            dp.merge_command(inp, str(out), job)
    part1.write_bytes(part1.read_bytes() + _rec(4, job, **OK))  # a retry that worked, after the error
    out.write_bytes(_rec(2, job, **dict(OK, text="earlier")))  # a merge cut short after id 2
    assert dp.merge_command(inp, str(out), job) == 0
    assert last(capsys.readouterr().err) == f"mindspec batch: 5 lines: 5 done, 0 failed, 0 left -> {out} " \
                                            "(merged from 2 parts)"
    recs = records(out)
    assert [r["id"] for r in recs] == [2, 1, 3, 4, 5] and recs[0]["text"] == "earlier" and "error" not in recs[3]
    assert not list(tmp_path.glob("o.jsonl.part*"))
    (tmp_path / "o.jsonl.part0of3").write_bytes(b"")
    with pytest.raises(MindspecError, match="unmerged parts of a --dp 3 run"):
        dp.check_parts(str(out), 2)


def test_a_data_parallel_launcher_counts_the_npus_before_any_replica_starts(tmp_path, monkeypatch):
    """The dp prober's (simulated): replicas past the visible NPUs saw none and ran on the host, and their
    parts were then refused as another job's. On Ascend the launcher refuses first (this machine's share)."""
    from mindspec import dp
    from mindspec.device import AscendEnv
    monkeypatch.setattr("mindspec.device.ascend_env", lambda: AscendEnv(npus=[0, 1, 2, 3]))
    monkeypatch.setattr(dp, "detect_device", lambda: "Ascend")
    monkeypatch.setattr(dp, "_start", lambda *a: pytest.fail("a replica started"))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(LINES[0] + "\n")
    with pytest.raises(MindspecError, match=r"^--dp 4 x --tp 2 needs 8 NPUs, 4 visible$"):
        dp.launch([], str(inp), str(out), "job", 4, tp=2)
    with pytest.raises(MindspecError, match=r"^--dp 8 over --nodes 2 \(4 replicas on this machine\) x --tp 2 needs "
                                            r"8 NPUs, 4 visible$"):
        dp.launch([], str(inp), str(out), "job", 8, tp=2, nodes=2, node_rank=1)
    assert not out.exists()


def test_scale_out_flags_that_cannot_work_exit_2_with_one_line(setup, tmp_path):
    out = tmp_path / "o.jsonl"
    first = ["--node-rank", "0"]
    _expect_usage_error(setup, out, "--dp 3 does not split over --nodes 2", extra=["--dp", "3", "--nodes", "2", *first])
    _expect_usage_error(setup, out, "--nodes > 1 needs --master-addr", extra=["--tp", "2", "--nodes", "2", *first])
    _expect_usage_error(setup, out, "6 ranks do not split evenly over --nodes 4",
                        extra=["--tp", "6", "--nodes", "4", *first, "--master-addr", "10.0.0.1",
                               "--master-port", "29500"])
    # one machine: a launcher ran replicas 6 and 7 of a --dp 2 job (their parts never merged)
    _expect_usage_error(setup, out, "--node-rank must be in 0..0 for --nodes 1, got 3",
                        extra=["--dp", "2", "--node-rank", "3"])
    # two machines each forgetting --node-rank both ran as node 0
    _expect_usage_error(setup, out, "--nodes 2 needs --node-rank: this machine's index, 0..1",
                        extra=["--dp", "2", "--nodes", "2"])
    # a model path that is not there: said by every replica (and a replica without lines left its summary)
    _expect_usage_error(setup, out, f"draft model not found: {tmp_path / 'nope.onnx'}",
                        extra=["--dp", "2", "--draft", str(tmp_path / "nope.onnx")])
    _expect_usage_error(setup, out, f"model directory not found: {tmp_path / 'nope'}",
                        extra=["--dp", "2", "--target", str(tmp_path / "nope")])
    assert not out.exists() and not list(tmp_path.glob("o.jsonl.part*"))
    (tmp_path / "o.jsonl.part1of3").write_bytes(b"")  # an unfinished --dp 3 run
    _expect_usage_error(setup, out, "unmerged parts of a --dp 3 run", extra=["--dp", "2"])
    # the dp prober's: piped input reached every replica empty ("0 lines"), and the launcher then said to
    # run the command again (which did the same), leaving empty parts behind
    pipe_in = subprocess.run(command(setup, tmp_path / "piped.jsonl", "/dev/stdin", ["--dp", "2"]),
                             input=LINES[0] + "\n", capture_output=True, text=True, timeout=300)
    assert pipe_in.returncode == 2 and pipe_in.stderr == (
        "mindspec: error: --dp needs its input as a regular file (every replica reads it): /dev/stdin is not one\n")
    assert not list(tmp_path.glob("piped.jsonl*"))
    # the launcher prober's: /dev/stdin from a file passed as a regular file, yet each replica opened its own
    # stdin (/dev/null): 0 lines each, and empty parts left that refused every later run
    (tmp_path / "in1.jsonl").write_text(LINES[0] + "\n")
    with open(tmp_path / "in1.jsonl", "rb") as f:
        from_file = subprocess.run(command(setup, tmp_path / "piped.jsonl", "/dev/stdin", ["--dp", "2"]),
                                   stdin=f, capture_output=True, text=True, timeout=300)
    assert from_file.returncode == 2 and from_file.stderr == (
        "mindspec: error: --dp needs its input by its file's own path (every replica opens it): /dev/stdin is a "
        "descriptor of this process\n")
    with open(tmp_path / "in1.jsonl", "rb") as f:  # (the review's: the same under --tp, each rank's stdin /dev/null)
        from_file = subprocess.run(command(setup, tmp_path / "piped.jsonl", "/dev/fd/0", ["--tp", "2"]),
                                   stdin=f, capture_output=True, text=True, timeout=300)
    assert from_file.returncode == 2 and from_file.stderr == (
        "mindspec: error: --tp needs its input by its file's own path (every rank opens it): /dev/fd/0 is a "
        "descriptor of this process\n")
    assert not list(tmp_path.glob("piped.jsonl*"))
    _expect_usage_error(setup, out, "unmerged parts of a --dp 3 run")  # nor without --dp
    (tmp_path / "o.jsonl.part1of3").unlink()
    _expect_usage_error(setup, out, "no part files beside", extra=["--merge"])


def test_sigterm_to_a_data_parallel_launcher_stops_every_replica_and_keeps_the_parts(setup, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt_ids": [5, 6, i], "max_new_tokens": 100}) + "\n" for i in range(16)))
    p = subprocess.Popen(command(setup, out, inp, ["--dp", "2"]),
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, MINDSPEC_PROGRESS_S="3600"))
    parts = [tmp_path / f"out.jsonl.part{i}of2" for i in range(2)]
    while _in_parts(parts) < 2:
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    code, err = p.wait(timeout=120), p.stderr.read()
    assert code == 130, err
    assert "Traceback" not in err
    summaries = [line for line in err.splitlines() if " left -> " in line]  # one per replica, of its share
    assert sorted(s.split(" left -> ")[1].split(";")[0] for s in summaries) == [str(q) for q in parts], err
    assert not _job_processes(str(out)) and not out.exists()  # nothing running; the empty output is removed
    assert 2 <= _in_parts(parts) < 16


def test_data_parallel_tensor_parallel_replicas_equal_dp1(setup, first_run, tmp_path):
    """`--dp 2 --tp 2`: each replica is itself a tensor-parallel launcher (its own msrun, two ranks; rank 0
    writes its part): the merged output holds the DP=1 texts, in input order."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([LINES[0], LINES[3], LINES[8]]) + "\n")
    code, err = batch(setup, out, inp, extra=["--dp", "2", "--tp", "2", "--max-batch", "1"])  # (ONE_ROW)
    assert code == 0, err
    assert last(err) == f"mindspec batch: 3 lines: 3 done, 0 failed, 0 left -> {out} (merged from 2 parts)", err
    dp1, recs = by_id(first_run[2]), records(out)
    assert [r["id"] for r in recs] == ["a", "d", "u"]
    assert all(r["token_ids"] == dp1[r["id"]]["token_ids"] for r in recs)


def test_killing_the_ranks_of_a_tensor_parallel_replica_fails_the_job_and_a_rerun_finishes_it(setup, pipe,
                                                                                                  tmp_path):
    """`--dp 2 --tp 2`, both ranks of replica 0 killed with SIGKILL mid-job: its msrun stops and its launcher
    names the rank (keeping that job's logs, which it names); replica 1 finishes its share; the job exits 2 with
    one line naming replica 0, and nothing of it runs on. The same command then runs only what is missing:
    every id once, in input order, the texts of an uninterrupted DP=1 run."""
    lines = [{"id": i, "prompt_ids": [5 + i, 6, 7], "max_new_tokens": 40} for i in range(12)]
    inp, out, tmp = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "tmp"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    tmp.mkdir()
    extra, env = ["--dp", "2", "--tp", "2"], {"TMPDIR": str(tmp), "MINDSPEC_PROGRESS_S": "3600"}
    p = subprocess.Popen(command(setup, out, inp, extra), stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, **env))
    while _in_parts([tmp_path / "out.jsonl.part0of2"]) < 1:
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.05)
    ranks = [pid for pid in _job_processes(str(out)) if b"--dp-replica\x000" in _proc(pid, "cmdline")
             and b"MS_ROLE=MS_WORKER\x00" in _proc(pid, "environ")]
    assert len(ranks) == 2
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    code, err = p.wait(timeout=300), p.stderr.read()
    assert code == 2 and re.fullmatch(r"mindspec: error: data-parallel replica 0 of 2 ended \(exit code 1\) with "
                                      r"[1-5] of its 6 lines unfinished; its part is kept: run the same command "
                                      r"again to finish what is missing", last(err)), err
    # the replica's own line comes before (the other replica's summary may land in between)
    assert any(x.startswith("mindspec: error: tensor-parallel rank ") for x in err.strip().splitlines()[:-1]), err
    deadline = time.time() + 15  # the ranks' watchers poll every 0.5 s
    while time.time() < deadline and (_job_processes(str(out)) or _job_processes(str(tmp))):
        time.sleep(0.2)
    assert not _job_processes(str(out)) and not _job_processes(str(tmp)), "a process of the job outlived it"
    kept = _tp_dirs(tmp)  # replica 0's logs, named in its line
    assert len(kept) == 1 and f"(logs: {tmp / kept[0] / 'logs'})" in err, (kept, err)
    assert len(records(tmp_path / "out.jsonl.part1of2")) == 6 and not out.exists()
    code, err = batch(setup, out, inp, extra=extra, env=env)
    assert code == 0 and "this run: 0 done, 0 failed, 6 skipped" in err, err  # replica 1 had finished
    assert [r["id"] for r in records(out)] == list(range(12)) and _tp_dirs(tmp) == kept
    for r, x in zip(records(out), lines):
        assert r["token_ids"] == _alone(pipe, x["prompt_ids"], 40), r["id"]


def _tp_dirs(tmp):
    return [d for d in os.listdir(tmp) if d.startswith("mindspec-tp-")]


def _proc(pid, name):
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_dying_replica_fails_the_job_with_one_line_and_a_rerun_finishes_it(setup, tmp_path, sig):
    """Replica 0 is killed mid-job: replica 1 finishes its share, the launcher names the dead replica (exit 2)
    and merges nothing; the same command then runs only what is missing: every id once, in input order.
    Stopped by SIGTERM, the replica prints its summary and the launcher said nothing (the dp prober's): now
    it names the replica too (exit 130)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt_ids": [5, 6, i], "max_new_tokens": 100}) + "\n" for i in range(16)))
    cmd = command(setup, out, inp, ["--dp", "2"])
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, MINDSPEC_PROGRESS_S="3600"))
    part0 = tmp_path / "out.jsonl.part0of2"
    while _in_parts([part0]) < 1:
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.05)
    replica0 = [c for c in _children(p.pid) if b"--dp-replica\x000" in open(f"/proc/{c}/cmdline", "rb").read()]
    os.kill(replica0[0], sig)
    code, err = p.wait(timeout=300), p.stderr.read()
    how = "died (killed by signal 9)" if sig == signal.SIGKILL else "was stopped by a signal (exit code 130)"
    assert code == (2 if sig == signal.SIGKILL else 130) and last(err) == (
        f"mindspec: error: data-parallel replica 0 of 2 {how}; its part is kept: run the same command again to "
        "finish what is missing"), err
    assert len(records(tmp_path / "out.jsonl.part1of2")) == 8 and _in_parts([part0]) < 8 and not out.exists()
    code, err = batch(setup, out, inp, extra=["--dp", "2"])
    assert code == 0 and "this run: 0 done, 0 failed, 8 skipped" in err, err  # replica 1 had finished
    assert [r["id"] for r in records(out)] == list(range(1, 17))


def test_two_nodes_of_a_data_parallel_job_share_one_output(setup, first_run, tmp_path):
    """`--dp 2 --nodes 2`, both "machines" here, one output directory (as a shared file system): each node
    runs its replica; whichever finds every part complete merges, the other says lines were left to it.
    Every id once, in input order, the DP=1 texts."""
    out = tmp_path / "out.jsonl"
    procs = [subprocess.Popen(command(setup, out, extra=["--dp", "2", "--nodes", "2", "--node-rank", str(r),
                                                         "--max-batch", "1"]),  # (ONE_ROW)
                              stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    errs = "\n".join(e for _, e in results)
    merged = f"mindspec batch: 8 lines: 4 done, 4 failed, 0 left -> {out} (merged from 2 parts)"
    for code, err in results:  # merged (exit 1: some lines failed), or finished first and left the merge
        assert (code, last(err)) == (1, merged) or (code == 0 and "lines are left to other nodes" in last(err)), err
    assert any(code == 1 for code, _ in results), errs
    recs, dp1 = records(out), by_id(first_run[2])
    assert [r["id"] for r in recs] == IDS and all(r.get("token_ids") == dp1[r["id"]].get("token_ids") for r in recs)
    assert not list(tmp_path.glob("out.jsonl.part*"))


def test_a_line_edited_since_its_result_is_refused_not_given_the_old_result(tmp_path, capsys, monkeypatch):
    """Found trying it carelessly: results are matched to lines by id (a line without one is its line
    number), so a prompt inserted at the top of an input shifted every line onto the result of the line
    before it — exit 0, "2 skipped", the new prompt never run. Each result now keeps a hash of its
    line's request as written; a resume refuses a line whose request changed, before anything runs."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    inp.write_text('{"prompt_ids": [1]}\n{"prompt_ids": [2], "temperature": 0.5}\n')
    ran = driver(monkeypatch)
    assert _batch(str(inp), out) == 0 and ran == [1, 2]
    assert all(isinstance(r["request"], str) for r in records(out))
    # the same lines (keys in another order, an appended line): resumed, only the new line runs
    inp.write_text('{"prompt_ids": [1]}\n{"temperature": 0.5, "prompt_ids": [2]}\n{"prompt_ids": [3]}\n')
    assert _batch(str(inp), out) == 0 and ran == [1, 2, 3]
    before = out.read_bytes()
    inp.write_text('{"prompt_ids": [9]}\n{"prompt_ids": [1]}\n{"prompt_ids": [2], "temperature": 0.5}\n')
    with pytest.raises(MindspecError, match=rf"in.jsonl:1: this line \(id 1\) changed since {out} got its result"):
        _batch(str(inp), out)
    assert out.read_bytes() == before and ran == [1, 2, 3]
    # a result written before results kept their request is taken as it is
    out.write_bytes(_rec(1, B.job_id(DEFAULTS), **OK))
    assert _batch(str(inp), out) == 0 and ran == [1, 2, 3, 1, 2]


def test_an_output_that_is_a_symlink_to_a_file_not_yet_made_is_made_there(tmp_path, capsys, monkeypatch):
    """Found trying it carelessly: `--output results.jsonl`, a symlink to a file on another disk not yet
    written (as a shell's `>` would create it), stopped with "No such file or directory" (the exclusive
    create refuses any symlink). The file it points to is now made, and a resume goes through it too."""
    inp, real = _input(tmp_path / "in.jsonl", 2), tmp_path / "disk" / "o.jsonl"
    real.parent.mkdir()
    link = tmp_path / "o.jsonl"
    link.symlink_to(real)
    ran = driver(monkeypatch)
    assert _batch(inp, link) == 0 and ran == [1, 2]
    assert link.is_symlink() and [r["id"] for r in records(real)] == [1, 2]
    assert _batch(inp, link) == 0 and ran == [1, 2]  # resumed through the link: nothing left
    nowhere = tmp_path / "nowhere.jsonl"
    nowhere.symlink_to(tmp_path / "no-such-dir" / "o.jsonl")
    with pytest.raises(MindspecError, match=r"cannot write output .*nowhere.jsonl: No such file or directory"):
        _batch(inp, nowhere)


def _changed(inp, line, rid, path):
    return (f"{inp}:{line}: this line (id {rid}) changed since {path} got its result; give the new request a new id, "
            "or another --output")


def test_a_line_edited_into_a_bad_line_is_refused_like_any_edited_line(tmp_path, capsys, monkeypatch):
    """Found by a review: a line edited into a bad one (a typo'd field, broken JSON, a bad id) whose id had
    a result was skipped, exit 0, "2 skipped": a bad line has no request to compare, so the old result
    stood for the new line. Results come from good lines only, so it was edited: refused, exit 2."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    inp.write_text('{"id": "a", "prompt_ids": [1]}\n{"prompt_ids": [2]}\n')
    ran = driver(monkeypatch)
    assert _batch(str(inp), out) == 0 and ran == [1, 2]
    before = out.read_bytes()
    capsys.readouterr()
    for edited, line, rid in (('{"id": "a", "prompt_ids": [99], "temprature": 0.7}\n{"prompt_ids": [3]\n', 1, '"a"'),
                              ('{"id": "a", "prompt_ids": [1]}\n{"prompt_ids": [3]\n', 2, "2"),
                              ('{"id": "a", "prompt_ids": [1]}\n{"id": true, "prompt_ids": [2]}\n', 2, "2")):
        inp.write_text(edited)
        with pytest.raises(MindspecError) as e:
            _batch(str(inp), out)
        assert str(e.value) == _changed(inp, line, rid, out)
        assert out.read_bytes() == before and ran == [1, 2] and capsys.readouterr().err == ""  # not begun: no summary
    # a result written before records kept their request is taken as it is (the docs' rule), bad line or not
    out.write_bytes(_rec("a", B.job_id(DEFAULTS), **OK) + _rec(2, B.job_id(DEFAULTS), **OK))
    assert _batch(str(inp), out) == 0 and ran == [1, 2]


def test_a_merge_refuses_a_line_edited_since_a_part_got_its_result(tmp_path, capsys, monkeypatch):
    """Found by a review: `--merge` after a line was edited wrote the part's old result under the new line's
    request hash (exit 0; the next run skipped it too), and a line moved to the other replica's share (a
    line inserted above it) and edited was given the stale result of the part it had been in. The launcher
    and every merge now compare the parts' results with the lines, as a resume compares the output's."""
    from mindspec import dp
    inp, out, job = tmp_path / "in.jsonl", tmp_path / "o.jsonl", B.job_id(DEFAULTS)
    line = lambda rid, p: json.dumps({"id": rid, "prompt_ids": p}) + "\n"
    inp.write_text(line("a", [1]) + line("b", [2]))
    ran = driver(monkeypatch)
    assert _batch(str(inp), out, part=(0, 2)) == 0 and _batch(str(inp), out, part=(1, 2)) == 0 and ran == [1, 2]
    parts = {p: p.read_bytes() for p in tmp_path.glob("o.jsonl.part*")}
    inp.write_text(line("a", [1]) + line("b", [22]))  # b edited before the merge
    with pytest.raises(MindspecError) as e:
        dp.merge_command(str(inp), str(out), job)
    assert str(e.value) == _changed(inp, 2, '"b"', f"{out}.part1of2")
    assert not out.exists() and {p: p.read_bytes() for p in tmp_path.glob("o.jsonl.part*")} == parts
    inp.write_text(line("a", [1]) + line("b", [2]))
    assert dp.merge_command(str(inp), str(out), job) == 0
    assert records(out) == [json.loads(parts[tmp_path / f"o.jsonl.part{i}of2"]) for i in (0, 1)]  # as the parts hold
    # a line inserted at the top moves "b" to replica 0's share; "b" edited: the launcher refuses first
    out.unlink()
    assert _batch(str(inp), out, part=(1, 2)) == 0 and ran == [1, 2, 2]  # b, in part 1
    inp.write_text(line("x", [0]) + line("a", [1]) + line("b", [22]))
    monkeypatch.setattr(dp, "_start", lambda *a: pytest.fail("a replica started"))
    capsys.readouterr()
    with pytest.raises(MindspecError) as e:
        dp.launch([], str(inp), str(out), job, 2)
    assert str(e.value) == _changed(inp, 3, '"b"', f"{out}.part1of2") and not out.exists()
    # replicas run by hand anyway (x and b in part 0, a in part 1): the merge refuses part 1's stale "b"
    assert _batch(str(inp), out, part=(0, 2)) == 0 and _batch(str(inp), out, part=(1, 2)) == 0
    assert ran == [1, 2, 2, 0, 22, 1]
    with pytest.raises(MindspecError) as e:
        dp.merge_command(str(inp), str(out), job)
    assert str(e.value) == _changed(inp, 3, '"b"', f"{out}.part1of2") and not out.exists()


def test_a_node_that_finishes_first_leaves_the_merge_to_the_node_still_writing(tmp_path, capsys, monkeypatch):
    """Found by a review: only the two-node subprocess test covered a node that finishes while another
    node's replica still writes its part, and only when timing made it so. Its part is locked here."""
    from mindspec import dp
    inp, out, job = _input(tmp_path / "in.jsonl", 2), tmp_path / "o.jsonl", B.job_id(DEFAULTS)
    driver(monkeypatch, fail={2})
    assert _batch(inp, out, part=(0, 2)) == 0 and _batch(inp, out, part=(1, 2)) == 1
    parts = {p: p.read_bytes() for p in tmp_path.glob("o.jsonl.part*")}
    rows = B._rows(B._read_lines(inp), inp)
    capsys.readouterr()
    with open(tmp_path / "o.jsonl.part1of2", "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # the other node's replica 1 still retries id 2
        o = B.Output(str(out), job, inp)
        try:
            assert dp._finish(o, rows, 2, node=True) == 0
        finally:
            o.close()
    assert capsys.readouterr().err == ("mindspec batch: this node's replicas are done; 2 of 2 lines are left to other "
                                       "nodes: the last to finish merges (or run the job with --merge)\n")
    assert out.read_bytes() == b"" and {p: p.read_bytes() for p in tmp_path.glob("o.jsonl.part*")} == parts


def _in_process_replicas(monkeypatch, inp, out):
    """The launcher's replicas run here, one after another, instead of as subprocesses."""
    from mindspec import dp
    monkeypatch.setattr(dp, "_start", lambda argv, here, tp: {i: _batch(inp, out, part=(i, len(here))) for i in here})
    monkeypatch.setattr(dp, "_wait", lambda procs: procs)


def test_a_data_parallel_rerun_of_a_merged_job_runs_only_its_failed_lines(tmp_path, capsys, monkeypatch):
    """Found by mutation testing: nothing re-ran a merged --dp job; a replica that ignored the output's
    results (or its errors' words) would run or write every line again."""
    from mindspec import dp
    inp, out, job = _input(tmp_path / "in.jsonl", 4), tmp_path / "o.jsonl", B.job_id(DEFAULTS)
    _in_process_replicas(monkeypatch, inp, out)
    merged = f"mindspec batch: 4 lines: 3 done, 1 failed, 0 left -> {out} (merged from 2 parts)"
    ran = driver(monkeypatch, fail={3})
    assert dp.launch([], inp, str(out), job, 2) == 1 and ran == [1, 3, 2, 4]
    assert last(capsys.readouterr().err) == merged
    first = out.read_bytes()
    assert [(r["id"], r.get("error")) for r in records(out)] == [(1, None), (2, None), (3, "line 3: nope"), (4, None)]
    ran = driver(monkeypatch, fail={3})
    assert dp.launch([], inp, str(out), job, 2) == 1 and ran == [3]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"mindspec batch: 2 lines: 1 done, 1 failed, 0 left -> {out}.part0of2; this run: 0 done, "
                             "1 failed, 1 skipped; ") and err[-1] == merged
    assert out.read_bytes() == first and not list(tmp_path.glob("o.jsonl.part*"))  # the same error: not again
    ran = driver(monkeypatch)
    assert dp.launch([], inp, str(out), job, 2) == 0 and ran == [3]
    assert [(r["id"], r.get("error")) for r in records(out)][4:] == [(3, None)]


def test_the_summary_line_exactly(tmp_path, capsys, monkeypatch):
    """Found by mutation testing: no test read the summary's acceptance or tokens per target call, nor the
    words when nothing was drafted."""
    inp, out = _input(tmp_path / "in.jsonl", 2), tmp_path / "o.jsonl"
    clock = [1000.0]
    monkeypatch.setattr(B, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    stats = dict(STATS, new_tokens=6, target_calls=2, drafted=4, accepted=3)

    def drive(pipe, items, check=lambda: None, max_batch=1, ready=lambda: None):
        ready()
        for item in items:
            clock[0] += 1.5
            yield item, dict(OK, stats=dict(stats)) if item.kw["prompt_ids"][0] != 9 else {"error": "line 1: nope"}

    monkeypatch.setattr(B, "generate_records", drive)
    assert _batch(inp, out) == 0
    assert capsys.readouterr().err == (f"mindspec batch: 2 lines: 2 done, 0 failed, 0 left -> {out}; this run: 2 done, "
                                       "0 failed, 0 skipped; 12 tokens in 3.00 s = 4.0 tok/s; acceptance 0.75; 3.00 "
                                       "tokens per target call\n")
    (tmp_path / "in2.jsonl").write_text('{"prompt_ids": [9]}\n')
    assert _batch(str(tmp_path / "in2.jsonl"), tmp_path / "o2.jsonl") == 1
    assert capsys.readouterr().err == (f"mindspec batch: 1 lines: 0 done, 1 failed, 0 left -> {tmp_path / 'o2.jsonl'}; "
                                       "this run: 0 done, 1 failed, 0 skipped; 0 tokens in 1.50 s = - tok/s; no "
                                       "drafts; - tokens per target call\n")


def test_a_model_that_fails_to_load_leaves_no_new_output_and_no_summary(tmp_path, capsys, monkeypatch):
    """Found by mutation testing: nothing checked that a job whose model cannot load (it never began)
    removes the output it made, keeps one it did not, and prints no summary (only the error line)."""
    inp, out, job = _input(tmp_path / "in.jsonl", 2), tmp_path / "o.jsonl", B.job_id(DEFAULTS)

    def load():
        raise MindspecError("model directory is unusable: config.json missing")

    for before in (None, _rec(1, job, **OK)):
        if before is not None:
            out.write_bytes(before)
        with pytest.raises(MindspecError) as e:
            B.run_batch(load, DEFAULTS, inp, str(out))
        assert str(e.value) == "model directory is unusable: config.json missing"
        assert (out.read_bytes() if out.exists() else None) == before and capsys.readouterr().err == ""


def test_ids_a_bool_id_an_int_and_its_string_and_a_byte_order_mark(tmp_path, capsys, monkeypatch):
    """Found by mutation testing: nothing pinned a bool id's error record (True is an int to Python), that 1
    and "1" are two ids (on resume too), or that a first line after a UTF-8 byte-order mark runs."""
    inp, out, job = tmp_path / "in.jsonl", tmp_path / "o.jsonl", B.job_id(DEFAULTS)
    ran = driver(monkeypatch)
    inp.write_text('{"id": true, "prompt_ids": [1]}\n{"prompt_ids": [2]}\n')
    assert _batch(str(inp), out) == 1 and ran == [2]
    assert records(out) == [{"mindspec_batch": 1, "job": job, "id": 1,
                             "error": "line 1: id must be a string or an integer, got true"},
                            {"mindspec_batch": 1, "job": job, "id": 2, **OK, "request": B._asked({"prompt_ids": [2]})}]
    out.unlink()
    inp.write_text('{"id": 1, "prompt_ids": [1]}\n{"id": "1", "prompt_ids": [2]}\n')
    assert _batch(str(inp), out) == 0 and ran == [2, 1, 2] and [r["id"] for r in records(out)] == [1, "1"]
    assert _batch(str(inp), out) == 0 and ran == [2, 1, 2]  # resumed: each has its own result
    out.unlink()
    inp.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt_ids": [3]}\n')
    assert _batch(str(inp), out) == 0 and ran == [2, 1, 2, 3] and [r["id"] for r in records(out)] == ["a"]


def test_each_record_carries_the_compile_time_since_the_record_before(monkeypatch):
    """Found by mutation testing: nothing checked that a record's stats.compile_s is the compiling since the
    previous record (the pipeline's is the job's running total), so that their sum is the job's."""
    from types import SimpleNamespace as NS
    total = iter([5.0, 5.0, 7.0])  # the job's compile time when each line finished

    class Req:
        error, done, prompt_ids = None, True, [1]

        def result(self):
            return NS(text="t", token_ids=[1], finish_reason="length", logprobs=None, stats=dict(self.stats.__dict__))

    class Pipe:
        def stream(self, reqs, max_batch, ready):
            ready()
            for r in reqs:
                r.stats = NS(compile_s=next(total))
                yield r, None

    monkeypatch.setattr(B, "make", lambda pipe, kw: Req())
    items = [B.Item(i, i, {"prompt_ids": [i]}) for i in (1, 2, 3)]
    assert [(item.rid, body["stats"]["compile_s"]) for item, body in B.generate_records(Pipe(), items)] == \
        [(1, 5.0), (2, 0.0), (3, 2.0)]


def test_a_merge_keeps_other_files_and_the_parts_records_as_they_are(tmp_path, capsys, monkeypatch):
    """Found by mutation testing: nothing checked that a merge removes only the parts (a user's
    o.jsonl.part0of2.bak matches a looser pattern). Found by a review: a merged record took the line's
    request hash, which a part's result written before records kept one never had."""
    from mindspec import dp
    inp, out, job = _input(tmp_path / "in.jsonl", 2), tmp_path / "o.jsonl", B.job_id(DEFAULTS)
    driver(monkeypatch)
    assert _batch(inp, out, part=(0, 2)) == 0
    part0 = records(tmp_path / "o.jsonl.part0of2")
    (tmp_path / "o.jsonl.part1of2").write_bytes(_rec(2, job, **OK))  # no "request"
    (tmp_path / "o.jsonl.part0of2.bak").write_text("my backup\n")
    assert dp.merge_command(inp, str(out), job) == 0
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "o.jsonl", "o.jsonl.part0of2.bak"]
    assert (tmp_path / "o.jsonl.part0of2.bak").read_text() == "my backup\n"
    assert records(out) == part0 + [json.loads(_rec(2, job, **OK))]


def test_a_data_parallel_launcher_refuses_an_edited_line_and_stops_at_a_replica_that_ended_with_2(
        tmp_path, capsys, monkeypatch):
    """Found by mutation testing: nothing checked that the launcher refuses a line edited since its result
    before any replica starts, or that a replica ending with exit 2 (it printed its own line) stops the
    merge: exit 2, nothing merged, the parts kept."""
    from mindspec import dp
    inp, out, job = tmp_path / "in.jsonl", tmp_path / "o.jsonl", B.job_id(DEFAULTS)
    driver(monkeypatch)
    inp.write_text('{"id": "a", "prompt_ids": [1]}\n')
    assert _batch(str(inp), out) == 0
    before = out.read_bytes()
    inp.write_text('{"id": "a", "prompt_ids": [99]}\n')
    monkeypatch.setattr(dp, "_start", lambda *a: pytest.fail("a replica started"))
    with pytest.raises(MindspecError) as e:
        dp.launch([], str(inp), str(out), job, 2)
    assert str(e.value) == _changed(inp, 1, '"a"', out) and out.read_bytes() == before
    out.unlink()
    inp.write_text('{"prompt_ids": [1]}\n{"prompt_ids": [2]}\n')
    assert _batch(str(inp), out, part=(0, 2)) == 0 and _batch(str(inp), out, part=(1, 2)) == 0
    parts = {p: p.read_bytes() for p in tmp_path.glob("o.jsonl.part*")}
    capsys.readouterr()
    monkeypatch.setattr(dp, "_start", lambda *a: {})
    monkeypatch.setattr(dp, "_wait", lambda procs: {0: 2, 1: 0})  # replica 0 refused (exit 2), its part complete
    assert dp.launch([], str(inp), str(out), job, 2) == 2
    assert capsys.readouterr().err == "" and not out.exists()
    assert {p: p.read_bytes() for p in tmp_path.glob("o.jsonl.part*")} == parts


def test_what_an_output_record_counts_for(tmp_path, capsys, monkeypatch):
    """Found by mutation testing: nothing pinned that a later duplicate result's request hash is not the one
    compared (the first result wins), that an empty error message is still an error (retried), that a
    record without the marker, of another format version or with a bool id is refused, or what an empty
    input does (exit 0, an empty output)."""
    inp, out, job = _input(tmp_path / "in.jsonl", 1), tmp_path / "o.jsonl", B.job_id(DEFAULTS)
    ran = driver(monkeypatch)
    first = _rec(1, job, **OK, request=B._asked({"prompt_ids": [1]}))
    out.write_bytes(first + _rec(1, job, **dict(OK, text="later"), request=B._asked({"prompt_ids": [9]})))
    assert _batch(inp, out) == 0 and ran == []
    out.write_bytes(_rec(1, job, error=""))
    assert _batch(inp, out) == 0 and ran == [1]
    for foreign in (b'{"id": 1, "job": "train-7", "text": "hi"}\n',
                    json.dumps({"mindspec_batch": 2, "job": job, "id": 1, **OK}).encode() + b"\n",
                    _rec(True, job, **OK)):
        out.write_bytes(foreign)
        with pytest.raises(MindspecError) as e:
            _batch(inp, out)
        assert str(e.value) == f"{out}:1 is not a mindspec batch record; not writing to that file"
        assert out.read_bytes() == foreign and ran == [1]
    (tmp_path / "empty.jsonl").write_text("\n")
    capsys.readouterr()
    assert _batch(str(tmp_path / "empty.jsonl"), tmp_path / "o2.jsonl") == 0 and ran == [1]
    assert (tmp_path / "o2.jsonl").read_bytes() == b""
    assert capsys.readouterr().err == (f"mindspec batch: 0 lines: 0 done, 0 failed, 0 left -> {tmp_path}/o2.jsonl; "
                                       "this run: 0 done, 0 failed, 0 skipped; 0 tokens in 0.00 s = - tok/s; no "
                                       "drafts; - tokens per target call\n")


def test_chat_on_a_model_without_a_chat_template_is_refused_before_it_loads(tiny_target, tmp_path):
    """Found by a user probe: `batch --chat` on a model whose tokenizer_config.json has no chat_template loaded the
    model, then wrote an error record for every line, exit 1. Now one line, exit 2, before MindSpore is imported
    and with no output made (as `generate --chat`); a model with a template passes the check."""
    from mindspec.cli import parse
    model = tmp_path / "m"
    shutil.copytree(tiny_target[0], model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    out = tmp_path / "out.jsonl"
    args = ["batch", "--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--chat", "--max-new-tokens", "2"]
    code = f"import sys\nfrom mindspec.cli import main\nrc = main({args + ['--target', str(model)]!r})\n" \
           "print(rc, 'mindspore' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (p.stdout, p.stderr) == ("2 False\n", f"mindspec: error: --chat wraps the prompts in the model's chat "
                                    f"template, and {model} has none (no chat_template.jinja, no chat_template in "
                                    "tokenizer_config.json): "
                                    "run without --chat\n"), p.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl", "m"]
    assert parse(args + ["--target", tiny_target[0]]).chat  # (its template: no refusal)


def test_an_internal_error_is_recorded_in_one_line():
    """Found by a launcher probe: a rank's collective timing out wrote MindSpore's whole message into each
    failed line's record (450-1900 characters of C++ call stack); a record now holds its first line of words."""
    from types import SimpleNamespace
    err = RuntimeError("----------------------------------------------------\n- Kernel error:\n----------------\n"
                       "Launch kernel failed: Default/AllReduce-op47\n\n- C++ Call Stack: (For framework developers)\n"
                       "mindspore/ccsrc/runtime/graph_scheduler/actor/kernel_actor.cc:995 ExecuteLaunchKernelTask\n")
    assert B._body(SimpleNamespace(line=3), SimpleNamespace(error=err)) == {
        "error": "line 3: internal error: RuntimeError: Launch kernel failed: Default/AllReduce-op47"}


def test_the_progress_eta_goes_by_the_lines_generated_not_the_bad_lines_written_at_once():
    """A batch probe's: 300 bad lines (their error records written at once) and 300 good ones said "ETA 0m00s"
    with the good ones all left: the rate counted the bad lines as work done."""
    from types import SimpleNamespace
    items = [SimpleNamespace(rid=i) for i in range(1, 601)]
    t = B.Tally(items, done=set(), errors=set())
    for item in items[:300]:
        t.add(item, {"error": f"line {item.rid}: not valid JSON"})
    t.add(items[300], dict(OK))
    t.t0 = time.monotonic() - 10.0
    t.t1 = t.t0 + 10.0  # 10 s of generation, one line generated: 299 left
    line = B.Progress(t, bar=False)._line(None, None)
    assert line == "mindspec batch: 301/600 lines (300 failed), - tok/s, acceptance -, ETA 49m50s", line
