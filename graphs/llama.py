"""The target Llama decoder as a MindSpore static graph with a preallocated KV cache.

One K and one V Parameter per layer, shape [B, KV, S, D], written with scatter_nd_update at absolute
positions start..start+T-1. Attention runs over the whole static cache with a position mask
(key_pos <= query_pos), so rollback is free: stale slots past the current position are masked
and later overwritten. `start` is a 0-d Tensor, never a Python int (an int recompiles per value).

On CPU the cost of a small model is dominated by per-kernel dispatch (~20 us a kernel, measured),
so the weights are pre-folded to need few kernels per layer (see fuse.py).

Tensor parallel (graphs/tp.py): when collectives were initialised (tp_size() > 1) each rank holds its
slice of every matrix and its KV heads' cache; the decoder adds one AllReduce after the embedding and
after each row-parallel matmul (o_proj, down_proj) and gathers the vocabulary-parallel logits, so
every rank returns the same logits [B, T, V]. Argmax and GreedyVerify gather only each rank's (max,
index) pair instead of its logits. With one rank the graph is exactly the single-device one.
"""
import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from .fuse import fused_weights, rope_rows
from .tp import shard_plan, tp_rank, tp_size

NEG = -1e9  # finite "minus infinity": exp() underflows to exactly 0 in float32


def _param(arr, name, dtype):
    return Parameter(Tensor(arr, dtype), name=name, requires_grad=False)


def _slicer(get):
    """The checkpoint's get_slice when `get` is a bound Checkpoint.get (a rank then reads only its
    slice of each tensor), else None (slices are cut from whole tensors)."""
    return getattr(getattr(get, "__self__", None), "get_slice", None)


