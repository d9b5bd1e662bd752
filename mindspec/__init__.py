"""mindspec: speculative decoding for Llama-family models (MindSpore target, ONNX draft)."""
import os

os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ logging: errors only

from .errors import MindspecError  # noqa: E402
from .pipeline import Pipeline, Result, load  # noqa: E402

__all__ = ["load", "Pipeline", "Result", "MindspecError"]
__version__ = "0.1.0"
