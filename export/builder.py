"""Build a Llama decoder ONNX graph straight from numpy weights (no torch).

Profile "cpu" (draft format 3; onnxruntime's CPU provider; B rows, T new tokens per row, S = cache length):
  inputs   input_ids [B, T] int64, positions [B] int64 (cached length of each row = absolute
           position of input_ids[b, 0]), last [B] int64 (the token of each row whose logits are
           returned), past_key_i / past_value_i [B, KV, S, D] in the export's dtype
  outputs  logits [B, V] float32 (after token last[b]), present_key_i / present_value_i [B, KV, S, D]:
           the past buffers with each row's T new tokens (keys after RoPE) written at positions[b]..
Attention is onnxruntime's GroupQueryAttention (com.microsoft): RoPE, the cache write and attention
in one node a layer. The runtime binds present_* to the past_* memory, so the static preallocated
cache is written in place (no per-call shape change, no copy), and each row attends to its own
positions[b] + T slots only, whatever the stale slots past them hold; right-padded rows are exact for
their real tokens. Its CPU kernel runs several tokens a row only in a call of one row (B = 1) or one
token a row (T = 1): the runtime splits other calls. RoPE tables of max_seq + 1 positions.
dtype float16: weights, activations and the KV cache in float16; RMSNorm statistics and the logits in
float32 (as the target's graph).

Profile "ascend" (for CANN's graph mode: ops of cann_ops.py, opset ASCEND_OPSET, float16, one compile per
static (B, T, S)): the graph writes the cache itself and never returns K/V to the host.
  inputs   input_ids [B, T], positions [B, T] (absolute position of each token, clipped to the RoPE
           table), slots [B, T] (the cache slot each token is written to, -1 for padding), last_index [B]
           (b*T + the token whose logits are returned), past_key_i / past_value_i [B, KV, S, D]
  outputs  logits [B, V] float32, present_key_i / present_value_i [B, KV, S, D]: the past with the new
           tokens written in (the runtime binds them to the other half of a double buffer)
Query t of row b sees the slots s <= positions[b, t] of the updated cache.
"""
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mindspec.checkpoint import narrow, source
from mindspec.reference import rope_inv_freq

OPSET = 17
ASCEND_OPSET = 13  # inside the opset range of every op the ascend profile uses (cann_ops.py)
IR_VERSION = 8  # what opset 17 needs; newer IRs are refused by older runtimes
_PROTO_LIMIT = 1_800_000_000  # protobuf cannot serialize 2 GB; keep a margin
NEG = -1e9  # finite mask value: no score row is ever all -inf (NaN softmax)
DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}


class _Graph:
    """Collects nodes and initializers; every helper returns its output name."""

    def __init__(self, dtype="float32"):
        self.nodes, self.inits, self._n = [], [], 0
        self.np_dtype, self.onnx_dtype = DTYPES[dtype]
        self.half = dtype != "float32"

    def const(self, value, name=None, dtype=None):
        self._n += 1
        name = name or f"c{self._n}"
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type, inputs, n_out=1, out=None, **attrs):
        self._n += 1
        outs = ([out] if isinstance(out, str) else list(out)) if out else \
            [f"{op_type.lower()}{self._n}_{j}" for j in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{op_type}_{self._n}", **attrs))
        return outs[0] if len(outs) == 1 else outs

    def i64(self, v):
        return self.const(v, dtype=np.int64)

    def dim(self, name, axis):
        """Dimension `axis` of tensor `name` as an int64 scalar."""
        return self.op("Gather", [self.op("Shape", [name]), self.i64(axis)], axis=0)

    def weight(self, value, name):
        """An initializer in the export's dtype (name: "embed_tokens", "lm_head" or l<layer>.<kind>)."""
        layer, _, kind = name[1:].partition(".") if name[0] == "l" and name[1].isdigit() else (None, "", name)
        told = source({"embed_tokens": "embed", "lm_head": "head"}.get(kind, kind), layer)
        return self.const(narrow(value, self.np_dtype, told, "export this draft with --dtype float32 (--profile "
                                                             "cpu)"), name)

    def wide(self, x):
        """x in float32 (a no-op for a float32 export)."""
        return self.op("Cast", [x], to=TensorProto.FLOAT) if self.half else x

    def narrow(self, x):
        """x back in the export's dtype."""
        return self.op("Cast", [x], to=self.onnx_dtype) if self.half else x

    def arange(self, n):
        """[n] int64: 0..n-1 for an int64 scalar n."""
        return self.op("Range", [self.i64(0), n, self.i64(1)])


def _rms_norm(g, x, w, eps):
    # Pow/ReduceMean/Add/Sqrt/Div/Mul: the pattern ORT fuses into SimplifiedLayerNormalization
    x = g.wide(x)  # statistics in float32 whatever the dtype
    var = g.op("ReduceMean", [g.op("Pow", [x, g.const(2.0, dtype=np.float32)])], axes=[-1], keepdims=1)
    den = g.op("Sqrt", [g.op("Add", [var, g.const(eps, dtype=np.float32)])])
    return g.narrow(g.op("Mul", [g.op("Div", [x, den]), g.const(w.astype(np.float32))]))


def _rope(g, x, cos, sin_signed, swap):
    """HF rotate-half on x [B, T, N, D]: x*cos + [x2, x1]*[-sin, sin]; one Gather swaps the halves."""
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [g.op("Gather", [x, swap], axis=-1), sin_signed])])


