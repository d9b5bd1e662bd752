"""The target Llama decoder as a MindSpore static graph with a preallocated, slotted KV cache.

One K and one V Parameter per layer, [slots, KV, S, D] stored flat as [slots*KV*S, D] rows: each
running request owns a slot. A call feeds ids [B, T], each row at its own position pos[b] of its own
slot slots[b]; K/V are written with ScatterUpdate by row index, in place, and each row's attention
gathers the rows of its own slot (a copy of B slots, what the attention reads anyway), only its first
W positions: `keys` [W] (0..W-1, an input so that its length picks the graph) is the call's attention
window (spec.attention_windows), past every real row's last position. Masked positions weigh exactly
0, so a window changes no bit of the result, only what the gathers copy and the attention reads. On CPU
scatter_nd_update on the 4-d cache copied the whole cache every call, and a full batch reading the
cache in place did not help: a one-row verify with 8 slots of 512 positions cost 126 ms against 89
with one slot; now 95. Attention runs over the window with a per-row position mask
(key_pos <= query_pos), so rollback is free: stale positions past a row's position are masked and
later overwritten. Positions and slots are Tensors, never Python ints (an int recompiles per value),
so one graph per (B, T, W) serves every mix of rows in any order. Padding rows write into a reserved
tail of positions that no real row ever attends to.

On CPU the cost of a small model is dominated by per-kernel dispatch (~20 us a kernel, measured),
so the weights are pre-folded to need few kernels per layer (see fuse.py).

Tensor parallel (graphs/tp.py): when collectives were initialised (tp_size() > 1) each rank holds its
slice of every matrix and its KV heads' cache; the decoder adds one AllReduce after the embedding and
after each row-parallel matmul (o_proj, down_proj) and gathers the vocabulary-parallel logits, so
every rank gets the same logits; greedy steps gather only each rank's (max, index) pairs. With one
rank the graph is exactly the single-device one.
"""
import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from .fuse import fused_weights, rope_rows
from .prims import finite_or_zero, finite_rows, halves, heads, iota, or_minus_one
from .sampling import (NEG, TOPK_CAP, greedy_accept, output_counts, process, sample, seen_mask, speculative_accept,
                       token_logprobs, wide)
from .tp import shard_plan, tp_rank, tp_size


def _param(arr, name, dtype):
    return Parameter(Tensor(arr, dtype), name=name, requires_grad=False)


def _slicer(get):
    """The checkpoint's get_slice when `get` is a bound Checkpoint.get (a rank then reads only its
    slice of each tensor), else None (slices are cut from whole tensors)."""
    return getattr(getattr(get, "__self__", None), "get_slice", None)


