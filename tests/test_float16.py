"""Half precision end to end: a float16 target (weights, activations, KV cache; norms, softmax and
sampling in float32) and a float16 ONNX draft. Exactness is per dtype: greedy speculative output equals
greedy target-only output of the same float16 target, whatever the draft's dtype; sampling stays
lossless against the float16 target's own distribution; TP=2 equals TP=1 in float16."""
import json
import os
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest
from scipy.stats import chisquare

import mindspec
from mindspec.checkpoint import Checkpoint
from mindspec.errors import MindspecError
from mindspec.export import DraftSession, export_draft
from mindspec.graphs.runner import TargetModel, init_mindspore
from mindspec.reference import reference_logits

from conftest import make_tiny_checkpoint

PROMPTS = [[5, 6, 7], [100, 3, 250, 17, 9], list(range(10, 50)), [300, 301, 302, 7, 7, 7, 7]]
ENV = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


@pytest.fixture(scope="module")
def drafts(tiny_draft_ckpt, noisy_draft, tmp_path_factory):
    """{dtype: path} of the noisy draft exported in float32 and in float16."""
    path = str(tmp_path_factory.mktemp("f16") / "noisy16.onnx")
    export_draft(tiny_draft_ckpt[0], path, dtype="float16")
    return {"float32": noisy_draft, "float16": path}


@pytest.fixture(scope="module")
def pipe16(tiny_target, drafts):
    return mindspec.load(target=tiny_target[0], draft=drafts["float16"], k=4, max_seq=128, dtype="float16")


def test_float16_target_holds_float16_and_matches_the_reference(tiny_target):
    init_mindspore()
    ckpt = Checkpoint(tiny_target[0])
    m = TargetModel(ckpt, max_seq=64, k_buckets=(2,), dtype="float16")
    d = m.decoder
    assert {p.dtype for p in list(d.w) + [d.embed, d.head] + list(d.k_cache) + list(d.v_cache)} == {ms.float16}
    seq = [int(x) for x in np.random.default_rng(3).integers(3, 300, 40)]
    ref = reference_logits(ckpt.config, ckpt.get, seq)
    got = np.concatenate([m.logits(0, 0, seq[:33]), m.logits(0, 33, seq[33:])])
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert got.dtype == np.float32 and 1e-5 < err < 5e-3, err  # float16's rounding, and no worse
    names = m.graph_names([1], [2])
    assert m.cache_key(names) != TargetModel(ckpt, max_seq=64, k_buckets=(2,)).cache_key(names)  # dtype in the key


def test_bfloat16_is_refused_on_cpu_before_any_weight_loads(tiny_target, tmp_path):
    bad = tmp_path / "broken"
    bad.mkdir()
    for name in os.listdir(tiny_target[0]):
        data = open(os.path.join(tiny_target[0], name), "rb").read()
        (bad / name).write_bytes(data[:100] if name.endswith(".safetensors") else data)  # weights truncated
    p = subprocess.run([sys.executable, "-m", "mindspec", "generate", "--target", str(bad), "--no-speculate",
                        "--prompt-ids", "5,6", "--dtype", "bfloat16"], capture_output=True, text=True, env=ENV)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "mindspec: error: bfloat16 does not run on CPU: this device runs float32, float16"], p.stderr


def test_a_numpy_dtype_is_taken_by_its_name():
    """A float16 prober's: np.dtype("float16") equals "float16" but hashes apart, and ended in a KeyError."""
    from mindspec.errors import MindspecError
    from mindspec.spec import resolve_dtype
    assert resolve_dtype(np.dtype("float16"), "CPU") == resolve_dtype("float16", "CPU") == "float16"
    with pytest.raises(MindspecError, match="^dtype must be one of float32, float16, bfloat16, got "):
        resolve_dtype(np.float16, "CPU")  # (the type, not a dtype)


