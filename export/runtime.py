"""Run an exported draft: provider choice, session options, and a batched static KV cache moved by integers."""
import contextlib
import os
import sys

import numpy as np

from mindspec.device import detect_device, device_id
from mindspec.errors import MindspecError
from mindspec.spec import BATCH_BUCKETS, PREFILL_CHUNK

from .manifest import read_manifest


def providers(device=None, graph=False):
    """onnxruntime's provider list for the draft on `device` ("CPU" or "Ascend", as resolved by
    mindspec.device; None: resolve it here by the rule the target shares). Ascend asks for CANN alone: a fall back to the host is an error
    (DraftSession checks what onnxruntime chose), never a silent slow run. graph: CANN's graph mode, for
    the ascend profile (static shapes: one whole-graph compile per (B, T) bucket)."""
    if (device or detect_device()).lower() == "cpu":
        return ["CPUExecutionProvider"]
    # without graph (cpu profile) B, T and the fed cache length change from call to call: a whole-graph
    # build per shape would recompile. dump_om_model off: CANN reloads a dumped .om by node name and shape
    # from the working directory, a re-exported draft at the same path could get the old one
    opts = {"device_id": device_id(), "arena_extend_strategy": "kNextPowerOfTwo", "enable_cann_graph": bool(graph)}
    return [("CANNExecutionProvider", dict(opts, dump_om_model=False) if graph else opts)]


def check_profile(m, onnx_path, device=None):
    """Refuse a cpu-profile draft (manifest m) on Ascend: CANN runs neither its com.microsoft ops
    (GroupQueryAttention, MatMulNBits) nor its quantized MatMuls, so most of it would run on the host."""
    if m["profile"] != "ascend" and str(device or detect_device()).lower() == "ascend":
        raise MindspecError(f"draft {onnx_path} is exported with the cpu profile, whose ops CANN does not run: export "
                            "it for the NPU with `mindspec export --profile ascend`")


def start_session(onnx_path, options, provider_list, model=None):
    """An InferenceSession on exactly the providers asked for (of `model` bytes when given, named
    onnx_path in messages). A fall back to the CPU is an error: of the whole session (the provider did not
    start), or of a node (onnxruntime's own error, with the session's disable_cpu_ep_fallback). What
    onnxruntime prints on stdout goes to stderr (it would corrupt --json)."""
    import onnxruntime as ort
    want = [p[0] if isinstance(p, tuple) else p for p in provider_list]
    if want[0] != "CPUExecutionProvider":
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    not_started = f"draft {onnx_path}: onnxruntime could not start {want[0]}{{}}: install onnxruntime-cann and " \
                  "source CANN's set_env.sh"
    try:
        with contextlib.redirect_stdout(sys.stderr):  # (no retry on the CPU: that hid why the first try failed)
            session = ort.InferenceSession(model or onnx_path, options, providers=provider_list, enable_fallback=0)
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        first = str(e).splitlines()[0]
        if "ExecutionProvider fail" in first:  # (its log line above says why: a library missing, a bad device)
            raise MindspecError(not_started.format("")) from None
        raise MindspecError(f"cannot load draft {onnx_path}: {first}") from None
    if session.get_providers()[0] != want[0]:
        raise MindspecError(not_started.format(f" (it chose {session.get_providers()[0]})"))
    if want[0] != "CPUExecutionProvider":
        print(f"mindspec: draft on {want[0]} (device {device_id()})", file=sys.stderr)
    return session


