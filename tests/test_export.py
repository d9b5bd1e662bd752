"""ONNX draft export (format 2: batched rows, static cache): numerics against the numpy reference,
quantized variants, manifest refusals."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import LLAMA3_ROPE, make_tiny_checkpoint
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


def _feed_pieces(sess, ids, pieces, row=0):
    """Feed ids to one row in pieces; logits after each piece [len(pieces), V]."""
    out, i = [], 0
    for n in pieces:
        out.append(sess.forward([ids[i:i + n]], start=row)[0])
        i += n
    return np.stack(out)                                                               # [pieces, V]


def _ends(pieces):
    return np.cumsum(pieces) - 1  # the position whose logits each piece returns


def test_fp32_matches_reference_in_pieces_and_after_rollback(tiny_target, fp32_draft):
    sess = DraftSession(fp32_draft)
    ids = _ids(9, 320)
    ref = _ref(tiny_target[0], ids)
    pieces = [5, 1, 1, 2]
    got = _feed_pieces(sess, ids, pieces)
    assert got.shape == (4, 320) and sess.pos.tolist() == [9]
    np.testing.assert_allclose(got, ref[_ends(pieces)], atol=TOL, rtol=0)
    # roll back 2 positions and continue differently: stale slots 7, 8 must be ignored and overwritten
    sess.rollback(0, 7)
    new = ids[:7] + _ids(3, 320, seed=5)
    ref = _ref(tiny_target[0], new)
    np.testing.assert_allclose(_feed_pieces(sess, new[7:], [1, 2]), ref[[7, 9]], atol=TOL, rtol=0)
    assert sess.pos.tolist() == [10]
    sess.reset()
    np.testing.assert_allclose(sess.forward([new[:4]])[0], ref[3], atol=TOL, rtol=0)


@pytest.mark.parametrize("kw", [dict(tie=True), dict(head_dim=32, kv_heads=1), dict(tie=True, heads=6, kv_heads=3,
                                                                                    head_dim=16, hidden=48),
                                dict(extra=LLAMA3_ROPE)])  # (the reference's own RoPE: test_target checks it)
def test_other_shapes_match_reference(tmp_path, kw):
    model_dir, _ = make_tiny_checkpoint(tmp_path / "ckpt", seed=3, **kw)
    m = export_draft(model_dir, str(tmp_path / "d.onnx"))
    assert m["max_seq"] == 4096 and m["quantize"] is None
    sess = DraftSession(str(tmp_path / "d.onnx"), max_seq=32, max_batch=2)
    ids, pieces = _ids(7, 320, seed=1), [4, 1, 2]
    want = _ref(model_dir, ids)[_ends(pieces)]
    np.testing.assert_allclose(_feed_pieces(sess, ids, pieces, row=1), want, atol=TOL, rtol=0)
    assert sess.pos.tolist() == [0, 7]


def test_layer_truncated_export(tiny_target, tmp_path):
    path = str(tmp_path / "l1.onnx")
    m = export_draft(tiny_target[0], path, layers=1, max_seq=16)
    assert (m["num_layers"], m["source_layers"], m["max_seq"]) == (1, 2, 16)
    ids = _ids(6, 320, seed=2)
    got = _feed_pieces(DraftSession(path), ids, [3, 3])
    np.testing.assert_allclose(got, _ref(tiny_target[0], ids, n_layers=1)[[2, 5]], atol=TOL, rtol=0)


def test_graph_interface(fp32_draft):
    """The format-3 contract: names, symbolic B/T/S, the cache read only by GroupQueryAttention, which
    writes it in place (present_* have the past's shape: the runtime binds them to the same memory)."""
    import onnx
    model = onnx.load(fp32_draft)
    dims = lambda vi: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]  # noqa: E731
    ins, outs = {i.name: dims(i) for i in model.graph.input}, {o.name: dims(o) for o in model.graph.output}
    assert ins["input_ids"] == ["B", "T"] and ins["positions"] == ins["last"] == ["B"]
    assert ins["past_key_1"] == ins["past_value_0"] == outs["present_key_1"] == outs["present_value_0"] == ["B", 2, "S", 16]
    assert outs["logits"] == ["B", 320]
    assert len(ins) == 3 + 4 and len(outs) == 1 + 4
    assert {n.domain for n in model.graph.node} <= {"", "com.microsoft"}
    readers = {n.op_type for n in model.graph.node for x in n.input if x.startswith("past_")}
    assert readers == {"GroupQueryAttention"}