def test_float16_draft_manifest_and_cache(drafts):
    a, b = DraftSession(drafts["float32"], max_seq=64), DraftSession(drafts["float16"], max_seq=64)
    assert a.manifest["dtype"] == "float32" and b.manifest["dtype"] == "float16"
    assert a.keys[0].dtype == np.float32 and b.keys[0].dtype == b.values[-1].dtype == np.float16
    assert os.path.getsize(drafts["float16"]) < 0.6 * os.path.getsize(drafts["float32"])  # weights in float16
    for s in (a, b):
        s.forward([PROMPTS[2]])
    la, lb = a.forward([[7]]), b.forward([[7]])
    assert lb.dtype == np.float32 and 0 < np.abs(la - lb).max() < 5e-3 * np.abs(la).max()


@pytest.mark.parametrize("draft_dtype", ["float16", "float32"])
def test_float16_speculative_greedy_equals_float16_target_only(pipe16, drafts, draft_dtype):
    pipe16.set_draft(drafts[draft_dtype])
    drafted = accepted = 0
    for ids in PROMPTS:
        base = pipe16.generate(prompt_ids=ids, max_new_tokens=30, speculate=False)
        spec = pipe16.generate(prompt_ids=ids, max_new_tokens=30, k=4)
        assert spec.token_ids == base.token_ids, (ids, draft_dtype)
        drafted, accepted = drafted + spec.stats["drafted"], accepted + spec.stats["accepted"]
    assert 0.1 < accepted / drafted < 0.9, accepted / drafted  # rollbacks happen: the test has teeth


def test_float16_sampling_is_lossless(pipe16, drafts):
    """The second token's marginal is the float16 target's own sum_a p(a) p(b | a) (chi-square)."""
    pipe16.set_draft(drafts["float16"])
    T, prompt, n = 3.0, [5, 6, 7], 300
    soft = lambda x: np.exp(x / T - (x / T).max()) / np.exp(x / T - (x / T).max()).sum()  # noqa: E731
    p1 = soft(pipe16.target.logits(0, 0, prompt)[-1].astype(np.float64))
    top = np.flatnonzero(p1 > 1e-6)
    p2 = sum(p1[a] * soft(pipe16.target.logits(0, 0, prompt + [int(a)])[-1].astype(np.float64)) for a in top)
    p2 /= p2.sum()
    seen = np.zeros(len(p2))
    for s in range(n):  # 3 tokens: the step deciding the second drafts (the prefill gives the first)
        res = pipe16.generate(prompt_ids=prompt, max_new_tokens=3, temperature=T, k=2, seed=500 + s)
        assert res.stats["drafted"] >= 1
        seen[res.token_ids[1]] += 1
    big = p2 * n >= 5
    obs, exp = np.append(seen[big], seen[~big].sum()), np.append(p2[big], p2[~big].sum()) * n
    assert chisquare(obs, exp).pvalue > 1e-3, (obs, exp)
    wrong = np.roll(p2[big], 1)  # the same counts against a wrong distribution must fail
    assert chisquare(seen[big], wrong / wrong.sum() * seen[big].sum()).pvalue < 1e-3


def test_device_mem_counts_the_dtype_in_use(tiny_target, drafts):
    from mindspec.plan import check_fits, shape_from_config, shape_from_draft, target_per_device
    cfg = Checkpoint(tiny_target[0]).config
    assert shape_from_draft(drafts["float16"]).kv_dtype_bytes == 2
    assert shape_from_draft(drafts["float32"]).kv_dtype_bytes == 4
    # a device that holds the float16 target (as the CPU graphs fold it) and not the float32 one
    f16, f32 = (shape_from_config(cfg, d, rot_rows=True) for d in ("fp16", "fp32"))
    mem = (target_per_device(f16, 1)[0] + target_per_device(f32, 1)[0]) / 2 + 2e4
    check_fits(f16, None, device_mem=mem, seq_len=16)
    with pytest.raises(mindspec.MindspecError, match="does not fit"):
        check_fits(f32, None, device_mem=mem, seq_len=16)
    mindspec.load(target=tiny_target[0], draft=False, max_seq=16, dtype="float16", device_mem=mem)
    with pytest.raises(mindspec.MindspecError, match="does not fit"):
        mindspec.load(target=tiny_target[0], draft=False, max_seq=16, dtype="float32", device_mem=mem)