class LlamaDecoder(nn.Cell):
    """ids [B, T], slots [B], pos [B] -> normed hidden [B*T, d]; writes K/V of the T positions into the
    rows' cache slots. head_logits / head_argmax turn hidden rows into logits / greedy tokens.

    `get(name)` returns a checkpoint tensor; under tensor parallelism (tp_size() > 1, or an explicit
    `plan` from graphs.tp.shard_plan) the rank's slices are read through `get.__self__.get_slice`
    when it exists."""

    def __init__(self, cfg, get, max_seq, slots=1, dtype=ms.float32, plan=None, rot_rows=True):
        super().__init__()
        plan = plan or shard_plan(cfg, tp_size(), tp_rank())
        self.tp, self.V = plan.size, cfg.vocab_size
        self.L, self.D = cfg.num_hidden_layers, cfg.head_dim
        self.KV, self.G = plan.kv_local, plan.group_local  # this rank's KV heads, query heads per KV head
        self.H = self.KV * self.G
        self.N = (self.H + 2 * self.KV) * self.D  # width of the fused q|k|v projection
        self.eps, self.dtype = cfg.rms_norm_eps, dtype
        host = np.float16 if dtype == ms.float16 else np.float32  # numpy has no bfloat16: MindSpore casts
        self.rot_rows = rot_rows  # rotate-half from weight rows (CPU) or computed in the graph (fuse.rot_rows_for)
        w = fused_weights(cfg, get, plan, _slicer(get), host, rot_rows)
        self.embed = _param(w["embed"], "embed", dtype)
        self.head = _param(w["head"], "head", dtype)
        self.w = ParameterTuple([_param(w[f"{n}.{i}"], f"{n}.{i}", dtype)
                                 for i in range(self.L) for n in ("qkv", "o", "gate_up", "down")])
        self.qkv_bias = cfg.qkv_bias  # Qwen2: q/k/v biases (a compile-time branch)
        self.b = ParameterTuple([_param(w[f"qkv_bias.{i}"], f"qkv_bias.{i}", dtype) for i in range(self.L)]) \
            if cfg.qkv_bias else None
        shape = (slots * self.KV * max_seq, self.D)  # [slots*KV*S, D]: row (slot*KV + h)*S + position
        self.k_cache = ParameterTuple([_param(np.zeros(shape, host), f"k_cache.{i}", dtype) for i in range(self.L)])
        self.v_cache = ParameterTuple([_param(np.zeros(shape, host), f"v_cache.{i}", dtype) for i in range(self.L)])
        cos, sin = rope_rows(cfg, max_seq, self.H, self.KV)
        self.cos, self.sin = Tensor(cos, dtype), Tensor(sin, dtype)  # [S, N]
        self.S = max_seq  # positions per slot (the cache rows' stride)
        self.qk_t = ops.BatchMatMul(transpose_b=True)  # q @ k^T without materialising k^T
        self.head_index = Tensor(np.arange(self.KV, dtype=np.int32))
        if self.tp > 1:
            from mindspore.communication import GlobalComm
            self.all_reduce = ops.AllReduce(group=GlobalComm.WORLD_COMM_GROUP)
            self.all_gather = ops.AllGather(group=GlobalComm.WORLD_COMM_GROUP)
            (va, vb), self.Vl = plan.vocab, plan.vocab_local
            self.vocab_start = Tensor(np.int32(va))
            # logits columns past this rank's real vocabulary (padding) never win an argmax
            self.vocab_mask = Tensor(np.where(np.arange(self.Vl) < vb - va, 0, NEG).astype(np.float32))

    def f32(self, x):  # statistics, softmax and logits in float32 whatever the weights' dtype
        return x if self.dtype == ms.float32 else x.astype(ms.float32)

    def narrow(self, x):  # back to the weights' dtype for the next matmul
        return x if self.dtype == ms.float32 else x.astype(self.dtype)

    def norm(self, x):  # x [B*T, d]; the RMSNorm weight is folded into the next matmul
        x = self.f32(x)
        return self.narrow(x * wide(ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps), x))

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

    def head_logits(self, h):
        """h [R, d] (normed hidden rows) -> logits [R, V] float32, the whole vocabulary on every rank."""
        x = self.f32(ops.dense(h, self.head))  # [R, V / tp]
        if self.tp == 1:
            return x
        R = h.shape[0]
        x = self.all_gather(x)  # [tp*R, Vl]: rank r's columns are tokens r*Vl ..
        x = x.reshape(self.tp, R, self.Vl).transpose(1, 0, 2).reshape(R, self.tp * self.Vl)
        return x[:, :self.V]

    def head_argmax(self, h):
        """h [R, d] -> greedy tokens [R] int32, -1 where a row's hidden state is not finite (activations past
        the dtype's range, the decoder's mark included: its argmax would be some token). h, not the logits:
        1/85 of the check for the default model (a logit past float16's range from a finite h, +inf, wins its
        row's argmax, the first such one). Under TP each rank sends its (max, index) pairs only."""
        ok = finite_rows(h)  # [R] (the same on every rank)
        x = ops.dense(h, self.head)
        if self.tp == 1:
            return or_minus_one(ops.argmax(x, -1).astype(ms.int32), ok)
        R = h.shape[0]
        x = x.astype(ms.float32) + self.vocab_mask
        best, idx = ops.max(x, -1)  # [R] each: this rank's first maximum
        tok = (idx.astype(ms.int32) + self.vocab_start).astype(ms.float32)  # exact below 2**24
        pair = self.all_gather(ops.stack((best, tok), -1)).reshape(self.tp, R, 2)  # [tp, R, 2]
        r = ops.argmax(pair[:, :, 0], 0).reshape(1, R)  # first rank holding the max = first index
        return or_minus_one(ops.gather_elements(pair[:, :, 1], 0, r).reshape(R).astype(ms.int32), ok)

    def construct(self, ids, slots, pos, keys):
        """ids [B, T] int32 fed at positions pos[b].. of cache slot slots[b] (slots [B], pos [B] int32),
        attending over keys [W] (positions 0..W-1 of each slot) -> normed hidden states [B*T, d]. Writes
        the T positions' K/V into each row's slot."""
        B, T = ids.shape
        S, W = self.S, keys.shape[0]
        qpos = pos.reshape(B, 1) + iota(T).reshape(1, T)  # [B, T]
        cos = ops.gather(self.cos, qpos.reshape(-1), 0).reshape(B, T, self.N)  # [B, T, N]
        sin = ops.gather(self.sin, qpos.reshape(-1), 0).reshape(B, T, self.N)
        mask = ops.select(keys.reshape(1, 1, W) <= qpos.reshape(B, T, 1),
                          ops.zeros((B, T, W), ms.float32), ops.fill(ms.float32, (B, T, W), NEG))  # [B, T, W]
        # [B, KV, G*T, W]: rows grouped per KV head, a copy per KV head made once (not broadcast in every
        # layer's Add: see sampling.wide)
        mask = ops.tile(mask.reshape(B, 1, T, W), (1, self.KV, self.G, 1))
        base = (slots.reshape(B, 1, 1) * self.KV + self.head_index.reshape(1, self.KV, 1)) * S  # [B, KV, 1]
        idx = base + qpos.reshape(B, 1, T)  # [B, KV, T]: the cache row of cache[slot[b], h, qpos[b, t]]
        rows = base + keys.reshape(1, 1, W)  # [B, KV, W]: the window of the rows' slots
        x = self.embed_tokens(ids.reshape(-1))  # [B*T, d]
        for i in range(self.L):
            w_qkv, w_o, w_gu, w_down = self.w[4 * i:4 * i + 4]
            qkv = ops.dense(self.norm(x), w_qkv, self.b[i]) if self.qkv_bias else ops.dense(self.norm(x), w_qkv)
            if self.rot_rows:  # rotate_half(a) came out of the matmul
                a, a_rot = halves(qkv, 1)  # [B*T, N] each
            else:
                a = qkv  # [B*T, N]
                x1, x2 = halves(a.reshape(B * T, self.H + 2 * self.KV, self.D), 2)
                a_rot = ops.concat((-x2, x1), -1).reshape(B * T, self.N)  # rotate_half per head
            # RoPE as x*cos + rotate_half(x)*sin (v: cos 1, sin 0)
            # (q, k, v of an overflowing position as 0: see finite_or_zero; one select over the three, not
            # a check of each: per-layer kernels cost a one-row call 15-30%)
            a = finite_or_zero(a.reshape(B, T, self.N) * cos + a_rot.reshape(B, T, self.N) * sin)
            a = a.reshape(B, T, self.H + 2 * self.KV, self.D).transpose(0, 2, 1, 3)
            q, k, v = heads(a, self.H, self.KV)  # [B, H|KV|KV, T, D]
            kc = ops.gather(ops.scatter_update(self.k_cache[i], idx, k), rows, 0)  # [B, KV, W, D]
            vc = ops.gather(ops.scatter_update(self.v_cache[i], idx, v), rows, 0)
            # GQA without copying the cache per head: the G query heads of a KV head become extra rows
            s = self.f32(self.qk_t(q.reshape(B, self.KV, self.G * T, self.D), kc)) + mask  # [B, KV, G*T, W]
            o = ops.matmul(self.narrow(ops.softmax(s, -1)), vc)  # [B, KV, G*T, D]
            o = o.reshape(B, self.H, T, self.D).transpose(0, 2, 1, 3).reshape(B * T, self.H * self.D)
            x = x + self.reduce(ops.dense(o, w_o))
            g, u = halves(ops.dense(self.norm(x), w_gu), 1)  # [B*T, I] each
            x = x + self.reduce(ops.dense(ops.silu(g) * u, w_down))
        return self.norm(x)


