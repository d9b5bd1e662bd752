"""`mindspec plan`: will a target + draft fit on these devices, and will speculation pay there?

Memory accounting (decimal GB, as device memory is sold), per device:
- The target is split over a tensor-parallel group of `tp` devices. Each device holds params/tp of
  the weights and kv_heads/tp of every layer's KV cache (at least one head: KV heads are
  replicated when tp > kv_heads).
- The draft is one onnxruntime session, so it cannot be sharded, and every rank of a TP group runs
  its own copy in lock step (each drafts the same tokens, so no rank waits for drafts from another):
  every device holds the whole draft and its whole KV cache. `devices // tp` groups run side by side.
- Every sequence needs both caches on every device of its group.
- When the target's config is known (a checkpoint), the per-device figures are those of the graphs
  mindspec builds (graphs/fuse.py: the fused QKV width, with the rotate-half rows on CPU; padded head,
  intermediate and vocabulary slices per rank; embedding and LM head apart); from bare numbers they
  are estimates (params / tp).
- `reserve` is the fraction of each device held back (activations, workspace, HCCL buffers).

Speed model (decode, batch 1): one forward pass costs max(bytes read / bandwidth, FLOPs / peak)
per device (a roofline), plus, for the target at tp > 1, the latency of 2 AllReduces per layer
(after o_proj and down_proj). Bytes read = weights + the KV cache at the mean context (seq_len/2).
Verifying K drafts is one target pass over K+1 tokens that reads the weights once, so
v(K) = t(K+1)/t(1) stays ~1 until the FLOPs catch up with the bytes.
"""
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass

from .errors import MindspecError
from .spec import DTYPES, K_BUCKETS, PLAN_DTYPE, PREFILL_CHUNK, QUANTIZE_MODES, cache_positions

GB = 1e9
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "q8": 1, "q4": 0.5}
_ONNX_WEIGHT_BYTES = {"int8": 1, "q8": 1, "q4": 0.5}  # a quantized export's weights (else: its dtype's)
ALPHAS = (0.6, 0.7, 0.8, 0.9)
SEQ_LEN = 4096  # plan's default sequence
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40}


@dataclass(frozen=True)
class ModelShape:
    params: float           # number of weights
    layers: int
    kv_heads: int
    head_dim: int
    weight_bytes: float     # bytes of weights as loaded on the device(s)
    kv_dtype_bytes: float   # bytes per KV-cache element
    cfg: object = None      # the LlamaConfig when known: per-device figures follow the graphs' layout
    kv_copies: int = 1      # KV caches held (the ascend draft's is double-buffered); a step reads one
    rot_rows: bool = False  # the target's fused QKV holds rotate-half rows (the CPU graphs)


def kv_dtype_bytes(dtype):
    return 4 if dtype == "fp32" else 2  # int8/q4 weights still keep an fp16 KV cache


MAX_COUNT = 10 ** 6  # devices, layers, heads, head dims: past any machine or model (and within a float's range)


def shape(params, layers, kv_heads, head_dim, dtype="fp16", names=("layers", "KV heads", "head dim")):
    for name, v in zip(names, (layers, kv_heads, head_dim)):
        if not isinstance(v, int) or not 1 <= v <= MAX_COUNT:
            raise MindspecError(f"{name} must be an integer in 1..{MAX_COUNT:,}, got {v!r}")
    if not params > 0:
        raise MindspecError(f"parameter count must be positive, got {params!r}")
    return ModelShape(float(params), layers, kv_heads, head_dim, params * DTYPE_BYTES[dtype], kv_dtype_bytes(dtype))