def test_cpu_profile_needs_head_dim_multiple_of_16(tmp_path):
    model_dir, _ = make_tiny_checkpoint(tmp_path / "ckpt", head_dim=24, kv_heads=1)
    with pytest.raises(MindspecError, match="multiple of 16.*is 24: export it with profile ascend"):
        export_draft(model_dir, str(tmp_path / "d.onnx"))
    assert not os.path.exists(tmp_path / "d.onnx.json")


def test_quantization_leaves_attention_alone(q8_draft):
    """q8 swaps the weight MatMuls (4 per layer + the head) for MatMulNBits and nothing else."""
    import onnx
    nodes = onnx.load(q8_draft).graph.node
    ms = {(n.domain, n.op_type) for n in nodes if n.domain}
    assert ms == {("com.microsoft", "MatMulNBits"), ("com.microsoft", "GroupQueryAttention")}
    assert sum(n.op_type == "MatMulNBits" for n in nodes) == 4 * 2 + 1
    readers = {n.op_type for n in nodes for x in n.input if x.startswith("past_")}
    assert readers == {"GroupQueryAttention"}


def _prefilled(path, prefixes, rows=None, **kw):
    """A session (of `rows` rows, default one per prefix) whose row r holds prefixes[r] (fed row by row)."""
    sess = DraftSession(path, max_batch=rows or len(prefixes), **kw)
    for r, p in enumerate(prefixes):
        if p:
            sess.forward([p], start=r)
    return sess


def _histories(n_rows, length=16):
    return [_ids(length, 320, seed=10 + r) for r in range(n_rows)]


def test_batch_rows_match_alone_and_reference(tiny_target, fp32_draft):
    """Rows at different positions, with different numbers of new tokens and an empty row (rows with
    several new tokens run in calls of one row first, then every row's last token in one call)."""
    seqs = _histories(6)
    cached, new = [5, 2, 3, 0, 4, 9], [3, 1, 0, 6, 2, 1]
    sess = _prefilled(fp32_draft, [s[:c] for s, c in zip(seqs, cached)])
    got = sess.forward([s[c:c + n] for s, c, n in zip(seqs, cached, new)])
    assert got.shape == (6, 320) and got.dtype == np.float32
    assert sess.pos.tolist() == [8, 3, 3, 6, 6, 10]
    for r, (s, c, n) in enumerate(zip(seqs, cached, new)):
        if not n:
            continue
        alone = DraftSession(fp32_draft)
        if c:
            alone.forward([s[:c]])
        want = alone.forward([s[c:c + n]])[0]
        np.testing.assert_allclose(got[r], want, atol=TOL, rtol=0)
        np.testing.assert_allclose(got[r], _ref(tiny_target[0], s[:c + n])[-1], atol=TOL, rtol=0)
        for i in range(2):  # the cache holds exactly what the lone row cached
            np.testing.assert_allclose(sess.keys[i][r, :, :c + n], alone.keys[i][0, :, :c + n], atol=1e-5, rtol=0)
            np.testing.assert_allclose(sess.values[i][r, :, :c + n], alone.values[i][0, :, :c + n], atol=1e-5,
                                       rtol=0)
    # a sub-batch by `start`: rows 1..2 only, row 1 sits out
    got = sess.forward([[], seqs[2][3:5]], start=1)
    assert got.shape == (2, 320) and sess.pos.tolist() == [8, 3, 5, 6, 6, 10]
    np.testing.assert_allclose(got[1], _ref(tiny_target[0], seqs[2][:5])[-1], atol=TOL, rtol=0)


