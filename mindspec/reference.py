"""A plain numpy Llama forward pass: the numerical reference the ONNX draft and the MindSpore target
are tested against. Slow and cache-free on purpose: it is the definition, not the implementation."""
import numpy as np


def rope_inv_freq(cfg):
    """RoPE's frequencies [head_dim // 2], float64, with cfg.rope_scaling applied as Hugging Face's
    modeling_rope_utils does ("linear", "llama3"): the one definition the target's tables, the draft's and
    this reference all use."""
    D, s = cfg.head_dim, cfg.rope_scaling
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return inv_freq / s.factor
    # llama3: long wavelengths slowed by factor, short ones kept, a linear blend in 1/wavelength between
    wavelen = 2 * np.pi / inv_freq
    old = s.original_max_position_embeddings
    smooth = np.clip((old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor), 0, 1)
    return (1 - smooth) * inv_freq / s.factor + smooth * inv_freq


def rope_tables(cfg, positions):
    """cos, sin of shape [T, head_dim // 2] for the given absolute positions (HF rotate-half layout)."""
    ang = np.asarray(positions, dtype=np.float64)[:, None] * rope_inv_freq(cfg)[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x, cos, sin):
    """x: [H, T, D]; cos/sin: [T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rms_norm(x, w, eps):
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)).astype(np.float32) * w


def reference_logits(cfg, get, ids, n_layers=None):
    """Logits [T, V] for token ids [T]. `get(name)` returns a HF-named weight as float32."""
    ids = np.asarray(ids)
    T, H, KV, D = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = get("model.embed_tokens.weight")[ids]
    cos, sin = rope_tables(cfg, np.arange(T))
    causal = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    for i in range(cfg.num_hidden_layers if n_layers is None else n_layers):
        w = lambda n: get(f"model.layers.{i}.{n}.weight")  # noqa: E731
        h = rms_norm(x, w("input_layernorm"), cfg.rms_norm_eps)
        b = (lambda n: get(f"model.layers.{i}.{n}.bias")) if cfg.qkv_bias else (lambda n: 0.0)  # noqa: E731
        q = (h @ w("self_attn.q_proj").T + b("self_attn.q_proj")).reshape(T, H, D).transpose(1, 0, 2)
        k = (h @ w("self_attn.k_proj").T + b("self_attn.k_proj")).reshape(T, KV, D).transpose(1, 0, 2)
        v = (h @ w("self_attn.v_proj").T + b("self_attn.v_proj")).reshape(T, KV, D).transpose(1, 0, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = np.repeat(k, H // KV, axis=0), np.repeat(v, H // KV, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(D) + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v
        x = x + a.transpose(1, 0, 2).reshape(T, H * D) @ w("self_attn.o_proj").T
        h = rms_norm(x, w("post_attention_layernorm"), cfg.rms_norm_eps)
        g = h @ w("mlp.gate_proj").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    x = rms_norm(x, get("model.norm.weight"), cfg.rms_norm_eps)
    return x @ get("lm_head.weight").T