def count_params(cfg, layers=None):
    """Weights of a LlamaConfig (optionally only its first `layers` layers)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    attn = d * hd * 2 * (cfg.num_attention_heads + cfg.num_key_value_heads)  # q, o + k, v
    if cfg.qkv_bias:                                                         # Qwen2: + q, k, v biases
        attn += hd * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    per_layer = attn + 3 * d * cfg.intermediate_size + 2 * d                 # + gate/up/down + 2 norms
    emb = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    return emb + (cfg.num_hidden_layers if layers is None else layers) * per_layer + d


def shape_from_config(cfg, dtype="fp16", layers=None, rot_rows=False):
    m = shape(count_params(cfg, layers), layers or cfg.num_hidden_layers, cfg.num_key_value_heads,
              cfg.head_dim, dtype)
    return m if layers else dataclasses.replace(m, cfg=cfg, rot_rows=rot_rows)


def shape_from_checkpoint(model_dir, dtype="fp16"):
    from .checkpoint import Checkpoint
    return shape_from_config(Checkpoint(model_dir).config, dtype)


def shape_from_draft(path, dtype="fp16", sha=True):
    """A draft from a checkpoint dir (weights in `dtype`) or an exported .onnx (its real file size;
    the KV cache in the manifest's dtype, which the runtime allocates, twice for the ascend profile,
    whose device-side cache is double-buffered)."""
    if os.path.isdir(path):
        return shape_from_checkpoint(path, dtype)
    from mindspec.export import read_manifest
    from .config import load_config
    m = read_manifest(path, sha=sha)  # (sha=False: its file's checksum checked elsewhere, or left to the load)
    weight_bytes = sum(os.path.getsize(p) for p in (path, path + ".data") if os.path.exists(p))
    try:
        params = count_params(load_config(m["source"]), layers=m["num_layers"])
    except MindspecError:  # source checkpoint moved away: estimate from the file size
        params = weight_bytes / (_ONNX_WEIGHT_BYTES[m["quantize"]] if m["quantize"] else
                                 DTYPE_BYTES[PLAN_DTYPE[m["dtype"]]])
    return ModelShape(float(params), m["num_layers"], m["num_key_value_heads"], m["head_dim"], weight_bytes,
                      DTYPE_BYTES[PLAN_DTYPE[m["dtype"]]], kv_copies=2 if m.get("profile") == "ascend" else 1)


def kv_bytes_per_token(m, dtype_bytes=None):
    """K and V for every layer of one position: 2 * layers * kv_heads * head_dim * dtype bytes.
    `m` is a ModelShape, a LlamaConfig (dtype_bytes defaults to 2) or a draft manifest dict."""
    if isinstance(m, dict):
        dims = m["num_layers"], m["num_key_value_heads"], m["head_dim"]
    elif hasattr(m, "num_hidden_layers"):
        dims = m.num_hidden_layers, m.num_key_value_heads, m.head_dim
    else:
        dims = m.layers, m.kv_heads, m.head_dim
    b = dtype_bytes if dtype_bytes is not None else getattr(m, "kv_dtype_bytes", 2)
    return 2 * dims[0] * dims[1] * dims[2] * b


def host_memory():
    """Bytes this process may hold: the machine's memory, or its container's limit (cgroup v2 or v1) where
    lower (the OOM killer counts that one)."""
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                limit = f.read().strip()
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # ("max": none)
            have = min(have, int(limit))
    return have


def host_bytes_per_row(cfg, dtype_bytes, positions, draft=None, chunk=PREFILL_CHUNK):
    """A lower bound of what one KV-cache row of `positions` costs a CPU host: the target's K/V, the
    draft's (`draft`: its manifest) and the graphs' workspace, measured at about four float32 copies of a
    layer's prompt-chunk scores ([heads, chunk] a position) and activations ([chunk, hidden + intermediate])."""
    d_kv = kv_bytes_per_token(draft, DTYPE_BYTES[PLAN_DTYPE[draft["dtype"]]]) * min(positions, draft["max_seq"]) \
        if draft else 0
    work = 16 * chunk * (cfg.num_attention_heads * positions + cfg.hidden_size + cfg.intermediate_size)
    return kv_bytes_per_token(cfg, dtype_bytes) * positions + d_kv + work


def target_per_device(target, tp):
    """(weight bytes, KV bytes per token) of the target on its fullest device at TP=tp."""
    if target.cfg is None:  # bare numbers: an estimate
        kv_local = math.ceil(target.kv_heads / tp)  # (multiplied first: exact bytes, no float division)
        return target.weight_bytes / tp, kv_bytes_per_token(target) * kv_local // target.kv_heads
    from mindspec.graphs.fuse import rank_weight_elements
    from mindspec.graphs.tp import shard_plan
    plans = [shard_plan(target.cfg, tp, r) for r in range(tp)]
    per_element = target.weight_bytes / target.params
    shard = max(rank_weight_elements(target.cfg, p, target.rot_rows) for p in plans) * per_element
    kv = 2 * target.layers * max(p.kv_local for p in plans) * target.head_dim * target.kv_dtype_bytes
    return shard, kv