class Logits(nn.Cell):
    """ids [B, T], slots [B], pos [B], keys [W] -> logits [B, T, V] float32 (tests, numerical checks)."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def construct(self, ids, slots, pos, keys):
        B, T = ids.shape
        return self.decoder.head_logits(self.decoder(ids, slots, pos, keys)).reshape(B, T, -1)


class GreedyStep(nn.Cell):
    """One greedy engine step for a (B, K) bucket: ids [B, K+1] = each row's last committed token and
    K drafts, fed at pos [B] of cache slots [B]; n_valid [B] caps each row's acceptance (padding rows
    and rows with fewer drafts); keys [W] the attention window (LlamaDecoder). Returns n_accepted [B]
    and next [B] (recovered or bonus token; -1 where the hidden state of the position it comes from is not
    finite: head_argmax). K = 0 is a plain decode step."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def construct(self, ids, slots, pos, n_valid, keys):
        B, T = ids.shape
        g = self.decoder.head_argmax(self.decoder(ids, slots, pos, keys)).reshape(B, T)  # [B, K+1]
        if T == 1:
            return ops.zeros((B,), ms.int32), g[:, 0]
        return greedy_accept(g, ids, n_valid)


class SampleStep(nn.Cell):
    """One engine step with per-row sampling (speculative sampling for K >= 1, plain sampling for
    K = 0; greedy rows are rows whose temperature is 0). ids, slots, pos, n_valid as GreedyStep;
    q [B, K, V] the processed draft distributions the drafts were sampled from (K = 0: [B, 1, V],
    unused); u_acc [B, K] (K = 0: [B, 1], unused) and u_smp [B, K+1] uniforms in [0, 1);
    temperature, top_k (int32), top_p, penalty [B]; seen [B, V] float32 (1: token committed); counts
    [B, V] float32 (the output's tokens, counted) with presence, frequency [B]; keys [W] as GreedyStep.
    Returns n_accepted [B], next [B] (-1 where a committed position's logits are not finite), the
    logprobs of the tokens the step commits (lp [B, K+1]: the accepted drafts, then next at index
    n_accepted; top_lp, top_id [B, K+1, TOP_LOGPROBS]: see token_logprobs), exact [B] bool (the top-k
    candidates held the row's kept set; when not, its outputs are redone on the host: graphs/exact.py) and the
    logits [B, K+1, V] for that.
    penalties: whether counts, presence and frequency are applied (graphs of their own, for the runs that ask:
    a [B, K+1, V] count and four passes over it measured 5-17% of a call of 8 rows at K = 8 when every
    sampling graph held them, 0-7% of the calls that ask for them)."""

    def __init__(self, decoder, cap=TOPK_CAP, penalties=False):
        super().__init__()
        self.decoder, self.cap, self.penalties = decoder, cap, penalties

    def construct(self, ids, slots, pos, n_valid, q, u_acc, u_smp, temperature, top_k, top_p, penalty, seen, counts,
                  presence, frequency, keys):
        B, T = ids.shape
        V = seen.shape[1]
        logits = self.decoder.head_logits(self.decoder(ids, slots, pos, keys)).reshape(B, T, V)
        drafts = ids[:, 1:]  # [B, K]
        seen_all = seen_mask(seen, drafts, V) if T > 1 else (seen > 0).reshape(B, 1, V)
        if self.penalties:  # (a static branch: the graph of rows with presence/frequency penalties)
            counts_all = output_counts(counts, drafts, V) if T > 1 else counts.reshape(B, 1, V)
            p, exact = process(logits, temperature, top_k, top_p, penalty, seen_all, self.cap, counts_all, presence,
                               frequency)  # [B, K+1, V]
        else:
            p, exact = process(logits, temperature, top_k, top_p, penalty, seen_all, self.cap)  # [B, K+1, V]
        if T == 1:
            n, nxt = ops.zeros((B,), ms.int32), sample(p.reshape(B, V), u_smp[:, 0])
        else:
            n, nxt = speculative_accept(p, q, drafts, n_valid, u_acc, u_smp)
        at = iota(T).reshape(1, T)
        if T == 1:
            committed = nxt.reshape(B, 1)
        else:  # [B, T]: the drafts, next at index n (past it: unused)
            committed = ops.select(at == n.reshape(B, 1), ops.broadcast_to(nxt.reshape(B, 1), (B, T)),
                                   ops.concat((drafts, ids[:, :1]), 1))
        ok = ops.maximum(finite_rows(logits), (at > n.reshape(B, 1)).astype(ms.int32)).min(-1)  # [B]: up to n
        return (n, or_minus_one(nxt, ok)) + token_logprobs(logits, committed) + (exact, logits)


