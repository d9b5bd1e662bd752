"""`mindspec bench` as a real subprocess on a tiny pair: valid JSON with the required keys, a PNG
that opens at a sensible size, a readable table; bad input exits 2 with one line."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mindspec.export import export_draft

REQUIRED = {"prompt_set", "mode", "k", "tokens_per_s", "acceptance_rate", "tokens_per_target_call",
            "identical_to_target_only"}


def bench(*args, home):
    p = subprocess.run([sys.executable, "-m", "mindspec", "bench", *args], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, MINDSPEC_HOME=str(home)))
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def pair(tiny_target, tiny_draft_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    draft = str(d / "draft.onnx")
    export_draft(tiny_draft_ckpt[0], draft)
    return tiny_target[0], draft, d


def test_bench_writes_json_png_and_table(pair):
    target, draft, d = pair
    prompts = d / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time", "set": "story"}\n\n'
                       '{"prompt": "How are you?", "chat": true, "set": "chat"}\n'
                       '{"prompt": "def f(x):"}\n')
    out = d / "out"
    code, stdout, err = bench("--target", target, "--draft", draft, "--prompts", str(prompts), "--ks", "1,2",
                              "--max-new-tokens", "6", "--out", str(out), "--no-hf", "--batch-sizes", "1,2",
                              home=d / "home")
    assert code == 0, err
    res = json.loads((out / "bench.json").read_text())
    assert res["complete"] is True and not (out / "bench.partial.json").exists()
    runs = res["runs"]
    assert {r["prompt_set"] for r in runs} == {"story", "chat", "p"}  # "p": rows without a set, by file name
    for r in runs:
        assert REQUIRED <= set(r), r
        assert r["tokens_per_s"] > 0 and r["new_tokens"] > 0
    mine = [r for r in runs if r["mode"] in ("target-only", "fixed-k", "dynamic-k")]
    assert all(r["identical_to_target_only"] for r in mine)  # greedy speculation changes nothing
    for s in ("story", "chat", "p"):
        for B in (1, 2):
            modes = {(r["mode"], r["k"]) for r in runs if r["prompt_set"] == s and r["batch_size"] == B}
            assert modes == {("target-only", 0), ("fixed-k", 1), ("fixed-k", 2), ("dynamic-k", "auto")}
    for r in runs:  # a batch's tokens are all its rows' tokens, over the batch's wall time
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["wall_s"], rel=1e-2)  # wall_s is rounded
        assert r["mean_latency_s"] > 0
    for r in runs:
        if r["mode"] == "fixed-k":
            assert 0 <= r["acceptance_rate"] <= 1 and 1 <= r["tokens_per_target_call"] <= r["k"] + 1
            assert r["k_used"] and sum(r["k_used"].values()) > 0
    assert res["batch_sizes"] == [1, 2] and set(res["costs_vs_decode"]) == {"1", "2"}
    for cost in res["costs_vs_decode"].values():
        assert set(cost["c"]) >= {"1", "2"} and min(cost["c"].values()) > 0 and set(cost["v"]) >= {"0", "1", "2"}
    assert (d / "home" / "costs.json").exists()  # measured once, cached for the next start

    from PIL import Image
    with Image.open(out / "bench.png") as im:
        assert im.format == "PNG" and im.width >= 800 and im.height >= 300, im.size
        px = np.asarray(im.convert("L"), dtype=np.float32)
    assert px.std() > 5 and (px < 128).mean() > 0.005  # drawn on, not a blank canvas
    with Image.open(out / "bench-batch.png") as im:  # tokens/s against the batch size
        assert im.format == "PNG" and np.asarray(im.convert("L"), dtype=np.float32).std() > 5

    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| prompt set | B | mode | K | tokens/s")
    assert len(lines) == 2 + len(runs)


def test_a_bench_stopped_half_way_keeps_the_sets_it_finished(pair):
    """Found: bench.json was written at the very end only: Ctrl-C (or any failure) 19 minutes into the
    README's bench lost every result. Then: a stopped re-run into the same --out replaced the earlier
    run's complete bench.json with its partial one."""
    import signal
    target, draft, d = pair
    prompts = d / "two.jsonl"
    prompts.write_text('{"prompt": "Once", "set": "a"}\n' + '{"prompt": "Twice upon", "set": "b"}\n' * 40)
    out = d / "half"
    out.mkdir()
    (out / "bench.json").write_text('{"complete": true, "runs": "an earlier run"}')
    p = subprocess.Popen([sys.executable, "-m", "mindspec", "bench", "--target", target, "--draft", draft, "--prompts",
                          str(prompts), "--ks", "1,2", "--max-new-tokens", "6", "--out", str(out), "--no-hf",
                          "--batch-sizes", "1,2"], stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, MINDSPEC_HOME=str(d / "home")))  # (the graphs of the test above)
    for line in p.stderr:
        if "a B=2: done" in line:
            p.send_signal(signal.SIGINT)
            break
    err = p.stderr.read()
    assert p.wait(120) == 130, err
    assert f"mindspec bench: stopped; {out}/bench.partial.json holds the 2 finished" in err, err
    assert json.loads((out / "bench.json").read_text())["runs"] == "an earlier run"
    got = json.loads((out / "bench.partial.json").read_text())
    assert got["complete"] is False
    assert {(r["prompt_set"], r["batch_size"]) for r in got["runs"]} == {("a", 1), ("a", 2)}
    assert {r["mode"] for r in got["runs"]} == {"target-only", "fixed-k", "dynamic-k"}