def test_tp2_float16_equals_tp1_float16(tiny_target, drafts, pipe16, tmp_path):
    pipe16.set_draft(drafts["float16"])
    ids = PROMPTS[1]
    want = pipe16.generate(prompt_ids=ids, max_new_tokens=20, k=2).token_ids
    p = subprocess.run([sys.executable, "-m", "mindspec", "generate", "--tp", "2", "--dtype", "float16", "--target",
                        tiny_target[0], "--draft", drafts["float16"], "-k", "2", "--max-seq", "128", "--json",
                        "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "20"],
                       capture_output=True, text=True, env=dict(ENV, MINDSPEC_HOME=str(tmp_path)), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["token_ids"] == want


def test_one_row_decode_takes_the_kernels_of_verification(tmp_path):
    """A matmul of one row (M = 1) rounds differently from one of several rows (at a hidden size of
    a few hundred, as real models): the same position's logits from a 1-token and a 3-token call
    differ. A one-row decode therefore runs as a verify call with no valid draft, so target-only and
    speculative steps share kernels."""
    init_mindspore()
    ckpt = Checkpoint(make_tiny_checkpoint(tmp_path / "wide", hidden=512, inter=768, layers=1, heads=8,
                                           kv_heads=2)[0])
    m = TargetModel(ckpt, max_seq=64, k_buckets=(2, 4), dtype="float16")
    seq = [int(x) for x in np.random.default_rng(5).integers(3, 300, 9)]
    m.logits(0, 0, seq[:8])
    one, three = m.logits(0, 8, seq[8:9]), m.logits(0, 8, seq[8:9] + [5, 6])[:1]
    assert not np.array_equal(one, three)  # the rounding this avoids
    names = [n[:3] for n in m.graph_names([1, 2], [0, 2])]  # (kind, B, T) of each window's graphs
    assert ("greedy", 1, 3) in names and ("greedy", 1, 1) not in names and ("greedy", 2, 1) in names
    acc, nxt = m.step([seq[8:9]], [0], [8], [0])
    assert acc.tolist() == [0] and nxt.tolist() == [int(three.argmax())]


def test_weights_beyond_float16s_range_are_refused_in_float16(tiny_target, tmp_path):
    """Found by a CLI probe: a checkpoint with weights past +-65504 ran in float16 as inf (generate: token 0
    for ever, exit 0; export: a draft that accepted nothing). Refused in one line, naming the checkpoint's tensor
    (a float16 probe's: it said "down.1", the graphs' name); float32 still runs it."""
    big = dict(tiny_target[1])
    big["model.layers.1.mlp.down_proj.weight"] = big["model.layers.1.mlp.down_proj.weight"] * 1e6
    model = make_tiny_checkpoint(tmp_path / "big", base=big)[0]
    msg = "mindspec: error: weight {} holds values beyond float16's range (+-65504): {}"
    gen = [sys.executable, "-m", "mindspec", "generate", "--target", model, "--no-speculate", "--prompt-ids", "5,6",
           "--max-new-tokens", "2", "--json"]
    p = subprocess.run(gen + ["--dtype", "float16"], capture_output=True, text=True, env=ENV)
    fix = "run this model in float32 (--dtype float32), or bfloat16 where the device runs it"
    assert (p.returncode, p.stdout, p.stderr.splitlines()) == (2, "", [msg.format("model.layers.1.mlp.down_proj.weight", fix)]), p.stderr
    p = subprocess.run(gen, capture_output=True, text=True, env=ENV)
    assert p.returncode == 0 and len(json.loads(p.stdout)["token_ids"]) == 2, p.stderr
    out = tmp_path / "d" / "draft.onnx"
    p = subprocess.run([sys.executable, "-m", "mindspec", "export", "--model", model, "--out", str(out),
                        "--dtype", "float16"], capture_output=True, text=True, env=ENV)
    fix = "export this draft with --dtype float32 (--profile cpu)"
    assert (p.returncode, p.stderr.splitlines()) == (2, [msg.format("model.layers.1.mlp.down_proj.weight", fix)]), p.stderr
    assert not out.parent.exists()  # (a CLI probe's: a failed export left the directory it made)


def test_a_folded_weight_is_named_by_its_tensors():
    """The norms fold into the matmuls before the float16 check: the message names both tensors."""
    from mindspec.graphs.fuse import _Cast
    with pytest.raises(MindspecError, match=r"^weight model\.layers\.3\.mlp\.\{gate,up\}_proj\.weight times its "
                                            r"post_attention_layernorm\.weight holds values beyond float16's range"):
        _Cast(np.float16)["gate_up.3"] = np.array([7e4])
    with pytest.raises(MindspecError, match=r"^weight lm_head\.weight times its model\.norm\.weight holds"):
        _Cast(np.float16)["head"] = np.array([7e4])


def _hot(tiny_target, tmp_path):
    """The tiny target with its MLPs scaled up: weights within float16's range, activations not (~3.5e6)."""
    big = dict(tiny_target[1])
    for i in range(2):
        for name, scale in (("down_proj", 400), ("up_proj", 40), ("gate_proj", 40)):
            big[f"model.layers.{i}.mlp.{name}.weight"] = big[f"model.layers.{i}.mlp.{name}.weight"] * scale
    return make_tiny_checkpoint(tmp_path / "hot", base=big)[0]


def test_every_graph_gives_minus_one_where_its_logits_are_not_finite(tiny_target, tmp_path):
    """The graphs' side of the refusal below: greedy and sampling steps (K = 0 and K = 2) and a prefill chunk
    give -1 for a row whose committed position's logits are not finite, beside a finite row of the tiny target's
    own weights in another pipeline (the argmax of NaN was token 0)."""
    from mindspec.graphs.runner import RowSampling
    init_mindspore()
    hot = TargetModel(Checkpoint(_hot(tiny_target, tmp_path)), max_seq=64, k_buckets=(2,), dtype="float16",
                      batch_buckets=(1, 2), max_batch=2)
    cool = TargetModel(Checkpoint(tiny_target[0]), max_seq=64, k_buckets=(2,), dtype="float16")
    V = hot.cfg.vocab_size
    assert hot.prefill([0], [0], [[5, 6, 7]], RowSampling.greedy(1)).tolist() == [-1]
    assert cool.prefill([0], [0], [[5, 6, 7]], RowSampling.greedy(1))[0] >= 0
    for K, s in ((0, None), (2, None), (0, RowSampling.greedy(2, 0, V)), (2, RowSampling.greedy(2, 2, V))):
        ids = np.array([[5, 6, 7][:K + 1]] * 2)
        acc, nxt = hot.step(ids, [0, 1], [3, 3], [K, K], s)
        assert nxt.tolist() == [-1, -1] and acc.tolist() == [0, 0], (K, s is None)
        acc, nxt = cool.step(ids[:1], [0], [3], [K], None if s is None else RowSampling.greedy(1, K, V))
        assert nxt[0] >= 0


def test_activations_beyond_float16s_range_end_the_request_with_one_line(tiny_target, drafts, tmp_path):
    """A float16 probe's: weights within float16's range whose activations are not (the residual stream
    reached 3.5e6) generated token 0 for ever, exit 0, "acceptance 1.0", and logprobs of bare NaN (not JSON).
    A step whose committed position has non-finite logits now ends its request with one line, exit 2 (greedy,
    speculative and sampled alike); float32 runs the model."""
    model = _hot(tiny_target, tmp_path)
    gen = [sys.executable, "-m", "mindspec", "generate", "--target", model, "--prompt-ids", "5,6,7,8,9",
           "--max-new-tokens", "6", "--json", "--dtype", "float16"]
    want = ("mindspec: error: the target's activations are not finite in prompt positions 0-4: they leave "
            "float16's range (run it in float32: --dtype float32)")
    for extra in (["--no-speculate"], ["--draft", drafts["float16"], "-k", "4", "--logprobs", "2"],
                  ["--no-speculate", "--temperature", "0.8", "--seed", "1"]):
        p = subprocess.run(gen + extra, capture_output=True, text=True, env=ENV, timeout=300)
        assert (p.returncode, p.stdout, p.stderr.splitlines()) == (2, "", [want]), (extra, p.stderr[-3000:])
    p = subprocess.run(gen[:-1] + ["float32", "--no-speculate"], capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0 and set(json.loads(p.stdout)["token_ids"]) != {0}, p.stderr[-3000:]
    # a batch job's line records it in those words (not "internal error: MindspecError: ..."), the others go on
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [5, 6, 7]}\n')
    p = subprocess.run([sys.executable, "-m", "mindspec", "batch", "--target", model, "--no-speculate", "--dtype",
                        "float16", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                        "--max-new-tokens", "4"], capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 1 and json.loads((tmp_path / "out.jsonl").read_text())["error"] == \
        "line 1: " + want[len("mindspec: error: "):].replace("0-4", "0-2"), p.stderr[-3000:]


def test_one_overflowing_position_spoils_neither_the_positions_before_it_nor_its_slots_next_request(tiny_target,
                                                                                                    tmp_path):
    """A review's, then found while testing it: a token whose float16 activations overflow (here 77: its
    embedding at float16's largest value) wrote NaN K/V, and attention's p @ V made every position of its call
    (0 * NaN: masked positions too) and every later request in its slot not finite. So a draft proposing it
    ended a request target-only would have finished. Non-finite K/V are now written as 0: the positions before
    it, a rejected draft's step and the slot's next request are as without it."""
    from mindspec.graphs.runner import RowSampling
    init_mindspore()
    w = dict(tiny_target[1])
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"].copy()
    w["model.embed_tokens.weight"][77] = 65504.0
    w["model.layers.0.mlp.down_proj.weight"] = w["model.layers.0.mlp.down_proj.weight"] * 8
    m = TargetModel(Checkpoint(make_tiny_checkpoint(tmp_path / "edge", base=w)[0]), max_seq=64, k_buckets=(2,),
                    dtype="float16")
    V = m.cfg.vocab_size
    assert np.isfinite(m.logits(0, 0, [5, 6, 9, 7, 8, 77, 3])).all(-1).tolist() == [True] * 5 + [False, True]
    assert m.prefill([0], [0], [[5, 6, 77]], RowSampling.greedy(1)).tolist() == [-1]
    # (a second review's: 77 inside a prompt, its K/V written as 0, went on silently; every real position counts)
    assert m.prefill([0], [0], [[5, 77, 6]], RowSampling.greedy(1)).tolist() == [-1]
    first = m.prefill([0], [0], [[5, 6]], RowSampling.greedy(1))  # the same slot, its position 2 was NaN's
    assert first[0] >= 0 and first[0] != 77
    for s in (None, RowSampling.greedy(1, 2, V)):  # the draft 77 rejected: the step as with another draft
        steps = [m.step(np.array([[int(first[0]), d, 3]]), [0], [2], [2], s) for d in (77, 78)]
        assert [(int(a[0]), int(n[0])) for a, n in steps] == [(0, int(steps[1][1][0]))] * 2 and steps[1][1][0] >= 0
