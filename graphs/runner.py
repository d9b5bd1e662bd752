"""TargetModel: the compiled target graphs over a slotted KV cache. It keeps no per-request state:
the engine says, per call, which slot each row uses and at which position (rollback = the engine
moving that integer)."""
import fcntl
import hashlib
import os
import shutil
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Tensor

from mindspec import reference, signals
from mindspec.errors import MindspecError
from mindspec.device import detect_device, device_id
from mindspec.spec import PREFILL_CHUNK, attention_windows, cache_positions, round_up
from . import cache_budget
from .fuse import rot_rows_for
from .llama import GreedyStep, LlamaDecoder, Logits, Prefill, SampleStep
from .exact import redo_prefill, redo_step
from .sampling import TOPK_CAP
from .tp import all_reduce_sum, tp_layout, tp_size


JIT_LEVELS = {"CPU": "O0", "Ascend": None}  # CPU: O1 measured 5-10% slower per call (default model); Ascend:
# not measured yet, MindSpore's own default (O0)
JIT_ENV = "MINDSPEC_JIT_LEVEL"  # O0 | O1: try another level without a code change (part of the cache key)


def jit_level(device):
    level = os.environ.get(JIT_ENV) or JIT_LEVELS.get(device)
    if level not in (None, "O0", "O1"):
        raise MindspecError(f"{JIT_ENV} must be O0 or O1, got {level!r}")
    return level


_STARTED_BY = None  # the process that set MindSpore up (kept across a fork: a child sees its parent's)


def init_mindspore(device=None):
    """GRAPH_MODE on the detected (or given) device, at its jit level. Refused in a process forked from one that
    did it (a library prober's: the child's first graph call hung for ever, deaf to SIGTERM)."""
    global _STARTED_BY
    if _STARTED_BY not in (None, os.getpid()):
        raise MindspecError(f"MindSpore was set up by process {_STARTED_BY}, and a process forked from it cannot "
                            "use it again (its threads do not survive a fork: it would hang): start children with "
                            "multiprocessing's \"spawn\" method, or fork before loading")
    _STARTED_BY = os.getpid()
    device = detect_device(device)
    ms.set_context(mode=ms.GRAPH_MODE)
    level = jit_level(device)
    if level:
        ms.set_context(jit_config={"jit_level": level})
    if tp_size() == 1:  # under msrun, init_tp() already set this rank's device id
        ms.set_device(device, 0 if device == "CPU" else device_id())
    return device


_COMPILES = 0  # graphs compiled in this process (see TargetModel.warmup)


def _source_hash():
    """The graph code's identity, part of the compile-cache key: read once, at import, so it is the
    code this process runs even if the files change later. The reference's file too: it defines the
    RoPE tables the graphs hold as constants."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    names = [os.path.join(here, n) for n in sorted(os.listdir(here)) if n.endswith(".py")]
    for path in names + [reference.__file__]:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


_SOURCE = _source_hash()


def _pin_cache_dependencies():
    """MindSpore checks cached graphs against a hash of the entry script and of every module it imports
    from outside sys.path, a list that depends on the working directory: run from the repository, the
    package is on sys.path and only the entry script counts; from anywhere else each imported mindspec
    module does. So a command run from another directory than the last one compiled every graph again
    (found: `mindspec batch` from two directories, a cold compile each time). The graphs depend on this
    package's graph code, which the cache key covers (_SOURCE): MindSpore's list is pinned to those
    files. (A private MindSpore function; where it is missing the cache still works, per directory.)
    Returns what puts MindSpore's own back (other networks in the process keep MindSpore's check)."""
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, n) for n in sorted(os.listdir(here)) if n.endswith(".py")]
    saved = {}
    for name in ("mindspore.graph.api", "mindspore.common.api"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "_get_compile_cache_dep_files"):
            saved[mod] = mod._get_compile_cache_dep_files
            mod._get_compile_cache_dep_files = lambda: list(files)
    return lambda: [setattr(mod, "_get_compile_cache_dep_files", f) for mod, f in saved.items()]


@dataclass
class RowSampling:
    """Per-row sampling inputs of one step (n rows): temperature, top_k, top_p, penalty [n]; seen [n, V]
    (None: no row penalises); q [n, K, V] draft probabilities (None for K = 0); u_acc [n, K] and
    u_smp [n, K+1] uniforms; presence, frequency [n] and the output's counts [n, V] (None: none of them)."""
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    penalty: np.ndarray
    u_acc: np.ndarray
    u_smp: np.ndarray
    seen: Optional[np.ndarray] = None
    q: Optional[np.ndarray] = None
    presence: Optional[np.ndarray] = None
    frequency: Optional[np.ndarray] = None
    counts: Optional[np.ndarray] = None

    @classmethod
    def greedy(cls, n, K=0, V=None):
        """n plain greedy rows (uniforms 0.5; q uniform when V is given and K > 0)."""
        q = np.full((n, K, V), 1.0 / V, np.float32) if V and K else None
        return cls(np.zeros(n, np.float32), np.zeros(n, np.int64), np.ones(n, np.float32), np.ones(n, np.float32),
                   np.full((n, max(K, 1)), 0.5, np.float32), np.full((n, K + 1), 0.5, np.float32), q=q)


