"""Checkpoint reading: sharded safetensors with an index, bf16 weights, shape checks."""
import json
import os
import pathlib
import shutil
import warnings

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from mindspec.checkpoint import Checkpoint
from mindspec.config import RopeScaling
from mindspec.errors import MindspecError

from conftest import make_tiny_checkpoint

L31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
           original_max_position_embeddings=8192)  # Llama 3.1's


def test_sharded_checkpoint_loads_the_same_tensors(tmp_path, tiny_target):
    d, tensors = make_tiny_checkpoint(tmp_path / "sharded", shard_bytes=60_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3  # really several files
    ck, one = Checkpoint(d), Checkpoint(tiny_target[0])
    for name in tensors:
        assert np.array_equal(ck.get(name), one.get(name)), name
    assert ck.fingerprint() != one.fingerprint()  # different files, different identity


def test_bf16_weights_are_read_as_float32(tmp_path):
    d, tensors = make_tiny_checkpoint(tmp_path / "bf16")
    bf = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    save_file({k: v.view(np.uint16) for k, v in bf.items()}, str(tmp_path / "bf16" / "model.safetensors"))
    raw = (tmp_path / "bf16" / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for k in header:
        if k != "__metadata__":
            header[k]["dtype"] = "BF16"
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    (tmp_path / "bf16" / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + raw[8 + n:])
    w = Checkpoint(d).get("model.layers.0.mlp.up_proj.weight")
    assert w.dtype == np.float32
    assert np.array_equal(w, bf["model.layers.0.mlp.up_proj.weight"].astype(np.float32))


def test_safetensors_metadata_is_ignored(tmp_path, tiny_target):
    """A mutant that kept the header's __metadata__ (every checkpoint PyTorch saves has {"format": "pt"})
    refused them all: no test wrote one."""
    d, tensors = make_tiny_checkpoint(tmp_path / "m")
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    assert np.array_equal(Checkpoint(d).get("model.norm.weight"), tensors["model.norm.weight"])


def test_an_edit_at_the_end_of_a_shard_changes_the_fingerprint(tmp_path, tiny_target):
    """The fingerprint samples every shard up to its last byte (a mutant that stopped short left an edit
    there unseen: a stale draft or batch job taken for this checkpoint's)."""
    d = tmp_path / "e"
    shutil.copytree(tiny_target[0], d)
    before = Checkpoint(str(d)).fingerprint()
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert Checkpoint(str(d)).fingerprint() != before


def test_missing_shard_and_wrong_shape_are_clear_errors(tmp_path):
    d, tensors = make_tiny_checkpoint(tmp_path / "s", shard_bytes=60_000)
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    (tmp_path / "s" / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(MindspecError, match="shard missing"):
        ck = Checkpoint(d)
        for name in tensors:
            ck.get(name)
    d2, t2 = make_tiny_checkpoint(tmp_path / "w")
    t2["model.norm.weight"] = np.ones(7, np.float32)
    save_file(t2, str(tmp_path / "w" / "model.safetensors"))
    with pytest.raises(MindspecError, match="model.norm.weight has shape"):
        Checkpoint(d2).get("model.norm.weight")


def test_a_tied_head_reads_the_embedding_whatever_the_file_holds(tmp_path):
    """The hostile-file probe's: with tie_word_embeddings true, an lm_head.weight in the file was used
    unchecked: of another shape a numpy traceback, or (100 rows) exit 0 with only ids below 100 generated,
    and an export whose graph had 100 logits. Hugging Face ties the head to the embedding and ignores the
    file's; so does mindspec now."""
    d, tensors = make_tiny_checkpoint(tmp_path / "t")
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    (tmp_path / "t" / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    for head in (np.ones((100, tensors["lm_head.weight"].shape[1]), np.float32), np.ones(5, np.float32),
                 tensors["lm_head.weight"]):
        save_file(dict(tensors, **{"lm_head.weight": head}), str(tmp_path / "t" / "model.safetensors"))
        ck = Checkpoint(d)
        assert np.array_equal(ck.get("lm_head.weight"), tensors["model.embed_tokens.weight"])
        assert np.array_equal(ck.get_slice("lm_head.weight", 0, 0, 7), tensors["model.embed_tokens.weight"][:7])


def test_a_weight_of_both_infinities_is_refused_in_one_line(tmp_path):
    """The hostile-file probe's: +inf beside -inf printed numpy's RuntimeWarning (two lines) before the error."""
    d, tensors = make_tiny_checkpoint(tmp_path / "i")
    w = tensors["model.layers.0.mlp.up_proj.weight"].copy()
    w[0, :2] = np.inf, -np.inf
    save_file(dict(tensors, **{"model.layers.0.mlp.up_proj.weight": w}), str(tmp_path / "i" / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a warning printed is a line more on stderr)
        with pytest.raises(MindspecError, match="holds NaN or infinite values"):
            Checkpoint(d).get("model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("bad", [np.nan, -np.inf, 1e30, -3e38])  # (the last two: the hostile-file probe's, which
def test_a_weight_that_is_not_finite_is_refused(tmp_path, tiny_target, bad):  # generated token 0 for ever, exit 0)
    """Found by a user probe: a checkpoint with NaN weights loaded and generated token 0 for ever."""
    d, tensors = make_tiny_checkpoint(tmp_path / "n")
    w = tensors["model.layers.0.mlp.up_proj.weight"].copy()
    w[3, 5] = bad
    save_file(dict(tensors, **{"model.layers.0.mlp.up_proj.weight": w}), str(tmp_path / "n" / "model.safetensors"))
    ck = Checkpoint(d)
    words = ("tensor model.layers.0.mlp.up_proj.weight holds NaN or infinite values, or values whose squares "
             "overflow float32: the checkpoint is broken")
    for read in (lambda: ck.get("model.layers.0.mlp.up_proj.weight"),
                 lambda: ck.get_slice("model.layers.0.mlp.up_proj.weight", 0, 0, 4)):
        with pytest.raises(MindspecError, match=words):
            read()
    assert np.array_equal(ck.get_slice("model.layers.0.mlp.up_proj.weight", 0, 4, 8), w[4:8])  # (a rank's rows)
    assert np.array_equal(ck.get("model.norm.weight"), tensors["model.norm.weight"])


def test_rope_settings_are_read_from_transformers_5s_rope_parameters(tmp_path, tiny_target):
    """transformers 5 writes RoPE's base and scaling in rope_parameters, without a top-level rope_theta: that
    config loaded with the default base 10000 (found reading the format, for a model of base 100000)."""
    d = tmp_path / "c"
    shutil.copytree(tiny_target[0], d)
    cfg = {k: v for k, v in json.loads((d / "config.json").read_text()).items() if k != "rope_theta"}
    for params, theta, scaling in (({"rope_theta": 100000.0, "rope_type": "default"}, 100000.0, None),
                                   (dict(L31, rope_theta=500000.0), 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))):
        (d / "config.json").write_text(json.dumps(dict(cfg, rope_parameters=params)))
        got = Checkpoint(str(d)).config
        assert (got.rope_theta, got.rope_scaling) == (theta, scaling)
        # transformers 4's form of the same: top-level rope_theta and rope_scaling
        old = dict(cfg, rope_theta=theta, rope_scaling=dict(params, rope_theta=None) if scaling else None)
        (d / "config.json").write_text(json.dumps(old))
        assert Checkpoint(str(d)).config == got


@pytest.mark.parametrize("change,words", [
    (dict(num_attention_heads=0), "num_attention_heads must be an integer >= 1, got 0"),  # ZeroDivisionError
    (dict(vocab_size="320"), "vocab_size must be an integer >= 1, got \"320\""),  # taken as 320
    (dict(rope_theta=-1), "rope_theta must be a number > 0, got -1"),  # NaN logits: every token EOS
    (dict(num_hidden_layers=1), "weights of more layers than config.json's num_hidden_layers 1"),  # ran 1 of 2
    # the second review's: each was a traceback
    (dict(architectures={"a": 1}), "architectures must be a list of class names"),
    (dict(rope_scaling="linear"), "rope_scaling must be an object"),
    (dict(eos_token_id=[2, None]), "eos_token_id must be an integer or a list of integers"),
    # a user probe's: each ran as a SiLU, full-RoPE model, giving another model's tokens
    (dict(hidden_act="gelu"), 'hidden_act "gelu" is not supported .only silu.'),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported .RoPE over whole heads only."),
    (dict(rope_scaling={"factor": 2.0}), "rope_scaling without a rope_type"),
    # RoPE settings (transformers 5's rope_parameters, Llama 3.1's scaling)
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), 'rope_scaling "yarn" is not supported'),
    (dict(rope_scaling=dict(L31, rope_type=["llama3"])), r'rope_type must be a string, got \["llama3"\]'),
    (dict(rope_parameters={"rope_type": 3}), "rope_parameters.rope_type must be a string, got 3"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), 'rope_scaling "llama3" needs low_freq_factor, a '
                                                                "number > 0, got null"),
    (dict(rope_scaling=dict(L31, factor=0.5)), "needs factor, a number >= 1, got 0.5"),
    (dict(rope_scaling=dict(L31, original_max_position_embeddings=8192.5)), "an integer from 1 to 2\\*\\*31, got 8192.5"),
    # the hostile-file probe's: a traceback (numpy's object array of 10**20) in generate, serve, batch and export
    (dict(rope_scaling=dict(L31, original_max_position_embeddings=10 ** 20)), "an integer from 1 to 2\\*\\*31, got "
                                                                               "100000000000000000000"),
    (dict(rope_scaling=dict(L31, factor=1e300)), r"needs factor, a number >= 1, got 1e\+300: beyond float32's range"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), 'rope_parameters "yarn" is not supported'),
    (dict(rope_scaling=dict(L31, low_freq_factor=4.0)), "needs low_freq_factor < high_freq_factor, got 4.0 and 4.0"),
    (dict(rope_parameters={"rope_theta": 500000.0}), "rope_theta 10000.0 and rope_parameters' 500000.0 differ"),
    (dict(rope_parameters={"full_attention": {"rope_theta": 1e6}}), "per-layer RoPE is not supported"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}, rope_scaling={"type": "linear", "factor": 4.0}),
     "rope_scaling and rope_parameters differ"),
    (dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     "partial_rotary_factor 0.5 is not supported"),
])
def test_a_config_that_does_not_describe_the_weights_is_refused(tmp_path, tiny_target, change, words):
    """Found trying broken checkpoints: each of these ran (or died with a traceback) instead."""
    d = tmp_path / "c"
    shutil.copytree(tiny_target[0], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, **change)))
    with pytest.raises(MindspecError, match=words):
        Checkpoint(str(d))


