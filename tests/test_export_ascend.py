"""The ascend export profile (CANN graph mode), run here on the CPU provider through the same IOBinding
path: every node on the op list kept in export/cann_ops.py, numerics against the numpy reference
through prefill, steps, rollback and move, only bucketed static shapes, the cache never on the host."""
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

import mindspec
from mindspec.checkpoint import Checkpoint
from mindspec.errors import MindspecError
from mindspec.export import DraftSession, export_draft, providers, read_manifest
from mindspec.export.builder import ASCEND_OPSET, build_row_copy
from mindspec.export.cann_ops import GRAPH_OPS, problems
from mindspec.export.runtime import T_BUCKETS, batch_buckets
from mindspec.reference import reference_logits

from conftest import LLAMA3_ROPE, make_tiny_checkpoint

ROWS, SEQ = 3, 64


def _ids(n, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(0, 320, n)]


def _close(got, ids, model_dir):
    """Logits after the last of `ids` within float16's reach of the float32 reference."""
    ck = Checkpoint(model_dir)
    want = reference_logits(ck.config, ck.get, ids)[-1]                               # [V]
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)


@pytest.fixture(scope="module")
def ascend_draft(tiny_target, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ascend") / "draft.onnx")
    export_draft(tiny_target[0], path, max_seq=SEQ, profile="ascend")
    return path


def test_every_node_is_on_the_cann_list(tiny_target, ascend_draft, tmp_path):
    model = onnx.load(ascend_draft)
    assert {n.op_type for n in model.graph.node} <= GRAPH_OPS and {n.domain for n in model.graph.node} == {""}
    assert [o.version for o in model.opset_import] == [ASCEND_OPSET]
    assert problems(model) == []
    assert problems(build_row_copy(4, (ROWS, 2, SEQ, 16))) == []  # move's graph runs on CANN too
    cpu = str(tmp_path / "cpu.onnx")
    export_draft(tiny_target[0], cpu, max_seq=SEQ, dtype="float16")
    found = problems(onnx.load(cpu))  # the default profile is not claimed to be CANN-ready
    assert any("opsets 8-16, the model is opset 17" in p for p in found), found


def _one_node(op, dtype, **inits):
    """A one-node opset-13 model: op(x [2, 2], x or the named initializers)."""
    from onnx import helper, numpy_helper
    vi = lambda n: helper.make_tensor_value_info(n, dtype, None)  # noqa: E731
    node = helper.make_node(op, ["x"] + (list(inits) or ["x"]), ["y"])
    graph = helper.make_graph([node], "g", [vi("x")], [vi("y")],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_checker_flags_types_and_restricted_ops():
    from onnx import TensorProto
    assert problems(_one_node("MatMul", TensorProto.FLOAT16)) == []
    assert "input types FLOAT (CANN takes FLOAT16)" in problems(_one_node("MatMul", TensorProto.FLOAT))[0]
    found = problems(_one_node("Tile", TensorProto.FLOAT, repeats=np.array([1, 2], np.int64)))
    assert len(found) == 1 and "Atlas inference products only" in found[0], found


def test_profile_in_manifest_and_refusals(tiny_target, ascend_draft, tmp_path):
    m = read_manifest(ascend_draft)
    assert (m["profile"], m["dtype"], m["quantize"]) == ("ascend", "float16", None)
    from mindspec.plan import shape_from_draft
    d = shape_from_draft(ascend_draft)
    assert (d.kv_dtype_bytes, d.kv_copies) == (2, 2)  # float16, double-buffered on the device
    assert export_draft(tiny_target[0], str(tmp_path / "c.onnx"), max_seq=SEQ)["profile"] == "cpu"
    for kw, words in [(dict(quantize="q8"), "quantize q8 does not go with profile ascend"),
                      (dict(dtype="float32"), "profile ascend is float16"),
                      (dict(profile="gpu"), "profile must be one of cpu, ascend, got \"gpu\"")]:
        with pytest.raises(MindspecError, match=words):
            export_draft(tiny_target[0], str(tmp_path / "x.onnx"), **dict(dict(profile="ascend"), **kw))
    bad = dict(json.load(open(ascend_draft + ".json")), profile="tpu")
    (tmp_path / "b.onnx").write_bytes(open(ascend_draft, "rb").read())
    (tmp_path / "b.onnx.json").write_text(json.dumps(bad))
    with pytest.raises(MindspecError, match="bad or missing .*profile"):
        read_manifest(str(tmp_path / "b.onnx"))
    (tmp_path / "b.onnx.json").write_text(json.dumps(dict(bad, profile="ascend", max_seq=m["max_seq"] + 1)))
    with pytest.raises(MindspecError, match=f"max_seq {m['max_seq'] + 1}, its graph's position tables hold "
                                            f"{m['max_seq']}; re-export"):
        DraftSession(str(tmp_path / "b.onnx"))
    graph = providers("Ascend", graph=True)[0][1]
    assert graph["enable_cann_graph"] is True and graph["dump_om_model"] is False
    assert providers("Ascend")[0][1]["enable_cann_graph"] is False  # the cpu profile keeps kernel mode


def test_cli_profile_and_quantize_refused(tiny_target, tmp_path):
    def run(*flags):
        return subprocess.run([sys.executable, "-m", "mindspec", "export", "--model", tiny_target[0],
                               "--out", str(tmp_path / "d.onnx"), "--max-seq", "16", *flags],
                              capture_output=True, text=True)
    p = run("--profile", "ascend", "--quantize", "q8")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "quantize q8 does not go with profile ascend" in p.stderr and not os.path.exists(tmp_path / "d.onnx")
    p = run("--profile", "ascend")
    assert p.returncode == 0 and "float16" in p.stdout and "profile ascend" in p.stdout, p.stderr
    assert read_manifest(str(tmp_path / "d.onnx"))["profile"] == "ascend"


def test_matches_reference_through_steps_rollback_and_move(tiny_target, ascend_draft, monkeypatch):
    import onnxruntime as ort

    def no_cann_branch(*a, **kw):  # (a review's: onnxruntime's binding allocates and updates on CPU and GPU only)
        raise AssertionError("onnxruntime cannot do this on CANN")
    for name in ("ortvalue_from_shape_and_type", "update_inplace"):
        monkeypatch.setattr(ort.OrtValue, name, no_cann_branch)
    sess = DraftSession(ascend_draft, max_batch=ROWS)
    bufs = sess.device_kv.bufs[0] + sess.device_kv.bufs[1]
    assert len({b.data_ptr() for b in bufs}) == len(bufs)  # (one array each: none shares another's memory)
    sess.session.run = None  # the plain run (host feeds) is never used: only run_with_iobinding
    assert sess.keys is None and sess.device_kv.bufs[0][0].device_name() == "cpu"
    a, b = _ids(40, 1), _ids(30, 2)
    _close(sess.forward([a[:35]], start=1)[0], a[:35], tiny_target[0])                # two chunks: 32 + 3
    got = sess.forward([b[:5], a[35:36]])                                               # rows 0 and 1 together
    _close(got[0], b[:5], tiny_target[0])
    _close(got[1], a[:36], tiny_target[0])
    for t in range(36, 39):                                                             # single-token steps
        _close(sess.forward([[], a[t:t + 1]])[1], a[:t + 1], tiny_target[0])
    sess.rollback(1, 37)  # forget a[37:39]; the stale slots are overwritten by other tokens
    other = a[:37] + b[20:22]
    _close(sess.forward([[], other[37:39]])[1], other, tiny_target[0])
    assert sess.pos.tolist() == [5, 39, 0]
    sess.move(1, 2)  # row 1 leaves: ... rows move down on the device
    sess.reset(1)
    assert sess.pos.tolist() == [5, 0, 39]
    got = sess.forward([b[5:6], [], b[:1]])
    _close(got[0], b[:6], tiny_target[0])
    _close(got[2], other + b[:1], tiny_target[0])
    allowed = {(B, T, SEQ) for B in batch_buckets(ROWS) for T in T_BUCKETS}
    assert set(sess.device_kv.seen) <= allowed  # rows 0..1 ran as bucket 2, rows 0..2 as 3; T is 1 or 32
    assert set(sess.device_kv.seen) == {(2, 32, SEQ), (2, 1, SEQ), (3, 1, SEQ)}, sess.device_kv.seen


def test_pipeline_greedy_equals_target_only(tiny_target, tiny_draft_ckpt, tmp_path):
    draft = str(tmp_path / "noisy-ascend.onnx")
    export_draft(tiny_draft_ckpt[0], draft, max_seq=128, profile="ascend")
    pipe = mindspec.load(target=tiny_target[0], draft=draft, k=2, max_seq=64)
    assert pipe.proposer.session.device_kv is not None
    drafted = accepted = 0
    for ids in ([5, 6, 7], _ids(20, 3), _ids(9, 4)):
        base = pipe.generate(prompt_ids=ids, max_new_tokens=12, speculate=False)
        spec = pipe.generate(prompt_ids=ids, max_new_tokens=12)
        assert spec.token_ids == base.token_ids, ids
        drafted, accepted = drafted + spec.stats["drafted"], accepted + spec.stats["accepted"]
    assert 0 < accepted < drafted  # rollbacks happened: the comparison has teeth


def test_llama3_rope_scaling_matches_reference(tmp_path):
    d, _ = make_tiny_checkpoint(tmp_path / "l3", seed=4, extra=LLAMA3_ROPE)
    path = str(tmp_path / "d.onnx")
    export_draft(d, path, max_seq=SEQ, profile="ascend")
    ids = _ids(40, 3)
    _close(DraftSession(path).forward([ids])[0], ids, d)


def test_the_default_pair_on_ascend_exports_the_ascend_profile(tiny_target, tmp_path, monkeypatch):
    """An Ascend review's: the default pair's draft was the 8-bit cpu profile on every device, which CANN runs
    mostly on the host. On Ascend it is the ascend profile's, beside the 8-bit one (NPUs faked: none here)."""
    import shutil
    from mindspec import default, device
    home = tmp_path / "model"
    shutil.copytree(tiny_target[0], home)
    monkeypatch.setattr(default, "default_target", lambda: str(home))
    monkeypatch.setattr(device, "detect_device", lambda asked=None, probe=None: "Ascend")
    target, draft = default.default_pair()
    assert (target, draft) == (str(home), str(home / "draft-ascend.onnx"))
    assert read_manifest(draft)["profile"] == "ascend" and read_manifest(draft)["quantize"] is None
    monkeypatch.setattr(device, "detect_device", lambda asked=None, probe=None: "CPU")
    assert default.default_pair()[1] == str(home / "draft-q8.onnx")
