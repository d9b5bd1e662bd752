"""GGUF -> HF conversion on a tiny GGUF written here with gguf.GGUFWriter, the way llama.cpp writes one."""
import dataclasses
import json
import math
import os

import numpy as np
import pytest

from mindspec.checkpoint import LAYER_WEIGHTS, Checkpoint, expected_shape
from mindspec.config import RopeScaling, config_from_dict, load_config
from mindspec.convert import convert_gguf, find_default_gguf
from mindspec.errors import MindspecError
from mindspec.reference import rope_inv_freq
from mindspec.tokenizer import Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "1 2"]
CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
DIMS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
Q8_TENSORS = {"model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight"}
_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def _vocab():
    from tokenizers.pre_tokenizers import ByteLevel
    tokens = SPECIALS + sorted(ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


def _llama_cpp_permute(w, n_head):
    """What llama.cpp's convert_hf_to_gguf does to Q/K rows (the inverse of our un-permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch="llama", tok_model="gpt2", pre="smollm", add_bos=False, seed=0,
                    vocab_meta=None, user_tokens=()):
    """Returns the HF-layout float32 tensors the GGUF was made from (tied embeddings: no output.weight).
    user_tokens: appended to the vocabulary as llama.cpp's user-defined tokens (type 4)."""
    import gguf
    tokens, types = _vocab()
    tokens, types = tokens + list(user_tokens), types + [4] * len(user_tokens)
    cfg = config_from_dict(dict(DIMS, vocab_size=len(tokens)))
    rng = np.random.default_rng(seed)
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(cfg.num_hidden_layers) for n in LAYER_WEIGHTS]
    hf = {n: rng.standard_normal(expected_shape(cfg, n)).astype(np.float32) for n in names}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(512)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab_meta or len(tokens))
    w.add_tokenizer_model(tok_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT)
    for name, t in hf.items():
        parts = name.split(".")
        gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}.get(
            name) or f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:-1])]}.weight"
        if name.endswith("q_proj.weight"):
            t = _llama_cpp_permute(t, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            t = _llama_cpp_permute(t, cfg.num_key_value_heads)
        if name in Q8_TENSORS:
            w.add_tensor(gname, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    hf = write_tiny_gguf(d / "tiny.gguf")
    out = convert_gguf(str(d / "tiny.gguf"), str(d / "hf"))
    return out, hf


def test_weights_match_originals(converted):
    out, hf = converted
    ck = Checkpoint(out)
    for name, want in hf.items():
        got = ck.get(name)
        assert got.dtype == np.float32 and got.shape == want.shape, name
        if name in Q8_TENSORS:  # blocks of 32 int8 with an fp16 scale: within one step absmax/127
            step = np.abs(want).reshape(want.shape[0], -1, 32).max(-1, keepdims=True) / 127
            assert np.all(np.abs(got - want).reshape(step.shape[:2] + (32,)) <= step), name
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_every_converted_file_has_the_umask_mode(converted):
    """Found: model.safetensors came out 0600 (safetensors' own writer) beside 0644 files: another user of
    a shared model directory could read its config but not its weights."""
    out, _ = converted
    mask = os.umask(0)
    os.umask(mask)
    modes = {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)}
    assert modes and set(modes.values()) == {0o666 & ~mask}, modes
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~mask  # as os.makedirs makes it (not mkdtemp's 0700)


def test_config_and_tied_embeddings(converted):
    out, hf = converted
    cfg = load_config(out)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        len(_vocab()[0]), 64, 96, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope_theta == 50000.0 and cfg.rms_norm_eps == pytest.approx(1e-6)
    assert cfg.max_position_embeddings == 512 and cfg.tie_word_embeddings
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2}
    ck = Checkpoint(out)
    assert "lm_head.weight" not in ck._where
    np.testing.assert_array_equal(ck.get("lm_head.weight"), ck.get("model.embed_tokens.weight"))


def test_tokenizer_round_trip_and_merges(converted):
    tok = Tokenizer(converted[0])
    tokens, _ = _vocab()
    ids = tok.encode("hello world")
    assert ids == [tokens.index("hello"), tokens.index("Ġwor"), tokens.index("l"), tokens.index("d")]
    assert tok.decode(ids) == "hello world"
    assert tok.encode("<|im_start|>hi<|im_end|>")[0] == 1 and tok.encode("<|im_end|>") == [2]
    # smollm splits digits one by one before BPE, so the "1 2" merge never applies
    assert tok.encode("1212") == [tokens.index(c) for c in "1212"]
    text = "héllo 世界 <|im_end|> 42"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == {2} and tok.vocab_size == len(tokens)


