"""TargetModel: the compiled target graphs plus the one integer that says how much cache is valid."""
import hashlib
import os
import time

import numpy as np
import mindspore as ms
from mindspore import Tensor

from mindspec.errors import MindspecError
from .llama import Argmax, GreedyVerify, LlamaDecoder, Logits

PREFILL_CHUNK = 32  # prompt processed in fixed chunks: one compiled prefill graph for any length
DEFAULT_BUCKETS = (1, 2, 4, 8)


def init_mindspore(device=None):
    """GRAPH_MODE on Ascend when present, else CPU."""
    device = device or ("Ascend" if os.environ.get("ASCEND_HOME_PATH") else "CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device(device)
    return device


def _source_hash():
    h = hashlib.sha256()
    for name in sorted(os.listdir(os.path.dirname(__file__))):
        if name.endswith(".py"):
            with open(os.path.join(os.path.dirname(__file__), name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:8]


def round_up(n, m):
    return (n + m - 1) // m * m


class TargetModel:
    """Greedy target over a static cache of `max_seq` positions (a multiple of PREFILL_CHUNK)."""

    def __init__(self, ckpt, max_seq, buckets=DEFAULT_BUCKETS, dtype=ms.float32, cache_dir=None):
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
        # compiled graphs persist per (weights, cache size, graph source): a second run starts fast
        self.cache_path = cache_dir and os.path.join(
            cache_dir, f"{ckpt.fingerprint()}-s{self.max_seq}-{_source_hash()}")
        self.compiled, self.compile_s = set(), 0.0

    def _run(self, cell, key, ids):
        """Call a graph; the first call of each (graph, shape) compiles it (or loads it from cache)."""
        if key in self.compiled:
            return cell(self._ids(ids), self._start())
        if self.cache_path:  # set right before compiling: several models may live in one process
            ms.set_context(enable_compile_cache=True, compile_cache_path=self.cache_path)
        t = time.perf_counter()
        out = cell(self._ids(ids), self._start())
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

    def warmup(self, ks=()):
        """Compile (or load from the cache) prefill, decode and the verify graphs of `ks`, so that
        timed generation measures decoding only. Runs at position 0 and leaves pos at 0."""
        need = ["prefill", "decode"] + [f"verify{k}" for k in ks]
        if all(n in self.compiled for n in need):
            return
        self.rollback(0)
        self.prefill([0])
        self.decode(0)
        for k in ks:
            self.rollback(1)
            self.verify(0, [0] * k)
        self.rollback(0)
