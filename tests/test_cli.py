"""The `mindspec` command line, run as a real subprocess: output, JSON, and bad input -> exit 2."""
import argparse
import json
import re
import os
import shutil
import subprocess
import sys
import time

import pytest

from mindspec import scratch
from mindspec.cli import _ids
from mindspec.export import export_draft

from conftest import make_tiny_checkpoint


def run(*args, env=None, cwd=None):
    p = subprocess.run([sys.executable, "-m", "mindspec", *args], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, **(env or {})), cwd=cwd)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def pair(tiny_target, tiny_draft_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    draft = str(d / "draft.onnx")
    assert run("export", "--model", tiny_draft_ckpt[0], "--out", draft)[0] == 0
    return tiny_target[0], draft, d


def test_generate_json_speculative_equals_no_speculate(pair):
    target, draft, _ = pair
    args = ["generate", "--target", target, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "20", "--json"]
    code, out, err = run(*args, "--draft", draft, "-k", "2")
    assert code == 0, err
    spec = json.loads(out)
    assert (spec["device"], spec["dtype"]) == ("CPU", "float32")  # (a float16 prober's: nothing said what ran)
    assert set(spec["stats"]) >= {"new_tokens", "target_calls", "drafted", "accepted", "acceptance_rate",
                                  "tokens_per_target_call", "accepted_at", "k_used", "prefill_s", "draft_s",
                                  "verify_s", "other_s", "wall_s", "tokens_per_s"}
    st = spec["stats"]
    assert st["prefill_s"] + st["draft_s"] + st["verify_s"] + st["other_s"] == pytest.approx(st["wall_s"], abs=1e-3)
    # K=2 on every step but where fewer than 3 tokens were left (drafts are capped to what can be committed)
    assert sum(st["k_used"].values()) == st["target_calls"] - 1 and st["k_used"]["2"] >= st["target_calls"] - 3
    assert set(st["k_used"]) <= {"0", "1", "2"} and len(st["accepted_at"]) == 2
    assert spec["stats"]["new_tokens"] == len(spec["token_ids"]) == 20
    code, out, _ = run(*args, "--no-speculate", "--logprobs", "1")
    base = json.loads(out)
    assert code == 0 and base["token_ids"] == spec["token_ids"] and base["text"] == spec["text"]
    assert base["stats"]["drafted"] == 0 and "logprobs" not in spec
    assert [top[0][0] for _, top in base["logprobs"]] == base["token_ids"]  # greedy: each token is the best
    assert all(lp == top[0][1] <= 0 for lp, top in base["logprobs"])
    code, out, err = run(*args, "--logprobs", "21")
    assert code == 2 and out == "" and err.startswith("mindspec: error: logprobs must be an integer in [0, 20]")


def test_generate_streams_text_and_summarises_on_stderr(pair):
    target, draft, _ = pair
    code, out, err = run("generate", "hi", "--target", target, "--draft", draft, "--max-new-tokens", "12",
                         "--stats", "-k", "2")
    assert code == 0, err
    assert out.strip() and "tokens per target call" in err and "Traceback" not in err
    assert "accepted at draft position" in err and "K=2:" in err  # the --stats table
    summary = err.strip().splitlines()[-1]  # (the docs probe's: "K used {'2': 5}", Python's notation)
    assert re.fullmatch(r"\[12 tokens in .* s = .* tok/s; acceptance .*, .* tokens per target call; K=2; K used "
                        r"(K=\d:\d+ ?)+; float32 on CPU\]", summary), summary


def test_text_the_terminals_encoding_lacks_is_replaced_not_a_traceback(pair):
    """Found under a zh_CN.GBK locale (stdout's encoding gbk): a generated emoji ended `generate` with
    UnicodeEncodeError, exit 1, the text cut off. Such a character now prints as '?' (--json, or
    PYTHONIOENCODING=utf-8, keep every character)."""
    target, draft, _ = pair
    args = ("generate", "hi", "--target", target, "--draft", draft, "--max-new-tokens", "24", "-k", "2")
    code, out, err = run(*args, "--json")
    text = json.loads(out)["text"]
    assert any(not c.isascii() for c in text)  # (this model writes what gbk lacks: the case is there)
    code, out, err = run(*args, env={"PYTHONIOENCODING": "gbk"})
    assert code == 0 and "Traceback" not in err, err
    assert out.rstrip("\n") == text.encode("gbk", "replace").decode("gbk")


def test_a_path_the_terminals_encoding_lacks_is_replaced_not_a_traceback(tiny_target, tmp_path):
    """Found by a CLI probe: export (convert, doctor) printing a path stdout's encoding lacks ended in
    UnicodeEncodeError, exit 1, after the work was done."""
    out = tmp_path / "草稿🙂" / "d.onnx"
    p = subprocess.run([sys.executable, "-m", "mindspec", "export", "--model", tiny_target[0], "--out", str(out)],
                       capture_output=True, timeout=600, env=dict(os.environ, PYTHONIOENCODING="gbk"))
    assert (p.returncode, p.stderr) == (0, b""), p.stderr
    assert str(out).replace("🙂", "?") in p.stdout.decode("gbk") and os.path.exists(str(out) + ".json")


@pytest.mark.parametrize("extra", [[], ["--json", "--logprobs", "2"]])
def test_generate_into_a_pipe_that_closed_ends_quietly(pair, extra):
    """Found piping it into `head -c 10`: a BrokenPipeError traceback, exit 1. Now quiet, with the
    status a shell gives a writer that SIGPIPE ended (141)."""
    target, draft, _ = pair
    p = subprocess.Popen([sys.executable, "-m", "mindspec", "generate", "hi", "--target", target, "--draft", draft,
                          "--max-new-tokens", "8", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the reader has gone before the first token
    err = p.communicate(timeout=300)[1]
    assert p.returncode == 141 and "Traceback" not in err and "Error" not in err, (p.returncode, err)


def _started(p, timeout=60):
    """Wait for the command p's main() to hold its signals (blocked, or SIGTERM handled): sent before, a signal
    lands in Python's start-up, which on a busy machine can outlast a test's delay."""
    import signal
    import time
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        with open(f"/proc/{p.pid}/status") as f:
            st = dict(line.split(":", 1) for line in f if ":" in line)
        if int(st["SigBlk"], 16) >> (signal.SIGINT - 1) & 1 or int(st["SigCgt"], 16) >> (signal.SIGTERM - 1) & 1:
            return
        time.sleep(0.005)
    raise AssertionError(f"the command never held its signals: {p.args}")


@pytest.mark.parametrize("delays", [[0.3], [1.0], [4.0], [1.0, 0.05], [4.0, 0.05]])  # import 0.1-2 s, then compiles
def test_ctrl_c_while_generate_loads_or_compiles_exits_130_quietly(pair, tmp_path, delays):
    """Found by a signals probe: Ctrl-C while `generate` imported MindSpore or compiled was lost (the
    generation ran on, exit 0), or aborted the interpreter; twice, it dumped MindSpore's errors into
    ./rank_0. Now it stops at the next safe point (exit 130, nothing on stderr), a second one at once."""
    import signal
    import time
    target, draft, _ = pair
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, MINDSPEC_HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"))  # (graphs compile)
    p = subprocess.Popen([sys.executable, "-m", "mindspec", "generate", "hi", "--target", target, "--draft", draft,
                          "--max-new-tokens", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=tmp_path)
    _started(p)
    for d in delays:
        time.sleep(d)
        p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert (p.returncode, out, err) == (130, "", ""), (p.returncode, out, err[-3000:])
    assert set(os.listdir(tmp_path)) <= {"home", "tmp"} and not os.listdir(tmp_path / "tmp")  # (no ./rank_0)


def test_the_empty_dump_directories_of_killed_commands_are_removed_by_the_next(pair, tmp_path):
    """Found by a launcher probe: a command killed (a --dp replica SIGKILLed) left its empty
    $TMPDIR/mindspec-om-* for good. The next command removes those of dead processes; a dump stays."""
    target, draft, _ = pair
    gone = subprocess.Popen(["true"])
    gone.wait()
    tmp = tmp_path / "tmp"
    dead, alive = scratch.name("mindspec-om-", gone.pid), scratch.name("mindspec-om-")
    other = f"mindspec-om-elsewhere-{gone.pid}-d"  # (another host's: its pids are not ours to judge)
    for name in (dead + "a", dead + "b/rank_0/om", alive + "c", other):
        (tmp / name).mkdir(parents=True)
    (tmp / f"{dead}b/rank_0/om/analyze_fail.ir").write_text("a failed compile's dump")
    code, out, err = run("generate", "hi", "--target", target, "--draft", draft, "--max-new-tokens", "2",
                         env={"TMPDIR": str(tmp)})
    assert code == 0, err
    assert set(os.listdir(tmp)) == {dead + "b", alive + "c", other}


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_while_generate_waits_for_its_prompt_on_stdin_exits_130(pair, sig):
    """Found by a signals probe: `generate -` read stdin with the signals held back, deaf to Ctrl-C; a SIGTERM
    there killed it (-15) where elsewhere it exits 130 as a Ctrl-C does."""
    import signal
    import time
    target, draft, _ = pair
    p = subprocess.Popen([sys.executable, "-m", "mindspec", "generate", "-", "--target", target, "--draft", draft],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _started(p)
    time.sleep(1)  # (then it waits on stdin, which stays open)
    p.send_signal(getattr(signal, sig))
    try:
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert (p.returncode, out, err) == (130, "", ""), (p.returncode, out, err[-3000:])


def test_a_signal_after_a_command_ended_and_before_it_exits_changes_nothing():
    """Left from a signals round: between a command's `with Signals(...)` and `stopping(code)` (its exit code
    known) the caller's handlers were back, and a Ctrl-C there raised KeyboardInterrupt (a traceback, exit 1).
    A command's signals are now recorded until then; a second one still stops it at once."""
    code = """if 1:
        import os, signal, sys
        from mindspec.signals import Signals, stopping
        with Signals(True, lambda: os._exit(9), final=True):
            print("ran")
        os.kill(os.getpid(), signal.SIGINT)  # the command ended: its code is being worked out
        print("went on", flush=True)
        if sys.argv[1] == "twice":
            os.kill(os.getpid(), signal.SIGTERM)
        stopping(3)
        os.kill(os.getpid(), signal.SIGINT)  # once the code is known: exit at once with it
        print("not reached")
    """
    for how, want in (("once", (3, "ran\nwent on\n")), ("twice", (9, "ran\nwent on\n"))):
        p = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=60)
        assert (p.returncode, p.stdout, p.stderr) == (*want, ""), (how, p.returncode, p.stdout, p.stderr[-2000:])


def test_a_stop_inside_deferred_is_raised_at_the_first_check_after():
    """A tensor-parallel server's turn runs with its stop deferred (rank 0 leaving it half-way, e.g. at a graph
    compile's check, would leave the other ranks in a collective): the stop is raised at the next check."""
    code = """if 1:
        import os, signal
        from mindspec import signals
        with signals.Signals(True, lambda: os._exit(9), final=True):
            with signals.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                signals.check()
                print("deferred", flush=True)
            try:
                signals.check()
            except KeyboardInterrupt:
                print("raised", flush=True)
        os._exit(0)
    """
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (0, "deferred\nraised\n", ""), (p.returncode, p.stdout, p.stderr)


def _bad(d, name, breaker):
    path = d / name
    if not path.exists():
        make_tiny_checkpoint(path)
    breaker(path)
    return str(path)


def _expect_error(args, needle):
    code, out, err = run(*args)
    assert code == 2, (code, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("mindspec: error:") and needle in err, err


def test_bad_checkpoints(pair):
    _, draft, d = pair
    gen = ["generate", "--prompt-ids", "5,6", "--draft", draft, "--target"]
    _expect_error(gen + [str(d / "nowhere")], "model directory not found")
    _expect_error(gen + [draft], f"{draft} is a file: give the model's directory")  # said "not found"
    _expect_error(gen + [_bad(d, "nocfg", lambda p: os.remove(p / "config.json"))], "config.json not found")
    _expect_error(gen + [_bad(d, "badcfg", lambda p: (p / "config.json").write_text("{oops"))],
                  "config.json is not valid JSON")
    _expect_error(gen + [_bad(d, "badst", lambda p: (p / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0garbage"))],
                  "not a valid safetensors file")
    _expect_error(gen + [_bad(d, "notok", lambda p: os.remove(p / "tokenizer.json"))], "tokenizer.json")
    _expect_error(gen + [_bad(d, "rope", lambda p: (p / "config.json").write_text(json.dumps(dict(
        json.loads((p / "config.json").read_text()), rope_scaling={"rope_type": "llama3", "factor": 8.0}))))],
        "rope_scaling")

    def high_id(p):  # (the hostile-file review: MindSpore's Gather traceback on the first prompt with "a")
        tok = json.loads((p / "tokenizer.json").read_text())
        tok["model"]["vocab"]["a"] = 5000
        (p / "tokenizer.json").write_text(json.dumps(tok))
    _expect_error(["generate", "aaa", "--draft", draft, "--target", _bad(d, "highid", high_id)],
                  "tokenizer.json has token id 5000 ('a'), outside the model's vocabulary [0, 320)")


def test_a_server_given_a_model_that_is_not_there_refuses_it_before_listening(pair):
    """Found: `serve --target <typo>` bound its port and said "listening on ..." before the one-line error."""
    target, draft, d = pair
    for args, words in (((str(d / "nowhere"), draft), f"model directory not found: {d / 'nowhere'}"),
                        ((target, str(d / "nowhere.onnx")), f"draft model not found: {d / 'nowhere.onnx'}")):
        _expect_error(["serve", "--port", "0", "--target", args[0], "--draft", args[1]], words)


def test_a_server_given_a_broken_model_or_a_draft_of_another_tokenizer_refuses_it_before_listening(pair, tmp_path):
    """Found by a CLI probe: a draft of another vocabulary, a file that is not ONNX or truncated weights
    were refused after the "listening on" line (only missing paths and a bad config came first)."""
    target, draft, d = pair
    other = make_tiny_checkpoint(tmp_path / "other", vocab=400)[0]
    export_draft(other, str(tmp_path / "other.onnx"), layers=1, max_seq=64)
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    cut = tmp_path / "cut"
    shutil.copytree(target, cut)
    weights = next(cut.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])
    for args, words in (((target, str(tmp_path / "other.onnx")), "has vocabulary size 400, the target has 320"),
                        ((target, str(tmp_path / "junk.onnx")), "not an ONNX file"),
                        ((str(cut), draft), "not a valid safetensors file")):
        _expect_error(["serve", "--port", "0", "--target", args[0], "--draft", args[1]], words)


def test_an_empty_draft_path_is_refused_not_read_as_no_draft(pair):
    """The CLI prober's: `load(target, draft="")` ran target-only; False (or --no-speculate) says that."""
    import mindspec
    target, _, _ = pair
    for kw in (dict(target=target, draft=""), dict(target="")):
        with pytest.raises(mindspec.MindspecError, match="path is empty"):
            mindspec.load(**kw)


def test_a_bad_checkpoint_or_draft_is_refused_before_mindspore_loads(pair):
    """MindSpore takes ~3 s to import: a checkpoint, tokenizer or draft that cannot work is refused first
    (it was imported before any check, so every such mistake cost the import)."""
    target, draft, d = pair
    no_tokenizer = _bad(d, "notok2", lambda p: os.remove(p / "tokenizer.json"))
    for kw in (dict(target=str(d / "nowhere")), dict(target=no_tokenizer), dict(target=target, draft=str(d / "x.onnx"))):
        code = (f"import sys, mindspec\ntry:\n    mindspec.load(**{kw!r})\nexcept mindspec.MindspecError as e:\n"
                "    print(e)\nprint('mindspore' in sys.modules)")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and p.stdout.splitlines()[-1] == "False", (kw, p.stdout, p.stderr[-2000:])


def test_generate_reads_the_prompt_from_stdin_given_as_dash(pair):
    """`mindspec generate -` reads the prompt from stdin (it was the one-character prompt "-"), its final
    newline dropped as a shell's $(...) does; text that is not UTF-8 is one line, exit 2."""
    target, draft, _ = pair
    gen = [sys.executable, "-m", "mindspec", "generate", "-", "--target", target, "--draft", draft, "--max-seq", "4"]
    for data, needle in ((b"hello\n", "prompt is 5 tokens; it does not fit max_seq 4"),  # byte tokens: 5, not 1
                         # a file saved by Notepad: its byte-order mark and CRLF are not the prompt's (found: 9)
                         (b"\xef\xbb\xbfhello\r\n", "prompt is 5 tokens; it does not fit max_seq 4"),
                         (b"\xff\xfe", "the prompt on stdin is not UTF-8 text"),
                         (b"", "the prompt is empty")):
        p = subprocess.run(gen, input=data, capture_output=True, timeout=300)
        err = p.stderr.decode()
        assert p.returncode == 2 and err.splitlines() == [f"mindspec: error: {needle}"], (data, p.returncode, err)
    p = subprocess.run(gen[:-2] + ["--tp", "2"], input=b"hi", capture_output=True, timeout=300)
    assert p.returncode == 2 and p.stderr.decode().splitlines() == [
        "mindspec: error: the prompt on stdin (-) cannot reach tensor-parallel ranks: give it as an argument"]


def test_bad_drafts(pair, tmp_path):
    target, draft, d = pair
    gen = ["generate", "--prompt-ids", "5,6", "--target", target, "--draft"]
    other, _ = make_tiny_checkpoint(tmp_path / "othervocab", vocab=400)
    other_onnx = str(tmp_path / "other.onnx")
    export_draft(other, other_onnx)
    _expect_error(gen + [other_onnx], "vocabulary")
    # a manifest copied from another export does not describe this file
    shutil.copy(other_onnx + ".json", str(tmp_path / "copied.onnx.json"))
    shutil.copy(draft, str(tmp_path / "copied.onnx"))
    _expect_error(gen + [str(tmp_path / "copied.onnx")], "another ONNX file")
    shutil.copy(draft, str(tmp_path / "bare.onnx"))
    _expect_error(gen + [str(tmp_path / "bare.onnx")], "not a mindspec draft")
    (tmp_path / "junk.onnx").write_bytes(b"not onnx at all")
    _expect_error(gen + [str(tmp_path / "junk.onnx")], "junk.onnx")


def test_bad_requests(pair):
    target, draft, _ = pair
    gen = ["generate", "--target", target, "--draft", draft]
    _expect_error(gen + ["--prompt-ids", "5,6,320"], "outside the vocabulary")
    _expect_error(gen + ["--prompt-ids", "5,-1"], "outside the vocabulary")
    _expect_error(gen + ["--prompt-ids", ",".join(["5"] * 80), "--max-seq", "64"], "does not fit")
    _expect_error(gen + ["--prompt-ids", "5", "-k", "0"], "k must be between")
    _expect_error(gen + ["--prompt-ids", "5", "-k", "9"], "k must be between")
    # (a newcomer's: serve bound its port and said "listening on ..." first)
    _expect_error(["serve", "--port", "0", "--target", target, "--draft", draft, "-k", "9"],
                  'argument -k: k must be between 1 and the largest K bucket 8 (or "auto"), got 9')
    code, _, err = run(*gen, "--prompt-ids", "5", "--max-new-tokens", "0")  # refused while parsing
    assert code == 2 and "--max-new-tokens: must be an integer >= 1, got '0'" in err
    code, _, err = run(*gen, "--prompt-ids", "5,x")
    assert code == 2 and "not a comma-separated list" in err
    assert _ids("1 2 3") == _ids("1, 2,3") == _ids(" 1 , 2 3 ") == [1, 2, 3]  # "1 2 3" was the one id 123
    for bad in ("1,,2", ",1", "1,", "1_0", "\uff11", ""):  # (a user probe's: ran as [1, 2], [1], [1], [10], [1], [])
        with pytest.raises(argparse.ArgumentTypeError, match="not a comma-separated list of token ids"):
            _ids(bad)
    _expect_error(gen + ["--prompt-ids", "5", "--logprobs", "2"], "--logprobs needs --json")  # were dropped
    _expect_error(gen + ["--prompt-ids", "5", "--chat"], "it does not apply to --prompt-ids")  # was ignored
    _expect_error(gen + ["--prompt-ids", "5", "--node-rank", "1"], "--node-rank must be in 0..0")  # was ignored
    _expect_error(gen + ["--prompt-ids", "5", "--no-speculate", "-k", "4"],  # was accepted, and never ran
                  "-k 4 sets the draft tokens of a step: it does not apply with --no-speculate")
    # asked for explicitly, more than fits is refused, as by serve and batch (it was cut: fewer tokens, exit 0)
    _expect_error(gen + ["--prompt-ids", "5,6,7", "--max-seq", "64", "--max-new-tokens", "62"],
                  "--max-new-tokens=62 does not fit: the 3-token prompt leaves 61 of the 64 positions")
    code, _, err = run(*gen, "--prompt-ids", "5", "--max-seq", "0")  # was "unset"; -4 failed after loading
    assert code == 2 and "--max-seq: must be an integer >= 1, got '0'" in err
    code, _, err = run(*gen, "--prompt-ids", "5", env={"MINDSPEC_HOME": target + "/config.json"})  # a file
    assert code == 2 and err.strip().splitlines() == [  # was NotADirectoryError's traceback
        f"mindspec: error: MINDSPEC_HOME {target}/config.json cannot be a directory: File exists"], err


def test_export_bad_arguments(tiny_target, tmp_path):
    _expect_error(["export", "--model", tiny_target[0], "--out", str(tmp_path / "d.onnx"), "--layers", "9"],
                  "--layers must be between 1 and 2")  # (the flag typed: was the library's keyword, layers)
    _expect_error(["export", "--model", tiny_target[0], "--out", str(tmp_path / "d.onnx"), "--max-seq", "99999"],
                  "--max-seq must be an integer from 1 to")
    _expect_error(["export", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "d.onnx")],
                  "not found")
    # README's `--quantize none` (float weights) was an argparse error
    code, out, err = run("export", "--model", tiny_target[0], "--out", str(tmp_path / "f.onnx"), "--quantize", "none")
    assert code == 0 and "float32, quantize=none" in out, err  # (the flag's word: was Python's None, a probe found)
    # found by a CLI probe: written, exit 0, and then every load failed on onnxruntime's INVALID_GRAPH
    code, out, err = run("export", "--model", tiny_target[0], "--out", str(tmp_path / "h" / "d.onnx"), "--dtype",
                         "float16", "--quantize", "int8")
    assert (code, out, err) == (2, "", "mindspec: error: quantize int8 does not go with dtype float16 "
                                "(onnxruntime's DynamicQuantizeLinear reads float32 only): use q8 or q4\n")
    assert not os.path.exists(tmp_path / "h")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                  "model.safetensors.index.json", "model.gguf"])
def test_a_models_file_that_is_a_fifo_is_refused_not_waited_on(tiny_target, tmp_path, name):
    """Found by a CLI probe: export (or generate, convert) of a model whose tokenizer.json, config.json... was
    a FIFO blocked for ever (tokenizer.json: deaf to Ctrl-C and SIGTERM). One line, exit 2."""
    model = tmp_path / "m"
    make_tiny_checkpoint(model, shard_bytes=60_000)
    path = model / name
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    args = ["convert", "--gguf", str(path), "--out", str(tmp_path / "c")] if name.endswith(".gguf") else \
        ["export", "--model", str(model), "--out", str(tmp_path / "d.onnx")]
    p = subprocess.run([sys.executable, "-m", "mindspec", *args], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (
        2, "", f"mindspec: error: {path} is not a regular file (a pipe, a device or a socket)\n"), p.stderr


def test_draft_with_another_tokenizer_is_refused(pair, tmp_path):
    target, _, _ = pair
    other, _ = make_tiny_checkpoint(tmp_path / "othertok")
    tok = json.loads((tmp_path / "othertok" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (tmp_path / "othertok" / "tokenizer.json").write_text(json.dumps(tok))
    export_draft(other, str(tmp_path / "othertok.onnx"))
    _expect_error(["generate", "--prompt-ids", "5,6", "--target", target, "--draft",
                   str(tmp_path / "othertok.onnx")], "different tokenizer")
    # found by a CLI probe: exported without tokenizer.json, it had no fingerprint and paired silently
    (tmp_path / "othertok" / "tokenizer.json").unlink()
    _expect_error(["export", "--model", other, "--out", str(tmp_path / "notok.onnx")],
                  f"{other} has no tokenizer.json: a draft must carry its tokenizer's fingerprint")
    m = json.loads((tmp_path / "othertok.onnx.json").read_text())
    (tmp_path / "othertok.onnx.json").write_text(json.dumps(dict(m, tokenizer_fingerprint=None)))
    _expect_error(["generate", "--prompt-ids", "5,6", "--target", target, "--draft", str(tmp_path / "othertok.onnx")],
                  "was exported without its tokenizer")


def test_generate_refuses_what_cannot_fit_before_loading(pair):
    target, draft, d = pair
    args = ["generate", "--target", target, "--draft", draft, "--prompt-ids", "5,6"]
    _expect_error(args + ["--device-mem", "200kB"], "does not fit")
    # no --device-mem on the CPU: the host's memory (found: serve said "listening", then numpy's MemoryError
    # for a 38 TiB cache, exit 1)
    (d / "huge.jsonl").write_text('{"prompt_ids": [5, 6]}\n')
    batch = ["batch", "--input", str(d / "huge.jsonl"), "--output", str(d / "huge.out.jsonl")]
    huge = ["--target", target, "--draft", draft, "--max-batch", "100000000", "--max-seq", "128"]
    _expect_error(batch + huge, "100000000 rows of 128 positions need about")
    # (two probes': serve said "listening on ..." first, and a supervisor saw a port open, then close)
    _expect_error(["serve", "--port", "0", *huge], "100000000 rows of 128 positions need about")
    _expect_error(["serve", "--port", "0", "--target", target, "--draft", draft, "--max-seq", "100000"],
                  "100000 positions exceed the model's")
    short = str(d / "short.onnx")
    export_draft(target, short, max_seq=32)
    _expect_error(["serve", "--port", "0", "--target", target, "--draft", short, "--max-seq", "48"],
                  "--max-seq 48 is more than the 32 positions the draft was exported for")
    # (a drafts probe's: "it does not fit max_seq 32", a max_seq nobody gave, the draft not named)
    _expect_error(["generate", "--target", target, "--draft", short, "--prompt-ids", ",".join(["5"] * 32)],
                  "prompt is 32 tokens; it does not fit max_seq 32 (the positions the draft was exported for)")
    # (the same for a text refused on its length before the tokenizer runs: it still said "max_seq 32")
    _expect_error(["generate", "--target", target, "--draft", short, "--prompt", "a" * 5000],
                  "prompt is 5000 characters; it does not fit max_seq 32 (the positions the draft was exported for)")
    assert not (d / "huge.out.jsonl").exists()
    # the CLI prober's: a cache that fit, with the graphs' workspace that did not: `bench --batch-sizes 100000`
    # was killed by the kernel (19 GB resident, exit 137). Address space capped: a miss fails, not the machine.
    import resource
    if os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") > 90e9:  # (the tiny rows' 96.7 GB would fit)
        return
    cap = lambda: resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))  # noqa: E731
    p = subprocess.run([sys.executable, "-m", "mindspec", "bench", "--target", target, "--draft", draft, "--prompts",
                        "story", "--max-new-tokens", "4", "--ks", "1", "--no-hf", "--batch-sizes", "100000",
                        "--out", str(d / "bench-huge")], capture_output=True, text=True, timeout=600, preexec_fn=cap)
    assert p.returncode == 2 and p.stderr.splitlines()[-1].startswith("mindspec: error: 100000 rows of ") \
        and "more than this machine's" in p.stderr, p.stderr[-3000:]
    _expect_error(args + ["--device-mem", "lots"], "bad size")
    code, _, err = run(*args, "--device-mem", "64GB", "--max-new-tokens", "3", "-k", "2")
    assert code == 0, err


def test_data_parallel_replicas_share_the_hosts_memory(pair, monkeypatch):
    """`batch --dp N` on one host: N replicas, each with its own cache. Its launcher checked no size (each replica
    said it, after loading), and each replica's bound was the whole host: N that fit alone were let through."""
    from mindspec import cli, plan
    from mindspec.config import load_config
    from mindspec.errors import MindspecError
    from mindspec.export.manifest import read_manifest
    from mindspec.spec import K_BUCKETS, cache_positions
    target, draft, d = pair
    row = plan.host_bytes_per_row(load_config(target), 4, cache_positions(128, K_BUCKETS), read_manifest(draft))
    monkeypatch.setattr(plan, "host_memory", lambda: int(row * 8 * 1.5))  # 8 rows fit, 16 do not
    argv = ["batch", "--input", str(d / "in.jsonl"), "--output", str(d / "dp.out.jsonl"), "--target", target,
            "--draft", draft, "--max-seq", "128", "--max-batch", "8"]
    (d / "in.jsonl").write_text('{"prompt_ids": [5, 6]}\n')
    a = cli.parse(argv)
    cli._check_size(a, *cli._check_model_paths(a))  # one replica: fits
    with pytest.raises(MindspecError, match=r"^2 replicas of 8 rows of 128 positions need about .* more than this "
                                            r"machine's"):
        cli.launch_dp(argv + ["--dp", "2"], cli.parse(argv + ["--dp", "2"]))
    assert not (d / "dp.out.jsonl").exists() and not list(d.glob("dp.out.jsonl.part*"))


def test_the_embedded_drafts_state_is_left_to_its_load(pair, tmp_path, monkeypatch):
    """A review's: the size check before a server binds its port read the embedded draft, which the load exports
    again when it is of an older format or half written: `serve` exited 2 where `generate` went on."""
    from mindspec import cli, default
    from mindspec.errors import MindspecError
    home = tmp_path / "model"
    shutil.copytree(pair[0], home)
    (home / "draft-q8.onnx").write_bytes(b"half an export")
    monkeypatch.setattr(default, "default_target", lambda: str(home))
    cli._check_size(cli.parse(["serve", "--max-seq", "64"]), None, None)
    with pytest.raises(MindspecError, match="100000 positions exceed the model's"):
        cli._check_size(cli.parse(["serve", "--max-seq", "100000"]), None, None)


def test_a_cpu_profile_draft_is_refused_on_ascend_before_a_port_or_a_replica(pair, monkeypatch):
    """An Ascend review's: CANN runs the cpu profile's draft mostly on the host. serve and batch --dp refuse it
    before binding their port or starting replicas, with the embedded target too (NPUs faked: none here)."""
    from mindspec import cli
    from mindspec.errors import MindspecError
    target, draft, d = pair
    monkeypatch.setattr(cli, "detect_device", lambda asked=None, probe=None: "Ascend")
    for argv in (["serve", "--target", target, "--draft", draft], ["serve", "--draft", draft],
                 ["batch", "--input", str(d / "in.jsonl"), "--output", str(d / "o.jsonl"), "--draft", draft,
                  "--dp", "2"]):
        with pytest.raises(MindspecError, match=r"is exported with the cpu profile, whose ops CANN does not run"):
            cli._check_model_paths(cli.parse(argv))


def test_dynamic_k_flag():
    from mindspec.cli import parser
    for cmd in (["generate"], ["serve"], ["batch", "--input", "in.jsonl", "--output", "out.jsonl"]):
        assert parser().parse_args(cmd).k == "auto"  # dynamic K is the default
        assert parser().parse_args(cmd + ["-k", "4"]).k == 4
        assert parser().parse_args(cmd + ["-k", "4", "--dynamic-k"]).k == "auto"


def test_help_gives_each_command_its_own_max_seq_default(capsys):
    """Found: `serve --help` said --max-seq defaults to "sized to the job", as generate's; a server holds 1024."""
    from mindspec.cli import SERVE_MAX_SEQ, parser
    for cmd, words in (("serve", f"(default: {SERVE_MAX_SEQ}"), ("generate", "(default: sized to the job)")):
        with pytest.raises(SystemExit):
            parser().parse_args([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert words in text.split("--max-seq MAX_SEQ ")[1].split(" --")[0], text


@pytest.mark.parametrize("bad", ["-1", "inf", "nan", "soon"])
def test_a_step_timeout_is_a_finite_number_of_seconds(bad, capsys):
    from mindspec.cli import parser
    assert parser().parse_args(["serve", "--step-timeout", "0.5"]).step_timeout == 0.5
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["serve", "--step-timeout", bad])
    assert e.value.code == 2 and f"--step-timeout: must be a number >= 0, got '{bad}'" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_tp_must_be_positive(bad, capsys):
    from mindspec.cli import parser
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["batch", "--input", "a", "--output", "b", "--tp", bad])
    assert e.value.code == 2 and "--tp: must be an integer >= 1" in capsys.readouterr().err


def test_compile_cache_is_written_then_used(pair, tmp_path):
    """The first run fills MindSpore's compile cache (one entry per warm-up, keyed by device, dtype,
    weights, shapes, graph source and TP layout); a second process loads its graphs from it, run from
    another directory (found: MindSpore's own check of the entry script's imports depends on the working
    directory, and a run from anywhere but the last one's compiled every graph again)."""
    target, draft, _ = pair
    args = ["generate", "--target", target, "--draft", draft, "-k", "2", "--max-seq", "64", "--prompt-ids", "5,6,7",
            "--max-new-tokens", "8", "--json"]
    env = {"MINDSPEC_HOME": str(tmp_path)}
    code, out1, err = run(*args, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert code == 0, err
    entries = sorted(os.listdir(tmp_path / "compile_cache"))
    key = entries[0]
    assert entries == [key, key + ".lock", key + ".whole"]  # one entry, its lock, the mark that it holds every graph
    graphs = os.listdir(tmp_path / "compile_cache" / key / "rank_0" / "graph_cache")
    # prefill, decode (a one-row verify of K=1), verify K=2; not K=4 or 8, which -k 2 never runs
    assert sum(g.endswith(".mindir") for g in graphs) == 3
    other = tmp_path / "elsewhere"
    other.mkdir()
    code, out2, err = run(*args, env=dict(env, GLOG_v="2"), cwd=other)  # MindSpore says when it uses the cache
    assert code == 0 and "Use the compilation cache" in err
    assert json.loads(out2)["token_ids"] == json.loads(out1)["token_ids"]
    # found while probing: each key an entry of its own (a server's 0.5-0.9 GB), none ever removed. Beyond
    # $MINDSPEC_COMPILE_CACHE_GB the least recently used go (the lock files stay)
    size = sum(f.stat().st_size for f in (tmp_path / "compile_cache" / key).rglob("*") if f.is_file())
    env["MINDSPEC_COMPILE_CACHE_GB"] = str(size * 1.5 / 1e9)  # one entry fits, two do not
    code, _, err = run(*args[:7], "--max-seq", "128", *args[9:], env=env)
    assert code == 0, err
    entries = sorted(os.listdir(tmp_path / "compile_cache"))
    new = next(e for e in entries if "." not in e and e != key)
    assert entries == sorted([key, key + ".lock", key + ".whole", new, new + ".lock", new + ".whole"])  # (one fits)
    hour_ago = time.time() - 3600  # (an entry used in the last 10 minutes stays: a TP rank may be about to read it)
    os.utime(tmp_path / "compile_cache" / (key + ".lock"), (hour_ago, hour_ago))
    code, _, err = run(*args[:7], "--max-seq", "1000", *args[9:], env=env)
    entries = sorted(os.listdir(tmp_path / "compile_cache"))
    assert code == 0 and key not in entries and new in entries and len(entries) == 7, (err, entries)
    code, _, err = run(*args, env=dict(env, MINDSPEC_COMPILE_CACHE_GB="lots"))
    assert (code, err) == (2, "mindspec: error: $MINDSPEC_COMPILE_CACHE_GB must be a number of gigabytes >= 0, got "
                              '"lots"\n'), err


def test_plan_with_tp_runs_in_this_process():
    """--tp of `plan` describes the deployment: no msrun launch (only model commands run on ranks)."""
    code, out, err = run("plan", "--params", "70B", "--layers", "80", "--kv-heads", "8", "--head-dim", "128",
                         "--tp", "8", "--device-mem", "64GB")
    assert code == 0 and "TP=8" in out, err


def test_tp_on_a_device_that_cannot_run_is_one_line(pair):
    target, _, _ = pair
    code, out, err = run("generate", "--target", target, "--no-speculate", "--prompt-ids", "5", "--tp", "2",
                         "--device", "ascend")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("mindspec: error: --device ascend: no NPU is visible")


def test_a_sampled_generate_under_msrun_takes_its_seed_from_the_shared_base(monkeypatch):
    """Ranks (on every machine) hold the same seed base (rank 0's): a sampled generate without --seed
    draws the same seed on each, so they draw the same uniforms; --seed and greedy runs are left alone."""
    import argparse
    import random
    from mindspec import cli, request
    monkeypatch.setattr(request, "_seeds", None)
    monkeypatch.setenv(request.SEED_ENV, "1234")
    a = argparse.Namespace(seed=None, temperature=0.8)
    assert cli._seed(a) == random.Random(1234).randrange(2 ** 31)
    assert cli._seed(argparse.Namespace(seed=7, temperature=0.8)) == 7
    assert cli._seed(argparse.Namespace(seed=None, temperature=0.0)) is None


def test_serve_and_batch_defaults_draw_no_seed_under_msrun_or_dp(monkeypatch):
    """Sampled requests without a seed draw one each (request.parse), never one for all in the defaults.
    Found: under msrun and in --dp replicas (both set the shared seed base) serve's and batch's defaults
    drew a seed, so every unseeded line sampled with the same one, and a replica's job id (the defaults'
    fingerprint) differed from its launcher's: a sampled `batch --dp 2` refused its own part files."""
    from mindspec import cli, request
    argvs = (["batch", "--input", "in.jsonl", "--output", "out.jsonl", "--temperature", "0.8"],
             ["serve", "--temperature", "0.8"])
    monkeypatch.delenv(request.SEED_ENV, raising=False)
    plain = [cli.batch_defaults(cli.parse(argvs[0])), cli.serve_defaults(cli.parse(argvs[1]))]
    monkeypatch.setattr(request, "_seeds", None)
    monkeypatch.setenv(request.SEED_ENV, "1234")
    assert [cli.batch_defaults(cli.parse(argvs[0])), cli.serve_defaults(cli.parse(argvs[1]))] == plain
    assert plain[0]["seed"] is None and plain[1]["seed"] is None
    a, b = (request.parse({"prompt": "hi"}, plain[0])["seed"] for _ in range(2))
    assert a != b  # each line its own seed


@pytest.mark.parametrize("args,words", [
    (["serve", "--port", "70000"], "--port: must be an integer in 0..65535, got '70000'"),  # hung after a traceback
    (["serve", "--port", "-1"], "--port: must be an integer in 0..65535, got '-1'"),
    (["serve", "--max-queue", "-9"], "--max-queue: must be an integer >= 0, got '-9'"),  # every request 429
    (["serve", "--top-p", "0"], "top_p must be a number in (0, 1], got 0.0"),  # every request a 400
    (["batch", "--input", "i", "--output", "o", "--temperature", "-1"],  # every line an error record
     "temperature must be a number in [0, 100.0], got -1.0"),
    (["batch", "--input", "i", "--output", "o", "--max-new-tokens", "0"], "--max-new-tokens: must be an integer >= 1"),
    # (a target that does not exist: loading it would fail first)
    (["generate", "--target", "nowhere", "--repetition-penalty", "0"],
     "repetition_penalty must be a number in [0.01, 100.0], got 0.0"),
    (["generate", "--target", "nowhere", "--draft-min-conf", "1.5"], "draft_min_conf must be between 0 and 1, got 1.5"),
    (["batch", "--input", "i", "--output", "o", "--presence-penalty", "2.5"],
     "presence_penalty must be a number in [-2, 2], got 2.5"),
    (["generate", "--target", "nowhere", "--seed", str(2 ** 64)], "seed must be an integer in [-2**63, 2**64), got 1844"),
    (["generate", "Hi", "-k", "abc"], "mindspec: error: argument -k: "),  # (the docs prober's: "mindspec generate:")
    (["generate", "Hi", "--max-seq", "-5"],
     "mindspec: error: argument --max-seq: must be an integer >= 1, got '-5' (see mindspec generate --help)"),
    (["batch", "--input", "i", "--output", "o", "--max-batch", "0"], "--max-batch: must be an integer >= 1"),
    # the dp prober's: a directory that exists but takes no files failed after the whole run, its results lost
    (["bench", "--no-hf", "--out", "/proc"], "cannot write in --out /proc: "),
    # the dp prober's: --dp 10**20 was an OverflowError traceback (and 16,000 replicas took 8.5 s to plan)
    (["batch", "--input", "i", "--output", "o", "--dp", "99999999999999999999"],
     "argument --dp: must be an integer in 1..1024, got '99999999999999999999'"),
    (["batch", "--input", "i", "--output", "o", "--dp", "2", "--dp-replica", "5"],  # (wrote o.part5of2)
     "--dp-replica 5 is not a replica of --dp 2"),
    (["serve", "--stop", "x", "--stop", ""], "stop cannot contain an empty string"),
    (["batch", "--input", "i", "--output", "o", "--stop", ""], "stop cannot contain an empty string"),
    (["serve", "--no-speculate", "-k", "2"], "-k 2 sets the draft tokens of a step: it does not apply with --no-spec"),
    # a value like a negative number but not one was read as a flag: "expected one argument"
    (["plan", "--params", "7e9", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--device-mem", "-1GB"],
     "mindspec: error: bad size '-1GB' for --device-mem"),
    (["generate", "Hi", "--max-seq", "-5x"], "argument --max-seq: must be an integer >= 1, got '-5x'"),
    (["batch", "--output", "o"], "the following arguments are required: --input"),
    (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    # the CLI prober's: an empty --draft (a "$DRAFT" never set) ran target-only, -k ignored, exit 0
    (["generate", "Hi", "--draft", "", "-k", "4"], "argument --draft: an empty path"),
    (["serve", "--target", ""], "argument --target: an empty path"),
    (["serve", "--config", ""], "argument --config: an empty path"),
    # the reviewer's: --target without --draft runs target-only, and -k was ignored there too
    (["generate", "Hi", "--target", "t", "-k", "4"],
     "-k 4 sets the draft tokens of a step: --target without --draft runs target-only"),
    (["bench", "--draft", ""], "argument --draft: an empty path"),
    (["plan", "--params", "7e9", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--device-mem", "64GB",
      "--draft", ""], "argument --draft: an empty path"),
    (["convert", "--gguf", "x.gguf", "--out", ""], "argument --out: an empty path"),
    (["export", "--model", "", "--out", "d.onnx"], "argument --model: an empty path"),
    (["batch", "--input", "i", "--output", ""], "argument --output: an empty path"),
    (["no-such-command"], "mindspec: error: argument cmd: invalid choice: 'no-such-command'"),
])
def test_bad_sampling_and_server_flags_are_refused_before_anything_runs(args, words):
    """Refused while parsing the command line: before a model loads, a server starts or a job writes
    (found: they reached each request or line, or, for a port out of range, killed the server's
    listening thread and left it waiting forever)."""
    code, out, err = run(*args)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err  # (found: argparse's ~18 lines of usage first)
    assert words in err, err


def test_a_negative_device_id_is_one_line_not_an_abort():
    """Found: DEVICE_ID=-1 aborted the process inside MindSpore's import (exit 134, a C++ terminate)."""
    for cmd, v in ((["doctor"], "-1"), (["generate", "--target", "nowhere", "Hi"], "-1"), (["doctor"], "4294967296")):
        code, out, err = run(*cmd, env={"DEVICE_ID": v})
        assert code == 2 and err == f'mindspec: error: DEVICE_ID="{v}" is not a device number (an integer >= 0)\n', err


def test_an_unwritable_or_closed_stdout_is_one_line_and_exit_2(tiny_target, tmp_path):
    """Found by a user probe: `generate ... > /dev/full` (streamed or --json), `plan`, `doctor`, `export` ended
    with an OSError traceback (ENOSPC), and with stdout closed (`>&-`) every command did with an AttributeError
    in _exit_code. Now a command whose output cannot be written says so in one line, exit 2; one that writes
    nothing there (batch) runs as usual, its output file whole."""
    target = tiny_target[0]
    gen = ["generate", "--target", target, "--prompt-ids", "5,6,7", "--max-new-tokens", "8"]
    plan = ["plan", "--params", "7B", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--device-mem", "64GB"]
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [5, 6, 7], "max_new_tokens": 3}\n')
    batch = ["batch", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
             "--target", target]
    with open("/dev/full", "w") as full:
        for args in (gen, plan + ["--json"], ["--help"]):
            p = subprocess.run([sys.executable, "-m", "mindspec", *args], stdout=full, stderr=subprocess.PIPE,
                               text=True, timeout=300)
            want = (2, "mindspec: error: cannot write to stdout: No space left on device\n")
            assert (p.returncode, p.stderr) == want, (args, p.returncode, p.stderr[-2000:])
    closed = "mindspec: error: cannot write to stdout: it is closed\n"
    for args, want in ((gen + ["--json"], (2, closed)), (plan, (2, closed)),
                       (batch, (0, "mindspec batch: 1 lines: 1 done"))):
        p = subprocess.run([sys.executable, "-m", "mindspec", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, timeout=300, preexec_fn=lambda: os.close(1))
        assert p.returncode == want[0] and p.stderr.startswith(want[1]) and len(p.stderr.splitlines()) == 1, \
            (args, p.returncode, p.stderr[-2000:])
    (rec,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rec["token_ids"]) == 3
    # stderr closed (`2>&-`, a cron or daemon wrapper's): a batch job ran nothing and exited 1, "0 done, 0 failed"
    # (its progress asked a None stderr whether it was a terminal), and generate printed its text, then exited 1.
    # What would be said there is dropped; the work is done
    batch[batch.index("--output") + 1] = str(tmp_path / "quiet.jsonl")
    for args in (gen + ["--json"], batch):
        p = subprocess.run([sys.executable, "-m", "mindspec", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True, timeout=300, preexec_fn=lambda: os.close(2))
        assert p.returncode == 0, (args, p.returncode, p.stdout[-2000:])
        if args is not batch:
            assert len(json.loads(p.stdout)["token_ids"]) == 8, p.stdout
    (rec,) = [json.loads(line) for line in (tmp_path / "quiet.jsonl").read_text().splitlines()]
    assert len(rec["token_ids"]) == 3


def test_the_penalty_flags_are_the_defaults_of_a_job_and_older_job_ids_stay():
    """--presence-penalty / --frequency-penalty reach a job's defaults (its lines, its id) only when set: a job's
    id holds its defaults, and a job made before the flags existed must resume (the review's)."""
    from mindspec.batch import job_id
    from mindspec.cli import parse, sampling_kwargs
    base = ["batch", "--input", "i", "--output", "o"]
    plain = sampling_kwargs(parse(base))
    assert "presence_penalty" not in plain and "frequency_penalty" not in plain
    assert job_id(plain) == job_id(sampling_kwargs(parse(base + ["--presence-penalty", "0"])))
    kw = sampling_kwargs(parse(base + ["--presence-penalty", "0.5", "--frequency-penalty", "-1"]))
    assert (kw["presence_penalty"], kw["frequency_penalty"]) == (0.5, -1.0) and job_id(kw) != job_id(plain)
    # the draft's temperature and confidence cut change speed, not what a result means (the batch prober's: a
    # greedy job re-run with --draft-min-conf was "another job"), as K: one job, whose id is the one made before (the default flags: d199c986c5ed)
    for speed in (["--draft-temperature", "1.5"], ["--draft-min-conf", "0.5"], ["-k", "2"]):
        assert job_id(sampling_kwargs(parse(base + speed))) == job_id(plain) == "d199c986c5ed", speed
    assert job_id(sampling_kwargs(parse(base + ["--temperature", "0.5"]))) != job_id(plain)


def test_generate_takes_the_prompt_as_prompt_too():
    """A soak prober's: `mindspec generate --prompt "text"` (llama.cpp's and many tools' spelling) was read as an
    abbreviation of --prompt-ids: "argument --prompt-ids: not a comma-separated list of token ids"."""
    from mindspec.cli import parse
    from mindspec.errors import MindspecError
    assert parse(["generate", "--prompt", "Write a story"]).prompt == "Write a story"
    assert parse(["generate", "--prompt-ids", "1,2"]).prompt_ids == [1, 2]
    with pytest.raises(MindspecError, match="give the prompt once: as an argument or with --prompt"):
        parse(["generate", "Hi", "--prompt", "Ho"])
    with pytest.raises(MindspecError, match="give a text prompt or --prompt-ids, not both"):  # (said after the load)
        parse(["generate", "--prompt", "Ho", "--prompt-ids", "1,2"])
