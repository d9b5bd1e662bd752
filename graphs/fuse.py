"""Fold a Llama checkpoint into few, wide matrices (numpy, at load time).

Per layer: one q|k|v|rot(q)|rot(k) projection with the input RMSNorm weight and the 1/sqrt(D)
attention scale folded in, o_proj, one gate|up projection with the post-attention norm folded in,
and down_proj. RoPE then costs two multiplies and an add: out = a*cos + a_rot*sin, where
a_rot = rotate_half(a) comes straight out of the matmul (rows rotated in the weight)."""
import numpy as np

from mindspec.reference import rope_tables


def rotate_half_rows(w, n_heads, D):
    """Rows of W such that x @ result.T == rotate_half(x @ W.T) per head: [-x2, x1]."""
    w = w.reshape(n_heads, D, -1)
    return np.concatenate([-w[:, D // 2:], w[:, :D // 2]], axis=1).reshape(n_heads * D, -1)


def fused_weights(cfg, get):
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {"embed": get("model.embed_tokens.weight"),
           "head": get("lm_head.weight") * get("model.norm.weight")[None, :]}
    for i in range(cfg.num_hidden_layers):
        g = lambda n: get(f"model.layers.{i}.{n}.weight")  # noqa: E731
        wq = g("self_attn.q_proj") / np.sqrt(D)
        wk, wv = g("self_attn.k_proj"), g("self_attn.v_proj")
        qkv = np.concatenate([wq, wk, wv, rotate_half_rows(wq, H, D), rotate_half_rows(wk, KV, D),
                              np.zeros_like(wv)])
        out[f"qkv.{i}"] = qkv * g("input_layernorm")[None, :]
        out[f"o.{i}"] = g("self_attn.o_proj")
        out[f"gate_up.{i}"] = np.concatenate([g("mlp.gate_proj"), g("mlp.up_proj")]) * \
            g("post_attention_layernorm")[None, :]
        out[f"down.{i}"] = g("mlp.down_proj")
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def rope_rows(cfg, max_seq):
    """cos, sin tables [S, (H + 2KV) * D] for the fused q|k|v row: RoPE on q and k, identity on v."""
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = rope_tables(D, cfg.rope_theta, np.arange(max_seq))  # [S, D/2]
    cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)  # [S, D]
    cos = np.concatenate([np.tile(cos, H + KV), np.ones((max_seq, KV * D), np.float32)], -1)
    sin = np.concatenate([np.tile(sin, H + KV), np.zeros((max_seq, KV * D), np.float32)], -1)
    return cos.astype(np.float32), sin.astype(np.float32)
