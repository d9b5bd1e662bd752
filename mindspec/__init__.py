"""mindspec: speculative decoding for Llama-family models (MindSpore target, ONNX draft)."""
import importlib
import os
import sys

os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ logging: errors only

from .errors import MindspecError  # noqa: E402
from .signals import holding as _holding  # noqa: E402  (stdlib only: ~5 ms)


def __getattr__(name):  # the pipeline (numpy...) on first use: the CLI reaches main() in ~40 ms. A Ctrl-C during
    # those imports waits for their end (see mindspec.signals)
    if name in ("load", "Pipeline", "Result"):
        pipeline = sys.modules.get("mindspec.pipeline")
        if pipeline is None or getattr(pipeline.__spec__, "_initializing", False):  # (another thread's import
            # under way: import_module waits for its end; its half-made module has no load yet)
            pipeline = _holding(importlib.import_module)("mindspec.pipeline")
        return getattr(pipeline, name)
    raise AttributeError(f"module 'mindspec' has no attribute {name!r}")


__all__ = ["load", "Pipeline", "Result", "MindspecError"]
__version__ = "0.1.0"