def test_rollback_one_row_leaves_the_others(tiny_target, fp32_draft):
    seqs = _histories(3)
    sess = _prefilled(fp32_draft, [s[:6] for s in seqs])
    twin = _prefilled(fp32_draft, [s[:6] for s in seqs])
    sess.rollback(1, 2)
    assert sess.pos.tolist() == [6, 2, 6]
    other = _ids(3, 320, seed=99)
    got = sess.forward([seqs[0][6:7], other, seqs[2][6:8]])
    want = twin.forward([seqs[0][6:7], [], seqs[2][6:8]])
    np.testing.assert_allclose(got[[0, 2]], want[[0, 2]], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[1], _ref(tiny_target[0], seqs[1][:2] + other)[-1], atol=TOL, rtol=0)
    assert sess.pos.tolist() == [7, 5, 8]
    for bad in [(1, 6), (1, -1), (3, 0)]:
        with pytest.raises(ValueError):
            sess.rollback(*bad)
    sess.reset(1)
    assert sess.pos.tolist() == [7, 0, 8]
    sess.reset()
    assert sess.pos.tolist() == [0, 0, 0]


def test_garbage_beyond_positions_is_masked(fp32_draft):
    """Stale K/V past pos[r] (rollbacks, rows that left) must not change anything."""
    seqs = _histories(3)
    prefixes, step = [seqs[0][:4], seqs[1][:7], []], [seqs[0][4:6], seqs[1][7:8], seqs[2][:3]]
    clean = _prefilled(fp32_draft, prefixes)
    dirty = _prefilled(fp32_draft, prefixes)
    rng = np.random.default_rng(0)
    for buf in dirty.keys + dirty.values:
        for r, p in enumerate(dirty.pos):
            buf[r, :, p:] = 1e4 * rng.standard_normal(buf[r, :, p:].shape)
    np.testing.assert_array_equal(dirty.forward(step), clean.forward(step))


def test_move(tiny_target, fp32_draft):
    seqs = _histories(3)
    sess = _prefilled(fp32_draft, [seqs[0][:3], seqs[1][:8], seqs[2][:5]])
    sess.move(2, 1)  # row 1 leaves, row 2 moves down
    assert sess.pos.tolist() == [3, 5, 5]
    for i in range(2):
        np.testing.assert_array_equal(sess.keys[i][1, :, :5], sess.keys[i][2, :, :5])
        np.testing.assert_array_equal(sess.values[i][1, :, :5], sess.values[i][2, :, :5])
    sess.reset(2)
    got = sess.forward([seqs[0][3:4], seqs[2][5:7]])
    np.testing.assert_allclose(got[0], _ref(tiny_target[0], seqs[0][:4])[-1], atol=TOL, rtol=0)
    np.testing.assert_allclose(got[1], _ref(tiny_target[0], seqs[2][:7])[-1], atol=TOL, rtol=0)
    sess.move(0, 0)
    assert sess.pos.tolist() == [4, 7, 0]
    with pytest.raises(ValueError):
        sess.move(0, 3)


def test_swap_and_long_calls(tiny_target, tmp_path):
    """swap exchanges two rows, positions and K/V; a row fed more than MAX_T tokens at once runs in
    pieces; each row's logits stay the reference's."""
    from mindspec.export.runtime import MAX_T
    path = str(tmp_path / "long.onnx")
    export_draft(tiny_target[0], path, max_seq=3 * MAX_T)
    long, short = _ids(MAX_T + 40, 320, seed=5), _ids(20, 320, seed=6)
    sess = _prefilled(path, [short[:6], long[:MAX_T + 20]])
    sess.swap(0, 1)
    assert sess.pos.tolist() == [MAX_T + 20, 6]
    got = sess.forward([long[MAX_T + 20:MAX_T + 21], short[6:8]])
    np.testing.assert_allclose(got[0], _ref(tiny_target[0], long[:MAX_T + 21])[-1], atol=TOL, rtol=0)
    np.testing.assert_allclose(got[1], _ref(tiny_target[0], short[:8])[-1], atol=TOL, rtol=0)
    sess.swap(0, 1)
    sess.rollback(1, 30)  # what a row keeps after a swap is its sequence's first positions
    got = sess.forward([short[8:9], long[30:31]])
    np.testing.assert_allclose(got[0], _ref(tiny_target[0], short[:9])[-1], atol=TOL, rtol=0)
    np.testing.assert_allclose(got[1], _ref(tiny_target[0], long[:31])[-1], atol=TOL, rtol=0)


