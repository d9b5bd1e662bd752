"""Weight quantization of an exported draft with onnxruntime's own quantizers.

int8: quantize_dynamic (MatMulInteger, per-tensor int8 activations, QInt8 weights).
q8/q4: MatMulNBits, 8/4-bit weights in blocks of 32, accuracy_level=4 (int8 activation
compute): the default accuracy level is ~20x slower on CPU for 8-bit.
Only weight MatMuls are touched (attention score MatMuls multiply two activations).
"""
import logging
import os

import onnx

from .builder import needs_external_data

MODES = ("int8", "q8", "q4")
BLOCK_SIZE = 32


def _weight_matmuls(model):
    inits = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits]


def quantize(model_proto_or_path, mode, out_path):
    """Write a quantized copy of the model (a ModelProto or an .onnx path) to out_path."""
    if mode not in MODES:
        raise ValueError(f"quantize mode must be one of {MODES}, got {mode!r}")
    model = model_proto_or_path
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(model)
    big = needs_external_data(model)
    if mode == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # it warns "consider pre-processing" on the root logger
        try:
            # onnx's shape inference has no type for GroupQueryAttention's output (a com.microsoft op): float
            quantize_dynamic(model, out_path, op_types_to_quantize=["MatMul"], nodes_to_quantize=_weight_matmuls(model),
                             weight_type=QuantType.QInt8, use_external_data_format=big,
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        finally:
            root.setLevel(level)
        return out_path
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    # it skips MatMuls without a constant weight itself; the LM head is quantized too (3x faster than fp32)
    q = MatMulNBitsQuantizer(model, bits=8 if mode == "q8" else 4, block_size=BLOCK_SIZE, is_symmetric=True,
                             accuracy_level=4, op_types_to_quantize=("MatMul",))
    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = log.level
    log.setLevel(logging.WARNING)  # it logs every node at INFO
    try:
        q.process()
    finally:
        log.setLevel(level)
    if os.path.exists(out_path + ".data"):
        os.remove(out_path + ".data")  # external data is appended to, never truncated
    q.model.save_model_to_file(out_path, use_external_data_format=big)
    return out_path
