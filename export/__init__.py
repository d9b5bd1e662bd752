"""Draft -> ONNX: build the graph from checkpoint weights, optionally quantize, write the manifest."""
import os
import shutil

from mindspec import scratch
from mindspec.checkpoint import Checkpoint
from mindspec.errors import MindspecError, shown
from mindspec.spec import QUANTIZE_MODES

from .manifest import PROFILES, read_manifest, read_pair_manifest, write_manifest
from .runtime import DraftSession, check_profile, providers

__all__ = ["export_draft", "DraftSession", "check_profile", "read_manifest", "read_pair_manifest", "providers"]
DTYPES = ("float32", "float16")


def export_draft(model_dir, out_path, quantize=None, layers=None, max_seq=None, dtype=None, profile="cpu"):
    """Export a HF Llama checkpoint as an ONNX draft (+ `<out_path>.json` manifest); returns the manifest.
    dtype: the weights' and KV cache's (float32 or float16; default float32, float16 for profile ascend).
    profile: "cpu" (onnxruntime's CPU provider, quantizable) or "ascend" (one CANN graph per shape bucket,
    the KV cache kept on the device: builder.py, cann_ops.py)."""
    _check_profile(profile, quantize, dtype)
    dtype = dtype or ("float16" if profile == "ascend" else "float32")
    if quantize not in QUANTIZE_MODES:
        raise MindspecError(f"quantize must be one of int8, q8, q4 (or None), got {shown(quantize)}")
    if dtype not in DTYPES:
        raise MindspecError(f"dtype must be one of {', '.join(DTYPES)} for a draft, got {shown(dtype)}")
    if quantize == "int8" and dtype == "float16":  # (its every load failed: INVALID_GRAPH)
        raise MindspecError("quantize int8 does not go with dtype float16 (onnxruntime's DynamicQuantizeLinear "
                            "reads float32 only): use q8 or q4")
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    if not os.path.exists(os.path.join(ckpt.dir, "tokenizer.json")):  # (what a load checks against its target's)
        raise MindspecError(f"{ckpt.dir} has no tokenizer.json: a draft must carry its tokenizer's fingerprint, "
                            "checked against its target's when loaded")
    n = cfg.num_hidden_layers
    if profile == "cpu" and cfg.head_dim % 16:
        raise MindspecError(f"profile cpu needs a head_dim that is a multiple of 16 (onnxruntime's GroupQueryAttention "
                            f"kernel), this checkpoint's is {cfg.head_dim}: export it with profile ascend")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= n):
        raise MindspecError(f"layers must be between 1 and {n} (the checkpoint's layers), got {shown(layers)}")
    max_seq = cfg.max_position_embeddings if max_seq is None else max_seq
    if isinstance(max_seq, bool) or not isinstance(max_seq, int) or not 1 <= max_seq <= cfg.max_position_embeddings:
        raise MindspecError(f"max_seq must be an integer from 1 to {cfg.max_position_embeddings} (the model's "
                            f"positions), got {shown(max_seq)}")
    _check_memory(cfg, max_seq, profile)
    out_path = os.path.abspath(out_path)
    out_dir = os.path.dirname(out_path)
    if out_path.endswith((".onnx.json", ".onnx.data")):  # would replace a draft's manifest (or data) with a model
        raise MindspecError(f"{out_path} is the {out_path[-4:]} file of {os.path.basename(out_path[:-5])}: "
                            f"give the .onnx path")
    for path in (out_path, out_path + ".json", out_path + ".data"):
        if os.path.isdir(path):
            raise MindspecError(f"{path} is a directory: give the draft's file name, e.g. {path}/draft.onnx")
        # only an earlier export's files are replaced (--out model.safetensors once replaced the weights)
        if os.path.exists(path) and not path.endswith((".onnx", ".onnx.json", ".onnx.data")):
            raise MindspecError(f"the draft would replace {path}, which is not an exported draft's file: "
                                f"give a path ending in .onnx")
    if not out_path.endswith(".onnx"):  # (written once, it was then refused as "not an exported draft's file")
        raise MindspecError(f"{out_path} does not end in .onnx: give the draft's file name, e.g. "
                            f"{out_path}.onnx")
    made = []
    try:  # (before the model is built: an --out where nothing can be written is found at once)
        made = scratch.makedirs(out_dir)
        tmp = scratch.mkdtemp(".export-", dir=out_dir)  # (a killed export's is removed)
    except OSError as e:
        scratch.unmake(made)
        raise MindspecError(f"cannot write the draft into {out_dir}: {e.strerror or e}") from None
    try:  # everything is made in tmp: a failure (or Ctrl-C) before the swap leaves an earlier draft whole
        from .builder import build_decoder
        model = build_decoder(ckpt, layers, dtype, profile, max_seq)
        manifest = _swap_in(_write(model, ckpt, tmp, os.path.basename(out_path), layers or n, quantize, max_seq,
                                   dtype, profile), out_path)
        made = []  # (the draft's directories stay)
        return manifest
    except OSError as e:
        raise MindspecError(f"cannot write the draft to {out_path}: {e.strerror or e}") from None
    except MemoryError:
        raise MindspecError(_TOO_BIG.format(max_seq)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        scratch.unmake(made)  # (a failed export's new directories go)


_TOO_BIG = "not enough memory to build the draft for {} positions: give a smaller max_seq"


def _check_memory(cfg, max_seq, profile):
    """Refuse RoPE tables larger than the machine's memory before building them: a config's 2**31 positions
    (a GGUF's context length, converted) were not a MemoryError but an OOM kill at 12.8 GB, of whichever
    process the kernel chose."""
    from mindspec.plan import GB, host_memory
    width = cfg.head_dim if profile == "ascend" else cfg.head_dim // 2  # (builder.py: _rope_lookup, _gqa_attention)
    tables = 4 * 8 * (max_seq + 1) * width  # angles, cos, sin and a copy, float64 while built
    have = host_memory()
    if tables > have:
        raise MindspecError(_TOO_BIG.format(max_seq) + f" (its RoPE tables need about {tables / GB:.0f} GB, this "
                            f"machine has {have / GB:.0f} GB)")


def _write(model, ckpt, tmp, base, layers, quantize, max_seq, dtype, profile):
    """Save (and quantize) the model in tmp and write its manifest beside it: (onnx path, manifest)."""
    from .builder import save_model
    # same basename in the temp dirs: external weights are referenced as "<basename>.data"
    os.makedirs(os.path.join(tmp, "fp32"))
    os.makedirs(os.path.join(tmp, "out"))
    done = save_model(model, os.path.join(tmp, "fp32", base))
    del model
    if quantize:
        from .quantize import quantize as run_quantize
        done = run_quantize(done, quantize, os.path.join(tmp, "out", base))
    return done, write_manifest(done, ckpt, layers, quantize, max_seq, dtype, profile)


def _swap_in(made, out_path):
    """Move a made draft over out_path: the manifest goes last (a draft without one is refused, never
    half-trusted) and stale weights of an earlier export go."""
    done, manifest = made
    if os.path.exists(out_path + ".json"):
        os.remove(out_path + ".json")
    for suffix in ("", ".data"):
        if os.path.exists(done + suffix):
            os.replace(done + suffix, out_path + suffix)
        elif os.path.exists(out_path + suffix):
            os.remove(out_path + suffix)
    os.replace(done + ".json", out_path + ".json")
    return manifest


def _check_profile(profile, quantize, dtype):
    """One-line refusals of what the ascend profile cannot be."""
    if profile not in PROFILES:
        raise MindspecError(f"profile must be one of {', '.join(PROFILES)}, got {shown(profile)}")
    if profile == "ascend" and quantize:
        raise MindspecError(f"quantize {quantize} does not go with profile ascend: its MatMulNBits/MatMulInteger "
                            "are com.microsoft ops CANN cannot run (export the ascend draft in float16)")
    if profile == "ascend" and dtype not in (None, "float16"):
        raise MindspecError(f"profile ascend is float16 (CANN's MatMul takes float16 only), got dtype {shown(dtype)}")