def _per_device(target, draft, tp):
    """(target weights, target KV bytes/token, draft weights, draft KV bytes/token held) on each device."""
    shard, t_kv = target_per_device(target, tp)
    if draft is None:
        return shard, t_kv, 0.0, 0.0
    return shard, t_kv, draft.weight_bytes, kv_bytes_per_token(draft) * draft.kv_copies


def _gb(a, b):
    """a and b in GB, with as many decimals as tell them apart (found: "0.4 GB > 0.4 GB usable")."""
    digits = next((d for d in range(1, 10) if f"{a / GB:.{d}f}" != f"{b / GB:.{d}f}"), 9)
    return f"{a / GB:.{digits}f}", f"{b / GB:.{digits}f}"


def _misfit(target, draft, tp, device_mem, seq_len, reserve, rows=1, flag="--seq-len", tail=0):
    """Why `rows` cache rows of seq_len positions (a sequence's flag-given length + `tail` each) do not fit a
    device, and what to change; None when they fit."""
    usable = device_mem * (1 - reserve)

    def need(tp_):
        shard, t_kv, d_w, d_kv = _per_device(target, draft, tp_)
        return shard + d_w + rows * seq_len * (t_kv + d_kv)

    if need(tp) <= usable:
        return None
    shard, t_kv, d_w, d_kv = _per_device(target, draft, tp)
    heads = target.cfg.num_attention_heads if target.cfg else 64  # more ranks than heads is refused
    fixes = [f"--tp {t} (on as many devices)" for t in (2, 4, 8, 16, 32, 64)
             if tp < t <= heads and need(t) <= usable][:1]
    max_len = int((usable - shard - d_w) // (t_kv + d_kv) // rows) - tail
    if max_len >= 1:
        fixes.append(f"{flag} {max_len} or less" + (" (or fewer rows: --max-batch)" if rows > 1 else ""))
    if draft is not None:
        fixes.append("a smaller draft")
    fixes.append("devices with more memory")
    draft_part = f"{d_w / GB:.1f} GB draft + " if draft is not None else ""
    cache = f"{rows} rows of {seq_len} positions" if rows > 1 else \
        f"one row of {seq_len} positions" if tail else f"one {seq_len}-token sequence"
    needs, has = _gb(need(tp), usable)
    return (f"does not fit: each device needs {shard / GB:.1f} GB target shard + {draft_part}"
            f"{rows * seq_len * (t_kv + d_kv) / GB:.2f} GB KV cache for {cache} = {needs} GB > {has} GB usable; "
            "try " + ", or ".join(fixes))


def fits(target, draft=None, *, tp=1, device_mem, seq_len, reserve=0.0):
    """True when the target shard + draft + the KV cache of one seq_len sequence fit each device."""
    return _misfit(target, draft, tp, device_mem, seq_len, reserve) is None


def check_fits(target, draft=None, *, tp=1, device_mem, seq_len, reserve=0.0, rows=1, flag="--seq-len", tail=0):
    """Raise MindspecError (one line, saying what to change) unless `fits(...)`; call before loading weights.
    rows, flag, tail: a cache of `rows` slots of seq_len positions each, of which `tail` past the length that
    `flag` gives (the engine's, from pipeline.check_size)."""
    problem = _misfit(target, draft, tp, device_mem, seq_len, reserve, rows, flag, tail)
    if problem:
        raise MindspecError(problem)


def _check_layout(tp, devices, reserve, seq_len):
    for flag, v, top in (("--tp", tp, MAX_COUNT), ("--devices", devices, MAX_COUNT), ("--seq-len", seq_len, 10 ** 9)):
        if v > top:
            raise MindspecError(f"{flag} {v} is out of range (at most {top:,})")
    if tp < 1:
        raise MindspecError(f"--tp must be >= 1, got {tp}")
    if devices < 1 or devices % tp:
        raise MindspecError(f"--devices ({devices}) must be a positive multiple of --tp ({tp})")
    if not 0 <= reserve < 1:
        raise MindspecError(f"--reserve must be a fraction in [0, 1), got {reserve}")
    if seq_len < 1:
        raise MindspecError(f"--seq-len must be positive, got {seq_len}")


def _check_speed_args(device_bw, allreduce_us, device_tflops):
    if not (0 < device_bw < math.inf and 0 < device_tflops < math.inf and 0 <= allreduce_us < math.inf):
        raise MindspecError("--device-bw and --device-tflops must be positive and --allreduce-us not negative")
    # (beyond these a time per token is inf, and the table NaN)
    if device_bw < 1:
        raise MindspecError(f"--device-bw must be at least 1B/s, got {device_bw:g} bytes per second")
    if not 1e-6 <= device_tflops <= 1e9:
        raise MindspecError(f"--device-tflops must be in [1e-06, 1e9], got {device_tflops:g}")
    if allreduce_us > 1e12:
        raise MindspecError(f"--allreduce-us must be in [0, 1e12], got {allreduce_us:g}")


def memory_plan(target, draft, *, tp, devices, device_mem, reserve=0.0, seq_len=4096):
    _check_layout(tp, devices, reserve, seq_len)
    slot = cache_positions(seq_len, K_BUCKETS)  # (found: a length whose slot fits no device planned 0 sequences)
    check_fits(target, draft, tp=tp, device_mem=device_mem, seq_len=slot, reserve=reserve,
               tail=cache_positions(1, K_BUCKETS) - 1)
    groups, usable = devices // tp, device_mem * (1 - reserve)
    shard, t_kv, d_w, d_kv = _per_device(target, draft, tp)
    free_draft_dev, free_other = usable - shard - d_w, usable - shard
    # a token needs t_kv + d_kv on every device of its group (each holds a draft)
    tokens = free_draft_dev // (t_kv + d_kv)
    tokens_nd = free_other // t_kv
    return {
        "total_gb": devices * device_mem / GB, "usable_gb": devices * usable / GB,
        "target_gb": target.weight_bytes / GB, "target_shard_gb": shard / GB, "draft_gb": d_w / GB,
        "kv_gb": devices * (usable - shard - d_w) / GB,
        "kv_gb_without_draft": devices * (usable - shard) / GB,
        "draft_device_free_gb": free_draft_dev / GB, "device_free_gb_without_draft": free_other / GB,
        # target: over all tp devices, KV heads replicated past kv_heads counted on each (what a token costs)
        "kv_bytes_per_token": {"target": t_kv * tp, "target_per_device": t_kv,
                               "draft": d_kv},
        "kv_tokens": int(groups * tokens), "kv_tokens_without_draft": int(groups * tokens_nd),
        # a sequence takes a slot of cache_positions (its length rounded up, and the verify's tail)
        "slot_positions": slot, "max_sequences": int(groups * (tokens // slot)),
        "max_sequences_without_draft": int(groups * (tokens_nd // slot)),
    }


def pass_ms(read_bytes, params, n_tokens, device_bw, device_tflops, allreduces=0, allreduce_us=0.0):
    """One forward pass over n_tokens on one device: roofline of bytes vs FLOPs, plus collective latency."""
    ms = 1e3 * max(read_bytes / device_bw, 2 * params * n_tokens / (device_tflops * 1e12))
    return ms + allreduces * allreduce_us / 1e3


def expected_tokens(alpha, k):
    """E[tokens per target call] = 1 + a + ... + a^K = (1 - a^(K+1)) / (1 - a)."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def speed_estimate(target, draft, *, tp, seq_len=4096, device_bw=1.6e12, allreduce_us=10.0,
                   device_tflops=280.0, alphas=ALPHAS, ks=K_BUCKETS):
    ctx = seq_len / 2  # mean context over a sequence that grows to seq_len
    shard, t_kv, d_w, d_kv = _per_device(target, draft, tp)
    allreduces = 2 * target.layers if tp > 1 else 0

    def target_ms(n):
        return pass_ms(shard + ctx * t_kv, target.params / tp, n, device_bw, device_tflops, allreduces, allreduce_us)

    t1 = target_ms(1)
    out = {"target_ms": t1, "target_gb_read_per_device": (shard + ctx * t_kv) / GB, "allreduces_per_token": allreduces,
           "verify_cost": {str(k): target_ms(k + 1) / t1 for k in ks},
           "draft_ms": None, "draft_gb_read": None, "c": None, "speedup": None, "best": None}
    if draft is None:
        return out
    d_kv = kv_bytes_per_token(draft)  # (read: one of the caches it holds)
    d_ms = pass_ms(d_w + ctx * d_kv, draft.params, 1, device_bw, device_tflops)
    c = d_ms / t1
    speedup = {f"{a:g}": {str(k): expected_tokens(a, k) / (k * c + target_ms(k + 1) / t1) for k in ks}
               for a in alphas}
    best = {a: max(row, key=row.get) for a, row in speedup.items()}
    out.update(draft_ms=d_ms, draft_gb_read=(d_w + ctx * d_kv) / GB, c=c, speedup=speedup,
               best={a: {"k": int(k), "speedup": speedup[a][k]} for a, k in best.items()})
    return out


def _warnings(mem, speed):
    w = []
    if speed["best"]:
        losing = [a for a, b in speed["best"].items() if b["speedup"] < 1]
        if losing:
            w.append(f"speculation is slower than the target alone at acceptance {', '.join(losing)} for every K "
                     f"(draft/target cost c = {speed['c']:.2f}): use a smaller draft")
        b = speed["best"].get("0.8")
        if b and 1 <= b["speedup"] < 1.2:
            w.append(f"speculation barely pays: at most {b['speedup']:.2f}x at acceptance 0.8 (K={b['k']}, "
                     f"c = {speed['c']:.2f}); a draft with c <= 0.1 gives about 2x")
    if mem["draft_gb"] and mem["kv_tokens"] < 0.75 * mem["kv_tokens_without_draft"]:
        cut = 1 - mem["kv_tokens"] / mem["kv_tokens_without_draft"]
        w.append(f"the draft's weights and KV cache on every device cut the KV tokens that fit by {cut:.0%} "
                 f"({mem['kv_tokens']:,} vs {mem['kv_tokens_without_draft']:,}): a smaller draft, or one with "
                 "fewer KV heads, leaves more room")
    return w


def make_plan(target, draft=None, *, tp=1, devices=None, device_mem, reserve=0.0, seq_len=4096,
              device_bw=1.6e12, allreduce_us=10.0, device_tflops=280.0):
    """The whole plan as one JSON-able dict (memory, speed, warnings)."""
    devices = tp if devices is None else devices
    _check_speed_args(device_bw, allreduce_us, device_tflops)
    mem = memory_plan(target, draft, tp=tp, devices=devices, device_mem=device_mem, reserve=reserve, seq_len=seq_len)
    speed = speed_estimate(target, draft, tp=tp, seq_len=seq_len, device_bw=device_bw, allreduce_us=allreduce_us,
                           device_tflops=device_tflops)
    inputs = {"tp": tp, "devices": devices, "device_mem_gb": device_mem / GB, "reserve": reserve,
              "seq_len": seq_len, "device_bw_tb_s": device_bw / 1e12, "allreduce_us": allreduce_us,
              "device_tflops": device_tflops, "target_params": target.params,
              "draft_params": draft.params if draft else None}
    return {**inputs, **mem, **speed, "warnings": _warnings(mem, speed)}


# --- parsing ---------------------------------------------------------------------------------------

def parse_size(text, what, rate=False):
    """'64GB' -> 64e9, '64GiB' -> 64 * 2**30 (bytes); rate: '1.6TB/s' -> 1.6e12 (bytes per second)."""
    m = re.fullmatch(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([kmgt]i?)?(b)?(/s)?\s*", str(text), re.I)
    if not m or not (m.group(2) or m.group(3)) or float(m.group(1)) <= 0:
        raise MindspecError(f"bad size {text!r} for {what}: give a positive number with a unit, e.g. 64GB, "
                            "64GiB or 1.6TB/s")
    if bool(m.group(4)) != rate:
        raise MindspecError(f"{what} is a rate: e.g. 1.6TB/s, got {text!r}" if rate else
                            f"{what} is a size, not a rate: e.g. 64GB, got {text!r}")
    return _in_range(float(m.group(1)) * _PREFIX[(m.group(2) or "").lower()], text, what, 1e18,
                     "1EB/s" if rate else "1EB")


def parse_count(text, what):
    """'70e9' or '70B' or '1.1B' -> a parameter count."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([kmbt]?)\s*", str(text), re.I)
    if not m or float(m.group(1)) <= 0:
        raise MindspecError(f"bad parameter count {text!r} for {what}: e.g. 70e9 or 70B")
    n = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    return _in_range(n, text, what, 1e15, "1000T")


def _in_range(x, text, what, top, name):
    """x unless it is beyond `top` (what a float holds only as inf or makes NaN of further on)."""
    if not x <= top:
        raise MindspecError(f"{what} {text!r} is out of range (at most {name})")
    return x


def _model_from_args(a, prefix, path):
    """The target (prefix '') or draft (prefix 'draft_') from a path or from the four numbers."""
    nums = [getattr(a, prefix + n) for n in ("params", "layers", "kv_heads", "head_dim")]
    flags = ", ".join(f"--{prefix.replace('_', '-')}{n}" for n in ("params", "layers", "kv-heads", "head-dim"))
    dtype = a.dtype
    if prefix:  # (an ascend draft is float16 whatever the target's --dtype: the profile's only)
        dtype = a.draft_dtype or ("fp16" if (a.draft_profile or "ascend") == "ascend" and not os.path.isfile(path or "")
                                  else a.dtype)
    if path:
        if any(v is not None for v in nums):
            raise MindspecError(f"give either --{prefix.rstrip('_') or 'target'} PATH or {flags}, not both")
        if not prefix:
            return shape_from_checkpoint(path, dtype)
        if not os.path.isdir(path):  # an export: its manifest says its profile
            if a.draft_profile:
                raise MindspecError(f"--draft-profile is for a draft given by its numbers or checkpoint: {path}'s "
                                    "manifest says its profile")
            return shape_from_draft(path, dtype)
        return _as_profile(shape_from_draft(path, dtype), a)
    if all(v is None for v in nums):
        if prefix and (a.draft_dtype or a.draft_profile):
            raise MindspecError("--draft-dtype and --draft-profile describe a draft: give one (--draft, or "
                                f"{flags})")
        return None
    if any(v is None for v in nums):
        raise MindspecError(f"{flags} go together")
    flag = f"--{prefix.replace('_', '-')}"
    m = shape(parse_count(nums[0], f"{flag}params"), *nums[1:], dtype,
              names=(f"{flag}layers", f"{flag}kv-heads", f"{flag}head-dim"))
    return _as_profile(m, a) if prefix else m


def _as_profile(draft, a):
    """A draft described by numbers or a checkpoint, as its export would run: the ascend profile's (the default;
    an NPU runs no other) keeps its KV cache on the device twice (double-buffered, export/runtime.py) and takes
    no quantized weights; the cpu profile's, once."""
    profile = a.draft_profile or "ascend"
    if profile == "ascend" and a.draft_dtype in _ONNX_WEIGHT_BYTES:
        raise MindspecError(f"--draft-dtype {a.draft_dtype}: the ascend profile takes no quantized draft "
                            "(CANN runs no quantized MatMul); give fp16, or --draft-profile cpu")
    if profile == "ascend" and a.draft_dtype not in (None, "fp16"):  # (found: planned; export refuses it)
        raise MindspecError(f"--draft-dtype {a.draft_dtype}: the ascend profile's draft is float16 (CANN's MatMul "
                            "takes float16 only); give fp16, or --draft-profile cpu")
    return dataclasses.replace(draft, kv_copies=2) if profile == "ascend" else draft


def cmd_plan(a):
    target = _model_from_args(a, "", a.target)
    if target is None:
        raise MindspecError("give the target: --target DIR, or --params, --layers, --kv-heads and --head-dim")
    draft = _model_from_args(a, "draft_", a.draft)
    positions = target.cfg.max_position_embeddings if target.cfg is not None else None  # (a checkpoint's)
    if a.seq_len is not None and positions is not None and a.seq_len > positions:  # (found: planned, where
        raise MindspecError(f"--seq-len {a.seq_len} exceeds the model's {positions} positions (its "  # generate
                            f"max_position_embeddings)")  # refuses such a sequence)
    if a.draft and not os.path.isdir(a.draft):  # an exported draft holds as many positions as it was exported for
        from mindspec.export.manifest import read_manifest
        drafted = read_manifest(a.draft, sha=False)["max_seq"]
        if a.seq_len is not None and a.seq_len > drafted:  # (found: planned, where generate refuses it)
            raise MindspecError(f"--seq-len {a.seq_len} is more than the {drafted} positions the draft was exported "
                                "for (mindspec export --max-seq)")
        positions = min(positions or SEQ_LEN, drafted)
    seq_len = a.seq_len if a.seq_len is not None else min(SEQ_LEN, positions or SEQ_LEN)
    if a.target and a.draft:  # (a pair no command would run: found planned, an export's or a checkpoint to export)
        from mindspec.export import read_pair_manifest
        from .tokenizer import Tokenizer
        from .checkpoint import Checkpoint
        has = os.path.exists(os.path.join(a.target, "tokenizer.json"))  # (a plan needs none: then the vocabulary)
        cfg, tok = Checkpoint(a.target).config, Tokenizer(a.target) if has else None
        if not os.path.isdir(a.draft):
            read_pair_manifest(a.draft, cfg, tok, sha=False)
        elif (v := Checkpoint(a.draft).config.vocab_size) != cfg.vocab_size:
            raise MindspecError(f"draft {a.draft} has vocabulary size {v}, the target has {cfg.vocab_size}: a draft "
                                "must share its target's tokenizer")
        elif tok and os.path.exists(os.path.join(a.draft, "tokenizer.json")) and \
                Tokenizer(a.draft).vocab_fingerprint() != tok.vocab_fingerprint():
            raise MindspecError(f"draft {a.draft} has a different tokenizer than the target's: a draft must share its "
                                "target's tokenizer")
    plan = make_plan(target, draft, tp=a.tp, devices=a.devices, device_mem=parse_size(a.device_mem, "--device-mem"),
                     reserve=a.reserve, seq_len=seq_len,
                     device_bw=parse_size(a.device_bw, "--device-bw", rate=True),
                     allreduce_us=a.allreduce_us, device_tflops=a.device_tflops)
    try:
        text = json.dumps(plan, indent=2, allow_nan=False)  # (inf or NaN: not JSON, nor a plan)
    except ValueError:
        raise MindspecError("these values take the plan's arithmetic out of range (inf or NaN): give smaller "
                            "or larger ones") from None
    print(text if a.json else format_plan(plan))


def format_plan(p):
    has_draft = p["draft_params"] is not None
    groups = p["devices"] // p["tp"]

    def row(label, with_, without=None, fmt="{:,.1f}"):
        cut = f"{1 - with_ / without:.0%}" if has_draft and without else ""
        return (f"  {label:<42}{fmt.format(with_) if has_draft else '-':>13}"
                f"{fmt.format(without if without is not None else with_):>15}{cut:>7}")

    kv = p["kv_bytes_per_token"]
    L = [f"{p['devices']} device(s) x {p['device_mem_gb']:.1f} GB, reserve {p['reserve']:.0%}, TP={p['tp']} "
         f"({groups} group(s){', the draft on every device' if has_draft else ''}); decimal GB",
         "",
         f"{'memory':<44}{'with draft':>13}{'without draft':>15}{'cut':>7}",
         row("total", p["total_gb"]),
         row(f"target weights ({p['target_shard_gb']:.2f} per device)", p["target_shard_gb"] * p["devices"]),
         row("draft weights", p["draft_gb"] * p["devices"], 0),
         row("left for KV cache, all devices", p["kv_gb"], p["kv_gb_without_draft"]),
         row("free per device", p["draft_device_free_gb"], p["device_free_gb_without_draft"]),
         row("KV bytes/token, target (all its devices)", kv["target"], fmt="{:,.0f}"),
         row("KV bytes/token, draft (on every device)", kv["draft"], 0, fmt="{:,.0f}"),
         row("tokens of KV cache that fit", p["kv_tokens"], p["kv_tokens_without_draft"], fmt="{:,}"),
         row(f"concurrent {p['seq_len']}-token sequences", p["max_sequences"], p["max_sequences_without_draft"],
             fmt="{:,}"),
         "",
         f"speed (batch 1, {p['device_bw_tb_s']:g} TB/s, {p['allreduce_us']:g} us per AllReduce, "
         f"{p['device_tflops']:g} TFLOPS per device)",
         f"  target at TP={p['tp']}: reads {p['target_gb_read_per_device']:.2f} GB per device per token + "
         f"{p['allreduces_per_token']} AllReduces = {p['target_ms']:.2f} ms/token"]
    if has_draft:
        L += [f"  draft (each rank): reads {p['draft_gb_read']:.2f} GB per token = {p['draft_ms']:.2f} ms/token; "
              f"c = {p['c']:.2f}",
              "  expected speedup E(a,K) / (K*c + v(K)) over the target alone:",
              "  " + f"{'':>8}" + "".join(f"{'K=' + k:>8}" for k in p["verify_cost"]),
              "  " + f"{'v(K)':>8}" + "".join(f"{v:>8.2f}" for v in p["verify_cost"].values())]
        L += ["  " + f"{'a=' + a:>8}" + "".join(f"{s:>8.2f}" for s in r.values()) for a, r in p["speedup"].items()]
    L += [""] + [f"warning: {w}" for w in p["warnings"]]
    return "\n".join(L).rstrip()


TARGET_DTYPES = tuple(PLAN_DTYPE[d] for d in DTYPES)  # what the target graphs run
DRAFT_DTYPES = ("fp16", "fp32") + tuple(q for q in QUANTIZE_MODES if q)  # what an export writes


def _dtype(names):
    """An argparse type: one of `names`, or its long name (float16, ...), as the other commands spell it."""
    long = {v: k for k, v in PLAN_DTYPE.items()}

    def parse(text):
        v = PLAN_DTYPE.get(text.lower(), text.lower())
        if v not in names:
            import argparse
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)} (or "
                                             f"{', '.join(long[n] for n in names if n in long)}), got {text!r}")
        return v
    return parse


def add_parser(subparsers):
    """Register `plan` on an argparse subparsers object."""
    p = subparsers.add_parser("plan", help="will a target + draft fit on N devices, and will speculation pay?",
                              description="Memory and speed plan for a target (+ draft) on N devices.")
    from .cli import path_arg
    p.add_argument("--target", type=path_arg,
                   help="target checkpoint dir (instead of --params/--layers/--kv-heads/--head-dim)")
    p.add_argument("--params", help="target parameters, e.g. 70e9 or 70B")
    p.add_argument("--layers", type=int, help="target layers")
    p.add_argument("--kv-heads", type=int, help="target key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, help="target head dimension")
    p.add_argument("--draft", type=path_arg, help="draft .onnx from `mindspec export`, or a checkpoint dir")
    p.add_argument("--draft-params", help="draft parameters (with --draft-layers, -kv-heads, -head-dim)")
    p.add_argument("--draft-layers", type=int, help="draft layers")
    p.add_argument("--draft-kv-heads", type=int, help="draft key/value heads")
    p.add_argument("--draft-head-dim", type=int, help="draft head dimension")
    p.add_argument("--dtype", type=_dtype(TARGET_DTYPES), default="fp16",
                   help="target weights: fp16 (default), bf16 or fp32 (float16, ... too)")
    p.add_argument("--draft-dtype", type=_dtype(DRAFT_DTYPES), default=None,
                   help="draft weights: fp16, or for the cpu profile fp32, q8, q4, int8 (default: fp16 for the ascend "
                        "profile, --dtype for cpu; an .onnx draft is measured from its files)")
    p.add_argument("--draft-profile", choices=("ascend", "cpu"), default=None,
                   help="how a draft given by numbers or a checkpoint runs: ascend (default: its KV cache "
                        "double-buffered on every device) or cpu")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the target")
    p.add_argument("--devices", type=int, default=None, help="devices in total (default: --tp)")
    p.add_argument("--device-mem", required=True, help="memory per device, e.g. 64GB or 64GiB")
    p.add_argument("--reserve", type=float, default=0.0, help="fraction of each device held back (default 0)")
    p.add_argument("--seq-len", type=int, help=f"tokens of one sequence (default {SEQ_LEN}, or the target "
                                                "checkpoint's or the exported draft's positions if fewer)")
    p.add_argument("--device-bw", default="1.6TB/s", help="memory bandwidth per device (default 1.6TB/s)")
    p.add_argument("--allreduce-us", type=float, default=10.0, help="latency of one small AllReduce (default 10)")
    p.add_argument("--device-tflops", type=float, default=280.0, help="peak dense TFLOPS per device (default 280)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)
    return p