def test_several_tokens_split_only_where_rows_can_batch(fp32_draft):
    """A row's several tokens run as all-but-the-last, then the last (the same calls alone and in any
    batch); a one-row session, which never batches, runs them in one call."""
    calls = {}
    for rows in (1, 2):
        sess = DraftSession(fp32_draft, max_batch=rows)
        run, calls[rows] = sess.session.run_with_iobinding, []
        sess.session.run_with_iobinding = lambda io, run=run, log=calls[rows]: log.append(1) or run(io)
        sess.forward([[1, 2, 3]])
    assert (len(calls[1]), len(calls[2])) == (1, 2)


def test_feed_caches_rows_without_logits(tiny_target, fp32_draft):
    """feed caches prompt tokens per row, each row in calls of its own: the cache bit for bit what the
    row caches alone, the next logits the reference's."""
    seqs = _histories(3, length=24)
    sess = DraftSession(fp32_draft, max_batch=3)
    sess.feed({0: seqs[0][:5], 1: [], 2: seqs[2][:20]})
    assert sess.pos.tolist() == [5, 0, 20]
    alone = DraftSession(fp32_draft, max_batch=3)
    alone.feed({0: seqs[2][:20]})
    for i in range(2):
        np.testing.assert_array_equal(sess.keys[i][2, :, :20], alone.keys[i][0, :, :20])
    got = sess.forward([seqs[0][5:6], [], seqs[2][20:21]])
    np.testing.assert_allclose(got[0], _ref(tiny_target[0], seqs[0][:6])[-1], atol=TOL, rtol=0)
    np.testing.assert_allclose(got[2], _ref(tiny_target[0], seqs[2][:21])[-1], atol=TOL, rtol=0)


def test_rows_one_token_behind_and_a_full_row(tiny_target, tmp_path):
    """Several rows one token behind (all their drafts accepted) and a row at max_seq sitting out of
    the call (it gets a padding token past its positions): every fed row exact, the full row's cache
    untouched."""
    path = str(tmp_path / "d.onnx")
    export_draft(tiny_target[0], path, max_seq=16)
    seqs = _histories(4)
    sess = _prefilled(path, [seqs[0][:5], seqs[1][:16], seqs[2][:3], seqs[3][:7]])
    full = [k[1].copy() for k in sess.keys]
    got = sess.forward([seqs[0][5:7], [], seqs[2][3:4], seqs[3][7:9]])
    assert sess.pos.tolist() == [7, 16, 4, 9]
    for r, n in ((0, 7), (2, 4), (3, 9)):
        np.testing.assert_allclose(got[r], _ref(tiny_target[0], seqs[r][:n])[-1], atol=TOL, rtol=0)
    for k, was in zip(sess.keys, full):
        np.testing.assert_array_equal(k[1, :, :16], was[:, :16])


def test_forward_refusals(fp32_draft):
    sess = _prefilled(fp32_draft, [[1, 2], [3]])
    for tokens, start in [([[], []], 0), ([[1], [2]], 1), ([], 0), ([[1]], -1)]:
        with pytest.raises(ValueError):
            sess.forward(tokens, start=start)
    with pytest.raises(MindspecError, match="vocabulary"):
        sess.forward([[4], [320]])
    with pytest.raises(MindspecError, match="vocabulary"):
        sess.forward([[-1], []])
    assert sess.pos.tolist() == [2, 1]  # nothing ran
    with pytest.raises(ValueError, match="max_batch"):
        DraftSession(fp32_draft, max_batch=0)


@pytest.mark.parametrize("mode,min_agree", [("int8", 0.7), ("q8", 0.9), ("q4", 0.5)])
def test_quantized_argmax_agrees(tiny_target, fp32_draft, q8_draft, tmp_path, mode, min_agree):
    path = q8_draft if mode == "q8" else str(tmp_path / f"{mode}.onnx")
    if mode != "q8":
        export_draft(tiny_target[0], path, quantize=mode, max_seq=64)
    assert read_manifest(path)["quantize"] == mode
    seqs = _histories(4, length=24)

    def run(p):  # 4 rows: prefill 8, then 16 single-token steps -> 68 logits rows
        sess = DraftSession(p, max_batch=4)
        out = [sess.forward([s[:8] for s in seqs])]
        out += [sess.forward([s[t:t + 1] for s in seqs]) for t in range(8, 24)]
        return np.concatenate(out)                                                     # [68, V]
    assert (run(path).argmax(-1) == run(fp32_draft).argmax(-1)).mean() > min_agree