def make_session_options(threads=None, dims=None):
    """Spinning off: with two sessions (draft + target) spinning pools fight over the cores. The thread
    count is always set (default: the cores this process may use): left at 0, onnxruntime pins its
    threads to cores, and pinned draft threads slowed the target's MindSpore calls in some processes
    (B=1, K=8, default pair, 2 cores, three alternating processes each: pinned 36.7 / 40.9 / 41.3
    tok/s, verify 55.5-63.7 ms; unpinned 41.3 / 41.7 / 41.8 tok/s, 55.0-55.6 ms). dims: symbolic
    dimensions fixed for the session's life ({"S": cache length})."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.intra_op_num_threads = int(threads or len(os.sched_getaffinity(0)))
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    so.log_severity_level = 3
    for name, value in (dims or {}).items():
        so.add_free_dimension_override_by_name(name, int(value))
    return so


MAX_T = 128  # most tokens a row feeds in one call of the cpu profile (its attention scratch grows with T x S)
T_BUCKETS = (1, PREFILL_CHUNK)  # ascend profile: tokens per row and call (a draft step, a prefill chunk)


def _check_interface(session, m, onnx_path):
    """The manifest's layers, KV heads, head size, profile, cache dtype and vocabulary against the graph's
    inputs and outputs: a hand-edited manifest keeps the graph's checksum, and onnxruntime's error came
    only on the first call."""
    ins = {i.name: i for i in session.get_inputs()}
    L, KV, D = m["num_layers"], m["num_key_value_heads"], m["head_dim"]
    layers = sum(n.startswith("past_key_") for n in ins)
    shape = ins["past_key_0"].shape if "past_key_0" in ins else [None] * 4  # [B, KV, S, D]
    if layers != L or shape[1] != KV or shape[3] != D:
        raise MindspecError(f"draft {onnx_path}: its manifest ({L} layers, {KV} KV heads of {D}) does not describe "
                            f"its graph ({layers} layers, {shape[1]} KV heads of {shape[3]})")
    graph = {"profile": "ascend" if "slots" in ins else "cpu",
             "dtype": {"tensor(float)": "float32", "tensor(float16)": "float16"}.get(ins["past_key_0"].type),
             "vocab_size": session.get_outputs()[0].shape[-1]}
    says = {"profile": f"the {m['profile']} profile (its graph's inputs are the {graph['profile']} profile's)",
            "dtype": f"a {m['dtype']} cache (its graph's is {graph['dtype']})",
            "vocab_size": f"a vocabulary of {m['vocab_size']} (its graph's logits have {graph['vocab_size']})"}
    for key, words in says.items():
        if m[key] != graph[key]:
            raise MindspecError(f"draft {onnx_path}: its manifest says {words}; re-export the draft")


def _check_positions(onnx_path, m):
    """The manifest's max_seq against the graph's RoPE tables (the cpu profile's hold one position more: a
    row sitting out of a call writes at max_seq): the graph's checksum does not cover the manifest, and
    onnxruntime's error came only once a row passed the tables."""
    import onnx
    model = onnx.load_model(onnx_path, load_external_data=False)  # (0.3 s for the default draft's 267 MB)
    P = next((i.dims[0] for i in model.graph.initializer if i.name == "rope_cos"), None)
    room = None if P is None else P - (m["profile"] == "cpu")
    if room is not None and m["max_seq"] > room:
        raise MindspecError(f"draft {onnx_path}: its manifest says max_seq {m['max_seq']}, its graph's position "
                            f"tables hold {room}; re-export the draft")


def batch_buckets(max_batch):
    """Rows per call of the ascend profile: the powers of two below max_batch, and max_batch."""
    return tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)


def _bucket(n, buckets):
    return next(b for b in buckets if b >= n)


