"""Draft -> ONNX: build the graph from checkpoint weights, optionally quantize, write the manifest."""
import os
import shutil
import tempfile

from mindspec.checkpoint import Checkpoint
from mindspec.errors import MindspecError

from .manifest import read_manifest, write_manifest
from .runtime import DraftSession, providers

__all__ = ["export_draft", "DraftSession", "read_manifest", "providers"]
QUANTIZE_MODES = (None, "int8", "q8", "q4")
DTYPES = ("float32", "float16")


def export_draft(model_dir, out_path, quantize=None, layers=None, max_seq=None, dtype="float32"):
    """Export a HF Llama checkpoint as an ONNX draft (+ `<out_path>.json` manifest); returns the manifest.
    dtype: the weights' and KV cache's (float32 or float16)."""
    if quantize not in QUANTIZE_MODES:
        raise MindspecError(f"--quantize must be one of int8, q8, q4 (or none), got {quantize!r}")
    if dtype not in DTYPES:
        raise MindspecError(f"--dtype must be one of {', '.join(DTYPES)} for a draft, got {dtype!r}")
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    n = cfg.num_hidden_layers
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= n):
        raise MindspecError(f"--layers must be between 1 and {n} (the checkpoint's layers), got {layers!r}")
    max_seq = cfg.max_position_embeddings if max_seq is None else max_seq
    if isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq < 1:
        raise MindspecError(f"--max-seq must be a positive integer, got {max_seq!r}")
    out_path = os.path.abspath(out_path)
    out_dir = os.path.dirname(out_path)
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(out_path + ".json"):
        os.remove(out_path + ".json")  # a half-finished export must not look valid

    from .builder import build_decoder, save_model
    model = build_decoder(ckpt, layers, dtype)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=out_dir)
    try:
        # same basename in the temp dirs: external weights are referenced as "<basename>.data"
        base = os.path.basename(out_path)
        os.makedirs(os.path.join(tmp, "fp32"))
        os.makedirs(os.path.join(tmp, "out"))
        done = save_model(model, os.path.join(tmp, "fp32", base))
        del model
        if quantize:
            from .quantize import quantize as run_quantize
            done = run_quantize(done, quantize, os.path.join(tmp, "out", base))
        for suffix in ("", ".data"):
            if os.path.exists(done + suffix):
                os.replace(done + suffix, out_path + suffix)
            elif os.path.exists(out_path + suffix):
                os.remove(out_path + suffix)  # stale weights of an earlier export
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return write_manifest(out_path, ckpt, layers or n, quantize, max_seq, dtype)