@pytest.mark.parametrize("mode", ["q8", "int8"])
def test_quantized_batched_like_alone(tiny_target, q8_draft, tmp_path, mode):
    """q8 (MatMulNBits) quantizes activations per row and a row's calls are the same alone and in a
    batch: batched = alone, bit for bit. int8 quantizes the whole
    activation tensor with one scale, so the rows of a batch nudge each other a little."""
    path = q8_draft if mode == "q8" else str(tmp_path / "int8.onnx")
    if mode == "int8":
        export_draft(tiny_target[0], path, quantize="int8", max_seq=64)
    seqs = _histories(3)
    plan = [(seqs[0][:5], seqs[0][5:8]), (seqs[1][:2], seqs[1][2:3]), ([], seqs[2][:4])]  # (prefix, step)
    sess = _prefilled(path, [p for p, _ in plan])
    got = [sess.forward([st for _, st in plan])] + [sess.forward([[s[t]] for s in seqs]) for t in (8, 9, 10)]
    got = np.stack(got, axis=1)                                                        # [3, 4, V]
    for r, (prefix, step) in enumerate(plan):
        alone = _prefilled(path, [prefix], rows=3)  # alone in a session that batches, as in the engine
        want = np.stack([alone.forward([step])[0]] + [alone.forward([[seqs[r][t]]])[0] for t in (8, 9, 10)])
        if mode == "q8":
            np.testing.assert_array_equal(got[r], want)
        else:
            assert (got[r].argmax(-1) == want.argmax(-1)).mean() >= 0.75


def test_manifest_contents(tiny_target, fp32_draft):
    m = read_manifest(fp32_draft)
    ck = Checkpoint(tiny_target[0])
    assert m["format"] == "mindspec-draft" and m["version"] == 3
    assert m["source_fingerprint"] == ck.fingerprint()
    assert (m["vocab_size"], m["num_layers"], m["num_key_value_heads"], m["head_dim"], m["hidden_size"]) == \
        (320, 2, 2, 16, 64)
    assert len(m["onnx_sha256"]) == 16


def _refused(path, words):
    with pytest.raises(MindspecError) as e:
        DraftSession(path)
    msg = str(e.value)
    assert "\n" not in msg and words in msg, msg
    return msg


def test_manifest_refusals(tmp_path, fp32_draft, q8_draft):
    _refused(str(tmp_path / "missing.onnx"), "not found")
    (tmp_path / "text.onnx").write_text("hello, I am not a graph\n")
    _refused(str(tmp_path / "text.onnx"), "not an ONNX file")
    bare = tmp_path / "bare.onnx"
    shutil.copy(fp32_draft, bare)
    _refused(str(bare), "not a mindspec draft (no manifest")
    os.mkdir(str(bare) + ".json")  # the hostile-file probe's: "no manifest" where one is, but not a file
    _refused(str(bare), f"draft manifest {bare}.json is not a regular file")
    os.rmdir(str(bare) + ".json")
    shutil.copy(q8_draft + ".json", str(bare) + ".json")  # manifest copied from another export
    _refused(str(bare), "was written for another ONNX file")
    m = json.load(open(fp32_draft + ".json"))
    m["onnx_sha256"] = "0" * 16  # edited manifest
    (tmp_path / "bare.onnx.json").write_text(json.dumps(m))
    _refused(str(bare), "was written for another ONNX file")
    (tmp_path / "bare.onnx.json").write_text("{not json")
    _refused(str(bare), "garbled draft manifest")
    (tmp_path / "bare.onnx.json").write_text(json.dumps(dict(m, format="something-else")))
    _refused(str(bare), "not a mindspec-draft version 3 manifest")
    (tmp_path / "bare.onnx.json").write_text(json.dumps(dict(m, version=4)))
    _refused(str(bare), "not a mindspec-draft version 3 manifest")
    shutil.copy(fp32_draft + ".json", str(tmp_path / "text.onnx.json"))
    _refused(str(tmp_path / "text.onnx"), "not an ONNX file")
    (tmp_path / "bare.onnx.json").write_text(json.dumps(dict(m, onnx_sha256=json.load(open(fp32_draft + ".json"))[
        "onnx_sha256"], num_layers=5, head_dim=8)))  # was onnxruntime's RuntimeError on the first call
    _refused(str(bare), "its manifest (5 layers, 2 KV heads of 8) does not describe its graph "
                        "(2 layers, 2 KV heads of 16)")
    # the hostile-file review's: each was onnxruntime's RuntimeError traceback on the first draft call
    good = json.load(open(fp32_draft + ".json"))
    for change, words in ((dict(dtype="float16"), "a float16 cache (its graph's is float32)"),
                          (dict(profile="ascend"), "the ascend profile (its graph's inputs are the cpu profile's)"),
                          (dict(vocab_size=300), "a vocabulary of 300 (its graph's logits have 320)")):
        (tmp_path / "bare.onnx.json").write_text(json.dumps(dict(good, **change)))
        _refused(str(bare), f"draft {bare}: its manifest says {words}; re-export the draft")
    # more positions than the graph's RoPE tables hold: GroupQueryAttention's traceback once a row got there
    (tmp_path / "bare.onnx.json").write_text(json.dumps(dict(good, max_seq=good["max_seq"] + 1)))
    _refused(str(bare), f"draft {bare}: its manifest says max_seq {good['max_seq'] + 1}, its graph's position "
                        f"tables hold {good['max_seq']}; re-export the draft")
    (tmp_path / "bare.onnx.json").write_text(json.dumps(dict(good, source=None)))  # (plan's TypeError)
    assert str(bare) + ".json (bad or missing source)" in _refused(str(bare), "garbled draft manifest")
    # the CLI prober's: max_seq 0 was read, then every prompt "did not fit max_seq 0"
    (tmp_path / "bare.onnx.json").write_text(json.dumps(dict(good, max_seq=0)))
    assert str(bare) + ".json (bad or missing max_seq)" in _refused(str(bare), "garbled draft manifest")
    # and a checkpoint directory given as the draft was "draft model not found"
    _refused(str(tmp_path), f"draft {tmp_path} is a directory: give the .onnx file `mindspec export` wrote")


