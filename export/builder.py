"""Build a Llama decoder ONNX graph straight from numpy weights (no torch).

Interface (batch 1; P = cached positions, T = new tokens, positions P..P+T-1):
  inputs   input_ids [1, T] int64, past_key_i / past_value_i [1, P, KV, D] float32
  outputs  logits [1, T, V], new_key_i / new_value_i [1, T, KV, D] (keys after RoPE)
The [1, P, KV, D] layout lets the caller pass a contiguous slice buf[:, :P] of a preallocated
[1, S, KV, D] cache, so rollback is moving P. RoPE tables are computed in-graph from the
positions, so no maximum length is baked in.
"""
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # what opset 17 needs; newer IRs are refused by older runtimes
_PROTO_LIMIT = 1_800_000_000  # protobuf cannot serialize 2 GB; keep a margin


class _Graph:
    """Collects nodes and initializers; every helper returns its output name."""

    def __init__(self):
        self.nodes, self.inits, self._n = [], [], 0

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


def _rms_norm(g, x, w, eps):
    # Pow/ReduceMean/Add/Sqrt/Div/Mul: the pattern ORT fuses into SimplifiedLayerNormalization
    var = g.op("ReduceMean", [g.op("Pow", [x, g.const(2.0, dtype=np.float32)])], axes=[-1], keepdims=1)
    den = g.op("Sqrt", [g.op("Add", [var, g.const(eps, dtype=np.float32)])])
    return g.op("Mul", [g.op("Div", [x, den]), g.const(w.astype(np.float32))])


def _rope(g, x, cos, sin_signed, swap, out=None):
    """HF rotate-half on x [1, T, N, D]: x*cos + [x2, x1]*[-sin, sin]; one Gather swaps the halves."""
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [g.op("Gather", [x, swap], axis=-1), sin_signed])],
                out=out)