def test_eos_ids_outside_the_vocabulary_are_refused_when_no_other_is_in_it(tmp_path, tiny_target):
    """Found by a library probe: an EOS id outside the vocabulary loaded, and a model whose only EOS it was never
    stopped at it. None in range is refused, naming the file; one of several is dropped (never generated)."""
    d = tmp_path / "g"
    shutil.copytree(tiny_target[0], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "generation_config.json").unlink()
    for eos, want in ((-1, None), ([10 ** 9, -3], None), ([2, 10 ** 9], (2,))):
        (d / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=eos)))
        if want is None:
            with pytest.raises(MindspecError, match=rf"config.json: eos_token_id {eos if eos == -1 else eos[0]} is "
                                                    r"not a token id of the vocabulary \[0, "):
                Checkpoint(str(d))
        else:
            assert Checkpoint(str(d)).config.eos_token_ids == want
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [99999]}))
    with pytest.raises(MindspecError, match=f"{d / 'generation_config.json'}: eos_token_id 99999 is not a token id"):
        Checkpoint(str(d))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 99999]}))  # one never made: dropped
    assert Checkpoint(str(d)).config.eos_token_ids == (2,)


def test_odd_safetensors_files_are_one_line_errors(tmp_path):
    """Found trying broken checkpoints (tracebacks before): an index naming a shard that lacks the
    tensor, an index whose weight_map is not an object, a header that is not a JSON object."""
    d, tensors = make_tiny_checkpoint(tmp_path / "s", shard_bytes=60_000)
    index_path = tmp_path / "s" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    wrong = next(f for f in shards if f != index["weight_map"]["model.norm.weight"])
    index_path.write_text(json.dumps({"weight_map": dict(index["weight_map"], **{"model.norm.weight": wrong})}))
    with pytest.raises(MindspecError, match=f"index maps model.norm.weight to {wrong}, which does not hold it"):
        Checkpoint(d)  # (found when the headers are checked, before any weight is read)
    index_path.write_text(json.dumps({"weight_map": "model.safetensors"}))
    with pytest.raises(MindspecError, match="bad safetensors index"):
        Checkpoint(d)
    d2, _ = make_tiny_checkpoint(tmp_path / "h")
    h = b"[1, 2]   "
    (tmp_path / "h" / "model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h)
    with pytest.raises(MindspecError, match="not a valid safetensors file: .*header is not a JSON object"):
        Checkpoint(d2)


def _edit_header(src, dst, edit):
    """A copy of checkpoint src at dst whose safetensors header went through edit(header dict)."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    edit(header)
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + data[8 + n:])
    return str(dst)


def _set(name, key, value):
    return lambda h: h[name].__setitem__(key, value(h) if callable(value) else value)


@pytest.mark.parametrize("edit,words", [
    # the hostile-file review's: each was a traceback, or (the last three) ran on wrong weights, exit 0
    (_set("model.norm.weight", "shape", [-8, -8]), "tensor model.norm.weight has a bad shape"),
    (_set("model.norm.weight", "shape", "64"), "tensor model.norm.weight has a bad shape"),
    (_set("model.norm.weight", "shape", [64, 2 ** 58 + 1]), "model.norm.weight has inconsistent offsets"),
    (_set("model.norm.weight", "data_offsets", lambda h: [float(x) for x in h["model.norm.weight"]["data_offsets"]]),
     "tensor model.norm.weight has bad data_offsets"),
    (_set("model.norm.weight", "data_offsets", lambda h: [-256, 0]), "tensor model.norm.weight has bad data_offsets"),
    (_set("model.embed_tokens.weight", "dtype", "I32"), "model.embed_tokens.weight is I32: weights must be floats"),
    (_set("lm_head.weight", "data_offsets", lambda h: h["model.embed_tokens.weight"]["data_offsets"]),
     "overlap"),
])
def test_hostile_safetensors_headers_are_one_line_errors(tmp_path, tiny_target, edit, words):
    d = _edit_header(pathlib.Path(tiny_target[0]), tmp_path / "c", edit)
    with pytest.raises(MindspecError, match=words):
        ck = Checkpoint(d)
        for name in ck._where:
            ck.get(name)


def test_hostile_config_and_index_files_are_one_line_errors(tmp_path, tiny_target):
    """The hostile-file review's: a billion layers built a list of 9e9 names (killed by the OOM killer),
    an rms_norm_eps beyond float32 ran as inf (token 0 forever, exit 0), a config nested past Python's
    stack or a directory named config.json were tracebacks, a shard that is a FIFO hung the load, and an
    index could name shards outside the model's directory."""
    def copy(name, **change):
        d = tmp_path / name
        shutil.copytree(tiny_target[0], d)
        if change:
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps(dict(cfg, **change)))
        return d

    with pytest.raises(MindspecError, match="has weights of 2 layers; config.json's num_hidden_layers is 1000000000"):
        Checkpoint(str(copy("layers", num_hidden_layers=10 ** 9)))
    # the hostile-file probe's: one empty tensor of layer 99999999 passed that check, and 9e8 names were listed
    # (a MemoryError traceback, or the machine's memory); a layer index in other digits ("²") was a traceback
    for index, words in (("99999999", "has weights of 2 layers; config.json's num_hidden_layers is 100000000"),
                         ("\u00b2", None)):
        d = _edit_header(pathlib.Path(tiny_target[0]), tmp_path / f"bogus{len(index)}",
                         lambda h: h.__setitem__(f"model.layers.{index}.foo", {"dtype": "F32", "shape": [0],
                                                                                "data_offsets": [0, 0]}))
        cfg = json.loads((pathlib.Path(d) / "config.json").read_text())
        (pathlib.Path(d) / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=10 ** 8)))
        with pytest.raises(MindspecError, match=words or "has weights of 2 layers"):
            Checkpoint(d)
        (pathlib.Path(d) / "config.json").write_text(json.dumps(cfg))
        if words:  # (a 2-layer config: a layer past its last is refused, as any other)
            with pytest.raises(MindspecError, match="weights of more layers than config.json's num_hidden_layers 2"):
                Checkpoint(d)
        else:  # (an unknown tensor, like any other name outside the model's)
            assert Checkpoint(d).config.num_hidden_layers == 2
    with pytest.raises(MindspecError, match=r"rms_norm_eps must be a number > 0, got 1e\+39: beyond float32's range"):
        Checkpoint(str(copy("eps", rms_norm_eps=1e39)))
    d = copy("nested")
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(MindspecError, match=r"config.json is not valid JSON: .*\(nested deeper than Python.s stack\)"):
        Checkpoint(str(d))
    d = copy("loop")  # the hostile-file probe's: a symlink loop read "no model.safetensors (or index)"
    (d / "model.safetensors").unlink()
    os.symlink("model.safetensors", d / "model.safetensors")
    with pytest.raises(MindspecError, match="model.safetensors.*Too many levels of symbolic links"):
        Checkpoint(str(d))
    d = copy("dir")
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    with pytest.raises(MindspecError, match="cannot read config.json: .*Is a directory"):
        Checkpoint(str(d))
    s, _ = make_tiny_checkpoint(tmp_path / "fifo", shard_bytes=60_000)
    shard = sorted((tmp_path / "fifo").glob("model-*.safetensors"))[0]
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(MindspecError, match="is not a regular file"):
        ck = Checkpoint(s)
        for name in ck._where:
            ck.get(name)
    s, _ = make_tiny_checkpoint(tmp_path / "out", shard_bytes=60_000)
    index = tmp_path / "out" / "model.safetensors.index.json"
    m = json.loads(index.read_text())
    m["weight_map"] = {k: "../out/" + v for k, v in m["weight_map"].items()}
    index.write_text(json.dumps(m))
    with pytest.raises(MindspecError, match=r"shard name '\.\./out/model-00001-of-.*' is not a file name"):
        Checkpoint(s)