@pytest.mark.parametrize("args, needle", [
    (["--prompts", "poetry"], "unknown prompt set"),
    (["--prompts", "{bad}.jsonl"], "cannot read prompts file"),
    (["--draft", "/nonexistent/d.onnx"], "draft model not found"),  # refused at load: --out was made before
])
def test_bench_bad_input_exits_2_with_one_line(pair, args, needle):
    target, draft, d = pair
    code, _, err = bench("--target", target, "--draft", draft, "--out", str(d / "bad"), *args, home=d / "home")
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (d / "bad").exists()  # found trying it: a bad prompts file (or draft) left an empty --out behind


def test_bench_refuses_before_loading_what_would_fail_after(pair, tmp_path):
    """Found trying it carelessly: --out naming a file failed after the whole benchmark had run (its
    results lost, a traceback); --repeat 0 was a KeyError and --max-new-tokens 0 an error after loading;
    a prompts file that is not UTF-8 a traceback; "chat": "no" read as true, unknown fields ignored."""
    target, draft, d = pair
    (tmp_path / "afile").write_text("x")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    base = ["--target", target, "--draft", draft, "--no-hf", "--prompts", str(prompts)]
    for args, needle in ((["--out", str(tmp_path / "afile")], f"--out {tmp_path / 'afile'} is a file"),
                         (["--out", str(tmp_path / "afile" / "x")], "cannot write"),
                         (["--repeat", "0"], "--repeat: must be an integer >= 1"),
                         (["--max-new-tokens", "0"], "--max-new-tokens: must be an integer >= 1"),
                         (["--batch-sizes", "1,x"], "not a comma-separated list of batch sizes"),
                         # found trying it carelessly: "1,,2" ran as 1,2; a bad HF assistant was a
                         # ValueError traceback after the whole mindspec part (never checked under --no-hf)
                         (["--batch-sizes", "1,,2"], "not a comma-separated list of batch sizes"),
                         (["--ks", "4,"], "not a comma-separated list of K buckets"),
                         (["--hf-assistants", "layers:x"], "unknown HF assistant 'layers:x'"),
                         (["--hf-assistants", "layers:0"], "unknown HF assistant 'layers:0'"),
                         (["--hf-assistants", "medusa"], "unknown HF assistant 'medusa'")):
        code, _, err = bench(*base, "--out", str(tmp_path / "o"), *args, home=d / "home")
        assert code == 2 and needle in err and "Traceback" not in err, err
    assert (tmp_path / "afile").read_text() == "x"
    from mindspec.bench import load_prompts
    from mindspec.errors import MindspecError
    for line, needle in ((b'\xff\xfe{"prompt": "x"}', "line 1 is not UTF-8 text"),
                         (b'{"prompt": "x", "chat": "no"}', '"chat" must be true or false'),
                         (b'{"prompt": "x", "max_new_tokens": 3}', 'unknown field "max_new_tokens"'),
                         (b'{"prompt": "x", "set": 5}', '"set" must be a non-empty string')):
        prompts.write_bytes(line + b"\n")
        with pytest.raises(MindspecError, match=needle) as e:
            load_prompts(str(prompts))
        assert "\n" not in str(e.value) and "p.jsonl" in str(e.value)


def test_bench_runs_in_the_dtype_asked(pair, tmp_path):
    """The float16 user's: bench had no --dtype (float16's speed only from a tool outside the CLI)."""
    target, draft, d = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n')
    base = ["--target", target, "--draft", draft, "--prompts", str(prompts), "--ks", "2", "--max-new-tokens", "5"]
    code, _, err = bench(*base, "--out", str(tmp_path / "o16"), "--dtype", "float16", "--device", "cpu",
                         home=d / "home")
    assert code == 0, err
    res = json.loads((tmp_path / "o16" / "bench.json").read_text())
    assert (res["device"], res["dtype"]) == ("CPU", "float16")
    assert all(r["identical_to_target_only"] for r in res["runs"]) and {r["mode"] for r in res["runs"]} == {
        "target-only", "fixed-k", "dynamic-k"}  # (HF's rows would be float32's: left out, with a note)
    assert any("float32" in n and "hf" in n for n in res["notes"]), res["notes"]
    code, _, err = bench(*base, "--out", str(tmp_path / "obf"), "--dtype", "bfloat16", home=d / "home")
    assert code == 2 and "bfloat16" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "obf").exists()


