"""Read Llama-family weights from (sharded) safetensors without torch.

The safetensors format is an 8-byte header length, a JSON header and raw little-endian data, so
we memory-map it: a rank that only needs a shard of a matrix reads only those rows.
"""
import hashlib
import json
import math
import os
import struct

import numpy as np

from .config import load_config
from .errors import MindspecError, is_int, parse_json, read_json, regular

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64,
           "I32": np.int32, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
FLOATS = ("F32", "F16", "F64", "BF16")  # what a weight may be stored as (an I32 one ran as its bit patterns)


def _np_dtype(name, path):
    if name == "BF16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    if name not in _DTYPES:
        raise MindspecError(f"{path}: unsupported tensor dtype {name}")
    return _DTYPES[name]


class SafetensorsFile:
    def __init__(self, path):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(regular(path), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n <= 0 or 8 + n > size:
                    raise ValueError("header length out of range")
                self.header_bytes = f.read(n)
            header = parse_json(self.header_bytes)
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            header.pop("__metadata__", None)
            self._data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else None
            _check_layout(header, size - 8 - n, path)
        except MindspecError:
            raise
        except OSError as e:  # (a dangling link, a loop, no permission: not the file's format)
            raise MindspecError(f"cannot read {path}: {e.strerror or e}") from None
        except (ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
            raise MindspecError(f"not a valid safetensors file: {path} ({e})") from None
        self.header = header

    def names(self):
        return list(self.header)

    def get(self, name):
        """Return the tensor as float32 (or its integer dtype), a fresh array."""
        info = self.header[name]
        b, e = info["data_offsets"]
        dt = _np_dtype(info["dtype"], self.path)
        arr = self._data[b:e].view(dt).reshape(info["shape"])
        return arr.astype(np.float32) if np.dtype(dt).kind == "f" or info["dtype"] == "BF16" else np.array(arr)


def finite(w, name, path):
    """w (float32), refused if a weight is NaN or infinite, or so large (past ~1.8e19) that its square overflows
    float32 (a norm squares activations: an embedding of 1e30 became 0 after every norm). Either generated
    token 0 for ever. The sum of squares in float32 (one BLAS pass, no array of w's size) is NaN or inf then,
    and finite for any real model's weights."""
    if w.dtype.kind != "f":
        return w
    flat = w.reshape(-1).astype(np.float32, copy=False)  # (float16's squares would overflow at 256)
    with np.errstate(invalid="ignore", over="ignore"):  # (inf + -inf: NaN, numpy's warning a line more)
        total = np.dot(flat, flat)
    if not np.isfinite(total):
        raise MindspecError(f"{path}: tensor {name} holds NaN or infinite values, or values whose squares overflow "
                            "float32: the checkpoint is broken")
    return w


_SOURCES = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight", "qkv": "self_attn.{q,k,v}_proj.weight",
            "qkv_bias": "self_attn.{q,k,v}_proj.bias", "o": "self_attn.o_proj.weight",
            "gate_up": "mlp.{gate,up}_proj.weight", "down": "mlp.down_proj.weight"}


def source(kind, layer=None):
    """The checkpoint tensors a weight the graphs make of them holds (kind: embed, head, qkv, qkv_bias, o,
    gate_up, down; another kind is named as it is), as a message names them (found: "weight down.0" for
    model.layers.0.mlp.down_proj.weight)."""
    return _SOURCES.get(kind, kind) if layer is None else f"model.layers.{layer}.{_SOURCES.get(kind, kind)}"


def narrow(w, dtype, name, fix):
    """w as a contiguous array of dtype, refused if a value is beyond float16's range (+-65504: it became
    inf, and a float16 target generated token 0 for ever, a float16 draft accepted nothing). fix: what to
    do instead, for the message. (w holds no NaN or inf: finite() passed.)"""
    w = np.asarray(w)
    if np.dtype(dtype) == np.float16 and w.size and max(w.max(), -w.min()) >= 65520:  # (what rounds to inf)
        raise MindspecError(f"weight {name} holds values beyond float16's range (+-65504): {fix}")
    return np.ascontiguousarray(w, dtype=dtype)


def _check_layout(header, data_bytes, path):
    """Each tensor's shape and offsets, in Python integers (numpy's int64 product of [64, 2**58 + 1] wraps
    to 64), inside the data and overlapping no other tensor (one would read another's bytes), as the
    safetensors library checks."""
    spans = []
    for name, info in header.items():
        shape, offsets = info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and all(is_int(x) and x >= 0 for x in shape)):
            raise ValueError(f"tensor {name} has a bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(x) for x in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise ValueError(f"tensor {name} has bad data_offsets {offsets!r}")
        b, e = offsets
        if e - b != math.prod(shape) * np.dtype(_np_dtype(info["dtype"], path)).itemsize:
            raise ValueError(f"tensor {name} has inconsistent offsets")
        spans.append((b, e, name))
    end, last = 0, None
    for b, e, name in sorted(s for s in spans if s[0] < s[1]):  # (empty tensors overlap nothing)
        if b < end:
            raise ValueError(f"tensors {last} and {name} overlap")
        end, last = e, name


class Checkpoint:
    """A Hugging Face Llama checkpoint directory: config + weights (one file or sharded with an index)."""

    def __init__(self, model_dir):
        self.dir = model_dir
        self.config = load_config(model_dir)
        single = os.path.join(model_dir, "model.safetensors")
        index = os.path.join(model_dir, "model.safetensors.index.json")
        self._files = {}
        if os.path.exists(index):
            try:
                self._where = dict(read_json(index)["weight_map"])
                if not all(isinstance(v, str) for v in self._where.values()):
                    raise ValueError("weight_map values must be shard file names")
                for v in self._where.values():  # a shard outside the model's directory is not its weights
                    if not v or os.path.basename(v) != v or v in (".", ".."):
                        raise ValueError(f"shard name {v!r} is not a file name in the model's directory")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise MindspecError(f"bad safetensors index {index} ({e})") from None
        elif os.path.lexists(single):  # (a symlink loop: its read says so, not "no model.safetensors")
            self._where = {n: "model.safetensors" for n in self._open("model.safetensors").names()}
        else:
            raise MindspecError(f"no model.safetensors (or index) in {model_dir}")
        self._check_names()
        for name in weight_names(self.config):  # from the headers, before anything is sized by the config
            read, sf = self._shard(name)
            shape, want = tuple(sf.header[read]["shape"]), expected_shape(self.config, name)
            if shape != want:
                raise MindspecError(f"{self.dir}: tensor {name} has shape {shape}, config says {want}")

    def _open(self, fname):
        if fname not in self._files:
            path = os.path.join(self.dir, fname)
            if not os.path.lexists(path):  # (a symlink loop or a dangling link: its read says which)
                raise MindspecError(f"safetensors shard missing: {path}")
            self._files[fname] = SafetensorsFile(path)
        return self._files[fname]

    def _check_names(self):
        cfg = self.config
        layers = {int(n.split(".")[2]) for n in self._where if n.startswith("model.layers.")
                  and n.split(".")[2].isascii() and n.split(".")[2].isdigit()}  # ("²" is a digit, not an int's)
        have = next(i for i in range(len(layers) + 1) if i not in layers)  # (0..have-1 all there: one stray
        if cfg.num_hidden_layers > have:  # name of layer 99999999 is not 1e8 layers) before listing their names
            raise MindspecError(f"checkpoint {self.dir} has weights of {have} layers; config.json's "
                                f"num_hidden_layers is {cfg.num_hidden_layers}")
        missing = [n for n in weight_names(cfg) if n not in self._where]
        if missing:
            raise MindspecError(f"checkpoint {self.dir} is missing {len(missing)} tensors, e.g. {missing[0]}")
        if any(i >= cfg.num_hidden_layers for i in layers):  # a config that drops layers would run without them
            raise MindspecError(f"checkpoint {self.dir} has weights of more layers than config.json's "
                                f"num_hidden_layers {cfg.num_hidden_layers}")

    def _shard(self, name):
        """(the name read, its shard): a tied LM head reads the embedding (an lm_head.weight the file holds
        beside it is not read, as Hugging Face ties them)."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        sf = self._open(self._where[name])
        if name not in sf.header:
            raise MindspecError(f"{self.dir}: the index maps {name} to {self._where[name]}, which does not hold it")
        if sf.header[name]["dtype"] not in FLOATS:
            raise MindspecError(f"{self.dir}: tensor {name} is {sf.header[name]['dtype']}: weights must be floats "
                                f"({', '.join(FLOATS)})")
        return name, sf

    def get(self, name):
        """A weight as float32 (its shape and dtype were checked when the checkpoint was opened)."""
        name, sf = self._shard(name)
        return finite(sf.get(name), name, sf.path)

    def get_slice(self, name, axis, start, stop):
        """Rows (axis 0) or columns (axis 1) start:stop of a 2-D tensor, equal to get(name) sliced,
        reading only those bytes of the memory-mapped file: a tensor-parallel rank's shard."""
        name, sf = self._shard(name)
        info = sf.header[name]
        shape = tuple(info["shape"])
        if len(shape) != 2 or axis not in (0, 1) or not 0 <= start <= stop <= shape[axis]:
            raise ValueError(f"bad slice {name}{list(shape)} axis {axis} [{start}:{stop}]")
        dt = _np_dtype(info["dtype"], sf.path)
        b, e = info["data_offsets"]
        full = sf._data[b:e].view(dt).reshape(shape)  # a view of the mapping: nothing read yet
        part = full[start:stop] if axis == 0 else full[:, start:stop]
        return finite(part.astype(np.float32) if np.dtype(dt).kind == "f" or info["dtype"] == "BF16"
                       else np.array(part), name, sf.path)

    def fingerprint(self):
        """Cheap identity of the weights: config, headers and sampled data bytes of every shard."""
        h = hashlib.sha256()
        with open(os.path.join(self.dir, "config.json"), "rb") as f:
            h.update(f.read())
        for fname in sorted(set(self._where.values())):
            sf = self._open(fname)
            h.update(sf.header_bytes)
            if sf._data is not None:
                n = len(sf._data)
                for i in range(17):
                    off = (n - 1) * i // 16
                    h.update(bytes(sf._data[off:off + 4096]))
        return h.hexdigest()[:16]


LAYER_WEIGHTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                 "input_layernorm", "post_attention_layernorm")
QKV_BIASES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")  # with config.qkv_bias (Qwen2)