class LlamaDecoder(nn.Cell):
    """ids [B, T] + start -> logits [B, T, V]; writes K/V of the T positions into the cache.

    `get(name)` returns a checkpoint tensor; under tensor parallelism (tp_size() > 1, or an explicit
    `plan` from graphs.tp.shard_plan) the rank's slices are read through `get.__self__.get_slice`
    when it exists."""

    def __init__(self, cfg, get, max_seq, batch=1, dtype=ms.float32, plan=None):
        super().__init__()
        plan = plan or shard_plan(cfg, tp_size(), tp_rank())
        self.tp, self.V = plan.size, cfg.vocab_size
        self.L, self.D = cfg.num_hidden_layers, cfg.head_dim
        self.KV, self.G = plan.kv_local, plan.group_local  # this rank's KV heads, query heads per KV head
        self.H = self.KV * self.G
        self.N = (self.H + 2 * self.KV) * self.D  # width of the fused q|k|v projection
        self.eps = cfg.rms_norm_eps
        w = fused_weights(cfg, get, plan, _slicer(get))
        self.embed = _param(w["embed"], "embed", dtype)
        self.head = _param(w["head"], "head", dtype)
        self.w = ParameterTuple([_param(w[f"{n}.{i}"], f"{n}.{i}", dtype)
                                 for i in range(self.L) for n in ("qkv", "o", "gate_up", "down")])
        shape = (batch, self.KV, max_seq, self.D)
        self.k_cache = ParameterTuple([_param(np.zeros(shape, np.float32), f"k_cache.{i}", dtype)
                                       for i in range(self.L)])
        self.v_cache = ParameterTuple([_param(np.zeros(shape, np.float32), f"v_cache.{i}", dtype)
                                       for i in range(self.L)])
        cos, sin = rope_rows(cfg, max_seq, self.H, self.KV)
        self.cos, self.sin = Tensor(cos, dtype), Tensor(sin, dtype)  # [S, N]
        self.key_pos = Tensor(np.arange(max_seq, dtype=np.int32))  # [S]
        self.qk_t = ops.BatchMatMul(transpose_b=True)  # q @ k^T without materialising k^T
        self.batch_index = Tensor(np.arange(batch, dtype=np.int32))
        self.head_index = Tensor(np.arange(self.KV, dtype=np.int32))
        if self.tp > 1:
            from mindspore.communication import GlobalComm
            self.all_reduce = ops.AllReduce(group=GlobalComm.WORLD_COMM_GROUP)
            self.all_gather = ops.AllGather(group=GlobalComm.WORLD_COMM_GROUP)
            (va, vb), self.Vl = plan.vocab, plan.vocab_local
            self.vocab_start = Tensor(np.int32(va))
            # logits columns past this rank's real vocabulary (padding) never win an argmax
            self.vocab_mask = Tensor(np.where(np.arange(self.Vl) < vb - va, 0, NEG).astype(np.float32))

    def norm(self, x):  # x [B*T, d]; the RMSNorm weight is folded into the next matmul
        return x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps)

    def embed_tokens(self, ids):
        """ids [B*T] -> [B*T, d]. Vocab-parallel: each rank looks up its own range, zeros elsewhere."""
        if self.tp == 1:
            return ops.gather(self.embed, ids, 0)
        local = ids - self.vocab_start
        mine = ops.logical_and(local >= 0, local < self.Vl)
        x = ops.gather(self.embed, ops.select(mine, local, ops.zeros_like(local)), 0)
        return self.all_reduce(x * mine.astype(x.dtype).reshape(-1, 1))

    def reduce(self, x):  # after a row-parallel matmul: the partial sums of all ranks
        return self.all_reduce(x) if self.tp > 1 else x

    def construct(self, ids, start):
        """ids [B, T] int32; start 0-d int32 (absolute position of ids[:, 0]) -> logits [B, T, V]."""
        B, T = ids.shape
        x = self.local_logits(ids, start)  # [B*T, V / tp]
        if self.tp == 1:
            return x.reshape(B, T, -1)
        x = self.all_gather(x)  # [tp*B*T, Vl]: rank r's columns are tokens r*Vl ..
        x = x.reshape(self.tp, B * T, self.Vl).transpose(1, 0, 2).reshape(B, T, self.tp * self.Vl)
        return x[:, :, :self.V]

    def argmax(self, ids, start):
        """Greedy next tokens [B, T] int32. Under TP each rank sends its (max, index) pairs only."""
        B, T = ids.shape
        x = self.local_logits(ids, start)
        if self.tp == 1:
            return ops.argmax(x.reshape(B, T, -1), -1).astype(ms.int32)
        x = x.astype(ms.float32) + self.vocab_mask
        best, idx = ops.max(x, -1)  # [B*T] each: this rank's first maximum
        tok = (idx.astype(ms.int32) + self.vocab_start).astype(ms.float32)  # exact below 2**24
        pair = self.all_gather(ops.stack((best, tok), -1))  # [tp*B*T, 2]
        pair = pair.reshape(self.tp, B * T, 2)
        r = ops.argmax(pair[:, :, 0], 0).reshape(1, B * T)  # first rank holding the max = first index
        tok = ops.gather_elements(pair[:, :, 1], 0, r)
        return tok.reshape(B, T).astype(ms.int32)

    def local_logits(self, ids, start):
        """This rank's logits columns [B*T, V / tp] (all of them at tp 1)."""
        B, T = ids.shape
        S = self.key_pos.shape[0]
        qpos = ops.arange(T, dtype=ms.int32) + start  # [T]
        cos = ops.gather(self.cos, qpos, 0).reshape(1, T, self.N)  # [1, T, N]
        sin = ops.gather(self.sin, qpos, 0).reshape(1, T, self.N)
        mask = ops.select(self.key_pos.reshape(1, -1) <= qpos.reshape(-1, 1),
                          ops.zeros((T, S), ms.float32), ops.fill(ms.float32, (T, S), NEG))  # [T, S]
        mask = ops.tile(mask, (self.G, 1))  # [G*T, S]: query rows grouped per KV head
        bi = ops.broadcast_to(self.batch_index.reshape(B, 1, 1), (B, self.KV, T))
        hi = ops.broadcast_to(self.head_index.reshape(1, self.KV, 1), (B, self.KV, T))
        ti = ops.broadcast_to(qpos.reshape(1, 1, T), (B, self.KV, T))
        idx = ops.stack((bi, hi, ti), -1)  # [B, KV, T, 3]: cache[b, h, qpos[t]]
        x = self.embed_tokens(ids.reshape(-1))  # [B*T, d]
        for i in range(self.L):
            w_qkv, w_o, w_gu, w_down = self.w[4 * i:4 * i + 4]
            a, a_rot = ops.split(ops.dense(self.norm(x), w_qkv), self.N, -1)  # [B*T, N] each
            # RoPE as x*cos + rotate_half(x)*sin, rotate_half precomputed in the weights (v: cos 1, sin 0)
            a = a.reshape(B, T, self.N) * cos + a_rot.reshape(B, T, self.N) * sin
            a = a.reshape(B, T, self.H + 2 * self.KV, self.D).transpose(0, 2, 1, 3)
            q, k, v = ops.split(a, (self.H, self.KV, self.KV), 1)  # [B, H|KV|KV, T, D]
            kc = ops.scatter_nd_update(self.k_cache[i], idx, k)  # [B, KV, S, D]
            vc = ops.scatter_nd_update(self.v_cache[i], idx, v)
            # GQA without copying the cache: the G query heads of a KV head become extra rows
            s = self.qk_t(q.reshape(B, self.KV, self.G * T, self.D), kc) + mask  # [B, KV, G*T, S]
            o = ops.matmul(ops.softmax(s, -1), vc)  # [B, KV, G*T, D]
            o = o.reshape(B, self.H, T, self.D).transpose(0, 2, 1, 3).reshape(B * T, self.H * self.D)
            x = x + self.reduce(ops.dense(o, w_o))
            g, u = ops.split(ops.dense(self.norm(x), w_gu), w_down.shape[1], -1)  # [B*T, I] each
            x = x + self.reduce(ops.dense(ops.silu(g) * u, w_down))
        return ops.dense(self.norm(x), self.head)


class Logits(nn.Cell):
    """ids [B, T], start -> logits [B, T, V] (float32)."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def construct(self, ids, start):
        return self.decoder(ids, start).astype(ms.float32)


class Argmax(nn.Cell):
    """ids [B, T], start -> greedy next tokens [B, T] int32 (prefill chunks, target-only decode)."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def construct(self, ids, start):
        return self.decoder.argmax(ids, start)


class GreedyVerify(nn.Cell):
    """The fused greedy verify step for one K bucket.

    ids [B, K+1] = the last committed token followed by K draft tokens, at positions start.. .
    Returns n_accepted [B] (length of the prefix of drafts equal to the target's argmax) and
    next_token [B] (the target's token after that prefix: recovered, or bonus when all K agree).
    """

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def construct(self, ids, start):
        g = self.decoder.argmax(ids, start)  # [B, K+1]
        K = ids.shape[1] - 1
        match = (g[:, :K] == ids[:, 1:]).astype(ms.int32)  # [B, K]
        n_acc = ops.cumprod(match, 1).sum(1).astype(ms.int32)  # [B]
        nxt = ops.gather_elements(g, 1, n_acc.reshape(-1, 1)).reshape(-1)  # [B]
        return n_acc, nxt