def test_bench_bad_jsonl_row(pair, tmp_path):
    from mindspec.bench import load_prompts
    from mindspec.errors import MindspecError
    f = tmp_path / "x.jsonl"
    f.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(MindspecError, match=r"x.jsonl:2"):
        load_prompts(str(f))
    assert load_prompts("code,story") == {"code": load_prompts("code")["code"], "story": load_prompts("story")["story"]}


def test_hf_modes_skip_cleanly_without_torch(monkeypatch):
    import builtins

    from mindspec import bench as b
    real = builtins.__import__

    def no_torch(name, *a, **kw):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(name)
        return real(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert b._hf_available() is False


def test_hf_modes_on_the_same_target(pair, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from mindspec.bench import run
    target, draft, d = pair
    monkeypatch.setenv("MINDSPEC_HOME", str(d / "home"))
    f = tmp_path / "one.jsonl"
    f.write_text('{"prompt": "Once upon a time"}\n')
    res = run(target, draft, prompts=str(f), max_new_tokens=5, ks=(1,), hf_assistants=["layers:1", "prompt-lookup"])
    hf = {(r["mode"], r["assistant"]): r for r in res["runs"] if r["mode"].startswith("hf-")}
    assert set(hf) == {("hf-generate", None), ("hf-assisted", "layers:1"), ("hf-assisted", "prompt-lookup")}
    for r in hf.values():  # same fp32 weights, greedy: the same tokens as mindspec's target-only
        assert r["identical_to_target_only"] and r["tokens_per_s"] > 0
    assert 0 <= hf[("hf-assisted", "layers:1")]["acceptance_rate"] <= 1


def _fake_result(complete, sets=("story",)):
    rows = [dict(prompt_set=s, batch_size=1, mode=m, k=k, tokens_per_s=t, speedup=t / 10, acceptance_rate=a,
                 tokens_per_target_call=c, mean_latency_s=0.5, identical_to_target_only=True)
            for s in sets for m, k, t, a, c in (("target-only", 0, 10.0, None, 1.0), ("fixed-k", 1, 12.0, 0.5, 1.5))]
    return {"runs": rows, "complete": complete, "notes": ["a note"], "target": "/m/tiny", "max_new_tokens": 6,
            "ks": [1], "batch_sizes": [1]}


def _bench_in_process(monkeypatch, out, parts=()):
    """cmd_bench with the benchmark itself stood in for: it hands on_part the results of `parts` (sets), then
    returns the whole result."""
    from mindspec import bench as b
    from mindspec.cli import parser

    def run(on_part=None, **kw):
        for sets in parts:
            on_part(_fake_result(False, sets))
        return _fake_result(True, ("story", "chat"))
    monkeypatch.setattr(b, "run", run)
    b.cmd_bench(parser().parse_args(["bench", "--out", str(out), "--no-hf", "--prompts", "story"]))


def test_a_plot_that_cannot_be_written_is_one_line_after_the_table(monkeypatch, tmp_path, capsys):
    """Found by a user probe on a full disk: bench.png's write failed after bench.json was written: an OSError
    traceback, the results table never printed, a 0-byte bench.png left. Now the table first, then one line;
    bench.json kept, no bench.png. (The full disk: bench.png a link to /dev/full.)"""
    from mindspec.bench import table
    from mindspec.errors import MindspecError
    os.symlink("/dev/full", tmp_path / "bench.png")
    with pytest.raises(MindspecError) as e:
        _bench_in_process(monkeypatch, tmp_path)
    assert str(e.value) == f"cannot write {tmp_path / 'bench.png'}: No space left on device (bench.json was written)"
    want = _fake_result(True, ("story", "chat"))
    assert capsys.readouterr() == (table(want) + "\nnote: a note\n", "")
    assert os.listdir(tmp_path) == ["bench.json"] and json.loads((tmp_path / "bench.json").read_text()) == want
    assert not os.path.isfile("/dev/full")


@pytest.mark.parametrize("parts,name", [([("story",)], "bench.partial.json"), ([], "bench.json")])
def test_results_that_cannot_be_saved_are_one_line_after_their_table(monkeypatch, tmp_path, capsys, parts, name):
    """Found by a user probe with 0 bytes free: the first save of the results (a partial one, or bench.json) was an
    OSError traceback, what had run lost. Now the runs so far go to stdout, then one line; no tmp file is left.
    (The full disk: the save's tmp file a link to /dev/full.)"""
    from mindspec.bench import table
    from mindspec.errors import MindspecError
    os.symlink("/dev/full", tmp_path / f"{name}.{os.getpid()}.tmp")
    with pytest.raises(MindspecError) as e:
        _bench_in_process(monkeypatch, tmp_path, parts)
    assert str(e.value) == (f"cannot write {tmp_path / name}: No space left on device (the results so far are on "
                            "stdout)")
    want = _fake_result(not parts, parts[0] if parts else ("story", "chat"))
    assert capsys.readouterr() == (table(want) + "\nnote: a note\n", "")  # (stderr: the one line to come)
    assert os.listdir(tmp_path) == []