class DraftSession:
    """An exported draft with a static KV cache of max_batch rows x max_seq positions per layer.

    Row r holds one sequence; pos[r] positions of it are cached. Slots past pos[r] are stale (a
    rollback is moving pos): no call reads them, and later tokens overwrite them. The manifest's profile
    picks the cache: host numpy buffers the graph writes in place, bound with IOBinding (cpu), or
    device buffers (ascend: BoundCache)."""

    def __init__(self, onnx_path, max_seq=None, max_batch=1, threads=None, device=None):
        self.manifest = m = read_manifest(onnx_path)
        self.max_seq = int(max_seq or m["max_seq"])
        if not 1 <= self.max_seq <= m["max_seq"]:
            raise MindspecError(f"max_seq {self.max_seq} is outside 1..{m['max_seq']} (the draft was exported "
                                f"for {m['max_seq']} positions)")
        if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.max_batch = int(max_batch)
        check_profile(m, onnx_path, device)
        bound = m["profile"] == "ascend"  # the cache on the session's device, written by the graph
        S = self.max_seq if bound else self.max_seq + 1  # + 1: see the host buffers below
        self.session = start_session(onnx_path, make_session_options(threads, {"S": S}), providers(device, graph=bound))
        _check_interface(self.session, m, onnx_path)
        _check_positions(onnx_path, m)
        L, KV, D = m["num_layers"], m["num_key_value_heads"], m["head_dim"]
        self.vocab_size = m["vocab_size"]
        self.pos = np.zeros(self.max_batch, np.int64)                                    # [R] cached length
        self.device_kv = BoundCache(self.session, m, self.max_batch, self.max_seq, threads) if bound else None
        if bound:  # no host copy of the cache (BoundCache)
            self.keys = self.values = None
            return
        # + 1: a row sitting out of a call (T = 1) gets one padding token written at its position. Untouched
        # pages of np.zeros are never committed: memory follows the positions rows reach
        shape, self.dtype = (self.max_batch, KV, S, D), np.dtype(m["dtype"])              # export's dtype
        self.keys = [np.zeros(shape, self.dtype) for _ in range(L)]                      # [R, KV, S+1, D]
        self.values = [np.zeros(shape, self.dtype) for _ in range(L)]                    # [R, KV, S+1, D]
        self.cache = [(f"{n}_{i}", buf[i]) for i in range(L) for n, buf in (("key", self.keys), ("value", self.values))]
        self._bindings = {}  # (start, B, T) -> (IOBinding, host arrays): see _binding

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

    def forward(self, tokens, start=0, alone=()):
        """Row start+b gets tokens[b] at positions pos..pos+len-1 (an empty list: the row sits this
        call out, its logits row is garbage). Returns logits [B, V] after each row's last token.
        alone: rows b whose several tokens run in a call of their own, as a one-row session runs them."""
        n = self._check(tokens, start)
        if self.device_kv:
            return self._forward_bound(tokens, start)
        if n.max() == 1 or self.max_batch == 1:
            return self._run(tokens, start)
        # GroupQueryAttention runs several tokens a row only in a call of one row (builder.py). q8 rounds
        # activations to int8, so the float noise between one call of a row's tokens and a split one grows
        # to ~0.6 in the default draft's logits: a sampled row (alone: its text follows its draws) runs them
        # in one call, as a one-row session does; other rows feed all but their last token (several rows one
        # token behind: one call), then every row its last token in one call
        solo = {b: self._run([tokens[b]], start + b)[0] for b in alone if n[b] > 1}  # b -> [V]
        lag = [b for b in np.flatnonzero(n > 1) if b not in solo]
        if len(lag) > 1 and max(n[lag]) == 2:  # one token behind on several rows (all drafts accepted): one call
            lo, hi = int(lag[0]), int(lag[-1]) + 1
            self._run([tokens[b][:1] if b in lag else [] for b in range(lo, hi)], start + lo)
        elif lag:
            self.feed({start + int(b): tokens[b][:-1] for b in lag})
        last = [[] if b in solo else t[-1:] for b, t in enumerate(tokens)]
        logits = self._run(last, start) if any(last) else np.zeros((len(tokens), self.vocab_size), np.float32)
        for b, x in solo.items():
            logits[b] = x
        return logits

    def feed(self, chunks, aligned=()):
        """Cache tokens without their logits (a prompt's catch-up): chunks {row: ids}. Host cache: each
        row in calls of its own (a row's calls the same alone and in any batch; no extra call for the
        last tokens, as forward needs for its logits), those of `aligned` rows cut at multiples of
        PREFILL_CHUNK positions (whatever their feed started from: see engine.draft_cut); the ascend
        profile: one call over the rows."""
        if self.device_kv:
            lo, hi = min(chunks), max(chunks)
            self.forward([list(chunks.get(row, ())) for row in range(lo, hi + 1)], start=lo)
            return
        chunks = {row: list(ids) for row, ids in chunks.items() if len(ids)}
        for row, ids in chunks.items():
            self._check([ids], row)
        for row, ids in chunks.items():
            while ids:
                n = PREFILL_CHUNK - int(self.pos[row]) % PREFILL_CHUNK if row in aligned else len(ids)
                self._run([ids[:n]], row)
                ids = ids[n:]

    def _run(self, tokens, start):
        """Calls over rows start..start+B-1 (B = 1, or at most one token a row) in pieces of at most MAX_T
        tokens. Returns the last call's logits [B, V]."""
        B = len(tokens)
        while True:
            n = np.array([min(len(t), MAX_T) for t in tokens], np.int64)               # [B]
            io, host = self._binding(start, B, int(n.max()))
            host["input_ids"][:] = 0                                                    # [B, T], right-padded
            for b, t in enumerate(tokens):
                host["input_ids"][b, :n[b]] = t[:n[b]]
            host["positions"][:] = self.pos[start:start + B]
            host["last"][:] = np.maximum(n - 1, 0)
            self.session.run_with_iobinding(io)
            self.pos[start:start + B] += n
            tokens = [t[m:] for t, m in zip(tokens, n)]
            if not any(len(t) for t in tokens):
                return host["logits"].copy()

    def _binding(self, start, B, T):
        """The IOBinding of a call over rows start..start+B-1 with T tokens a row, and its host arrays
        (filled in place before each run). present_* are bound to the past_* memory (a call's rows are
        contiguous: the leading axis), so the graph writes each row's new K/V into the cache itself.
        Kept for T = 1 (binding 4L + 4 names cost ~0.65 ms a call: 8% of a B=1 run's draft time)."""
        if (start, B, T) in self._bindings:
            return self._bindings[start, B, T]
        io = self.session.io_binding()
        host = {"input_ids": np.zeros((B, T), np.int64), "positions": np.zeros(B, np.int64),
                "last": np.zeros(B, np.int64), "logits": np.zeros((B, self.vocab_size), np.float32)}
        for name, x in host.items():
            (io.bind_output if name == "logits" else io.bind_input)(name, "cpu", 0, x.dtype, list(x.shape),
                                                                    x.ctypes.data)
        shape = [B] + list(self.keys[0].shape[1:])                                      # [B, KV, S+1, D]
        for name, buf in self.cache:
            at = buf[start].ctypes.data
            io.bind_input(f"past_{name}", "cpu", 0, self.dtype, shape, at)
            io.bind_output(f"present_{name}", "cpu", 0, self.dtype, shape, at)
        if T == 1:
            self._bindings[start, B, T] = io, host
        return io, host

    def _forward_bound(self, tokens, start):
        """The ascend profile: rows 0..Bb-1 run together, Bb the bucket covering every cached row (the
        buffer a call writes must hold them all), in calls of at most T_BUCKETS[-1] tokens a row.
        Returns logits [B, V] after each row's last token."""
        B, chunk = len(tokens), T_BUCKETS[-1]
        cached = np.flatnonzero(self.pos)
        todo = [[] for _ in range(_bucket(max(start + B, cached[-1] + 1 if len(cached) else 0),
                                          self.device_kv.b_buckets))]
        for b, t in enumerate(tokens):
            todo[start + b] = [int(x) for x in t]
        out = np.zeros((B, self.vocab_size), np.float32)                                # [B, V]
        while any(todo):
            logits = self.device_kv.run(self.pos, [t[:chunk] for t in todo])           # [Bb, V]
            for b in range(B):
                if 0 < len(todo[start + b]) <= chunk:  # the row's last token was in this call
                    out[b] = logits[start + b]
            self.pos[:len(todo)] += [min(len(t), chunk) for t in todo]
            todo = [t[chunk:] for t in todo]
        return out

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

    def swap(self, a, b):
        """Exchange rows a and b, cached positions and all (host cache only: the engine parks a
        finished row among the spare ones)."""
        a, b = self._row(a), self._row(b)
        if self.device_kv:
            raise MindspecError("swap needs the host cache (cpu profile)")
        p = int(max(self.pos[a], self.pos[b]))
        if a != b and p:
            for buf in (self.keys, self.values):
                for x in buf:
                    x[[a, b], :, :p] = x[[b, a], :, :p]                                  # [2, KV, p, D]
        self.pos[[a, b]] = self.pos[[b, a]]

    def move(self, src, dst):
        """Copy row src's cached positions into row dst (keeps the running rows contiguous)."""
        src, dst = self._row(src), self._row(dst)
        p = int(self.pos[src])
        if src != dst and self.device_kv:
            self.device_kv.move(src, dst)
        elif src != dst:
            for k, v in zip(self.keys, self.values):
                k[dst, :, :p], v[dst, :, :p] = k[src, :, :p], v[src, :, :p]            # [KV, p, D]
        self.pos[dst] = p


