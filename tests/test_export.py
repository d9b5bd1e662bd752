"""ONNX draft export: numerics against the numpy reference, quantized variants, manifest refusals."""
import json
import shutil

import numpy as np
import pytest

from conftest import make_tiny_checkpoint
from mindspec.checkpoint import Checkpoint
from mindspec.errors import MindspecError
from mindspec.export import DraftSession, export_draft, providers, read_manifest
from mindspec.export.runtime import make_session_options
from mindspec.reference import reference_logits

TOL = 1e-4


def _ids(n, vocab, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(0, vocab, n)]


def _ref(model_dir, ids, n_layers=None):
    ck = Checkpoint(model_dir)
    return reference_logits(ck.config, ck.get, ids, n_layers=n_layers)                # [T, V]


@pytest.fixture(scope="module")
def fp32_draft(tiny_target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fp32") / "draft.onnx")
    export_draft(tiny_target[0], path, max_seq=64)
    return path


@pytest.fixture(scope="module")
def q8_draft(tiny_target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("q8") / "draft.onnx")
    export_draft(tiny_target[0], path, quantize="q8", max_seq=64)
    return path


def _feed_pieces(sess, ids, pieces):
    out, i = [], 0
    for n in pieces:
        out.append(sess.forward(ids[i:i + n]))
        i += n
    return np.concatenate(out)                                                         # [T, V]


def test_fp32_matches_reference_in_pieces_and_after_rollback(tiny_target, fp32_draft):
    sess = DraftSession(fp32_draft)
    ids = _ids(9, 320)
    got = _feed_pieces(sess, ids, [5, 1, 3])
    assert got.shape == (9, 320) and sess.pos == 9
    np.testing.assert_allclose(got, _ref(tiny_target[0], ids), atol=TOL, rtol=0)
    # roll back 2 positions and continue differently: stale slots 7, 8 must be ignored and overwritten
    sess.rollback(7)
    new = ids[:7] + _ids(3, 320, seed=5)
    got = sess.forward(new[7:])
    np.testing.assert_allclose(got, _ref(tiny_target[0], new)[7:], atol=TOL, rtol=0)
    assert sess.pos == 10
    sess.reset()
    np.testing.assert_allclose(sess.forward(new[:4]), _ref(tiny_target[0], new[:4]), atol=TOL, rtol=0)


@pytest.mark.parametrize("kw", [dict(tie=True), dict(head_dim=24, kv_heads=1), dict(tie=True, heads=6, kv_heads=3,
                                                                                    head_dim=16, hidden=48)])
def test_other_shapes_match_reference(tmp_path, kw):
    model_dir, _ = make_tiny_checkpoint(tmp_path / "ckpt", seed=3, **kw)
    m = export_draft(model_dir, str(tmp_path / "d.onnx"))
    assert m["max_seq"] == 4096 and m["quantize"] is None
    sess = DraftSession(str(tmp_path / "d.onnx"), max_seq=32)
    ids = _ids(7, 320, seed=1)
    np.testing.assert_allclose(_feed_pieces(sess, ids, [4, 1, 2]), _ref(model_dir, ids), atol=TOL, rtol=0)


def test_layer_truncated_export(tiny_target, tmp_path):
    path = str(tmp_path / "l1.onnx")
    m = export_draft(tiny_target[0], path, layers=1, max_seq=16)
    assert (m["num_layers"], m["source_layers"], m["max_seq"]) == (1, 2, 16)
    ids = _ids(6, 320, seed=2)
    got = _feed_pieces(DraftSession(path), ids, [3, 3])
    np.testing.assert_allclose(got, _ref(tiny_target[0], ids, n_layers=1), atol=TOL, rtol=0)


@pytest.mark.parametrize("mode,min_agree", [("int8", 0.7), ("q8", 0.9), ("q4", 0.5)])
def test_quantized_argmax_agrees(tiny_target, fp32_draft, q8_draft, tmp_path, mode, min_agree):
    path = q8_draft if mode == "q8" else str(tmp_path / f"{mode}.onnx")
    if mode != "q8":
        export_draft(tiny_target[0], path, quantize=mode, max_seq=64)
    assert read_manifest(path)["quantize"] == mode
    ids = _ids(64, 320, seed=7)
    want = DraftSession(fp32_draft).forward(ids).argmax(-1)
    sess = DraftSession(path)
    got = np.concatenate([sess.forward(ids[:60])] + [sess.forward([t]) for t in ids[60:]]).argmax(-1)
    assert (got == want).mean() > min_agree


def test_manifest_contents(tiny_target, fp32_draft):
    m = read_manifest(fp32_draft)
    ck = Checkpoint(tiny_target[0])
    assert m["format"] == "mindspec-draft" and m["version"] == 1
    assert m["source_fingerprint"] == ck.fingerprint()
    assert (m["vocab_size"], m["num_layers"], m["num_key_value_heads"], m["head_dim"], m["hidden_size"]) == \
        (320, 2, 2, 16, 64)
    assert len(m["onnx_sha256"]) == 16


def _refused(path, words):
    with pytest.raises(MindspecError) as e:
        DraftSession(path)
    msg = str(e.value)
    assert "\n" not in msg and words in msg, msg


def test_manifest_refusals(tmp_path, fp32_draft, q8_draft):
    _refused(str(tmp_path / "missing.onnx"), "not found")
    (tmp_path / "text.onnx").write_text("hello, I am not a graph\n")
    _refused(str(tmp_path / "text.onnx"), "not an ONNX file")
    bare = tmp_path / "bare.onnx"
    shutil.copy(fp32_draft, bare)
    _refused(str(bare), "not a mindspec draft (no manifest")
    shutil.copy(q8_draft + ".json", str(bare) + ".json")  # manifest copied from another export
    _refused(str(bare), "was written for another ONNX file")
    m = json.load(open(fp32_draft + ".json"))
    m["onnx_sha256"] = "0" * 16  # edited manifest
    (tmp_path / "bare.onnx.json").write_text(json.dumps(m))
    _refused(str(bare), "was written for another ONNX file")
    (tmp_path / "bare.onnx.json").write_text("{not json")
    _refused(str(bare), "garbled draft manifest")
    (tmp_path / "bare.onnx.json").write_text(json.dumps(dict(m, format="something-else")))
    _refused(str(bare), "not a mindspec-draft version 1 manifest")
    shutil.copy(fp32_draft + ".json", str(tmp_path / "text.onnx.json"))
    _refused(str(tmp_path / "text.onnx"), "not an ONNX file")


def test_max_seq_exceeded(fp32_draft):
    sess = DraftSession(fp32_draft, max_seq=8)
    sess.forward([1, 2, 3, 4, 5, 6])
    with pytest.raises(MindspecError, match="exceed max_seq 8"):
        sess.forward([7, 8, 9])
    assert sess.pos == 6
    assert sess.forward([7, 8]).shape == (2, 320)
    with pytest.raises(MindspecError, match="max_seq"):
        DraftSession(fp32_draft, max_seq=65)  # longer than the exported max_seq
    with pytest.raises(ValueError):
        sess.rollback(9)


def test_export_validation(tiny_target, tmp_path):
    for kw, words in [(dict(quantize="fp16"), "--quantize"), (dict(layers=0), "--layers"),
                      (dict(layers=3), "--layers"), (dict(max_seq=0), "--max-seq")]:
        with pytest.raises(MindspecError, match=words):
            export_draft(tiny_target[0], str(tmp_path / "x.onnx"), **kw)
    with pytest.raises(MindspecError, match="not found"):
        export_draft(str(tmp_path / "nope"), str(tmp_path / "x.onnx"))


def test_providers_and_options(monkeypatch):
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        monkeypatch.delenv(var, raising=False)
    import os
    if not os.path.isdir("/usr/local/Ascend"):
        assert providers() == ["CPUExecutionProvider"]
    monkeypatch.setenv("ASCEND_HOME_PATH", "/opt/ascend")
    import onnxruntime as ort
    if "CANNExecutionProvider" in ort.get_available_providers():
        p = providers(3)
        assert p[0][0] == "CANNExecutionProvider" and p[0][1]["device_id"] == 3 and p[1] == "CPUExecutionProvider"
    assert providers("cpu") == ["CPUExecutionProvider"]
    so = make_session_options(2)
    assert so.intra_op_num_threads == 2
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert so.get_session_config_entry("session.inter_op.allow_spinning") == "0"


@pytest.mark.parametrize("mode", [None, "q8", "int8"])
def test_external_data_export(tiny_target, tmp_path, monkeypatch, mode):
    """Protos over protobuf's 2 GB go to `<file>.data`; simulated by lowering the limit."""
    from mindspec.export import builder
    monkeypatch.setattr(builder, "_PROTO_LIMIT", 10_000)
    path = str(tmp_path / "big.onnx")
    export_draft(tiny_target[0], path, quantize=mode, max_seq=16)
    assert (tmp_path / "big.onnx.data").exists() and sorted(p.name for p in tmp_path.iterdir()) == \
        ["big.onnx", "big.onnx.data", "big.onnx.json"]
    ids = _ids(5, 320, seed=4)
    got = DraftSession(path).forward(ids)
    if mode is None:
        np.testing.assert_allclose(got, _ref(tiny_target[0], ids), atol=TOL, rtol=0)