def test_chat_template_renders(converted):
    tok = Tokenizer(converted[0])
    s = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert s == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(s)[0] == 1


@pytest.mark.parametrize("pre, pieces", [("llama-bpe", ["12", "1", "2"]),  # digits in groups of 3
                                         ("gpt2", ["12", "12"]),  # a whole number is one word
                                         ("something-new", ["12", "12"])])  # falls back to gpt2
def test_pre_tokenizers_and_add_bos(tmp_path, pre, pieces):
    from tokenizers import Tokenizer as HF
    write_tiny_gguf(tmp_path / "b.gguf", pre=pre, add_bos=True)
    tok = Tokenizer(convert_gguf(str(tmp_path / "b.gguf"), str(tmp_path / "hf")))
    tokens, _ = _vocab()
    assert tok.encode("1212") == [1] + [tokens.index(p) for p in pieces]
    # tokenizer.json's post-processor puts BOS first too, for HF loaders that do not read add_bos_token
    assert HF.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode("1212").ids == tok.encode("1212")
    assert tok.decode(tok.encode("hello 1212")[1:]) == "hello 1212"
    assert tok.encode("<|im_start|>x")[:2] != [1, 1]  # BOS already in the text: not doubled


@pytest.mark.parametrize("kind", ["junk", "missing", "arch", "tokenizer", "shape"])
def test_bad_files_raise_one_line_error(tmp_path, kind):
    path = tmp_path / "bad.gguf"
    if kind == "junk":
        path.write_bytes(b"GGUF" + os.urandom(200))
    elif kind == "arch":
        write_tiny_gguf(path, arch="gpt2")
    elif kind == "tokenizer":
        write_tiny_gguf(path, tok_model="llama")
    elif kind == "shape":  # metadata disagrees with the embedding matrix
        write_tiny_gguf(path, vocab_meta=100)
    with pytest.raises(MindspecError) as e:
        convert_gguf(str(path), str(tmp_path / "out"))
    assert "\n" not in str(e.value) and "bad.gguf" in str(e.value)
    if kind == "missing":
        assert str(e.value) == f"GGUF file not found: {path}"


def test_find_default_gguf_missing(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MindspecError, match="setup"):
        find_default_gguf()


def test_out_is_a_new_directory_written_whole(converted, tmp_path):
    """`convert --out` an existing model directory replaced its config and tokenizer and wrote a
    model.safetensors beside its shards (a checkpoint neither could load); a file or an uncreatable path
    was a traceback. Now a non-empty directory or a file is refused untouched, and a conversion is
    written whole into OUT.partial and renamed: never a half-written model."""
    gguf = os.path.join(os.path.dirname(converted[0]), "tiny.gguf")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for out, why in ((model, "is not empty"), (model / "config.json", "is a file"),
                     (tmp_path / "model" / "config.json" / "x", "cannot write")):
        with pytest.raises(MindspecError, match=why) as e:
            convert_gguf(gguf, str(out))
        assert "\n" not in str(e.value) and str(out) in str(e.value)
    assert [p.name for p in model.iterdir()] == ["config.json"] and (model / "config.json").read_text() == "{}"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert_gguf(gguf, str(empty)) == str(empty)
    assert sorted(p.name for p in empty.iterdir()) == sorted(os.listdir(converted[0]))
    assert not list(tmp_path.glob("*.partial"))


def _bomb(path):
    """49 bytes: one metadata entry, a UINT8 array of 2**40 elements that ends with the file (the reader
    looped on empty reads, gigabytes before a MemoryError)."""
    import struct
    key = b"x"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", 9, 0, 2 ** 40))


def _writer_patch(method, replace):
    """A GGUFWriter method replaced by replace(writer, *args) for one file."""
    import gguf
    return lambda mp: mp.setattr(gguf.GGUFWriter, method, replace)


