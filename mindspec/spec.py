"""The speculative-decoding settings in one place (as vLLM's SpeculativeConfig): K buckets, batch
buckets, fixed or dynamic K, the cache sizing rule, quantization modes, the dtypes each device runs.
Importing it loads no framework, so bad input is refused before MindSpore or onnxruntime start."""
from dataclasses import dataclass

from .errors import MindspecError, is_int, shown

K_BUCKETS = (1, 2, 4, 8)  # draft lengths with their own compiled verify graph
BATCH_BUCKETS = (1, 2, 4, 8)  # rows per compiled call; a step pads its rows up to the next bucket
PREFILL_CHUNK = 32  # prompts go through compiled [B, 32] graphs, a chunk of each prefilling row per step
# most prompt tokens the draft feeds a row per step (after a prefix-cache hit it feeds the whole prompt):
# default draft: 128 tokens of one row 75 ms (format 3), under one target chunk (89 ms); 512 would stall the rows
DRAFT_CATCHUP = 4 * PREFILL_CHUNK  # a multiple: a prompt's catch-up stops at multiples of the chunk (engine.draft_cut)
SEQ_ROUND = 256  # an auto-sized cache grows in steps of this (each size is a new set of graphs)
QUANTIZE_MODES = (None, "int8", "q8", "q4")
TOP_LOGPROBS = 20  # most alternatives a request may ask per token with its logprobs (OpenAI's and vLLM's limit)


def round_up(n, m):
    return (n + m - 1) // m * m


def cache_positions(max_seq, k_buckets):
    """Positions per target cache slot for `max_seq` committed ones: past them a tail where a verify
    writes its drafts and the padding rows of a batch bucket write (a prefill chunk's worth), never
    attended before a real row writes there itself."""
    return round_up(max_seq, PREFILL_CHUNK) + max(max(k_buckets), PREFILL_CHUNK)


def attention_windows(positions):
    """The attention windows of a cache slot of `positions`: 256, 1024, 4096, ... up to half the slot, and
    the whole slot. A call whose rows all sit below a window attends over that window only (its gathers
    and attention cost in proportion: a B=8 verify of the default model 165 ms over 128 positions, 287 ms
    over 1024); each window is another set of graphs, so one is made only where it at least halves what
    a call reads."""
    small = []
    w = 256
    while 2 * w <= positions:
        small.append(w)
        w *= 4
    return tuple(small) + (positions,)


DTYPES = ("float32", "float16", "bfloat16")
DEVICE_DTYPES = {"CPU": ("float32", "float16"),  # MindSpore's CPU kernels have no bfloat16 MatMul
                 "Ascend": ("float16", "bfloat16", "float32")}  # the first: the device's default
PLAN_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # mindspec plan's names


def resolve_dtype(dtype, device):
    """The target's dtype on `device` ("CPU"/"Ascend"): None picks the device's default (float16 on
    Ascend, float32 on CPU). One line naming what the device runs when it cannot run `dtype`."""
    runs = DEVICE_DTYPES.get(device, ("float32",))
    if dtype is None:
        return runs[0]
    if not isinstance(dtype, str):  # numpy's dtype('float16') by its name (it equals the string, hashes apart)
        dtype = getattr(dtype, "name", dtype)
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise MindspecError(f"dtype must be one of {', '.join(DTYPES)}, got {shown(dtype)}")
    if dtype not in runs:
        raise MindspecError(f"{dtype} does not run on {device}: this device runs {', '.join(runs)}")
    return dtype


def _ints(what, values):
    """values (an iterable of integers >= 1, as compiled shapes are given) as a tuple of ints."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise MindspecError(f"{what} must be integers >= 1, got {shown(values)}")
    values = tuple(values)
    if not all(is_int(b) and b >= 1 for b in values):
        raise MindspecError(f"{what} must be integers >= 1, got {shown(values)}")
    return tuple(int(b) for b in values)


@dataclass(frozen=True)
class SpecConfig:
    """k: a K bucket (fixed K) or "auto" (dynamic K per step). k_buckets / batch_buckets: the compiled
    shapes; max_batch: rows running at once (KV-cache slots)."""
    k: object = "auto"
    k_buckets: tuple = K_BUCKETS
    batch_buckets: tuple = BATCH_BUCKETS
    max_batch: int = 1

    def __post_init__(self):
        ks = tuple(sorted(set(_ints("K buckets", self.k_buckets))))
        if not ks:
            raise MindspecError(f"K buckets must be integers >= 1, got {shown(self.k_buckets)}")
        if not (is_int(self.max_batch) and self.max_batch >= 1):
            raise MindspecError(f"max_batch must be an integer >= 1, got {shown(self.max_batch)}")
        object.__setattr__(self, "max_batch", int(self.max_batch))
        object.__setattr__(self, "k", self.check_k(self.k, ks))
        bs = sorted({b for b in _ints("batch buckets", self.batch_buckets) if b < self.max_batch} | {self.max_batch})
        object.__setattr__(self, "k_buckets", tuple(sorted(set(ks) | ({self.k} - {"auto"}))))
        object.__setattr__(self, "batch_buckets", tuple(bs))

    @staticmethod
    def check_k(k, buckets):
        """The pipeline's k: "auto", or 1..the largest bucket (a K that is no bucket is compiled as one; a
        request's own k must be a compiled bucket: k_for_request)."""
        if k == "auto":
            return k
        if not is_int(k) or not 1 <= k <= max(buckets):
            raise MindspecError(f"k must be between 1 and the largest K bucket {max(buckets)} (or \"auto\"), "
                                f"got {shown(k)}")
        return int(k)

    def k_for_request(self, k):
        """A request's own k (None: the pipeline's) checked against the compiled buckets."""
        k = self.k if k is None else k
        if k != "auto" and (not is_int(k) or k not in self.k_buckets):
            raise MindspecError(f"k={shown(k)} is not a compiled bucket {list(self.k_buckets)} (or \"auto\")")
        return k if k == "auto" else int(k)

    def batch_bucket(self, n):
        """The smallest compiled batch size that holds n rows."""
        return next(b for b in self.batch_buckets if b >= n)

    def seq_for(self, tokens, limit):
        """Cache length for `tokens` positions: rounded up to SEQ_ROUND, at most `limit`."""
        return min(round_up(tokens + max(self.k_buckets) + 1, SEQ_ROUND), limit)
