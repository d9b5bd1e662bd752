"""Run an exported draft: provider choice, session options, and a KV cache moved by an integer."""
import os

import numpy as np

from mindspec.errors import MindspecError

from .manifest import read_manifest


def cann_present():
    """The CANN toolkit is installed (not just compiled into the onnxruntime-cann wheel)."""
    return bool(os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
                or os.path.isdir("/usr/local/Ascend"))


def providers(device=None):
    """Provider list for onnxruntime. device: None (auto), "cpu", or an NPU id (int or digits).
    CANN is asked for only when present: otherwise ORT logs a fallback error on every session."""
    import onnxruntime as ort
    if str(device).lower() == "cpu" or not cann_present() \
            or "CANNExecutionProvider" not in ort.get_available_providers():
        return ["CPUExecutionProvider"]
    dev = int(device) if device is not None and str(device).isdigit() else int(os.environ.get("ASCEND_DEVICE_ID", 0))
    # enable_cann_graph off: P and T change every call, a whole-graph build per shape would recompile
    return [("CANNExecutionProvider", {"device_id": dev, "arena_extend_strategy": "kNextPowerOfTwo",
                                       "enable_cann_graph": False}), "CPUExecutionProvider"]


def make_session_options(threads=None):
    """Spinning off: with two sessions (draft + target) spinning pools fight over the cores."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.intra_op_num_threads = int(threads or 0)  # 0 = ORT's default (physical cores)
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


class DraftSession:
    """An exported draft with a preallocated KV cache of max_seq positions per layer."""

    def __init__(self, onnx_path, max_seq=None, threads=None, device=None):
        import onnxruntime as ort
        self.manifest = m = read_manifest(onnx_path)
        self.max_seq = int(max_seq or m["max_seq"])
        if not 1 <= self.max_seq <= m["max_seq"]:
            raise MindspecError(f"max_seq {self.max_seq} is outside 1..{m['max_seq']} (the draft was exported "
                                f"for {m['max_seq']} positions)")
        try:
            self.session = ort.InferenceSession(onnx_path, make_session_options(threads), providers=providers(device))
        except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
            raise MindspecError(f"cannot load draft {onnx_path}: {str(e).splitlines()[0]}") from None
        L, KV, D = m["num_layers"], m["num_key_value_heads"], m["head_dim"]
        self.vocab_size = m["vocab_size"]
        # np.zeros pages are only touched when written, so a long max_seq costs address space only
        self.keys = [np.zeros((1, self.max_seq, KV, D), np.float32) for _ in range(L)]    # [1, S, KV, D]
        self.values = [np.zeros((1, self.max_seq, KV, D), np.float32) for _ in range(L)]  # [1, S, KV, D]
        self.output_names = ["logits"] + [f"new_{n}_{i}" for i in range(L) for n in ("key", "value")]
        self.pos = 0

    def forward(self, ids):
        """Feed tokens at positions pos..pos+T-1; returns logits [T, V] and advances pos by T."""
        T, P = len(ids), self.pos
        if T == 0:
            raise ValueError("forward needs at least one token")
        if P + T > self.max_seq:
            raise MindspecError(f"draft cache full: {P} cached + {T} new tokens exceed max_seq {self.max_seq}")
        ids = np.asarray(ids, dtype=np.int64).reshape(1, T)                             # [1, T]
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise MindspecError(f"token id out of the draft's vocabulary (0..{self.vocab_size - 1})")
        feed = {"input_ids": ids}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            feed[f"past_key_{i}"], feed[f"past_value_{i}"] = k[:, :P], v[:, :P]          # [1, P, KV, D] views
        out = self.session.run(self.output_names, feed)
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            k[:, P:P + T], v[:, P:P + T] = out[1 + 2 * i], out[2 + 2 * i]                # [1, T, KV, D]
        self.pos = P + T
        return out[0][0]                                                                 # [T, V]

    def rollback(self, pos):
        """Forget everything from position `pos` on (stale slots are overwritten later)."""
        if not 0 <= pos <= self.pos:
            raise ValueError(f"rollback to {pos} outside 0..{self.pos}")
        self.pos = int(pos)

    def reset(self):
        self.pos = 0