def build_decoder(ckpt, n_layers=None):
    """ONNX ModelProto of the first `n_layers` layers (all by default) + final norm + LM head."""
    cfg = ckpt.config
    L = cfg.num_hidden_layers if n_layers is None else int(n_layers)
    H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    G, half = H // KV, D // 2
    g = _Graph()
    i64 = lambda v: g.const(v, dtype=np.int64)  # noqa: E731

    # positions P..P+T-1; angles in float64 reduced mod 2*pi before the float32 Cos/Sin (ORT has
    # no double Cos), so RoPE stays exact to ~1e-7 at any position
    P = g.op("Gather", [g.op("Shape", ["past_key_0"]), i64(1)], axis=0)        # scalar
    T = g.op("Gather", [g.op("Shape", ["input_ids"]), i64(1)], axis=0)         # scalar
    PT = g.op("Add", [P, T])
    pos = g.op("Range", [P, PT, i64(1)])                                       # [T]
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    ang = g.op("Mul", [g.op("Unsqueeze", [g.op("Cast", [pos], to=TensorProto.DOUBLE), i64([1])]),
                       g.const(np.concatenate([inv_freq, inv_freq])[None, :])])  # [T, D] float64
    ang = g.op("Cast", [g.op("Mod", [ang, g.const(2 * np.pi)], fmod=1)], to=TensorProto.FLOAT)
    cos = g.op("Reshape", [g.op("Cos", [ang]), i64([1, -1, 1, D])])          # [1, T, 1, D]
    sin = g.op("Mul", [g.op("Reshape", [g.op("Sin", [ang]), i64([1, -1, 1, D])]),
                       g.const(np.repeat([-1.0, 1.0], half).astype(np.float32))])  # [1, T, 1, D], [-sin, sin]
    swap = i64(np.concatenate([np.arange(half, D), np.arange(half)]))           # [D]: halves swapped
    # causal mask over past+new: key s is visible to query t iff s <= P + t
    keys = g.op("Range", [i64(0), PT, i64(1)])                                 # [P+T]
    hidden = g.op("Greater", [g.op("Unsqueeze", [keys, i64([0])]), g.op("Unsqueeze", [pos, i64([1])])])
    mask = g.op("Where", [hidden, g.const(-np.inf, dtype=np.float32), g.const(0.0, dtype=np.float32)])  # [T, P+T]
    mask = g.op("Tile", [mask, i64([G, 1])])                                   # [G*T, P+T], row g*T+t

    x = g.op("Gather", [g.const(ckpt.get("model.embed_tokens.weight"), "embed_tokens"), "input_ids"], axis=0)
    eps, inter = cfg.rms_norm_eps, cfg.intermediate_size
    for i in range(L):
        w = lambda n: ckpt.get(f"model.layers.{i}.{n}.weight")  # noqa: E731
        h = _rms_norm(g, x, w("input_layernorm"), eps)
        # one fused QKV matmul; 1/sqrt(D) folded into Wq (RoPE is linear, q is not an output)
        wqkv = np.concatenate([w("self_attn.q_proj") / np.sqrt(D), w("self_attn.k_proj"), w("self_attn.v_proj")]).T
        qkv = g.op("MatMul", [h, g.const(np.ascontiguousarray(wqkv, np.float32), f"l{i}.qkv")])
        qkv = g.op("Reshape", [qkv, i64([1, -1, H + 2 * KV, D])])             # [1, T, H+2KV, D]
        qk, v = g.op("Split", [qkv, i64([H + KV, KV])], out=[f"qk{i}", f"new_value_{i}"], axis=2)  # v [1, T, KV, D]
        qk = _rope(g, qk, cos, sin, swap)                                       # q and k rotated together
        q, k = g.op("Split", [qk, i64([H, KV])], out=[f"q{i}", f"new_key_{i}"], axis=2)  # k [1, T, KV, D]
        k_all = g.op("Concat", [f"past_key_{i}", k], axis=1)                    # [1, P+T, KV, D]
        v_all = g.op("Concat", [f"past_value_{i}", v], axis=1)
        # GQA without repeating K/V: the G query heads of a KV head become G*T rows of one matmul
        qg = g.op("Reshape", [g.op("Transpose", [g.op("Reshape", [q, i64([1, -1, KV, G, D])])],
                                   perm=[0, 2, 3, 1, 4]), i64([1, KV, -1, D])])  # [1, KV, G*T, D]
        s = g.op("MatMul", [qg, g.op("Transpose", [k_all], perm=[0, 2, 3, 1])])  # [1, KV, G*T, P+T]
        s = g.op("Add", [s, mask])
        v_t = g.op("Transpose", [v_all], perm=[0, 2, 1, 3])                     # [1, KV, P+T, D]
        a = g.op("MatMul", [g.op("Softmax", [s], axis=-1), v_t])                # [1, KV, G*T, D]
        a = g.op("Reshape", [g.op("Transpose", [g.op("Reshape", [a, i64([1, KV, G, -1, D])])], perm=[0, 3, 1, 2, 4]),
                             i64([1, -1, H * D])])                              # [1, T, H*D]
        x = g.op("Add", [x, g.op("MatMul", [a, g.const(np.ascontiguousarray(w("self_attn.o_proj").T), f"l{i}.o")])])
        h = _rms_norm(g, x, w("post_attention_layernorm"), eps)
        wgu = np.ascontiguousarray(np.concatenate([w("mlp.gate_proj"), w("mlp.up_proj")]).T)
        gu = g.op("MatMul", [h, g.const(wgu, f"l{i}.gate_up")])                # [1, T, 2I]
        gate, up = g.op("Split", [gu, i64([inter, inter])], n_out=2, axis=-1)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        x = g.op("Add", [x, g.op("MatMul", [act, g.const(np.ascontiguousarray(w("mlp.down_proj").T), f"l{i}.down")])])
    x = _rms_norm(g, x, ckpt.get("model.norm.weight"), eps)
    head = np.ascontiguousarray(ckpt.get("lm_head.weight").T)                   # [d, V]
    g.op("MatMul", [x, g.const(head, "lm_head")], out="logits")

    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"])]
    outs = [helper.make_tensor_value_info("logits", f32, [1, "T", cfg.vocab_size])]
    for i in range(L):
        inputs += [helper.make_tensor_value_info(f"past_{n}_{i}", f32, [1, "P", KV, D]) for n in ("key", "value")]
        outs += [helper.make_tensor_value_info(f"new_{n}_{i}", f32, [1, "T", KV, D]) for n in ("key", "value")]
    graph = helper.make_graph(g.nodes, "mindspec_draft", inputs, outs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="mindspec", ir_version=IR_VERSION)
    return model


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