def test_old_format_refused(tmp_path, fp32_draft):
    path = tmp_path / "old.onnx"
    shutil.copy(fp32_draft, path)
    (tmp_path / "old.onnx.json").write_text(json.dumps(dict(json.load(open(fp32_draft + ".json")), version=2)))
    with pytest.raises(MindspecError) as e:
        DraftSession(str(path))
    assert str(e.value) == (f"draft {path} was exported by an older mindspec (draft format 2; this version reads 3): "
                            "re-export it with `mindspec export`")


def test_max_seq_exceeded(fp32_draft):
    sess = DraftSession(fp32_draft, max_seq=8, max_batch=2)
    sess.forward([[1, 2, 3, 4, 5, 6], [1]])
    with pytest.raises(MindspecError, match="row 0: 6 cached \\+ 3 new tokens exceed max_seq 8"):
        sess.forward([[7, 8, 9], [2]])
    assert sess.pos.tolist() == [6, 1]  # the whole batch is refused before it runs
    assert sess.forward([[7, 8], [2, 3, 4, 5, 6, 7, 8]]).shape == (2, 320)
    assert sess.pos.tolist() == [8, 8]
    with pytest.raises(MindspecError, match="max_seq"):
        DraftSession(fp32_draft, max_seq=65)  # longer than the exported max_seq
    with pytest.raises(ValueError):
        sess.rollback(0, 9)


