"""TargetModel: the compiled target graphs plus the one integer that says how much cache is valid."""
import hashlib
import os
import time

import numpy as np
import mindspore as ms
from mindspore import Tensor

from mindspec.errors import MindspecError
from .llama import Argmax, GreedyVerify, LlamaDecoder, Logits
from .tp import tp_layout, tp_size
from .sampling import TOPK_CAP, SampleNext, SamplingVerify, scalars

PREFILL_CHUNK = 32  # prompt processed in fixed chunks: one compiled prefill graph for any length
DEFAULT_BUCKETS = (1, 2, 4, 8)


def init_mindspore(device=None):
    """GRAPH_MODE on Ascend when present, else CPU."""
    device = device or ("Ascend" if os.environ.get("ASCEND_HOME_PATH") else "CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    if tp_size() == 1:  # under msrun, init_tp() already set this rank's device id
        ms.set_device(device)
    return device


_COMPILES = 0  # graphs compiled in this process (see TargetModel.warmup)


def _source_hash():
    """The graph code's identity, part of the compile-cache key."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def round_up(n, m):
    return (n + m - 1) // m * m


class TargetModel:
    """Greedy target over a static cache of `max_seq` positions (a multiple of PREFILL_CHUNK)."""

    def __init__(self, ckpt, max_seq, buckets=DEFAULT_BUCKETS, dtype=ms.float32):
        self.cfg = ckpt.config
        self.max_seq = round_up(max_seq, PREFILL_CHUNK)
        self.buckets = tuple(sorted(buckets))
        self.decoder = LlamaDecoder(self.cfg, ckpt.get, self.max_seq, batch=1, dtype=dtype)
        self._logits = Logits(self.decoder)
        self._argmax = Argmax(self.decoder)
        self._verify = GreedyVerify(self.decoder)
        for cell in (self._logits, self._argmax, self._verify):
            cell.set_train(False)
        self.pos = 0  # tokens whose K/V are valid in the cache
        self.fingerprint = ckpt.fingerprint()
        self.compiled, self.compile_s = set(), 0.0
        self._samplers = {}  # (graph class, variant flags) -> cell, built on first use
        self.topk_cap = TOPK_CAP  # top-k/top-p candidates before the (exact) full-sort fallback
        self._no_seen = Tensor(np.zeros((1, self.cfg.vocab_size), np.float32))

    def _run(self, cell, key, ids, *extra):
        """Call a graph; the first call of each (graph, shape) compiles it.
        `extra`: inputs after (ids, start), Tensors only (a Python number recompiles per value)."""
        if key in self.compiled:
            return cell(self._ids(ids), self._start(), *extra)
        global _COMPILES
        _COMPILES += 1
        t = time.perf_counter()
        out = cell(self._ids(ids), self._start(), *extra)
        self.compile_s += time.perf_counter() - t
        self.compiled.add(key)
        return out

    def _start(self):
        return Tensor(np.array(self.pos, np.int32))

    def _ids(self, ids):
        return Tensor(np.asarray(ids, np.int32).reshape(1, -1))

    def _check_room(self, n):
        if self.pos + n > self.max_seq:
            raise MindspecError(f"sequence would exceed the target's max_seq {self.max_seq} "
                                f"(at position {self.pos} + {n})")

    def rollback(self, pos):
        assert 0 <= pos <= self.pos, (pos, self.pos)
        self.pos = pos

    def prefill(self, ids):
        """Feed prompt ids [n] from position pos in fixed-size chunks; return the greedy next token."""
        ids = list(ids)
        self._check_room(round_up(len(ids), PREFILL_CHUNK))
        nxt = None
        for c in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[c:c + PREFILL_CHUNK]
            n = len(chunk)
            # the padding lands in stale cache slots past pos: masked, later overwritten
            g = self._run(self._argmax, "prefill", chunk + [0] * (PREFILL_CHUNK - n)).asnumpy()
            self.pos += n
            nxt = int(g[0, n - 1])
        return nxt

    def decode(self, token):
        """Target-only step: feed one token, return the greedy next token."""
        self._check_room(1)
        g = self._run(self._argmax, "decode", [token]).asnumpy()
        self.pos += 1
        return int(g[0, 0])

    def verify(self, last, drafts):
        """Feed [last] + drafts (K = len(drafts), a compiled bucket) in one graph call.

        Returns (n_accepted, next_token). The cache ends valid for last + accepted drafts."""
        assert len(drafts) in self.buckets, (len(drafts), self.buckets)
        self._check_room(len(drafts) + 1)
        n_acc, nxt = self._run(self._verify, f"verify{len(drafts)}", [last] + list(drafts))
        n = int(n_acc.asnumpy()[0])
        self.pos += 1 + n
        return n, int(nxt.asnumpy()[0])

    def logits(self, ids):
        """Full logits [T, V] for ids fed at pos (tests, sampling). Advances pos."""
        self._check_room(len(ids))
        out = self._run(self._logits, f"logits{len(ids)}", ids).asnumpy()[0]
        self.pos += len(ids)
        return out

    def warmup(self, ks=(), cache_dir=None):
        """Compile prefill, decode and the verify graphs of `ks`, so that
        timed generation measures decoding only. Runs at position 0 and leaves pos at 0.

        With `cache_dir`, the graphs are saved to / loaded from MindSpore's compile cache, but
        only when they are the first graphs compiled in this process: MindSpore names cached
        graphs by the process's compile counter and reads the cache path once, so only a fixed
        compile order from a fresh process maps every cached file to the right graph (otherwise
        it handed a verify graph of another K to a run that compiled in another order)."""
        need = ["prefill", "decode"] + [f"verify{k}" for k in ks]
        self._warm(need, cache_dir, lambda: self._compile(ks))

    def _warm(self, need, cache_dir, compile_all):
        """Run compile_all() unless the graphs `need` exist, with the compile cache on only for a
        fresh process's first compiles (see warmup)."""
        if all(n in self.compiled for n in need):
            return
        cached = bool(cache_dir) and _COMPILES == 0
        if cached:
            # the TP layout too: MindSpore separates cached graphs by rank id, not by world size
            key = repr((self.fingerprint, self.max_seq, need, self.topk_cap, _source_hash(), tp_layout()))
            ms.set_context(enable_compile_cache=True, compile_cache_path=os.path.join(
                cache_dir, hashlib.sha256(key.encode()).hexdigest()[:16]))
        try:
            compile_all()
        finally:
            if cached:
                ms.set_context(enable_compile_cache=False)  # later graphs compile in any order

    def _compile(self, ks):
        self.rollback(0)
        self.prefill([0])
        self.decode(0)
        for k in ks:
            self.rollback(1)
            self.verify(0, [0] * k)
        self.rollback(0)

    # ---- sampling (temperature > 0): see graphs/sampling.py and mindspec/acceptance.py ----

    def _sampler(self, cls, params):
        """The sampling cell for these params and its key suffix: top-k/top-p (t) and the repetition
        penalty (r, which also serves greedy-with-penalty) are compiled variants, so plain sampling
        pays for neither."""
        flags = (params.truncates and not params.greedy, params.repetition_penalty != 1.0)
        if (cls, flags) not in self._samplers:
            cell = cls(self.decoder, *flags, cap=self.topk_cap)
            cell.set_train(False)
            self._samplers[(cls, flags)] = cell
        return self._samplers[(cls, flags)], "".join(c for c, f in zip("tr", flags) if f)

    def _sample_inputs(self, params, prev_ids):
        """(temperature, top_k, top_p, penalty, seen [1, V]) Tensors; prev_ids: the committed tokens
        the repetition penalty looks at (needed only when it is on)."""
        seen = self._no_seen
        if params.repetition_penalty != 1.0:
            if prev_ids is None:
                raise ValueError("repetition_penalty needs prev_ids (the committed token ids)")
            m = np.zeros((1, self.cfg.vocab_size), np.float32)
            m[0, np.asarray(list(prev_ids), np.int64)] = 1.0
            seen = Tensor(m)
        return scalars(params) + (seen,)

    @staticmethod
    def _uniforms(u, *shape):
        return Tensor(np.asarray(u, np.float32).reshape(shape))

    def prefill_sample(self, ids, params, u, prev_ids=None):
        """As prefill, but the next token is sampled with `params` (SamplingParams) and the uniform u.
        prev_ids defaults to ids (the repetition penalty sees the prompt)."""
        if params.greedy and params.repetition_penalty == 1.0:
            return self.prefill(ids)
        ids = list(ids)
        self._check_room(round_up(len(ids), PREFILL_CHUNK))
        cell, tag = self._sampler(SampleNext, params)
        rest = (self._uniforms(u, 1),) + self._sample_inputs(params, ids if prev_ids is None else prev_ids)
        tok = None
        for c in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[c:c + PREFILL_CHUNK]
            n = len(chunk)
            tok = self._run(cell, f"psample{tag}", chunk + [0] * (PREFILL_CHUNK - n), Tensor(np.int32(n - 1)), *rest)
            self.pos += n
        return int(tok.asnumpy()[0])

    def decode_sample(self, token, params, u, prev_ids=None):
        """Target-only sampling step: feed one token, sample the next with the uniform u."""
        if params.greedy and params.repetition_penalty == 1.0:
            return self.decode(token)
        self._check_room(1)
        cell, tag = self._sampler(SampleNext, params)
        tok = self._run(cell, f"dsample{tag}", [token], Tensor(np.int32(0)), self._uniforms(u, 1),
                        *self._sample_inputs(params, prev_ids))
        self.pos += 1
        return int(tok.asnumpy()[0])

    def verify_sample(self, last, drafts, q, u, params, prev_ids=None):
        """Speculative sampling in one graph call: drafts [K] (a compiled bucket) sampled from q [K, V]
        (the processed draft distributions), u [K+1] uniforms in [0, 1). Returns (n_accepted,
        next_token); the cache ends valid for last + accepted drafts. prev_ids: committed ids
        (including last) for the repetition penalty. Greedy params (temperature 0) without a penalty
        run the exact-match greedy graph (same result: p is one-hot)."""
        if params.greedy and params.repetition_penalty == 1.0:
            return self.verify(last, drafts)
        K = len(drafts)
        assert K in self.buckets, (K, self.buckets)
        self._check_room(K + 1)
        q = np.asarray(q, np.float32)
        assert q.shape == (K, self.cfg.vocab_size), q.shape
        cell, tag = self._sampler(SamplingVerify, params)
        n, nxt, _ = self._run(cell, f"vsample{K}{tag}", [last] + list(drafts), Tensor(q.reshape(1, K, -1)),
                              self._uniforms(u, 1, K + 1), *self._sample_inputs(params, prev_ids))
        n = int(n.asnumpy()[0])
        self.pos += 1 + n
        return n, int(nxt.asnumpy()[0])

    def warmup_sample(self, params, ks=(), cache_dir=None):
        """warmup() for the sampling graphs of these params' variant (same compile-cache rule: used
        only when these are the first graphs compiled in the process)."""
        if params.greedy and params.repetition_penalty == 1.0:
            return self.warmup(ks, cache_dir)
        _, tag = self._sampler(SampleNext, params)
        need = [f"psample{tag}", f"dsample{tag}"] + [f"vsample{k}{tag}" for k in ks]
        self._warm(need, cache_dir, lambda: self._compile_sample(params, ks))

    def _compile_sample(self, params, ks):
        V = self.cfg.vocab_size
        self.rollback(0)
        self.prefill_sample([0], params, 0.5, prev_ids=[0])
        self.decode_sample(0, params, 0.5, prev_ids=[0])
        for k in ks:
            self.rollback(1)
            self.verify_sample(0, [0] * k, np.full((k, V), 1.0 / V, np.float32), np.full(k + 1, 0.5), params,
                               prev_ids=[0])
        self.rollback(0)
