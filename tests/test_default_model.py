"""The embedded default pair (SmolLM2-135M-Instruct and its q8 self-draft), end to end."""
import pytest

import mindspec


@pytest.fixture(scope="module")
def pipe():
    return mindspec.load(k=4, max_seq=256)  # converts/exports on first use (tools/setup.sh does it once)


def test_default_pair_answers_and_speculation_is_exact(pipe):
    q = "What is the capital of France?"
    base = pipe.generate(prompt=q, chat=True, max_new_tokens=24, speculate=False)
    spec = pipe.generate(prompt=q, chat=True, max_new_tokens=24)
    assert "Paris" in base.text
    assert spec.token_ids == base.token_ids and spec.text == base.text
    assert base.finish_reason == "stop" and base.token_ids[-1] == 2  # <|im_end|>
    assert spec.stats["target_calls"] < base.stats["target_calls"]
    # the q8 self-draft agrees with its target ~93-97% of the time: judged over more than one short answer
    story = pipe.generate(prompt="Once upon a time, in a small village by the sea,", max_new_tokens=64)
    assert story.stats["acceptance_rate"] > 0.7


def test_default_tokenizer_and_manifest(pipe):
    tok = pipe.tokenizer
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert pipe.manifest["quantize"] == "q8" and pipe.manifest["vocab_size"] == 49152


def test_default_draft_runs_batched():
    """The default q8 draft, three prompts of different lengths in one batch: each row's next
    token is the fp32 numpy reference's, and its logits are exactly what the row gets alone (a
    seeded request's draws must not depend on its batch)."""
    import numpy as np
    from mindspec.checkpoint import Checkpoint
    from mindspec.default import default_pair
    from mindspec.export import DraftSession
    from mindspec.reference import reference_logits
    from mindspec.tokenizer import Tokenizer
    target, draft = default_pair()
    tok, ck = Tokenizer(target), Checkpoint(target)
    prompts = [tok.encode(p) for p in ("The capital of France is", "One, two, three, four,",
                                       "def add(a, b):\n    return")]
    sess = DraftSession(draft, max_seq=64, max_batch=3)
    got = sess.forward(prompts)                                                         # [3, V]
    for r, ids in enumerate(prompts):
        want = reference_logits(ck.config, ck.get, ids)[-1]
        assert got[r].argmax() == want.argmax(), (r, tok.decode([int(got[r].argmax())]))
        alone = DraftSession(draft, max_seq=64, max_batch=3)  # alone in a session that batches
        np.testing.assert_array_equal(got[r], alone.forward([ids])[0])  # the same calls: bit for bit
    assert sess.pos.tolist() == [len(p) for p in prompts]


def test_a_sampled_rows_draft_calls_are_the_same_in_a_one_row_session_and_in_a_batch():
    """Found trying the library: a seeded sampled request gave one text from pipe.generate on a fresh
    pipeline (a one-row draft session: a row's tokens in one call) and another after generate_many had
    grown the engine (a session of more rows split them; q8's int8 activations make the two differ by
    ~0.6 in a logit). A row run `alone` gets a one-row session's logits bit for bit, beside any rows."""
    import numpy as np
    from mindspec.default import default_pair
    from mindspec.export import DraftSession
    from mindspec.tokenizer import Tokenizer
    target, draft = default_pair()
    tok = Tokenizer(target)
    ids, other = tok.encode("The capital of France is"), tok.encode("One, two, three, four,")
    one, three = DraftSession(draft, max_seq=64, max_batch=1), DraftSession(draft, max_seq=64, max_batch=3)
    for step in (ids, ids[:2], ids[2:3]):  # a prompt, two tokens (all drafts accepted), one token
        want = one.forward([step])[0]
        got = three.forward([step, other[:1], other[:2]], alone=[0])
        np.testing.assert_array_equal(got[0], want)
        other = other[2:]
    split = DraftSession(draft, max_seq=64, max_batch=3).forward([ids, ids[:1]])[0]  # not alone: split
    joint = DraftSession(draft, max_seq=64, max_batch=1).forward([ids])[0]
    assert np.abs(split - joint).max() > 1e-3  # what `alone` is for (q8: ~0.6, 0.008 on an AVX2-only CPU)


def test_default_pair_reexports_an_old_draft(tmp_path, monkeypatch):
    """A draft left by an older mindspec (format 1), or one without a readable manifest, is
    exported again; a current one is kept."""
    import json
    import mindspec.export
    from mindspec.default import DEFAULT_NAME, default_pair
    from mindspec.export.manifest import VERSION
    monkeypatch.setenv("MINDSPEC_HOME", str(tmp_path))
    target = tmp_path / "models" / DEFAULT_NAME
    target.mkdir(parents=True)
    (target / "tokenizer_config.json").write_text("{}")  # the target counts as converted
    calls = []

    def fake_export(model_dir, out_path, quantize=None):
        calls.append(out_path)
        with open(out_path + ".json", "w") as f:
            json.dump({"format": "mindspec-draft", "version": VERSION}, f)
    monkeypatch.setattr(mindspec.export, "export_draft", fake_export)
    manifest = target / "draft-q8.onnx.json"
    for text, exported in [(None, True), (json.dumps({"version": 1}), True), ("{garbled", True), (None, False)]:
        if text is not None:
            manifest.write_text(text)
        calls.clear()
        assert default_pair() == (str(target), str(target / "draft-q8.onnx"))
        assert calls == ([str(target / "draft-q8.onnx")] if exported else [])


def test_the_set_up_step_making_the_default_pair_fails_in_one_line(tmp_path, monkeypatch, capsys):
    """tools/setup.sh makes the default pair with mindspec.default.main: a failure (here MINDSPEC_HOME is a
    file) is one line and exit 2 (it was a traceback from the script's `python -c`)."""
    from mindspec.default import main
    (tmp_path / "home").write_text("")
    monkeypatch.setenv("MINDSPEC_HOME", str(tmp_path / "home"))
    assert main() == 2
    assert capsys.readouterr().err.splitlines() == [
        f"mindspec: error: MINDSPEC_HOME {tmp_path / 'home'} cannot be a directory: File exists"]
    assert "main()" in open("tools/setup.sh").read()