@pytest.mark.parametrize("kind,patch,words", [
    # the hostile-file review's: a memory bomb, tracebacks, and (the last two) a model written, exit 0,
    # that no command could load
    ("bomb", None, "not a readable GGUF file"),
    ("heads", _writer_patch("add_head_count", lambda w, n: w.add_array("llama.attention.head_count", [n, n])),
     "unusable GGUF metadata"),
    ("eps", _writer_patch("add_layer_norm_rms_eps", lambda w, v: w.add_string("llama.attention.layer_norm_rms_epsilon",
                                                                              "tiny")), "unusable GGUF metadata"),
    ("bos", _writer_patch("add_bos_token_id", lambda w, v: w.add_float32("tokenizer.ggml.bos_token_id", 1.0)),
     "unusable GGUF metadata"),
    ("merges", lambda mp: mp.setattr(__import__(__name__), "MERGES", MERGES + ["zz qq"]), "unusable GGUF metadata"),
    ("missing", None, "has no tensor blk.1.ffn_up.weight"),
    ("extra", None, "has tensors of more layers than its block_count 2"),
    # a CLI probe's: written, exit 0, and every command after refused the model
    ("nan", None, "tensor blk.0.ffn_down.weight holds NaN or infinite values"),
])
def test_hostile_gguf_files_are_one_line_errors_and_write_nothing(tmp_path, monkeypatch, kind, patch, words):
    import gguf
    path = tmp_path / "bad.gguf"
    if patch:
        patch(monkeypatch)
    if kind == "missing":
        add = gguf.GGUFWriter.add_tensor
        monkeypatch.setattr(gguf.GGUFWriter, "add_tensor",
                            lambda w, name, *a, **kw: None if name == "blk.1.ffn_up.weight" else add(w, name, *a, **kw))
    if kind == "extra":
        _also_write(monkeypatch, "blk.1.attn_norm.weight", "blk.2.attn_norm.weight")
    if kind == "nan":
        add = gguf.GGUFWriter.add_tensor
        monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", lambda w, name, t, *a, **kw: add(
            w, name, np.where(np.arange(t.size).reshape(t.shape) == 7, np.nan, t).astype(t.dtype)
            if name == "blk.0.ffn_down.weight" else t, *a, **kw))
    if kind == "bomb":
        _bomb(path)
    else:
        write_tiny_gguf(path)
    monkeypatch.undo()
    with pytest.raises(MindspecError, match=words) as e:
        convert_gguf(str(path), str(tmp_path / "out"))
    assert "\n" not in str(e.value) and "bad.gguf" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_defaults_of_keys_a_gguf_may_omit(tmp_path, monkeypatch):
    """llama.cpp's defaults for optional keys: RMS epsilon 1e-5, RoPE base 10000, context 2048, no BOS."""
    for method in ("add_layer_norm_rms_eps", "add_rope_freq_base", "add_context_length", "add_add_bos_token"):
        _writer_patch(method, lambda w, v: None)(monkeypatch)
    write_tiny_gguf(tmp_path / "t.gguf")
    monkeypatch.undo()
    out = convert_gguf(str(tmp_path / "t.gguf"), str(tmp_path / "hf"))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["rms_norm_eps"], cfg["rope_theta"], cfg["max_position_embeddings"]) == (1e-5, 10000.0, 2048)
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    assert (tcfg["add_bos_token"], tcfg["model_max_length"]) == (False, 2048)
    tokens, _ = _vocab()
    assert Tokenizer(out).encode("hello") == [tokens.index("hello")]


def test_user_defined_tokens_are_kept_whole(tmp_path):
    """llama.cpp's user-defined tokens (type 4, e.g. <tool>) are never split by the pre-tokenizer; not
    special: a decode that skips special tokens keeps them."""
    write_tiny_gguf(tmp_path / "t.gguf", user_tokens=["<tool>"])
    tok = Tokenizer(convert_gguf(str(tmp_path / "t.gguf"), str(tmp_path / "hf")))
    tokens, _ = _vocab()
    ids = tok.encode("hello<tool>hello")
    assert ids == [tokens.index("hello"), len(tokens), tokens.index("hello")]
    assert tok.decode(ids, skip_special_tokens=True) == "hello<tool>hello"


