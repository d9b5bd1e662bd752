"""Run an exported draft: provider choice, session options, and a batched static KV cache moved by integers."""
import contextlib
import sys

import numpy as np

from mindspec.device import detect_device, device_id
from mindspec.errors import MindspecError

from .manifest import read_manifest


def providers(device=None):
    """onnxruntime's provider list for the draft on `device` ("CPU" or "Ascend", as resolved by
    mindspec.device; None: resolve it here by the rule the target shares). Ascend asks for CANN alone: a fall back to the host is an error
    (DraftSession checks what onnxruntime chose), never a silent slow run."""
    if (device or detect_device()).lower() == "cpu":
        return ["CPUExecutionProvider"]
    # enable_cann_graph off: B and T change from call to call, a whole-graph build per shape would recompile
    return [("CANNExecutionProvider", {"device_id": device_id(), "arena_extend_strategy": "kNextPowerOfTwo",
                                       "enable_cann_graph": False})]


def start_session(onnx_path, options, provider_list):
    """An InferenceSession on exactly the providers asked for. onnxruntime prints its "Falling back to
    CPU" notice on stdout (it would corrupt --json): it goes to stderr, and the fall back is an error."""
    import onnxruntime as ort
    try:
        with contextlib.redirect_stdout(sys.stderr):
            session = ort.InferenceSession(onnx_path, options, providers=provider_list)
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        raise MindspecError(f"cannot load draft {onnx_path}: {str(e).splitlines()[0]}") from None
    want = [p[0] if isinstance(p, tuple) else p for p in provider_list]
    if session.get_providers()[0] != want[0]:
        raise MindspecError(f"draft {onnx_path}: onnxruntime could not start {want[0]} (it chose "
                            f"{session.get_providers()[0]}): install onnxruntime-cann and source CANN's set_env.sh")
    if want[0] != "CPUExecutionProvider":
        print(f"mindspec: draft on {want[0]} (device {device_id()})", file=sys.stderr)
    return session


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


ATTEND_STEP = 128  # the fed cache length grows in steps of this (one ORT shape per step)


