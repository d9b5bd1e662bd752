"""TargetModel: the compiled target graphs plus the one integer that says how much cache is valid."""
import os
import time

import numpy as np
import mindspore as ms
from mindspore import Tensor

from mindspec.errors import MindspecError
from .llama import Argmax, GreedyVerify, LlamaDecoder, Logits

PREFILL_CHUNK = 32  # prompt processed in fixed chunks: one compiled prefill graph for any length
DEFAULT_BUCKETS = (1, 2, 4, 8)


def init_mindspore(device=None, cache_dir=None):
    """GRAPH_MODE on Ascend when present, else CPU. Compiled graphs persist in `cache_dir`."""
    device = device or ("Ascend" if os.environ.get("ASCEND_HOME_PATH") else "CPU")
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ.setdefault("MS_COMPILER_CACHE_ENABLE", "1")
        os.environ.setdefault("MS_COMPILER_CACHE_PATH", cache_dir)
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device(device)
    return device


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
        self.compile_s = 0.0

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
            g = self._argmax(self._ids(chunk + [0] * (PREFILL_CHUNK - n)), self._start()).asnumpy()
            self.pos += n
            nxt = int(g[0, n - 1])
        return nxt

    def decode(self, token):
        """Target-only step: feed one token, return the greedy next token."""
        self._check_room(1)
        g = self._argmax(self._ids([token]), self._start()).asnumpy()
        self.pos += 1
        return int(g[0, 0])

    def verify(self, last, drafts):
        """Feed [last] + drafts (K = len(drafts), a compiled bucket) in one graph call.

        Returns (n_accepted, next_token). The cache ends valid for last + accepted drafts."""
        assert len(drafts) in self.buckets, (len(drafts), self.buckets)
        self._check_room(len(drafts) + 1)
        n_acc, nxt = self._verify(self._ids([last] + list(drafts)), self._start())
        n = int(n_acc.asnumpy()[0])
        self.pos += 1 + n
        return n, int(nxt.asnumpy()[0])

    def logits(self, ids):
        """Full logits [T, V] for ids fed at pos (tests, sampling). Advances pos."""
        self._check_room(len(ids))
        out = self._logits(self._ids(ids), self._start()).asnumpy()[0]
        self.pos += len(ids)
        return out

    def warmup(self, ks=None):
        """Compile every graph up front (prefill, decode, each K bucket); returns seconds spent."""
        t0, pos = time.perf_counter(), self.pos
        self.prefill([0])
        self.decode(0)
        for k in (ks or self.buckets):
            self.rollback(pos)
            self.verify(0, [0] * k)
        self.rollback(pos)
        self.compile_s = time.perf_counter() - t0
        return self.compile_s