class Prefill(nn.Cell):
    """A prompt chunk for each of B rows: ids [B, C] at pos [B] of slots [B] (padding after a row's
    real tokens lands in stale positions: masked, later overwritten); each row's next token is sampled
    after its index last [B] with u [B] and the row's sampling parameters (as SampleStep; temperature
    0 = greedy); keys [W] as GreedyStep. Only those B positions go through the LM head. Returns next [B]
    int32 (-1 where a real position's hidden state or its logits are not finite), its logprobs (lp [B, 1],
    top_lp and top_id [B, 1, TOP_LOGPROBS]), exact [B] and the logits [B, 1, V] (as SampleStep)."""

    def __init__(self, decoder, cap=TOPK_CAP):
        super().__init__()
        self.decoder, self.cap = decoder, cap

    def construct(self, ids, slots, pos, last, u, temperature, top_k, top_p, penalty, seen, keys):
        B, C = ids.shape
        V = seen.shape[1]
        rows = iota(B) * C + last  # [B]: each row's last real token
        h = self.decoder(ids, slots, pos, keys)  # [B*C, d]
        logits = self.decoder.head_logits(ops.gather(h, rows, 0)).reshape(B, 1, V)
        p, exact = process(logits, temperature, top_k, top_p, penalty, (seen > 0).reshape(B, 1, V), self.cap)
        nxt = sample(p.reshape(B, V), u)
        # every real position of the chunk finite (its K/V stay in the cache for what follows), and the logits
        late = (iota(C).reshape(1, C) > last.reshape(B, 1)).astype(ms.int32)
        ok = ops.maximum(finite_rows(h).reshape(B, C), late).min(-1) * finite_rows(logits).reshape(B)
        return (or_minus_one(nxt, ok),) + token_logprobs(logits, nxt.reshape(B, 1)) + (exact, logits)
