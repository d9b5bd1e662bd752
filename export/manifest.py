"""The manifest beside an exported draft (`draft.onnx` -> `draft.onnx.json`).

It records what the graph was built from and pins the exact ONNX bytes (size + sha256), so a
manifest copied from another export, or an ONNX file replaced after export, is refused.
"""
import hashlib
import json
import os

from mindspec.errors import MindspecError, read_json

FORMAT, VERSION = "mindspec-draft", 3  # 2: batched, a static [B, KV, S, D] cache; 3: cpu on GroupQueryAttention
PROFILES = ("cpu", "ascend")  # builder.py: the graph's interface and how DraftSession runs it
INT_KEYS = ("vocab_size", "num_layers", "source_layers", "num_key_value_heads", "head_dim",
            "hidden_size", "max_seq", "onnx_bytes")


def manifest_path(onnx_path):
    return onnx_path + ".json"


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _tokenizer_fingerprint(model_dir):
    """The draft's vocabulary identity: a draft must tokenize exactly like its target."""
    from mindspec.tokenizer import Tokenizer
    return Tokenizer(model_dir).vocab_fingerprint()


def write_manifest(onnx_path, ckpt, num_layers, quantize, max_seq, dtype="float32", profile="cpu"):
    cfg = ckpt.config
    m = {"format": FORMAT, "version": VERSION,
         "source": os.path.abspath(ckpt.dir), "source_fingerprint": ckpt.fingerprint(),
         "vocab_size": cfg.vocab_size, "num_layers": int(num_layers), "source_layers": cfg.num_hidden_layers,
         "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
         "hidden_size": cfg.hidden_size, "quantize": quantize, "max_seq": int(max_seq),
         "dtype": dtype,  # of the weights and the KV cache (the runtime allocates its buffers in it)
         "profile": profile,
         "tokenizer_fingerprint": _tokenizer_fingerprint(ckpt.dir),
         "onnx_bytes": os.path.getsize(onnx_path), "onnx_sha256": _sha256(onnx_path)}
    with open(manifest_path(onnx_path), "w", encoding="utf-8") as f:
        json.dump(m, f, indent=2)
    return m


def _is_onnx(path):
    import onnx
    try:
        model = onnx.load_model(path, load_external_data=False)
    except Exception:  # DecodeError and friends: any unparsable file
        return False
    return model.ir_version > 0 and len(model.graph.node) > 0


def check_file(onnx_path):
    """Refuse a draft path that is not a file (the cheap part of read_manifest)."""
    if os.path.isdir(onnx_path):
        raise MindspecError(f"draft {onnx_path} is a directory: give the .onnx file `mindspec export` wrote")
    if not os.path.isfile(onnx_path):
        if os.path.exists(onnx_path):  # ("not found" misled: /dev/null, a pipe)
            raise MindspecError(f"draft {onnx_path} is not a file (a device, a pipe or a socket): give the .onnx "
                                "file `mindspec export` wrote")
        raise MindspecError(f"draft model not found: {onnx_path}")


def read_manifest(onnx_path, sha=True):
    """The manifest dict of an exported draft; MindspecError (one line) when it does not belong. sha=False:
    the ONNX file's size is checked, not its sha256 (a 7B draft's takes half a minute)."""
    mpath = manifest_path(onnx_path)
    check_file(onnx_path)
    if os.path.lexists(mpath) and not os.path.isfile(mpath):  # (a directory, a FIFO: "no manifest" misled)
        raise MindspecError(f"draft manifest {mpath} is not a regular file")
    if not os.path.isfile(mpath):
        if not _is_onnx(onnx_path):
            raise MindspecError(f"not an ONNX file: {onnx_path}")
        raise MindspecError(f"not a mindspec draft (no manifest {mpath}): export it with `mindspec export`")
    try:
        m = read_json(mpath)
    except (OSError, ValueError) as e:
        raise MindspecError(f"garbled draft manifest {mpath} ({e})") from None
    old = m.get("version") if isinstance(m, dict) and m.get("format") == FORMAT else None
    if isinstance(old, int) and not isinstance(old, bool) and 1 <= old < VERSION:
        raise MindspecError(f"draft {onnx_path} was exported by an older mindspec (draft format {old}; this "
                            f"version reads {VERSION}): re-export it with `mindspec export`")
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
        raise MindspecError(f"{mpath} is not a {FORMAT} version {VERSION} manifest")
    bad = [k for k in INT_KEYS if not isinstance(m.get(k), int) or isinstance(m.get(k), bool) or m[k] < 1]
    m.setdefault("dtype", "float32")  # exports before the dtype field were float32
    m.setdefault("profile", "cpu")  # and before the profile field, cpu
    bad += [k for k, ok in (("onnx_sha256", isinstance(m.get("onnx_sha256"), str)),
                            ("source", isinstance(m.get("source"), str)),  # (plan reads its config)
                            ("quantize", m.get("quantize") in (None, "int8", "q8", "q4")),
                            ("dtype", m["dtype"] in ("float32", "float16")), ("profile", m["profile"] in PROFILES))
            if not ok]
    if bad:
        raise MindspecError(f"garbled draft manifest {mpath} (bad or missing {bad[0]})")
    if not isinstance(m.get("tokenizer_fingerprint"), str):  # (then paired with any target of its vocabulary size)
        raise MindspecError(f"draft {onnx_path} was exported without its tokenizer, so nothing shows it tokenizes as "
                            "its target does: re-export it from a checkpoint with tokenizer.json")
    if os.path.getsize(onnx_path) != m["onnx_bytes"] or sha and _sha256(onnx_path) != m["onnx_sha256"]:
        if not _is_onnx(onnx_path):
            raise MindspecError(f"not an ONNX file: {onnx_path}")
        raise MindspecError(f"manifest {mpath} was written for another ONNX file (size/sha256 differ): "
                            "re-export the draft")
    return m


def read_pair_manifest(onnx_path, cfg, tokenizer, sha=True):
    """read_manifest(onnx_path, sha), refused if the draft does not share the tokenizer of its target (cfg,
    a LlamaConfig; tokenizer, a mindspec Tokenizer, or None: the vocabulary's size alone)."""
    m = read_manifest(onnx_path, sha)
    if m["vocab_size"] != cfg.vocab_size:
        raise MindspecError(f"draft {onnx_path} has vocabulary size {m['vocab_size']}, the target has "
                            f"{cfg.vocab_size}: a draft must share its target's tokenizer")
    if tokenizer is not None and m["tokenizer_fingerprint"] != tokenizer.vocab_fingerprint():
        raise MindspecError(f"draft {onnx_path} was exported from a model with a different tokenizer "
                            f"({m.get('source')}): a draft must share its target's tokenizer")
    return m