def weight_names(cfg):
    """The tensors a checkpoint of config cfg holds."""
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_hidden_layers):
        need += [f"model.layers.{i}.{n}.weight" for n in LAYER_WEIGHTS]
        need += [f"model.layers.{i}.{n}.bias" for n in QKV_BIASES if cfg.qkv_bias]
    return need + ([] if cfg.tie_word_embeddings else ["lm_head.weight"])


def expected_shape(cfg, name):
    d, hd = cfg.hidden_size, cfg.head_dim
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, d), "lm_head.weight": (cfg.vocab_size, d),
        "model.norm.weight": (d,),
        "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, d),
        "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, d),
        "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, d),
        "self_attn.o_proj.weight": (d, cfg.num_attention_heads * hd),
        "mlp.gate_proj.weight": (cfg.intermediate_size, d), "mlp.up_proj.weight": (cfg.intermediate_size, d),
        "mlp.down_proj.weight": (d, cfg.intermediate_size),
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.bias": (cfg.num_attention_heads * hd,),
        "self_attn.k_proj.bias": (cfg.num_key_value_heads * hd,),
        "self_attn.v_proj.bias": (cfg.num_key_value_heads * hd,),
    }
    if name in shapes:
        return shapes[name]
    return shapes.get(".".join(name.split(".")[3:]))


def umask():
    """The process's umask (reading it means setting it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _save(arrays, path):
    """safetensors writes 0600: the weights as readable as the config beside them."""
    from safetensors.numpy import save_file
    save_file(arrays, path)
    os.chmod(path, 0o666 & ~umask())


def write_checkpoint(model_dir, cfg_dict, tensors, shard_bytes=None):
    """Write a HF-style directory (config.json + safetensors, sharded with an index when asked)."""
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg_dict, f, indent=2)
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    if not shard_bytes:
        _save(tensors, os.path.join(model_dir, "model.safetensors"))
        return
    shards, cur, size = [], {}, 0
    for k, v in tensors.items():
        if cur and size + v.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += v.nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, os.path.join(model_dir, fname))
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
                   "weight_map": weight_map}, f, indent=2)