class BoundCache:
    """The ascend profile's KV cache: OrtValues on the session's device (CANN, or CPU where there is no
    NPU: the same code path), double-buffered (the present_* buffers call n writes are the past_* call
    n+1 reads) and bound with IOBinding, so the cache never visits the host: only the small per-token
    inputs go in and the logits come back. A call runs rows 0..Bb-1 (row-major: a prefix of each
    buffer) and Bb covers every row with something cached, so the buffer it writes holds them all: the
    rows beyond are stale there, and empty."""

    def __init__(self, session, m, rows, seq, threads=None):
        import onnxruntime as ort
        self.session, self.seq, self.b_buckets = session, seq, batch_buckets(rows)
        self.vocab, self.table = m["vocab_size"], m["max_seq"]  # table: positions of the graph's RoPE tables
        self.dtype = np.dtype(m["dtype"])
        self.where = ("cann", device_id()) if session.get_providers()[0] == "CANNExecutionProvider" else ("cpu", 0)
        self.names = [f"{n}_{i}" for i in range(m["num_layers"]) for n in ("key", "value")]
        self.shape = (rows, m["num_key_value_heads"], seq, m["head_dim"])               # [R, KV, S, D]
        # zeroed (stale slots are masked, but must be finite: no NaN scores), from numpy: onnxruntime's python
        # binding copies an array to CANN (ortvalue_from_numpy), but neither allocates nor updates an OrtValue
        # there (ortvalue_from_shape_and_type, update_inplace: CPU and GPU only); on the CPU it wraps the
        # array, one per buffer (the OrtValue keeps it)
        self.bufs = [[ort.OrtValue.ortvalue_from_numpy(np.zeros(self.shape, self.dtype), *self.where)
                      for _ in self.names] for _ in range(2)]
        self.cur, self.hosts, self.bindings, self.seen = 0, {}, {}, set()  # seen: (B, T, S) fed
        self.threads, self._mover = threads, None

    def _host(self, B, T):
        """The host side of a (B, T) call: inputs filled in place before each run, logits written by it."""
        if (B, T) not in self.hosts:
            self.hosts[B, T] = {"input_ids": np.zeros((B, T), np.int64), "positions": np.zeros((B, T), np.int64),
                                "slots": np.zeros((B, T), np.int64), "last_index": np.zeros(B, np.int64),
                                "logits": np.zeros((B, self.vocab), np.float32)}
        return self.hosts[B, T]

    def _bind(self, io, name, buf, shape, output=False):
        """Bind `buf` (an OrtValue of this cache, or a host numpy array) by address with `shape`."""
        where, dtype, ptr = (self.where, self.dtype, buf.data_ptr()) if hasattr(buf, "data_ptr") else \
            (("cpu", 0), buf.dtype, buf.ctypes.data)
        (io.bind_output if output else io.bind_input)(name, *where, dtype, list(shape), ptr)

    def _binding(self, B, T):
        """The IOBinding of a (B, T) call reading buffer `cur` and writing the other, made once."""
        key = (B, T, self.cur)
        if key not in self.bindings:
            io, host = self.session.io_binding(), self._host(B, T)
            for name in ("input_ids", "positions", "slots", "last_index"):
                self._bind(io, name, host[name], host[name].shape)
            self._bind(io, "logits", host["logits"], host["logits"].shape, output=True)
            rows = (B,) + self.shape[1:]                                                 # [B, KV, S, D]
            for j, n in enumerate(self.names):
                self._bind(io, f"past_{n}", self.bufs[self.cur][j], rows)
                self._bind(io, f"present_{n}", self.bufs[1 - self.cur][j], rows, output=True)
            self.bindings[key] = io
        return self.bindings[key], self._host(B, T)

    def run(self, pos, take):
        """One call over rows 0..len(take)-1: row b's tokens take[b] (a list, maybe empty) at positions
        pos[b]... Returns the logits [B, V] after each row's last token (valid until the next call)."""
        B, n = len(take), np.array([len(t) for t in take], np.int64)                   # [B]
        T = _bucket(int(n.max()), T_BUCKETS)
        io, h = self._binding(B, T)
        h["input_ids"][:] = 0
        for b, t in enumerate(take):
            h["input_ids"][b, :len(t)] = t
        p = pos[:B, None] + np.arange(T)                                                 # [B, T]
        np.minimum(p, self.table - 1, out=h["positions"])  # padding may pass the table: any position will do
        h["slots"][:] = np.where(np.arange(T) < n[:, None], p, -1)                       # padding writes nowhere
        h["last_index"][:] = np.arange(B) * T + np.maximum(n - 1, 0)
        self.session.run_with_iobinding(io)
        self.seen.add(h["input_ids"].shape + (self.seq,))
        self.cur ^= 1
        return h["logits"]

    def move(self, src, dst):
        """Row dst := row src in every buffer of the cache, on the device (a small graph of its own)."""
        if self._mover is None:
            self._mover = self._start_mover()
        session, host, bindings = self._mover
        host["src"][0], host["dst"][:] = src, False
        host["dst"][dst] = True
        if self.cur not in bindings:
            io = bindings[self.cur] = session.io_binding()
            for name in ("src", "dst"):
                self._bind(io, name, host[name], host[name].shape)
            for j in range(len(self.names)):
                self._bind(io, f"cache_{j}", self.bufs[self.cur][j], self.shape)
                self._bind(io, f"moved_{j}", self.bufs[1 - self.cur][j], self.shape, output=True)
        session.run_with_iobinding(bindings[self.cur])
        self.cur ^= 1

    def _start_mover(self):
        from .builder import build_row_copy
        model = build_row_copy(len(self.names), self.shape, self.dtype.name).SerializeToString()
        graph = self.where[0] == "cann"
        session = start_session("row copy graph", make_session_options(self.threads),
                                providers("Ascend" if graph else "CPU", graph=graph), model=model)
        host = {"src": np.zeros(1, np.int64), "dst": np.zeros((self.shape[0], 1, 1, 1), bool)}
        return session, host, {}