class DraftSession:
    """An exported draft with a static KV cache of max_batch rows x max_seq positions per layer.

    Row r holds one sequence; pos[r] positions of it are cached. Slots past pos[r] are stale (a
    rollback is moving pos) and masked by the graph, so nothing ever needs clearing."""

    def __init__(self, onnx_path, max_seq=None, max_batch=1, threads=None, device=None):
        self.manifest = m = read_manifest(onnx_path)
        self.max_seq = int(max_seq or m["max_seq"])
        if not 1 <= self.max_seq <= m["max_seq"]:
            raise MindspecError(f"max_seq {self.max_seq} is outside 1..{m['max_seq']} (the draft was exported "
                                f"for {m['max_seq']} positions)")
        if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.max_batch = int(max_batch)
        self.session = start_session(onnx_path, make_session_options(threads), providers(device))
        L, KV, D = m["num_layers"], m["num_key_value_heads"], m["head_dim"]
        self.vocab_size = m["vocab_size"]
        # np.zeros pages are only touched when written, so a long max_seq costs address space only
        shape, dtype = (self.max_batch, KV, self.max_seq, D), np.dtype(m["dtype"])  # the export's KV dtype
        self.keys = [np.zeros(shape, dtype) for _ in range(L)]                           # [R, KV, S, D]
        self.values = [np.zeros(shape, dtype) for _ in range(L)]                         # [R, KV, S, D]
        self.output_names = ["logits"] + [f"new_{n}_{i}" for i in range(L) for n in ("key", "value")]
        self.pos = np.zeros(self.max_batch, np.int64)                                    # [R] cached length

    def _row(self, row):
        if not 0 <= row < self.max_batch:
            raise ValueError(f"row {row} outside 0..{self.max_batch - 1}")
        return int(row)

    def _check(self, tokens, start):
        """Lengths [B] of the rows' new tokens; raises on a bad batch before anything runs."""
        B = len(tokens)
        if B == 0:
            raise ValueError("forward needs at least one row")
        if start < 0 or start + B > self.max_batch:
            raise ValueError(f"rows {start}..{start + B - 1} outside 0..{self.max_batch - 1}")
        n = np.array([len(t) for t in tokens], np.int64)                                # [B]
        if not n.any():
            raise ValueError("forward needs at least one token")
        P = self.pos[start:start + B]
        for b in np.flatnonzero(P + n > self.max_seq):
            raise MindspecError(f"draft cache full: row {start + b}: {P[b]} cached + {n[b]} new tokens "
                                f"exceed max_seq {self.max_seq}")
        flat = [x for t in tokens for x in t]
        if flat and (min(flat) < 0 or max(flat) >= self.vocab_size):
            raise MindspecError(f"token id out of the draft's vocabulary (0..{self.vocab_size - 1})")
        return n

    def forward(self, tokens, start=0):
        """Row start+b gets tokens[b] at positions pos..pos+len-1 (an empty list: the row sits this
        call out, its logits row is garbage). Returns logits [B, V] after each row's last token."""
        n = self._check(tokens, start)
        B, T = len(tokens), int(n.max())
        ids = np.zeros((B, T), np.int64)                                                # [B, T], right-padded
        for b, t in enumerate(tokens):
            ids[b, :len(t)] = t
        rows = slice(start, start + B)
        feed = {"input_ids": ids, "positions": self.pos[rows].copy(), "last": np.maximum(n - 1, 0)}
        # attention reads every fed slot: when the rows use less than half the cache, a copy of the used
        # prefix (in steps of ATTEND_STEP) is cheaper than reading the whole buffer (measured: B=8 at
        # S=1032, ~35 vs ~71 ms per call)
        used = -(-max(int(self.pos[rows].max()), 1) // ATTEND_STEP) * ATTEND_STEP
        cut = used * 2 <= self.max_seq
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if cut:
                k, v = np.ascontiguousarray(k[rows, :, :used]), np.ascontiguousarray(v[rows, :, :used])
            else:
                k, v = k[rows], v[rows]                                                 # [B, KV, S, D] views
            feed[f"past_key_{i}"], feed[f"past_value_{i}"] = k, v
        out = self.session.run(self.output_names, feed)
        self._write(out[1:], start, n)
        return out[0]                                                                   # [B, V]

    def _write(self, new, start, n):
        """Store the valid new K/V (new[2i], new[2i+1]: [B, KV, T, D]) behind each row's cache."""
        B = len(n)
        if B <= 4:  # plain slices per row: ~0.6 us each against ~2.5 us for a fancy-indexed copy
            for b in np.flatnonzero(n):
                r, p, m = start + b, int(self.pos[start + b]), int(n[b])
                for i, (k, v) in enumerate(zip(self.keys, self.values)):
                    k[r, :, p:p + m], v[r, :, p:p + m] = new[2 * i][b, :, :m], new[2 * i + 1][b, :, :m]
        else:  # one fancy-indexed copy per tensor: (row, slot) <- (b, t) for every valid token
            b = np.repeat(np.arange(B), n)                                              # [N]
            t = np.arange(len(b)) - np.repeat(np.cumsum(n) - n, n)                      # [N]: 0..n_b-1
            row, slot = start + b, self.pos[start + b] + t
            for i, (k, v) in enumerate(zip(self.keys, self.values)):
                k[row, :, slot], v[row, :, slot] = new[2 * i][b, :, t], new[2 * i + 1][b, :, t]  # [N, KV, D]
        self.pos[start:start + B] += n

    def rollback(self, row, pos):
        """Forget row's positions from `pos` on (stale slots are masked, and overwritten later)."""
        row = self._row(row)
        if not 0 <= pos <= self.pos[row]:
            raise ValueError(f"rollback of row {row} to {pos} outside 0..{self.pos[row]}")
        self.pos[row] = int(pos)

    def reset(self, row=None):
        """Empty one row (all rows when None)."""
        if row is None:
            self.pos[:] = 0
        else:
            self.pos[self._row(row)] = 0

    def move(self, src, dst):
        """Copy row src's cached positions into row dst (keeps the running rows contiguous)."""
        src, dst = self._row(src), self._row(dst)
        p = int(self.pos[src])
        if src != dst:
            for k, v in zip(self.keys, self.values):
                k[dst, :, :p], v[dst, :, :p] = k[src, :, :p], v[src, :, :p]            # [KV, p, D]
        self.pos[dst] = p