def _group_queries(g, q, KV, G, D):
    """q [B, T, KV*G, D] -> [B, KV, G*T, D]: GQA without repeating K/V, the G query heads of a KV head
    become G*T rows of one matmul (row g*T+t is query t)."""
    return g.op("Reshape", [g.op("Transpose", [g.op("Reshape", [q, g.i64([0, 0, KV, G, D])])],
                                 perm=[0, 2, 3, 1, 4]), g.i64([0, KV, -1, D])])


def _ungroup(g, a, KV, G, D):
    """a [B, KV, G*T, D] -> [B, T, KV*G*D], the inverse of _group_queries."""
    a = g.op("Transpose", [g.op("Reshape", [a, g.i64([0, KV, G, -1, D])])], perm=[0, 3, 1, 2, 4])  # [B, T, KV, G, D]
    return g.op("Reshape", [a, g.i64([0, 0, KV * G * D])])


def _last_rows(g, x, T, d):
    """x [B, T, d] -> [B, d] at token last[b] of each row: the head then runs on B rows, not B*T.
    A flat Gather (b*T + last[b]) rather than GatherND: every provider has it."""
    base = g.op("Mul", [g.arange(g.dim("input_ids", 0)), T])                           # [B]: b*T
    flat = g.op("Reshape", [x, g.i64([-1, d])])                                        # [B*T, d]
    return g.op("Gather", [flat, g.op("Add", [base, "last"])], axis=0)                 # [B, d]


def _gqa_attention(g, cfg, max_seq):
    """The cpu profile's attention: onnxruntime's GroupQueryAttention (com.microsoft, CPU provider), one
    node a layer for RoPE, the cache write and attention: it writes the new K/V into the past buffers
    themselves (the runtime binds present_* to the past_* memory) and reads each row's own length, not
    the whole buffer. RoPE tables of max_seq + 1 positions (a row sitting out of a call writes one
    token at its position, at most max_seq). Returns attend(i, qkv [B, T, (H+2KV)*D]) -> [B, T, H*D]."""
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ang = np.arange(max_seq + 1, dtype=np.float64)[:, None] * rope_inv_freq(cfg)        # [P, D/2], float64
    cos, sin = g.weight(np.cos(ang), "rope_cos"), g.weight(np.sin(ang), "rope_sin")
    end = g.op("Add", ["positions", g.dim("input_ids", 1)])                              # [B]: cached + T
    i32 = TensorProto.INT32
    seqlens = g.op("Cast", [g.op("Sub", [end, g.i64(1)])], to=i32)                      # [B]: each row's length - 1
    total = g.op("Cast", [g.op("ReduceMax", [end], keepdims=0)], to=i32)                # scalar

    def attend(i, qkv):
        q, k, v = g.op("Split", [qkv, g.i64([H * D, KV * D, KV * D])], n_out=3, axis=-1)
        return g.op("GroupQueryAttention", [q, k, v, f"past_key_{i}", f"past_value_{i}", seqlens, total, cos, sin],
                    out=[f"attn{i}", f"present_key_{i}", f"present_value_{i}"], domain="com.microsoft",
                    num_heads=H, kv_num_heads=KV, do_rotary=1, rotary_interleaved=0, scale=1.0)[0]
    return attend