@dataclass
class Logprobs:
    """The target's log-probabilities (of its raw logits) at each position of a call, per row: lp
    [n, T] of the token committed there; top_lp [n, T, N] and top_id [n, T, N] the N most likely."""
    lp: np.ndarray
    top_lp: np.ndarray
    top_id: np.ndarray

    def at(self, row, t, n_top):
        """Position t of a row: (logprob, [(id, logprob)] of its n_top best)."""
        return float(self.lp[row, t]), [(int(i), float(x)) for i, x in
                                        zip(self.top_id[row, t, :n_top], self.top_lp[row, t, :n_top])]


POISONED = "An error occurred in the previous step of this model execution"  # (MindSpore's words)


class TargetModel:
    """Target graphs for `max_batch` slots of `max_seq` committed positions (a multiple of
    PREFILL_CHUNK); `batch_buckets` / `k_buckets` are the compiled (B, K) shapes; dtype ("float32",
    "float16", "bfloat16") of the weights, activations and KV cache."""

    def __init__(self, ckpt, max_seq, k_buckets=(1, 2, 4, 8), batch_buckets=(1,), max_batch=1, dtype="float32"):
        self.cfg = ckpt.config
        self.max_seq = round_up(max_seq, PREFILL_CHUNK)
        self.k_buckets, self.batch_buckets = tuple(sorted(k_buckets)), tuple(sorted(batch_buckets))
        self.max_batch, self.dtype = max_batch, dtype  # weights, activations and KV cache (see llama.py)
        # One row of one token would run its matmuls with M = 1, a kernel whose rounding differs from the
        # M >= 2 one every verify call uses (in float16 that flipped near-tied argmaxes on 2 of 10
        # default-model prompts) and that is slower on CPU. So a one-row decode runs as a verify of the
        # smallest bucket with no valid draft: the kernels of speculation, and 0.87-0.94x the time
        # (default model, 2 cores). See _widen.
        self.rot_rows = rot_rows_for(ms.get_context("device_target"))
        S = cache_positions(self.max_seq, self.k_buckets)
        self.windows = attention_windows(S)  # a call attends over the smallest that holds its rows (_window)
        self._keys = {W: Tensor(np.arange(W, dtype=np.int32)) for W in self.windows}
        self.decoder = LlamaDecoder(self.cfg, ckpt.get, S, slots=max_batch, dtype=getattr(ms, dtype),
                                    rot_rows=self.rot_rows)
        self.cells = {kind: self._cell(kind) for kind in ("greedy", "sample", "penal", "prefill", "logits")}
        self.fingerprint = ckpt.fingerprint()
        self.compiled, self.compile_s = set(), 0.0
        # a graph compiling now, and when the last compile ended (monotonic): a server's step that compiles is not
        # hung (serve.App.stalled)
        self.compiling, self.compiled_at = False, 0.0
        # graphs run at least once, and how many calls were a graph's first run (one costs ~0.3-0.9 s more
        # than the next, default model, 2 cores: timings that include one say nothing of the steady state)
        self.ran, self.cold_runs, self.warm_names = set(), 0, []
        self.pending = []  # graphs warm-up left to load_next, in its order
        self._cache = None  # (path, lock, writing) of the compile cache the pending graphs go through
        self._caching = None  # the compile cache path of the graph compiling now (load_next), or None
        self.load_error = None  # why the next pending graph did not compile (load_next)
        self.writes = 0  # graph runs (each writes K/V into cache slots): the engine's prefix cache checks it
        self.host_rows = 0  # sampling rows redone on the host (_sampled)
        self._no_seen = {}  # B -> zeros [B, V]

    def _cell(self, kind):
        """A cell of the graphs of one kind (one compiled graph per input shape), over the shared decoder."""
        cls, *args = {"greedy": (GreedyStep,), "sample": (SampleStep, TOPK_CAP), "prefill": (Prefill, TOPK_CAP),
                      "penal": (SampleStep, TOPK_CAP, True),  # (rows with presence/frequency penalties: first need)
                      "logits": (Logits,)}[kind]
        cell = cls(self.decoder, *args)
        cell.set_train(False)
        return cell

    def _run(self, kind, shape, *args, dry=False):
        """Call a graph; the first call of each (graph, shape) compiles it. Every input is a Tensor
        (a Python number would recompile per value). dry: compile (or load from the compile cache)
        without running, returns None (warm-up compiles only; each graph's first run, ~0.3-0.9 s more
        than the next, is left to an idle moment, see warm_next)."""
        key = f"{kind}{shape}"
        try:
            return self._call(kind, key, args, dry)
        except RuntimeError as e:  # after a kernel error MindSpore refuses every later run of that graph: the
            # cell is made afresh then, and the run retried once (its graphs of every shape compile again)
            if dry or POISONED not in str(e):
                raise
            self.cells[kind] = self._cell(kind)
            # (the new cell compiles each shape again: a compile, for compile_s and a server's health)
            self.ran = {k for k in self.ran if not k.startswith(kind + "(")}
            self.compiled = {k for k in self.compiled if not k.startswith(kind + "(")}
            return self._call(kind, key, args, dry)

    def _call(self, kind, key, args, dry):
        if not dry:
            self.writes += 1
            if key in self.ran:
                return self.cells[kind](*args)
        global _COMPILES
        fresh = key not in self.compiled
        _COMPILES += fresh
        t = time.perf_counter()
        self.compiling = fresh
        try:
            with cache_budget.compile_env(self._caching if fresh else None):  # (its first run: cache off)
                out = self.cells[kind].compile(*args) if dry else self.cells[kind](*args)
        finally:
            if fresh:
                self.compiling, self.compiled_at = False, time.monotonic()
        if dry or fresh:  # the first run of a graph compiled dry builds what compile left: not compile time
            self.compile_s += time.perf_counter() - t
        self.compiled.add(key)
        if not dry:
            self.ran.add(key)
            self.cold_runs += 1
        return out

    def _sampled(self, kind, shape, *args, dry=False):
        """The outputs of a sampling graph as numpy arrays, the rows whose kept set its top-k candidates did
        not hold redone on the host from the step's logits (graphs/exact.py; counted in host_rows)."""
        if dry:
            return self._run(kind, shape, *args, dry=True)
        *out, exact, logits = self._run(kind, shape, *args)
        out = [x.asnumpy() for x in out]
        # (a prefill's -1: a prompt position not finite, which its last logits do not show; a step's: redone,
        # the host's n may stop before the graph's did)
        rows = np.flatnonzero(~exact.asnumpy() & ((out[0] >= 0) if kind == "prefill" else True))
        if len(rows):
            self.host_rows += len(rows)
            out = [np.array(x) for x in out]  # (changed in place)
            inputs = [a.asnumpy() for a in args[:-1]]  # (the keys left out)
            if kind == "prefill":
                redo_prefill(rows, logits.asnumpy(), *inputs[4:], out)
            else:
                redo_step(rows, logits.asnumpy(), inputs[0], *inputs[3:], out)
        return out

    @staticmethod
    def _i32(a):
        return Tensor(np.ascontiguousarray(a, np.int32))

    @staticmethod
    def _f32(a):
        return Tensor(np.ascontiguousarray(a, np.float32))

    def _seen(self, seen, B):
        if seen is not None:
            return self._f32(seen)
        if B not in self._no_seen:
            self._no_seen[B] = Tensor(np.zeros((B, self.cfg.vocab_size), np.float32))
        return self._no_seen[B]

    def _bucket(self, n):
        return next(b for b in self.batch_buckets if b >= n)

    def _window(self, need):
        """The attention window of a call whose real rows reach position need - 1."""
        return next(w for w in self.windows if w >= need)

    def _top_k(self, s):
        """RowSampling s's top_k [n], at most the vocabulary (k >= V means off; keeps int32 in range)."""
        return np.minimum(np.asarray(s.top_k, np.int64), self.cfg.vocab_size)

    def _pad(self, n, B, slots):
        """n real rows in a call of bucket B: (slot_of [B], each row's slot, padding rows in one slot no
        real row of the call uses; pad(a, fill) -> [B, ...], the padding rows filled). Padding rows write
        at positions >= max_seq - 1 of that slot: positions any row writes again before attending to them."""
        def pad(a, fill=0):
            a = np.asarray(a)
            if n == B:
                return a
            return np.concatenate([a, np.full((B - n,) + a.shape[1:], fill, a.dtype)])
        spare = int(np.setdiff1d(np.arange(self.max_batch), slots)[0]) if n < B else 0
        return pad(slots, spare), pad

    def prefill(self, slots, pos, chunks, s, dry=False, logprobs=False):
        """Feed one prompt chunk per row (chunks [n]: at most PREFILL_CHUNK ids each) at pos [n] of
        slots [n]; return the token sampled after each chunk [n] with the rows' RowSampling s (u_smp
        [n, 1]; temperature 0: greedy), and with logprobs their Logprobs ([n, 1], see step). Padding
        rows of the bucket write past max_seq (cache_positions' tail). dry: only compile (see _run)."""
        n, C = len(chunks), PREFILL_CHUNK
        assert all(1 <= len(c) <= C for c in chunks), [len(c) for c in chunks]
        if any(p + len(c) > self.max_seq for p, c in zip(pos, chunks)):
            raise MindspecError(f"prompt would exceed the target's max_seq {self.max_seq}")
        B, W = self._bucket(n), self._window(max(p + len(c) for p, c in zip(pos, chunks)))
        slot_of, pad = self._pad(n, B, slots)
        ids = np.zeros((n, C), np.int32)
        for i, c in enumerate(chunks):
            ids[i, :len(c)] = c
        args = (self._i32(pad(ids)), self._i32(slot_of), self._i32(pad(pos, self.max_seq)),
                self._i32(pad([len(c) - 1 for c in chunks])), self._f32(pad(np.asarray(s.u_smp)[:, 0], 0.5)),
                self._f32(pad(s.temperature)), self._i32(pad(self._top_k(s))), self._f32(pad(s.top_p, 1)),
                self._f32(pad(s.penalty, 1)), self._seen(None if s.seen is None else pad(s.seen), B), self._keys[W])
        out = self._sampled("prefill", (B, C, W), *args, dry=dry)
        if dry:
            return None
        tok = out[0][:n].astype(np.int64)
        return (tok, Logprobs(*(x[:n] for x in out[1:4]))) if logprobs else tok

    def step(self, ids, slots, pos, n_valid, s=None, dry=False, logprobs=False):
        """One decode (K = 0) or verify step over n rows: ids [n, K+1] (last committed token + K drafts),
        slots, pos, n_valid [n]; s: RowSampling, None when every row is plain greedy. Rows are padded
        to the batch bucket (_pad: padding rows in a slot no real row uses). Returns
        (n_accepted [n], next [n]) int arrays, and with logprobs (s required: the sampling graph has
        the whole logits) the Logprobs of the committed tokens, [n, K+1] (dry: None, the graph only
        compiled, see _run)."""
        ids = np.asarray(ids, np.int32)
        B = self._bucket(len(ids))
        ids, s = self._widen(ids, s, B)
        n, T = ids.shape
        K = T - 1
        assert K == 0 or K in self.k_buckets, (K, self.k_buckets)
        if (np.asarray(pos) + T > self.max_seq + max(self.k_buckets)).any():
            raise MindspecError(f"sequence would exceed the target's max_seq {self.max_seq}")
        slot_of, rows = self._pad(n, B, slots)
        W = self._window(int(np.max(pos)) + T)
        head = (self._i32(rows(ids)), self._i32(slot_of), self._i32(rows(pos, self.max_seq - 1)),
                self._i32(rows(n_valid)))
        if s is None:
            assert not logprobs, "logprobs come from the sampling graph: pass RowSampling"
            out = self._run("greedy", (B, T, W), *head, self._keys[W], dry=dry)
        else:
            V = self.cfg.vocab_size
            q = s.q if K else np.zeros((n, 1, V), np.float32)
            u_acc = s.u_acc if K else np.zeros((n, 1), np.float32)
            kind = "sample" if s.counts is None else "penal"
            out = self._sampled(kind, (B, T, W), *head, self._f32(rows(q)), self._f32(rows(u_acc, 0.5)),
                                self._f32(rows(s.u_smp, 0.5)), self._f32(rows(s.temperature)),
                                self._i32(rows(self._top_k(s))), self._f32(rows(s.top_p, 1)),
                                self._f32(rows(s.penalty, 1)),
                                self._seen(None if s.seen is None else rows(s.seen), B),
                                self._seen(None if s.counts is None else rows(s.counts), B),
                                self._f32(rows(np.zeros(n) if s.presence is None else s.presence)),
                                self._f32(rows(np.zeros(n) if s.frequency is None else s.frequency)),
                                self._keys[W], dry=dry)
        if dry:
            return None
        if s is None:
            out = [x.asnumpy() for x in out]  # (_sampled's are numpy already)
        acc, nxt = out[0][:n].astype(np.int64), out[1][:n].astype(np.int64)
        return (acc, nxt, Logprobs(*(x[:n] for x in out[2:5]))) if logprobs else (acc, nxt)

    def _decode_k(self, B, K):
        """The K a step of batch bucket B and K drafts really runs (a one-row decode: a verify, see __init__)."""
        return self.k_buckets[0] if K == 0 and B == 1 else K

    def _widen(self, ids, s, B):
        """ids [n, 1] of a one-row decode (batch bucket B) -> [n, 1 + k] (the token repeated: dummy drafts,
        never valid, their K/V past the row's position, stale) and its RowSampling padded to k drafts;
        else unchanged."""
        n, T = ids.shape
        k = self._decode_k(B, T - 1)
        if k == T - 1:
            return ids, s
        if s is not None:
            V = self.cfg.vocab_size
            u_smp = np.concatenate([np.asarray(s.u_smp, np.float32)[:, :1], np.full((n, k), 0.5, np.float32)], 1)
            s = replace(s, q=np.full((n, k, V), 1.0 / V, np.float32), u_acc=np.full((n, k), 0.5, np.float32),
                        u_smp=u_smp)
        return np.repeat(ids, k + 1, 1), s

    def logits(self, slot, pos, ids):
        """Full logits [T, V] of ids fed at pos of slot (tests and numerical checks)."""
        T = len(ids)
        W = self._window(pos + T)
        out = self._run("logits", (1, T, W), self._i32(np.reshape(ids, (1, T))), self._i32([slot]), self._i32([pos]),
                        self._keys[W])
        return out.asnumpy()[0]

    # ---- warm-up: compile before timing, through MindSpore's compile cache when that is safe ----

    def graph_names(self, batch_sizes, ks, greedy=True, sample=False, reach=None, penal=False):
        """The graphs (kind, B, T, W) a run over these batch sizes and K values (0: plain decode) needs,
        in a fixed order; reach: the most positions a row of the run holds (None: the whole cache), so
        no window larger than the one that holds it; penal: the sampling graphs of rows with presence or
        frequency penalties too."""
        top = self._window(min(reach + max(self.k_buckets), self.windows[-1])) if reach else self.windows[-1]
        names = []
        for B in batch_sizes:
            for W in (w for w in self.windows if w <= top):
                names.append(("prefill", B, PREFILL_CHUNK, W))
                for K in dict.fromkeys(self._decode_k(B, K) for K in ks):
                    names += [(kind, B, K + 1, W) for kind, on in (("greedy", greedy), ("sample", sample),
                                                                   ("penal", penal)) if on]
        return names

    def warmup(self, names, cache_dir=None, now=None):
        """Compile the graphs `names` (graph_names). `now`: where the compile cache holds every one of them
        (under tensor parallelism: every rank's own entry), only the first `now` here, the rest left pending
        for load_next (a server says ready once its one-row graphs are in and loads the others while it
        serves; a graph not in the cache compiles for seconds, so without a whole cache all of them compile
        here). Graphs an earlier warm-up left pending are compiled first. Compiling runs no graph: it writes
        no slot.

        With `cache_dir`, the graphs are saved to / loaded from MindSpore's compile cache, but only
        when they are the first graphs compiled in this process: MindSpore numbers the graphs it compiles
        with the cache on (graphs compiled with it off between them, e.g. a graph a request needed while
        some are pending, take no number) and reads the cache path once, so only a fixed compile order
        from a fresh process maps every cached file to the right graph (otherwise it handed a verify
        graph of another K to a run that compiled in another order). MindSpore also reads the entry
        script (sys.argv[0]) for the cache, so a `python -c` or stdin script runs without it."""
        while self.load_next():
            pass
        self.load_error = None  # a new warm-up tries again what failed
        self.warm_names += [n for n in names if n not in self.warm_names]
        self.pending = [(kind, *shape) for kind, *shape in names if f"{kind}{tuple(shape)}" not in self.compiled]
        if not self.pending:
            return
        whole, cached = False, cache_dir and _COMPILES == 0 and os.path.isfile(sys.argv[0] if sys.argv else "")
        if cached:
            path = os.path.join(cache_dir, self.cache_key(names))
            try:  # (held until the last pending graph is in)
                os.makedirs(cache_dir, exist_ok=True)
                lock = open(path + ".lock", "w")  # noqa: SIM115
            except OSError as e:  # a read-only or full MINDSPEC_HOME: the graphs compile, only not cached
                print(f"mindspec: warning: no compile cache in {cache_dir} ({e.strerror or e}): graphs compile "
                      f"afresh in each process", file=sys.stderr)
                cached = False
            whole = cached and os.path.exists(path + ".whole")
        if tp_size() > 1:  # ranks must hold the same graphs: whole only where every rank's entry is (agreed before
            # any lock: a rank waiting in a collective while holding one could deadlock two jobs sharing a cache)
            whole = all_reduce_sum(np.array([not whole], np.float32))[0] == 0
        if cached:  # one process fills an entry while the others wait; once whole, readers share it (a server
            # may hold it for as long as some graphs stay pending)
            fcntl.flock(lock, fcntl.LOCK_SH if whole else fcntl.LOCK_EX)
            if tp_size() == 1:  # filled while this one waited, or gone (cache_budget): a shared lock writes nothing
                whole = os.path.exists(path + ".whole")
                if not whole:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # (from LOCK_SH: it may wait for another writer)
                    whole = os.path.exists(path + ".whole")
            self._cache = (path, lock, not whole)  # (writing: this process fills the entry, under LOCK_EX)
            try:
                cache_budget.evict(cache_dir, os.path.basename(path))  # the least recently used others, over the bound
            except OSError:  # (it never stops a run)
                pass
            if not whole:
                self._cache_full(cache_budget.MIN_FREE, f"has under {cache_budget.MIN_FREE >> 20} MB free")
        first = set(names[:now] if whole else names)
        while self.pending and self.pending[0] in first and self.load_next():
            pass

    def load_next(self):
        """Compile the next graph warm-up left pending; returns whether there was one. A graph that fails
        to compile raises, stays pending (ready_rows stays below its batch) and is not tried again until
        the next warm-up."""
        if not self.pending or self.load_error is not None:
            return False
        signals.check()  # a stop raised inside MindSpore's compiler was swallowed or dumped an error
        kind, B, T, W = self.pending[0]
        if self._cache is not None and f"{kind}{(B, T, W)}" in self.compiled:
            self._close_cache()  # compiled meanwhile without the cache, it takes no number there: the graphs
            # after it would load the files of the ones before, so they compile afresh
        cached = self._cache is not None
        if cached:
            self._caching = self._cache[0]  # (_call: this compile alone; later graphs compile in any order)
            unpin = _pin_cache_dependencies()
        try:
            self._compile(kind, B, T - 1, W)
        except Exception as e:
            self.load_error = e
            self._close_cache()
            raise
        finally:
            if cached:
                self._caching = None
                unpin()
        self.pending.pop(0)
        if cached and self._cache is not None and self._cache[2]:  # (a reader's entry is whole: never dropped)
            self._cache_full(cache_budget.FULL, f"came within {cache_budget.FULL >> 20} MB of full as graphs were "
                             "saved")
        if not self.pending and self._cache is not None:
            try:
                open(self._cache[0] + ".whole", "w").close()  # every graph of this entry is in it
            except OSError:  # (a disk full to its last inode: not marked, compiled again next time)
                pass
            self._close_cache()
        return True

    def _cache_full(self, least, said):
        """With under `least` bytes free on the compile cache's disk, drop the entry being written (its files may be
        cut short: never marked whole) and compile on without the cache."""
        path = self._cache[0]
        try:
            free = cache_budget.free_bytes(os.path.dirname(path))
        except OSError:
            return
        if free < least:
            shutil.rmtree(path, ignore_errors=True)  # (under the lock: a writer waiting for it finds no remains)
            self._close_cache()
            print(f"mindspec: warning: the disk of {os.path.dirname(path)} {said} ({free >> 20} MB free): graphs "
                  "compile afresh in each process, not saved to the compile cache", file=sys.stderr, flush=True)

    def _close_cache(self):
        if self._cache is not None:
            self._cache[1].close()  # the lock
            self._cache = None

    def ready_rows(self):
        """The most rows a call may hold without compiling a graph warm-up left pending: the largest batch
        bucket below every pending graph's (every slot when none is pending)."""
        if not self.pending:
            return self.max_batch
        low = min(B for _, B, *_ in self.pending)
        return max([b for b in self.batch_buckets if b < low], default=0)

    def cache_key(self, names):
        """The compile-cache directory name of these graphs: everything a compiled graph depends on,
        the device, jit level, dtype and TP layout included (MindSpore separates cached graphs by rank id,
        not by world size), and the configuration as read (config.json's bytes are in the fingerprint, but
        a reading of them can change: a transformers 5 file's RoPE base once read as 10000)."""
        device = ms.get_context("device_target")
        key = repr((device, jit_level(device), self.fingerprint, self.cfg, self.dtype, self.max_seq, self.max_batch,
                    self.k_buckets, names, TOPK_CAP, _SOURCE, tp_layout()))
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def cold(self):
        """The warmed-up graphs (warmup's names) compiled but never run."""
        return [(kind, *shape) for kind, *shape in self.warm_names
                if f"{kind}{tuple(shape)}" in self.compiled and f"{kind}{tuple(shape)}" not in self.ran]

    def cold_count(self):
        """Graphs warm-up named that have not run yet: pending (not compiled) or cold."""
        return len(self.pending) + len(self.cold())

    def warm_next(self):
        """Run one graph that warm-up compiled but nothing ran yet, on dummy inputs (it writes into
        slots 0..B-1: call it only while no request holds a slot). Compiling without running leaves
        ~0.3 s a graph (default model, 2 cores) to its first run; an idle server pays it here instead
        of a request. Returns whether a graph ran."""
        todo = self.cold()
        if todo:
            kind, B, T, W = todo[0]
            self._compile(kind, B, T - 1, W, dry=False)
        return bool(todo)

    def _compile(self, kind, B, K, W, dry=True):
        """Compile (dry) or run a graph on dummy rows that reach into window W."""
        need = min(W, self.max_seq)  # (a step's rows end by max_seq in the windows below the whole cache)
        if kind == "prefill":
            return self.prefill(np.arange(B), np.full(B, need - 1), [[0]] * B, RowSampling.greedy(B), dry=dry)
        s = RowSampling.greedy(B, K, self.cfg.vocab_size) if kind in ("sample", "penal") else None
        if kind == "penal":
            s.counts = np.zeros((B, self.cfg.vocab_size), np.float32)  # (what makes step() run that kind)
        T = self._decode_k(B, K) + 1
        self.step(np.zeros((B, K + 1)), np.arange(B), np.full(B, need - T), np.zeros(B), s, dry=dry)
