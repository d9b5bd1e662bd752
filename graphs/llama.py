"""The target Llama decoder as a MindSpore static graph with a preallocated KV cache.

One KV Parameter per layer, shape [B, KV, S, D], written with scatter_nd_update at absolute
positions start..start+T-1. Attention runs over the whole static cache with a position mask
(key_pos <= query_pos), so rollback is free: stale slots past the current position are masked
and later overwritten. `start` is a 0-d Tensor, never a Python int (an int recompiles per value).
"""
import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from mindspec.reference import rope_tables

NEG = -1e9  # finite "minus infinity": exp() underflows to exactly 0 in float32


class LlamaDecoder(nn.Cell):
    """ids [B, T] + start -> final-normed hidden states [B, T, d]; writes K/V into the cache."""

    def __init__(self, cfg, get, max_seq, batch=1, dtype=ms.float32):
        super().__init__()
        self.L, self.H, self.KV, self.D = (cfg.num_hidden_layers, cfg.num_attention_heads,
                                           cfg.num_key_value_heads, cfg.head_dim)
        self.G = self.H // self.KV
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0 / float(np.sqrt(self.D))
        p = lambda name: Parameter(Tensor(get(name), dtype), name=name, requires_grad=False)  # noqa: E731
        self.embed = p("model.embed_tokens.weight")
        self.final_norm = p("model.norm.weight")
        names = [f"model.layers.{i}.{n}.weight" for i in range(self.L)
                 for n in ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                           "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj",
                           "mlp.up_proj", "mlp.down_proj")]
        self.w = ParameterTuple([p(n) for n in names])
        shape = (batch, self.KV, max_seq, self.D)
        self.k_cache = ParameterTuple([Parameter(Tensor(np.zeros(shape, np.float32), dtype), name=f"k_cache.{i}",
                                                 requires_grad=False) for i in range(self.L)])
        self.v_cache = ParameterTuple([Parameter(Tensor(np.zeros(shape, np.float32), dtype), name=f"v_cache.{i}",
                                                 requires_grad=False) for i in range(self.L)])
        cos, sin = rope_tables(self.D, cfg.rope_theta, np.arange(max_seq))
        self.cos, self.sin = Tensor(cos, dtype), Tensor(sin, dtype)  # [S, D/2]
        self.key_pos = Tensor(np.arange(max_seq, dtype=np.int32))  # [S]
        self.batch_index = Tensor(np.arange(batch, dtype=np.int32))
        self.head_index = Tensor(np.arange(self.KV, dtype=np.int32))

    def rms(self, x, w):  # x [B, T, d]
        var = ops.mean(x * x, -1, keep_dims=True)
        return x * ops.rsqrt(var + self.eps) * w

    def linear(self, x, w):  # x [B, T, in], w [out, in] -> [B, T, out]
        B, T, n = x.shape
        # ops.dense reads W in checkpoint layout; measured faster on CPU than MatMul(transpose_b)
        return ops.dense(x.reshape(B * T, n), w).reshape(B, T, -1)

    def rope(self, x, cos, sin):  # x [B, N, T, D], cos/sin [T, D/2]
        x1, x2 = ops.split(x, self.D // 2, -1)
        return ops.concat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)

    def construct(self, ids, start):
        """ids [B, T] int32; start 0-d int32 (absolute position of ids[:, 0])."""
        B, T = ids.shape
        qpos = ops.arange(T, dtype=ms.int32) + start  # [T]
        cos, sin = ops.gather(self.cos, qpos, 0), ops.gather(self.sin, qpos, 0)  # [T, D/2]
        mask = ops.select(self.key_pos.reshape(1, -1) <= qpos.reshape(-1, 1),
                          ops.zeros((T, self.key_pos.shape[0]), ms.float32),
                          ops.fill(ms.float32, (T, self.key_pos.shape[0]), NEG))  # [T, S]
        mask = ops.tile(mask, (self.G, 1))  # [G*T, S]: query rows grouped per KV head
        # scatter index [B, KV, T, 3] for cache[b, h, qpos[t]]
        bi = ops.broadcast_to(self.batch_index.reshape(B, 1, 1), (B, self.KV, T))
        hi = ops.broadcast_to(self.head_index.reshape(1, self.KV, 1), (B, self.KV, T))
        ti = ops.broadcast_to(qpos.reshape(1, 1, T), (B, self.KV, T))
        idx = ops.stack((bi, hi, ti), -1)
        x = ops.gather(self.embed, ids, 0)  # [B, T, d]
        for i in range(self.L):
            ln1, wq, wk, wv, wo, ln2, wg, wu, wd = self.w[9 * i:9 * i + 9]
            h = self.rms(x, ln1)
            q = self.linear(h, wq).reshape(B, T, self.H, self.D).transpose(0, 2, 1, 3)  # [B, H, T, D]
            k = self.linear(h, wk).reshape(B, T, self.KV, self.D).transpose(0, 2, 1, 3)  # [B, KV, T, D]
            v = self.linear(h, wv).reshape(B, T, self.KV, self.D).transpose(0, 2, 1, 3)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            kc = ops.scatter_nd_update(self.k_cache[i], idx, k)  # [B, KV, S, D]
            vc = ops.scatter_nd_update(self.v_cache[i], idx, v)
            # GQA without copying the cache: the G query heads of a KV head become extra rows
            qg = q.reshape(B, self.KV, self.G * T, self.D)
            s = ops.matmul(qg, kc.transpose(0, 1, 3, 2)) * self.scale + mask  # [B, KV, G*T, S]
            a = ops.matmul(ops.softmax(s, -1), vc)  # [B, KV, G*T, D]
            a = a.reshape(B, self.H, T, self.D).transpose(0, 2, 1, 3).reshape(B, T, self.H * self.D)
            x = x + self.linear(a, wo)
            h = self.rms(x, ln2)
            x = x + self.linear(ops.silu(self.linear(h, wg)) * self.linear(h, wu), wd)
        return self.rms(x, self.final_norm)


class Logits(nn.Cell):
    """ids [B, T], start -> logits [B, T, V] (float32)."""

    def __init__(self, decoder, lm_head):
        super().__init__()
        self.decoder, self.lm_head = decoder, lm_head

    def construct(self, ids, start):
        return self.decoder.linear(self.decoder(ids, start), self.lm_head).astype(ms.float32)


class Argmax(nn.Cell):
    """ids [B, T], start -> greedy next tokens [B, T] int32 (prefill chunks, target-only decode)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def construct(self, ids, start):
        return ops.argmax(self.logits(ids, start), -1).astype(ms.int32)


class GreedyVerify(nn.Cell):
    """The fused greedy verify step for one K bucket.

    ids [B, K+1] = the last committed token followed by K draft tokens, at positions start.. .
    Returns n_accepted [B] (length of the prefix of drafts equal to the target's argmax) and
    next_token [B] (the target's token after that prefix: recovered, or bonus when all K agree).
    """

    def __init__(self, argmax):
        super().__init__()
        self.argmax = argmax

    def construct(self, ids, start):
        g = self.argmax(ids, start)  # [B, K+1]
        K = ids.shape[1] - 1
        match = (g[:, :K] == ids[:, 1:]).astype(ms.int32)  # [B, K]
        n_acc = ops.cumprod(match, 1).sum(1).astype(ms.int32)  # [B]
        nxt = ops.gather_elements(g, 1, n_acc.reshape(-1, 1)).reshape(-1)  # [B]
        return n_acc, nxt