def _reshape(g, x, shape):
    return g.op("Reshape", [x, g.i64(shape)])


def _rope_lookup(g, cfg, P):
    """cos, signed sin [B, T, 1, D] gathered at positions [B, T] from tables of P positions computed
    here in float64: no float64 on the device, no per-call trigonometry."""
    D = cfg.head_dim
    inv_freq = rope_inv_freq(cfg)
    ang = np.arange(P, dtype=np.float64)[:, None] * np.concatenate([inv_freq, inv_freq])  # [P, D]
    sin = np.sin(ang) * np.repeat([-1.0, 1.0], D // 2)                                      # [-sin, sin]
    return tuple(_reshape(g, g.op("Gather", [g.weight(tab, name), "positions"], axis=0), [0, 0, 1, D])
                 for tab, name in ((np.cos(ang), "rope_cos"), (sin, "rope_sin")))


def _slot_maps(g, G):
    """From the per-token inputs, over the S cache slots: the additive mask [B, 1, G*T, S] (query t of
    row b sees slots s <= positions[b, t], its own included), the one-hot write map [B, 1, S, T] (slot s
    takes token t where slots[b, t] == s; padding has slot -1) and `written` [B, 1, S, 1]. Compared in
    float32 (CANN compares floats), reshaped rather than unsqueezed (attribute-free ops parse on
    every CANN version), G copies concatenated rather than tiled (CANN documents Tile for some products only)."""
    f32 = TensorProto.FLOAT
    s = g.op("Cast", [g.arange(g.dim("past_key_0", 2))], to=f32)                      # [S]
    qpos = g.op("Cast", ["positions"], to=f32)                                          # [B, T]
    seen = _reshape(g, g.op("Concat", [qpos] * G, axis=1), [0, 1, -1, 1])             # [B, 1, G*T, 1]
    mask = g.op("Where", [g.op("LessOrEqual", [_reshape(g, s, [1, 1, 1, -1]), seen]),   # [B, 1, G*T, S]
                          g.const(0.0, dtype=np.float32), g.const(NEG, dtype=np.float32)])
    slot = _reshape(g, g.op("Cast", ["slots"], to=f32), [0, 1, 1, -1])                 # [B, 1, 1, T]
    onehot = g.op("Cast", [g.op("Equal", [_reshape(g, s, [1, 1, -1, 1]), slot])], to=g.onnx_dtype)  # [B, 1, S, T]
    written = g.op("Less", [g.const(0.5, dtype=g.np_dtype),
                            g.op("ReduceMax", [onehot], axes=[3], keepdims=1)])          # [B, 1, S, 1] bool
    return mask, onehot, written


def _cache_attention(g, i, q, k, v, maps, dims):
    """The graph writes the new K/V into the cache (present_* = the whole [B, KV, S, D] buffers, bound
    on the device by the runtime) and attends over it; returns [B, T, H*D]."""
    H, KV, D = dims
    mask, onehot, written = maps
    present = [g.op("Where", [written, g.op("MatMul", [onehot, new]), f"past_{n}_{i}"], out=f"present_{n}_{i}")
               for n, new in (("key", k), ("value", v))]  # the one-hot MatMul copies each new row exactly
    qg = _group_queries(g, q, KV, H // KV, D)                                           # [B, KV, G*T, D]
    s = g.op("MatMul", [qg, g.op("Transpose", [present[0]], perm=[0, 1, 3, 2])])        # [B, KV, G*T, S]
    p = g.narrow(g.op("Softmax", [g.op("Add", [g.wide(s), mask])], axis=-1))
    return _ungroup(g, g.op("MatMul", [p, present[1]]), KV, H // KV, D)                # [B, T, H*D]


def _ascend_attention(g, cfg, max_seq):
    """The ascend profile's attention: RoPE tables of max_seq positions, the cache written and attended
    in the graph (K/V stay intermediate). Returns attend(i, qkv [B, T, (H+2KV)*D]) -> [B, T, H*D]."""
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = _rope_lookup(g, cfg, max_seq)
    maps = _slot_maps(g, H // KV)
    swap = g.i64(np.concatenate([np.arange(D // 2, D), np.arange(D // 2)]))             # [D]: halves swapped

    def attend(i, qkv):
        qkv = g.op("Reshape", [qkv, g.i64([0, 0, H + 2 * KV, D])])                     # [B, T, H+2KV, D]
        qk, v = g.op("Split", [qkv, g.i64([H + KV, KV])], n_out=2, axis=2)            # v [B, T, KV, D]
        qk = _rope(g, qk, cos, sin, swap)                                               # q and k rotated together
        q, k = g.op("Split", [qk, g.i64([H, KV])], n_out=2, axis=2)                    # q [B, T, H, D]
        k = g.op("Transpose", [k], perm=[0, 2, 1, 3])                                   # [B, KV, T, D]
        v = g.op("Transpose", [v], perm=[0, 2, 1, 3])                                   # [B, KV, T, D]
        return _cache_attention(g, i, q, k, v, maps, (H, KV, D))
    return attend


def _io(cfg, L, kv_dtype, profile):
    """Graph inputs and outputs of a profile (symbolic B, T, S: each call's shapes are static)."""
    KV, D, i64 = cfg.num_key_value_heads, cfg.head_dim, TensorProto.INT64
    vi = helper.make_tensor_value_info
    if profile == "cpu":
        ins = [vi("input_ids", i64, ["B", "T"]), vi("positions", i64, ["B"]), vi("last", i64, ["B"])]
    else:
        ins = [vi("input_ids", i64, ["B", "T"]), vi("positions", i64, ["B", "T"]), vi("slots", i64, ["B", "T"]),
               vi("last_index", i64, ["B"])]
    outs = [vi("logits", TensorProto.FLOAT, ["B", cfg.vocab_size])]
    for i in range(L):
        ins += [vi(f"past_{n}_{i}", kv_dtype, ["B", KV, "S", D]) for n in ("key", "value")]
        outs += [vi(f"present_{n}_{i}", kv_dtype, ["B", KV, "S", D]) for n in ("key", "value")]
    return ins, outs


def build_decoder(ckpt, n_layers=None, dtype="float32", profile="cpu", max_seq=None):
    """ONNX ModelProto of the first `n_layers` layers (all by default) + final norm + LM head, with
    weights and KV cache in `dtype` (float32 or float16), RoPE tables of `max_seq` positions (default:
    the checkpoint's). profile "cpu": GroupQueryAttention; "ascend" (cann_ops.py): the cache written in
    the graph by standard ops, opset ASCEND_OPSET."""
    cfg = ckpt.config
    L = cfg.num_hidden_layers if n_layers is None else int(n_layers)
    D, max_seq = cfg.head_dim, max_seq or cfg.max_position_embeddings
    g = _Graph(dtype)
    attend = (_gqa_attention if profile == "cpu" else _ascend_attention)(g, cfg, max_seq)

    x = g.op("Gather", [g.weight(ckpt.get("model.embed_tokens.weight"), "embed_tokens"), "input_ids"], axis=0)
    eps, inter = cfg.rms_norm_eps, cfg.intermediate_size                                # x [B, T, d]
    for i in range(L):
        w = lambda n: ckpt.get(f"model.layers.{i}.{n}.weight")  # noqa: E731
        h = _rms_norm(g, x, w("input_layernorm"), eps)
        # one fused QKV matmul; 1/sqrt(D) folded into Wq (RoPE is linear, q is not an output)
        wqkv = np.concatenate([w("self_attn.q_proj") / np.sqrt(D), w("self_attn.k_proj"), w("self_attn.v_proj")]).T
        qkv = g.op("MatMul", [h, g.weight(wqkv, f"l{i}.qkv")])                        # [B, T, (H+2KV)*D]
        if cfg.qkv_bias:  # Qwen2
            bqkv = np.concatenate([ckpt.get(f"model.layers.{i}.self_attn.q_proj.bias") / np.sqrt(D),
                                   ckpt.get(f"model.layers.{i}.self_attn.k_proj.bias"),
                                   ckpt.get(f"model.layers.{i}.self_attn.v_proj.bias")])
            qkv = g.op("Add", [qkv, g.weight(bqkv, f"l{i}.qkv_bias")])
        a = attend(i, qkv)                                                              # [B, T, H*D]
        x = g.op("Add", [x, g.op("MatMul", [a, g.weight(w("self_attn.o_proj").T, f"l{i}.o")])])
        h = _rms_norm(g, x, w("post_attention_layernorm"), eps)
        wgu = np.concatenate([w("mlp.gate_proj"), w("mlp.up_proj")]).T
        gu = g.op("MatMul", [h, g.weight(wgu, f"l{i}.gate_up")])                       # [B, T, 2I]
        gate, up = g.op("Split", [gu, g.i64([inter, inter])], n_out=2, axis=-1)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        x = g.op("Add", [x, g.op("MatMul", [act, g.weight(w("mlp.down_proj").T, f"l{i}.down")])])
    d = cfg.hidden_size
    if profile == "cpu":
        x = _last_rows(g, x, g.dim("input_ids", 1), d)                                  # [B, d]
    else:  # the runtime passes b*T + last[b]: no index arithmetic in the graph
        x = g.op("Gather", [_reshape(g, x, [-1, d]), "last_index"], axis=0)           # [B, d]
    x = _rms_norm(g, x, ckpt.get("model.norm.weight"), eps)
    logits = g.op("MatMul", [x, g.weight(ckpt.get("lm_head.weight").T, "lm_head")],
                  out=None if g.half else "logits")                                     # [B, V]
    if g.half:
        g.op("Cast", [logits], to=TensorProto.FLOAT, out="logits")
    inputs, outs = _io(cfg, L, g.onnx_dtype, profile)
    if profile == "cpu":
        return _model(g, "mindspec_draft", inputs, outs, OPSET, ms=True)
    return _model(g, "mindspec_draft", inputs, outs, ASCEND_OPSET)


def _model(g, name, inputs, outputs, opset, ms=False):
    """ms: the graph uses onnxruntime's com.microsoft ops (the cpu profile's GroupQueryAttention)."""
    graph = helper.make_graph(g.nodes, name, inputs, outputs, initializer=g.inits)
    domains = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    return helper.make_model(graph, opset_imports=domains, producer_name="mindspec", ir_version=IR_VERSION)


def build_row_copy(n, shape, dtype="float16"):
    """A tiny graph for DraftSession.move on the device: cache_j [R, KV, S, D] (j < n) -> moved_j, with
    the row selected by `dst` [R, 1, 1, 1] (bool) replaced by row `src` [1]; every other row copied."""
    g = _Graph(dtype)
    for j in range(n):
        g.op("Where", ["dst", g.op("Gather", [f"cache_{j}", "src"], axis=0), f"cache_{j}"], out=f"moved_{j}")
    vi = helper.make_tensor_value_info
    ins = [vi("src", TensorProto.INT64, [1]), vi("dst", TensorProto.BOOL, [shape[0], 1, 1, 1])]
    ins += [vi(f"cache_{j}", g.onnx_dtype, list(shape)) for j in range(n)]
    return _model(g, "mindspec_row_copy", ins, [vi(f"moved_{j}", g.onnx_dtype, list(shape)) for j in range(n)],
                  ASCEND_OPSET)


def needs_external_data(model):
    """True when the proto would not fit protobuf's 2 GB limit."""
    return sum(t.ByteSize() for t in model.graph.initializer) > _PROTO_LIMIT


def save_model(model, path):
    """Save; weights go to `<file>.data` beside it when the proto is too big for one file."""
    big = needs_external_data(model)
    data = os.path.basename(path) + ".data"
    if big and os.path.exists(path + ".data"):
        os.remove(path + ".data")  # external data is appended to, never truncated
    onnx.save_model(model, path, save_as_external_data=big, all_tensors_to_one_file=True, location=data)
    return path