def test_export_validation(tiny_target, tmp_path):
    for kw, words in [(dict(quantize="fp16"), "quantize must be one of int8, q8, q4 \\(or None\\), got \"fp16\""),
                      (dict(layers=0), "^layers must"), (dict(layers=3), "^layers must"), (dict(max_seq=0), "^max_seq must")]:
        with pytest.raises(MindspecError, match=words):
            export_draft(tiny_target[0], str(tmp_path / "x.onnx"), **kw)
    with pytest.raises(MindspecError, match="not found"):
        export_draft(str(tmp_path / "nope"), str(tmp_path / "x.onnx"))
    with pytest.raises(MindspecError, match=r"max_seq must be an integer from 1 to 4096 \(the model's positions\)"):
        export_draft(tiny_target[0], str(tmp_path / "x.onnx"), max_seq=10 ** 7)
    # --out once replaced whatever it named: here the weights of the checkpoint being exported
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_target[0], ckpt)
    weights = next(ckpt.glob("*.safetensors"))
    before = weights.read_bytes()
    with pytest.raises(MindspecError, match="not an exported draft's file: give a path ending in .onnx"):
        export_draft(str(ckpt), str(weights))
    assert weights.read_bytes() == before
    with pytest.raises(MindspecError, match="is a directory"):
        export_draft(str(ckpt), str(tmp_path))
    with pytest.raises(MindspecError, match=r"noext does not end in .onnx: give the draft's file name, e.g. .*noext.onnx"):
        export_draft(str(ckpt), str(tmp_path / "noext"))  # (a CLI probe's: written once, then refused to replace)
    # ... and an export's manifest: --out e.onnx.json wrote a model over e.onnx's manifest (e.onnx unusable)
    for suffix in (".onnx.json", ".onnx.data"):
        side = tmp_path / f"e{suffix}"
        side.write_text("{}")
        with pytest.raises(MindspecError, match=f"is the {suffix[6:]} file of e.onnx: give the .onnx path"):
            export_draft(str(ckpt), str(side))
        assert side.read_text() == "{}"


def test_a_failed_export_leaves_an_earlier_draft_whole(tiny_target, tmp_path):
    """Found: a second export to the same --out from a checkpoint with a garbage tokenizer.json failed with
    one line after it had deleted the manifest and moved its own model in: the working draft was lost. And
    an --out where nothing can be written was a traceback."""
    out = tmp_path / "keep.onnx"
    export_draft(tiny_target[0], str(out))
    before = {p.name: p.read_bytes() for p in tmp_path.glob("keep.onnx*")}
    bad = tmp_path / "bad"
    shutil.copytree(tiny_target[0], bad)
    (bad / "tokenizer.json").write_text("not json")
    with pytest.raises(MindspecError, match="tokenizer.json"):
        export_draft(str(bad), str(out), layers=1)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("keep.onnx*")} == before
    assert read_manifest(str(out))["num_layers"] == 2 and not list(tmp_path.glob(".export-*"))
    for where, words in [("/proc/x.onnx", "cannot write the draft into /proc: "),
                         (f"{out}/x.onnx", f"cannot write the draft into {out}: ")]:
        with pytest.raises(MindspecError, match=words):
            export_draft(tiny_target[0], where)


def test_the_scratch_directories_of_killed_exports_are_removed_by_the_next(tiny_target, tmp_path):
    """Found by a CLI probe: an export killed (SIGKILL, the OOM killer, SIGHUP) left its whole model in
    OUTDIR/.export-* (624 MB for the default pair, each time). The next export there removes those of dead
    processes, not a running one's."""
    import subprocess
    gone = subprocess.Popen(["true"])
    gone.wait()
    from mindspec import scratch
    dead, alive = scratch.name(".export-", gone.pid) + "abc", scratch.name(".export-") + "def"
    for name in (dead, alive):
        (tmp_path / name / "fp32").mkdir(parents=True)
        (tmp_path / name / "fp32" / "d.onnx").write_bytes(b"half")
    export_draft(tiny_target[0], str(tmp_path / "d.onnx"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive, "d.onnx", "d.onnx.json"])


def test_providers_and_options(monkeypatch):
    monkeypatch.setenv("ASCEND_DEVICE_ID", "0")  # inherited from an Ascend env script
    monkeypatch.setenv("DEVICE_ID", "3")  # msrun's, this rank's
    p = providers("Ascend")
    assert p == [("CANNExecutionProvider", {"device_id": 3, "arena_extend_strategy": "kNextPowerOfTwo",
                                            "enable_cann_graph": False})]  # CANN alone: no silent CPU fall back
    assert providers("cpu") == providers("CPU") == ["CPUExecutionProvider"]
    so = make_session_options(2)
    assert so.intra_op_num_threads == 2
    # never 0: onnxruntime pins the threads of a pool whose size it picks itself (they slowed the target)
    assert make_session_options().intra_op_num_threads == len(os.sched_getaffinity(0))
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
    got = DraftSession(path, max_batch=2).forward([ids, ids[:3]])                     # [2, V]
    if mode is None:
        ref = _ref(tiny_target[0], ids)
        np.testing.assert_allclose(got, ref[[4, 2]], atol=TOL, rtol=0)
