"""What CANN's graph mode takes from an ONNX draft, and a check of a model against it.

Sources (kept here so the list can be re-checked when onnxruntime-cann or CANN moves):
- GRAPH_OPS, MIN_OPSET: onnxruntime's CANN execution provider, `SupportONNXModel` in
  onnxruntime/core/providers/cann/cann_graph.cc (github.com/microsoft/onnxruntime). With
  enable_cann_graph the provider hands one subgraph to CANN's ONNX parser (aclgrphParseONNXFromMem) and
  builds it per input shape (aclgrphBuildModel with INPUT_SHAPE); a node outside this set, of another
  domain, under opset MIN_OPSET, or whose inputs are all initializers splits the graph and the parts
  between run elsewhere. The op names were checked against the strings of
  libonnxruntime_providers_cann.so in onnxruntime-cann 1.24.4 (the wheel this project pins).
  (Older revisions of that file also refused opsets above 15.)
- OPSETS, DTYPES: the Ascend documentation "Supported ONNX Operators", CANN 8.5.0 (commercial edition,
  hiascend.com/document/detail/en/canncommercial/850/API/aolapi/, pages atlasoxol_09_0080 LessOrEqual,
  0079 Less, 0092 MatMul, 0123 ReduceMean, 0128 ReduceMax, 0151 Softmax, 0165 Tile, 0170 Where): the
  ONNX parser registers each op for a range of model opsets and some input types only. The document
  states ONNX 1.12.0 overall; ops not listed in OPSETS were not looked up one by one: the profile's
  opset 13 is the version CANN's ATC documentation gave for all ops before per-op ranges (v9-v13, CANN
  5.x/6.0). RESTRICTED: ops the documentation limits to some products. The CANN 8.0.RC2 edition of the
  list says it applies to Atlas inference products only; the 8.5.0 and 9.0.0 editions no longer do.
"""
import onnx
from onnx import TensorProto

GRAPH_OPS = frozenset({
    "Abs", "Acos", "Acosh", "Add", "And", "ArgMax", "ArgMin", "Asin", "Asinh", "Atan", "Atanh", "AveragePool",
    "BatchNormalization", "BitShift", "Cast", "Ceil", "Celu", "Clip", "Compress", "Concat", "Constant",
    "ConstantOfShape", "Conv", "ConvTranspose", "Cos", "Cosh", "CumSum", "DepthToSpace", "Det", "Div", "Dropout",
    "Elu", "Equal", "Erf", "Exp", "Expand", "EyeLike", "Flatten", "Floor", "Gather", "GatherElements", "GatherND",
    "Gemm", "GlobalAveragePool", "GlobalLpPool", "GlobalMaxPool", "Greater", "GreaterOrEqual", "Hardmax",
    "HardSigmoid", "HardSwish", "Identity", "InstanceNormalization", "LeakyRelu", "Less", "LessOrEqual", "Log",
    "LogSoftmax", "LpNormalization", "LpPool", "LRN", "LSTM", "MatMul", "Max", "MaxPool", "MaxRoiPool",
    "MaxUnpool", "Mean", "MeanVarianceNormalization", "Min", "Mod", "Mul", "Multinomial", "Neg",
    "NonMaxSuppression", "NonZero", "Not", "OneHot", "Or", "Pad", "Pow", "PRelu", "RandomNormalLike",
    "RandomUniform", "RandomUniformLike", "Range", "Reciprocal", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare",
    "Relu", "Reshape", "Resize", "ReverseSequence", "RoiAlign", "Round", "Scatter", "ScatterElements",
    "ScatterND", "Selu", "Shape", "Shrink", "Sigmoid", "Sign", "Sin", "Sinh", "Size", "Slice", "Softmax",
    "SoftmaxCrossEntropyLoss", "Softplus", "Softsign", "SpaceToDepth", "Split", "Sqrt", "Squeeze", "Sub", "Sum",
    "Tanh", "TfIdfVectorizer", "ThresholdedRelu", "Tile", "TopK", "Transpose", "Unsqueeze", "Where", "Xor"})
MIN_OPSET = 8

OPSETS = {"LessOrEqual": (12, 18), "Less": (8, 18), "MatMul": (8, 18), "ReduceMax": (8, 18), "ReduceMean": (8, 16),
          "Softmax": (8, 18), "Tile": (8, 18), "Where": (8, 18)}  # inclusive model-opset ranges
RESTRICTED = {"Tile": "documented for Atlas inference products only (CANN 8.0 and 9.0 pages)"}
_F16, _F32 = TensorProto.FLOAT16, TensorProto.FLOAT
DTYPES = {"MatMul": {_F16}, "LessOrEqual": {_F16, _F32}, "Less": {_F16, _F32, TensorProto.INT32},
          "Where": {_F16, _F32, TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32}}
_TYPED_INPUTS = {"Where": (1, 2)}  # which inputs DTYPES constrains (default: all)


def _types(model):
    """Element type of every named value (shape inference fills the intermediates)."""
    m = onnx.shape_inference.infer_shapes(model)
    g = m.graph
    seen = {t.name: t.data_type for t in g.initializer}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        seen[vi.name] = vi.type.tensor_type.elem_type
    return seen


def _opset(model):
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def problems(model):
    """Why `model` would not run as one CANN graph: a list of one-line reasons ([] = none found)."""
    opset, inits, types = _opset(model), {t.name for t in model.graph.initializer}, _types(model)
    out = [] if opset >= MIN_OPSET else [f"opset {opset} < {MIN_OPSET}"]
    for n in model.graph.node:
        what = f"{n.name} ({n.domain + '.' if n.domain else ''}{n.op_type})"
        if n.domain not in ("", "ai.onnx") or n.op_type not in GRAPH_OPS:
            out.append(f"{what}: not an op CANN's graph mode converts")
            continue
        lo, hi = OPSETS.get(n.op_type, (MIN_OPSET, opset))
        if not lo <= opset <= hi:
            out.append(f"{what}: CANN parses it for opsets {lo}-{hi}, the model is opset {opset}")
        if n.op_type in RESTRICTED:
            out.append(f"{what}: {RESTRICTED[n.op_type]}")
        if n.input and all(x in inits for x in n.input if x):
            out.append(f"{what}: all inputs are initializers (onnxruntime keeps such nodes off CANN)")
        picks = _TYPED_INPUTS.get(n.op_type, range(len(n.input)))
        bad = {types.get(n.input[j]) for j in picks if j < len(n.input)} - DTYPES.get(n.op_type, {None})
        if n.op_type in DTYPES and bad:
            names = ", ".join(TensorProto.DataType.Name(t) for t in sorted(b for b in bad if b is not None))
            out.append(f"{what}: input types {names or 'unknown'} (CANN takes "
                       f"{', '.join(TensorProto.DataType.Name(t) for t in sorted(DTYPES[n.op_type]))})")
    return out
