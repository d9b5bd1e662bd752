"""ops.arange, ops.split, ops.full_like, ops.topk, ops.argmax and ops.one_hot as the primitives they end in,
for graph code: the functional wrappers are Python that MindSpore parses and type-infers again in every graph
it compiles (argument checks, loops over split sizes, dtype promotion), 0.2-0.6 s of a graph's compile each
on the test CPU. The same primitives with the same arguments: the same kernels and results."""
import mindspore as ms
from mindspore import Tensor, ops

_RANGE, _CAST, _SCALAR, _SLICE = ops.Range(), ops.Cast(), ops.ScalarToTensor(), ops.StridedSlice()
_HALVES = {axis: ops.Split(axis, 2) for axis in (1, 2)}
_FILL, _TOPK, _ARGMAX, _ONE_HOT = ops.FillV2(), ops.TopK(True), ops.Argmax(-1, ms.int64), ops.OneHot(-1)
_ON, _OFF = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)
_ISFINITE, _ALL, _SELECT, _ZEROS = ops.IsFinite(), ops.ReduceAll(), ops.Select(), ops.ZerosLike()


def iota(n):
    """[n] int32: 0 .. n-1, as ops.arange(n, dtype=ms.int32) (a Range over int64, then a Cast)."""
    return _CAST(_RANGE(_SCALAR(0, ms.int64), _SCALAR(n, ms.int64), _SCALAR(1, ms.int64)), ms.int32)


def halves(x, axis):
    """x's two equal halves along `axis` (1 or 2, the last), as ops.split(x, x.shape[axis] // 2, axis)."""
    return _HALVES[axis](x)


def heads(a, h, kv):
    """a [B, h + 2*kv, T, D] -> q [B, h, T, D], k, v [B, kv, T, D], as ops.split(a, (h, kv, kv), 1) (a
    StridedSlice each)."""
    B, _, T, D = a.shape
    return (_SLICE(a, (0, 0, 0, 0), (B, h, T, D), (1, 1, 1, 1)),
            _SLICE(a, (0, h, 0, 0), (B, h + kv, T, D), (1, 1, 1, 1)),
            _SLICE(a, (0, h + kv, 0, 0), (B, h + 2 * kv, T, D), (1, 1, 1, 1)))


def full_like(x, value):
    """x's shape and dtype, every element `value` (ops.full_like(x, value): a FillV2)."""
    return _FILL(x.shape, _SCALAR(value, x.dtype))


def largest(x, k):
    """The k largest of x along its last axis, sorted: (values, indices), as ops.topk(x, k, -1, True, True)."""
    return _TOPK(x, k)


def argmax(x):
    """Indices [...] int64 of x's maxima along its last axis (ops.argmax(x, -1))."""
    return _ARGMAX(x)


def one_hot(ids, depth):
    """ids [...] -> float32 [..., depth]: 1.0 at each id, else 0.0 (ops.one_hot(ids, depth, 1.0, 0.0))."""
    return _ONE_HOT(ids, depth, _ON, _OFF)


def finite_rows(x):
    """[..., V] -> [...] int32: 1 where every value along the last axis is finite (no inf, no NaN), else 0."""
    return _CAST(_ALL(_ISFINITE(x), -1), ms.int32)


def or_minus_one(tok, ok):
    """tok where ok (int32 1/0, same shape), else -1: a token the engine refuses (its logits were not finite:
    argmax and sampling of NaN give some token, as if it were the model's)."""
    return (tok + 1) * ok - 1


def finite_or_zero(x):
    """x with each inf or NaN made 0: what a row writes into its KV cache. A masked cache position still
    enters attention's p @ V as 0 * v, which is NaN for v NaN: one overflowing position (float16) made the
    positions before it in its call, and every later request in its slot, not finite. (An overflow of the
    residual stays in the position's hidden state, refused where it is committed or read as a prompt; one of
    q/k/v alone with a finite residual goes unseen.)"""
    return _SELECT(_ISFINITE(x), x, _ZEROS(x))