@pytest.mark.parametrize("change", [dict(hidden_size=2 ** 40), dict(head_dim=2 ** 30)])
def test_a_config_is_checked_against_the_weights_before_anything_is_sized_by_it(tmp_path, tiny_target, change):
    """The hostile-file review's: export built RoPE tables of 1-16 TiB from such a config (numpy's
    MemoryError traceback) before reading a weight."""
    from export import export_draft
    d = tmp_path / "c"
    shutil.copytree(tiny_target[0], d)
    (d / "config.json").write_text(json.dumps(dict(json.loads((d / "config.json").read_text()), **change)))
    with pytest.raises(MindspecError, match="has shape .*, config says"):
        export_draft(str(d), str(tmp_path / "d.onnx"))
    (d / "config.json").write_text(json.dumps(dict(json.loads((d / "config.json").read_text()),
                                                   hidden_size=64, head_dim=16, max_position_embeddings=10 ** 15)))
    with pytest.raises(MindspecError, match="not enough memory to build the draft for 1000000000000000 positions: "
                                            "give a smaller max_seq"):
        export_draft(str(d), str(tmp_path / "d.onnx"))
    # a CLI probe's: 2**31 positions (what convert writes for a GGUF that claims them) were no MemoryError but
    # an OOM kill at 12.8 GB; refused before anything is built (export's --max-seq still gets its tables)
    (d / "config.json").write_text(json.dumps(dict(json.loads((d / "config.json").read_text()),
                                                   max_position_embeddings=2 ** 31)))
    with pytest.raises(MindspecError, match=r"not enough memory to build the draft for 2147483648 positions: give a "
                                            r"smaller max_seq \(its RoPE tables need about 550 GB, this machine"):
        export_draft(str(d), str(tmp_path / "d.onnx"))
    with pytest.raises(MindspecError, match=r"its RoPE tables need about 1100 GB"):  # ([P, D] tables there)
        export_draft(str(d), str(tmp_path / "d.onnx"), profile="ascend")
    assert export_draft(str(d), str(tmp_path / "d.onnx"), max_seq=64)["max_seq"] == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d.onnx", "d.onnx.json"]

