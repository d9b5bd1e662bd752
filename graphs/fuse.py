"""Fold a Llama checkpoint into few, wide matrices (numpy, at load time).

Per layer: one q|k|v|rot(q)|rot(k) projection with the input RMSNorm weight and the 1/sqrt(D)
attention scale folded in (and its bias vector, same rows, for models with q/k/v biases), o_proj,
one gate|up projection with the post-attention norm folded in, and down_proj. RoPE then costs two
multiplies and an add: out = a*cos + a_rot*sin, where a_rot = rotate_half(a) comes straight out of
the matmul (rows rotated in the weight) on CPU, or from a split and a concat in the graph on Ascend
(rot_rows_for).

Under tensor parallelism (graphs/tp.py) each rank folds only its slice, read straight from the
safetensors files (`get_slice`), so no rank holds the full model: its query heads (laid out in the
plan's slots, empty slots zero) and their KV heads, its intermediate and vocabulary ranges. With one
rank the plan is the identity and the result is exactly the unsharded fold."""
import numpy as np

from mindspec.checkpoint import narrow, source
from mindspec.reference import rope_tables
from .tp import shard_plan


def rotate_half_rows(w, n_heads, D):
    """Rows of W such that x @ result.T == rotate_half(x @ W.T) per head: [-x2, x1]."""
    w = w.reshape(n_heads, D, -1)
    return np.concatenate([-w[:, D // 2:], w[:, :D // 2]], axis=1).reshape(n_heads * D, -1)


def reader(get, get_slice=None):
    """read(name, axis=None, start=None, stop=None): a whole tensor, or rows (axis 0) / columns
    (axis 1) start:stop of it; through get_slice when the checkpoint has it (reads only that slice)."""
    def read(name, axis=None, start=None, stop=None):
        if axis is None:
            return get(name)
        if get_slice is not None:
            return get_slice(name, axis, start, stop)
        w = get(name)
        return w[start:stop] if axis == 0 else w[:, start:stop]
    return read


def _blocks(w, idx, D, axis=0):
    """Head blocks of D rows (axis 0) or columns (axis 1) of w, in the order of idx (-1: zeros)."""
    idx = np.asarray(idx).ravel()
    n = w.shape[axis] // D
    if np.array_equal(idx, np.arange(n)):
        return w
    if axis == 1:
        return _blocks(w.T, idx, D).T
    out = np.zeros((len(idx) * D,) + w.shape[1:], w.dtype)
    for j, h in enumerate(idx):
        if h >= 0:
            out[j * D:(j + 1) * D] = w[h * D:(h + 1) * D]
    return out


def _pad(w, n, axis=0):
    """Zero-pad w to n rows (axis 0) or columns (axis 1)."""
    extra = n - w.shape[axis]
    if extra == 0:
        return w
    return np.pad(w, ((0, extra), (0, 0)) if axis == 0 else ((0, 0), (0, extra)))


class _Cast(dict):
    """A dict that stores every value as a contiguous array of one dtype."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def __setitem__(self, key, value):
        kind, _, layer = key.partition(".")  # ("embed", "head", or e.g. "down.0")
        norm = {"head": "model.norm", "qkv": "input_layernorm", "gate_up": "post_attention_layernorm"}.get(kind)
        name = source(kind, layer or None) + (f" times its {norm}.weight" if norm else "")  # (folded in)
        super().__setitem__(key, narrow(value, self.dtype, name, "run this model in float32 (--dtype float32), or "
                                                                   "bfloat16 where the device runs it"))


def fused_weights(cfg, get, plan=None, get_slice=None, dtype=np.float32, rot_rows=True):
    """The folded weights of one rank (plan: graphs.tp.ShardPlan; None: the whole model), folded in
    float32 and each stored in `dtype` as soon as it is made (the peak holds one float32 matrix, not all).
    rot_rows: the fused QKV also holds rot(q), rot(k) (and zero rows for v), so RoPE needs no rotate-half
    kernels (see rot_rows_for); else it is q|k|v only."""
    plan = plan or shard_plan(cfg)
    out = _Cast(dtype)
    D = cfg.head_dim
    read = reader(get, get_slice)
    whole = plan.size == 1
    (va, vb), Vl = plan.vocab, plan.vocab_local
    vocab = (lambda n: read(n)) if whole else (lambda n: read(n, 0, va, vb))
    out["embed"] = _pad(vocab("model.embed_tokens.weight"), Vl)
    out["head"] = _pad(vocab("lm_head.weight"), Vl) * read("model.norm.weight")[None, :]
    (ha, hb), (ka, kb) = plan.heads, plan.kv_heads
    q_idx = np.where(plan.q_slots >= 0, plan.q_slots - ha, -1)
    kv_idx = np.where(plan.kv_slots >= 0, plan.kv_slots - ka, -1)
    (ia, ib), Il = plan.inter, plan.inter_local
    for i in range(cfg.num_hidden_layers):
        def g(n, axis=None, a=None, b=None):
            name = f"model.layers.{i}.{n}.weight"
            return read(name) if whole or axis is None else read(name, axis, a, b)
        wq = g("self_attn.q_proj", 0, ha * D, hb * D) / np.sqrt(D)
        wk, wv = g("self_attn.k_proj", 0, ka * D, kb * D), g("self_attn.v_proj", 0, ka * D, kb * D)
        qkv = [_blocks(wq, q_idx, D), _blocks(wk, kv_idx, D), _blocks(wv, kv_idx, D)]
        if rot_rows:
            qkv += [_blocks(rotate_half_rows(wq, hb - ha, D), q_idx, D),
                    _blocks(rotate_half_rows(wk, kb - ka, D), kv_idx, D), np.zeros((len(kv_idx) * D, wv.shape[1]), wv.dtype)]
        qkv = np.concatenate(qkv)
        out[f"qkv.{i}"] = qkv * g("input_layernorm")[None, :]
        if cfg.qkv_bias:  # the same rows of the bias vectors (the norm folds into the weight's columns only)
            def bias(n, a, b):  # 1-D: read whole (small), sliced here
                return read(f"model.layers.{i}.{n}.bias")[a:b].reshape(-1, 1)
            bq = bias("self_attn.q_proj", ha * D, hb * D) / np.sqrt(D)
            bk, bv = bias("self_attn.k_proj", ka * D, kb * D), bias("self_attn.v_proj", ka * D, kb * D)
            b = [_blocks(bq, q_idx, D), _blocks(bk, kv_idx, D), _blocks(bv, kv_idx, D)]
            if rot_rows:
                b += [_blocks(rotate_half_rows(bq, hb - ha, D), q_idx, D),
                      _blocks(rotate_half_rows(bk, kb - ka, D), kv_idx, D), np.zeros((len(kv_idx) * D, 1), bv.dtype)]
            out[f"qkv_bias.{i}"] = np.concatenate(b).ravel()
        out[f"o.{i}"] = _blocks(g("self_attn.o_proj", 1, ha * D, hb * D), q_idx, D, axis=1)
        out[f"gate_up.{i}"] = np.concatenate([_pad(g("mlp.gate_proj", 0, ia, ib), Il),
                                              _pad(g("mlp.up_proj", 0, ia, ib), Il)]) * \
            g("post_attention_layernorm")[None, :]
        out[f"down.{i}"] = _pad(g("mlp.down_proj", 1, ia, ib), Il, axis=1)
    return dict(out)


def rot_rows_for(device):
    """Whether the fused QKV holds the rotate-half rows on `device`: yes on CPU, where a small model's
    cost is kernel dispatch (one wider matmul beats a split, a negate and a concat per layer); no on
    Ascend, where decoding is bandwidth-bound and the rows cost ~10% more weight bytes (Llama-2-70B)."""
    return device == "CPU"


def rank_weight_elements(cfg, plan, rot_rows):
    """Elements of the folded weights one rank holds (exactly what fused_weights returns for `plan`)."""
    d, D, L = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    q, kv = plan.kv_local * plan.group_local, plan.kv_local  # query and KV head slots
    qkv = (q + 2 * kv) * D * (2 if rot_rows else 1)  # rows of the fused projection
    layer = qkv * d + d * q * D + 3 * plan.inter_local * d + (qkv if cfg.qkv_bias else 0)
    return 2 * plan.vocab_local * d + L * layer  # embedding and LM head (kept apart even when tied)


def rope_rows(cfg, max_seq, heads=None, kv_heads=None):
    """cos, sin tables [S, (H + 2KV) * D] for the fused q|k|v row: RoPE on q and k, identity on v
    (H, KV: the heads this rank holds, default the model's)."""
    H = cfg.num_attention_heads if heads is None else heads
    KV = cfg.num_key_value_heads if kv_heads is None else kv_heads
    D = cfg.head_dim
    cos, sin = rope_tables(cfg, np.arange(max_seq))  # [S, D/2]
    cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)  # [S, D]
    cos = np.concatenate([np.tile(cos, H + KV), np.ones((max_seq, KV * D), np.float32)], -1)
    sin = np.concatenate([np.tile(sin, H + KV), np.zeros((max_seq, KV * D), np.float32)], -1)
    return cos.astype(np.float32), sin.astype(np.float32)