def _llama_cpp_rope_freqs(factor, theta=50000.0, dim=16):
    """The divisors llama.cpp's converter writes for Llama 3.1's RoPE scaling, as its code computes them
    (float32 frequencies; low_freq_factor 1, high_freq_factor 4, original context 8192)."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            out.append(1)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def _also_write(mp, after, name, value=None):
    """The GGUF writer writes tensor `name` (`value`, else a copy of `after`) right after tensor `after`."""
    import gguf
    add = gguf.GGUFWriter.add_tensor

    def add_and_more(w, n, t, *a, **kw):
        add(w, n, t, *a, **kw)
        if n == after:
            add(w, name, t if value is None else value)
    mp.setattr(gguf.GGUFWriter, "add_tensor", add_and_more)


def _with_rope_freqs(freqs):
    """rope_freqs.weight (Llama 3.1's frequency scaling), written after output_norm as llama.cpp does."""
    return lambda mp: _also_write(mp, "output_norm.weight", "rope_freqs.weight", freqs)


@pytest.mark.parametrize("factor", [8.0, 32.0, 1.0])  # Llama 3.1 and 3.3's, 3.2's; all ones: none (a probe's)
def test_llama_3_1s_rope_freqs_become_its_rope_scaling(tmp_path, monkeypatch, factor):
    """A Llama 3.1 GGUF was refused for its rope_freqs tensor: it is now the llama3 scaling it was made from,
    the frequencies the model runs with llama.cpp's (its own divided by rope_freqs)."""
    freqs = _llama_cpp_rope_freqs(factor)
    assert len(set(freqs.tolist())) == (1 if factor == 1 else 3)  # one blended, the others kept or divided
    _with_rope_freqs(freqs)(monkeypatch)
    write_tiny_gguf(tmp_path / "l31.gguf")
    monkeypatch.undo()
    out = convert_gguf(str(tmp_path / "l31.gguf"), str(tmp_path / "hf"))
    cfg = Checkpoint(out).config
    assert cfg.rope_scaling == (None if factor == 1 else RopeScaling("llama3", factor, 1.0, 4.0, 8192))
    plain = rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    np.testing.assert_allclose(rope_inv_freq(cfg), plain / freqs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("keys, want", [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, RopeScaling("linear", 4.0)),
    # as llama.cpp reads them (the review: each converted unscaled): a factor without a type is linear, and
    # the older key holds it too; a factor of 1 is no scaling
    ({"llama.rope.scaling.factor": 2.0}, RopeScaling("linear", 2.0)),
    ({"llama.rope.scale_linear": 8.0}, RopeScaling("linear", 8.0)),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1.0}, None),
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
    ({"llama.rope.scaling.factor": 0.0, "llama.rope.scale_linear": 4.0}, None),  # (the newer key wins, as there)
    ({"llama.rope.scaling.type": "yarn"}, None),  # (no factor: no scaling)
])
def test_linear_rope_scaling_is_converted(tmp_path, monkeypatch, keys, want):
    def add(w, v):
        w.add_float32("llama.rope.freq_base", v)
        for key, value in keys.items():
            (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    _writer_patch("add_rope_freq_base", add)(monkeypatch)
    write_tiny_gguf(tmp_path / "lin.gguf")
    monkeypatch.undo()
    assert Checkpoint(convert_gguf(str(tmp_path / "lin.gguf"), str(tmp_path / "hf"))).config.rope_scaling == want


@pytest.mark.parametrize("patch, why", [
    (_writer_patch("add_rope_freq_base", lambda w, v: (w.add_float32("llama.rope.freq_base", v),
                                                       w.add_string("llama.rope.scaling.type", "yarn"),
                                                       w.add_float32("llama.rope.scaling.factor", 4.0))),
     "RoPE scaling 'yarn' is not supported"),
    (_writer_patch("add_rope_dimension_count", lambda w, n: (w.add_uint32("llama.attention.key_length", n),
                                                             w.add_uint32("llama.rope.dimension_count", n // 2))),
     "partial RoPE (8 of 16 dims) is not supported"),
    # without key_length the head is embedding_length / head_count (llama.cpp's): found saying "tensor
    # blk.0.attn_q.weight has shape (64, 64), the metadata says (32, 64)"
    (_writer_patch("add_rope_dimension_count", lambda w, n: w.add_uint32("llama.rope.dimension_count", n // 2)),
     "partial RoPE (8 of 16 dims) is not supported"),
    # found saying "unsupported tensor 'rope_freqs.weight' (not a plain Llama model)"; Llama 3.1's: converted
    (_with_rope_freqs(np.linspace(1, 3, 8, dtype=np.float32)),
     "RoPE frequency scaling (rope_freqs) other than Llama 3.1's is not supported"),
    (_with_rope_freqs(np.ones(4, np.float32)), "RoPE frequency scaling (rope_freqs) other than Llama 3.1's is not supported"),
], ids=["scaling", "partial", "partial-no-key-length", "rope-freqs", "rope-freqs-shape"])
def test_llama_variants_it_cannot_run_are_refused_by_name(tmp_path, monkeypatch, patch, why):
    """Llama models whose RoPE is not the plain one: refused saying so (each converted, it ran wrong)."""
    path = tmp_path / "bad.gguf"
    patch(monkeypatch)
    write_tiny_gguf(path)
    monkeypatch.undo()
    with pytest.raises(MindspecError) as e:
        convert_gguf(str(path), str(tmp_path / "out"))
    assert str(e.value) == f"{path}: {why}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_a_conversion_leaves_other_directories_beside_out_alone(converted, tmp_path):
    """The hostile-file review's: `convert --out keep` deleted a directory keep.partial of the user's (it
    was the conversion's scratch directory)."""
    gguf = os.path.join(os.path.dirname(converted[0]), "tiny.gguf")
    (tmp_path / "keep.partial").mkdir()
    (tmp_path / "keep.partial" / "notes.txt").write_text("mine")
    assert convert_gguf(gguf, str(tmp_path / "keep")) == str(tmp_path / "keep")
    assert (tmp_path / "keep.partial" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "keep.partial"]
    # (and OUT's parent is made, as the default pair's conversion into a new $MINDSPEC_HOME needs)
    assert convert_gguf(gguf, str(tmp_path / "new" / "dirs" / "m")) == str(tmp_path / "new" / "dirs" / "m")
    assert Checkpoint(str(tmp_path / "new" / "dirs" / "m")).config.hidden_size == 64


def test_the_scratch_directories_of_killed_conversions_are_removed_by_the_next(converted, tmp_path):
    """Found by a CLI probe: `convert` killed (SIGKILL, a closed terminal's SIGHUP) left its OUT.partial-*,
    446-503 MB each, that no rerun removed. The next conversion beside it removes those of dead processes."""
    import subprocess
    gone = subprocess.Popen(["true"])
    gone.wait()
    from mindspec import scratch
    dead, alive = scratch.name("m.partial-", gone.pid) + "abc", scratch.name("m.partial-") + "def"
    for name in (dead, alive, "m.partial-ghi"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"half")
    gguf = os.path.join(os.path.dirname(converted[0]), "tiny.gguf")
    assert convert_gguf(gguf, str(tmp_path / "m")) == str(tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m", alive, "m.partial-ghi"])


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_conversion_leaves_nothing_behind(converted, tmp_path, monkeypatch, exc):
    """The CLI prober's: Ctrl-C or SIGTERM while `convert` wrote the weights left a 538 MB
    OUT.partial-* directory behind (the scratch directory was removed on OSError only)."""
    import mindspec.convert as conv
    gguf = os.path.join(os.path.dirname(converted[0]), "tiny.gguf")
    write = conv.write_checkpoint

    def write_then_stop(*a, **kw):
        write(*a, **kw)
        raise exc()
    monkeypatch.setattr(conv, "write_checkpoint", write_then_stop)
    with pytest.raises(exc):
        convert_gguf(gguf, str(tmp_path / "m"))
    assert list(tmp_path.iterdir()) == []


def test_a_conversion_that_cannot_write_is_one_line_and_leaves_nothing(converted, tmp_path, monkeypatch):
    """Found by a user probe on a full disk: safetensors' SafetensorError ("... No space left on device") and
    tokenizers' bare Exception escaped `convert` as a traceback, exit 1 (only an OSError was a one-line error).
    Now each is "cannot write OUT: <cause>", exit 2, and the scratch directory is gone. The real failures:
    the weights' write past a file-size limit (RLIMIT_FSIZE: "File too large"), the tokenizer's into /dev/full."""
    import resource
    import subprocess
    import sys
    import mindspec.convert as conv
    gguf = os.path.join(os.path.dirname(converted[0]), "tiny.gguf")
    out = tmp_path / "m"
    p = subprocess.run([sys.executable, "-m", "mindspec", "convert", "--gguf", gguf, "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"),
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, 32 << 10)))
    assert (p.returncode, p.stdout, p.stderr) == (2, "", f"mindspec: error: cannot write {out}: File too large\n")
    assert list(tmp_path.iterdir()) == []
    build = conv._build_tokenizer

    class Full:  # the tokenizer, saved into a file on a full disk
        def __init__(self, tok):
            self.tok = tok

        def save(self, path):
            os.symlink("/dev/full", path)
            self.tok.save(path)
    monkeypatch.setattr(conv, "_build_tokenizer", lambda meta: (Full(build(meta)[0]), build(meta)[1]))
    with pytest.raises(MindspecError) as e:
        convert_gguf(gguf, str(out))
    assert str(e.value) == f"cannot write {out}: No space left on device"
    assert list(tmp_path.iterdir()) == [] and not os.path.isfile("/dev/full")
