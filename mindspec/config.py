"""Llama-family model configuration read from a Hugging Face `config.json`."""
import os
from dataclasses import asdict, dataclass, field, replace

from .errors import MindspecError, read_json, shown

F32_MAX = 3.4028234663852886e38
SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """Hugging Face's RoPE scaling of the kinds that change only the frequencies (attention is unscaled):
    "linear" (every frequency / factor) and "llama3" (Llama 3.1's: a frequency whose wavelength exceeds
    original_max_position_embeddings / low_freq_factor divided by factor, one whose wavelength is under
    original_max_position_embeddings / high_freq_factor kept, a smooth blend between). The frequencies
    themselves: reference.rope_inv_freq."""
    rope_type: str
    factor: float
    low_freq_factor: float = None
    high_freq_factor: float = None
    original_max_position_embeddings: int = None


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int = None
    eos_token_ids: tuple = field(default_factory=tuple)
    qkv_bias: bool = False  # q/k/v projections with biases (Qwen2)
    sliding_window: int = None  # Mistral's: max_position_embeddings is cut to it (up to it, full attention is the same)
    rope_scaling: RopeScaling = None

    @property
    def q_per_kv(self):
        return self.num_attention_heads // self.num_key_value_heads

    def to_json(self):
        return asdict(self)


def _eos_list(v, where):
    if v is None:
        return ()
    ids = list(v) if isinstance(v, (list, tuple)) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise MindspecError(f"{where}: eos_token_id must be an integer or a list of integers, got {shown(v)}")
    return tuple(ids)


def _eos_in_vocab(ids, vocab, where):
    """The ids that are token ids of the vocabulary; none of several is refused (found: a model whose only EOS
    was outside the vocabulary loaded and never stopped at it). Others out of range are dropped: never made."""
    good = tuple(i for i in ids if 0 <= i < vocab)
    if ids and not good:
        raise MindspecError(f"{where}: eos_token_id {ids[0]} is not a token id of the vocabulary [0, {vocab})")
    return good


def _rope(raw, where):
    """rope_theta, rope_scaling (a RopeScaling or None) and partial_rotary_factor as config.json gives them:
    at the top level (transformers 4) or in rope_parameters (transformers 5, which writes no top-level
    rope_theta: found reading its format, the default 10000 would have been used for any base). Given both
    ways, they must agree."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict) or isinstance(params, dict) and \
            any(isinstance(v, dict) for v in params.values()):
        raise MindspecError(f"{where}: rope_parameters must be one object of RoPE settings (per-layer RoPE is "
                            f"not supported), got {shown(params)}")
    scaling = raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise MindspecError(f"{where}: rope_scaling must be an object, got {shown(scaling)}")
    params = params or {}
    out = {k: params[k] for k in ("rope_theta", "partial_rotary_factor") if k in params}
    for key, v in out.items():
        if raw.get(key) is not None and raw[key] != v:
            raise MindspecError(f"{where}: {key} {shown(raw[key])} and rope_parameters' {shown(v)} differ")
    settings = {k: v for k, v in params.items() if k not in out}
    out["rope_scaling"] = _scaling(settings, where, "rope_parameters") if settings else \
        _scaling(scaling or {}, where, "rope_scaling")
    if params and scaling and _scaling(scaling, where, "rope_scaling") != out["rope_scaling"]:
        raise MindspecError(f"{where}: rope_scaling and rope_parameters differ")
    return out


def _rope_type(settings):
    return settings.get("rope_type", settings.get("type"))


def _scaling(settings, where, src):
    """A RopeScaling from the settings of rope_scaling or rope_parameters (`src`, named in errors); None for
    plain RoPE."""
    rope_type = _rope_type(settings)
    if settings and rope_type is None:  # (Hugging Face refuses it too: a factor of which scaling?)
        raise MindspecError(f"{where}: {src} without a rope_type: {shown(settings)}")
    if rope_type is not None and not isinstance(rope_type, str):  # (found by a probe: a list, a traceback)
        raise MindspecError(f"{where}: {src}.rope_type must be a string, got {shown(rope_type)}")
    if rope_type in (None, "default"):
        return None
    needs = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings")}.get(rope_type)
    if needs is None:
        raise MindspecError(f"{where}: {src} {shown(rope_type)} is not supported (plain RoPE, \"linear\" and "
                            "\"llama3\" are)")
    for key in needs:
        v = settings.get(key)
        what = {"factor": "a number >= 1",
                "original_max_position_embeddings": "an integer from 1 to 2**31"}.get(key, "a number > 0")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf") \
                or key == "factor" and v < 1 or what.startswith("an integer") and (v != int(v) or v > 2 ** 31):
            raise MindspecError(f"{where}: {src} {shown(rope_type)} needs {key}, {what}, got {shown(v)}")  # (8192.0 ok)
        if v > F32_MAX:  # (10**20 positions were numpy's object array: a traceback)
            raise MindspecError(f"{where}: {src} {shown(rope_type)} needs {key}, {what}, got {shown(v)}: beyond "
                                "float32's range")
    if rope_type == "llama3" and not settings["low_freq_factor"] < settings["high_freq_factor"]:
        raise MindspecError(f"{where}: {src} \"llama3\" needs low_freq_factor < high_freq_factor, got "
                            f"{shown(settings['low_freq_factor'])} and {shown(settings['high_freq_factor'])}")
    return RopeScaling(rope_type, **{k: float(settings[k]) if k != "original_max_position_embeddings"
                                     else int(settings[k]) for k in needs})


def config_from_dict(raw, where="config.json"):
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise MindspecError(f"{where}: architectures must be a list of class names, got {shown(archs)}")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHS and raw.get("model_type") != "llama":
        raise MindspecError(f"{where}: architecture {shown(arch)} is not a Llama-family model")
    for key, what in (("attention_bias", "attention biases"), ("mlp_bias", "MLP biases"),
                      ("use_sliding_window", "sliding-window attention")):
        if raw.get(key) and not (key == "attention_bias" and arch == "Qwen2ForCausalLM"):
            raise MindspecError(f"{where}: {key} = true ({what}) is not supported")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # (Hugging Face's "swish" is SiLU too)
        raise MindspecError(f"{where}: hidden_act {shown(act)} is not supported (only silu)")
    raw = dict(raw, **_rope(raw, where))
    if raw.get("partial_rotary_factor", 1) != 1:
        raise MindspecError(f"{where}: partial_rotary_factor {shown(raw['partial_rotary_factor'])} is not supported "
                            "(RoPE over whole heads only)")

    def count(key, default=None):
        v = raw[key] if default is None else default if raw.get(key) is None else raw[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:  # ("320", 0: a division by zero later)
            raise MindspecError(f"{where}: {key} must be an integer >= 1, got {shown(v)}")
        return v

    def positive(key, default):
        v = raw.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise MindspecError(f"{where}: {key} must be a number > 0, got {shown(v)}")  # (rope_theta -1: NaN)
        if v > F32_MAX:  # the graphs hold it in float32: inf (rms_norm_eps 1e39 gave token 0 forever)
            raise MindspecError(f"{where}: {key} must be a number > 0, got {shown(v)}: beyond float32's range")
        return float(v)

    try:
        heads = count("num_attention_heads")
        hidden = count("hidden_size")
        cfg = LlamaConfig(
            vocab_size=count("vocab_size"),
            hidden_size=hidden,
            intermediate_size=count("intermediate_size"),
            num_hidden_layers=count("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=count("num_key_value_heads", heads),
            head_dim=count("head_dim", max(hidden // heads, 1)),
            rms_norm_eps=positive("rms_norm_eps", 1e-5),
            rope_theta=positive("rope_theta", 10000.0),
            max_position_embeddings=count("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_list(raw.get("eos_token_id"), where),
            qkv_bias=arch == "Qwen2ForCausalLM",  # Qwen2 always has them (its config has no flag)
            rope_scaling=raw["rope_scaling"],
        )
        # Mistral's alone (Qwen2's applies only with use_sliding_window, refused above; Llama has none)
        mistral = arch == "MistralForCausalLM" or raw.get("model_type") == "mistral"
        window = count("sliding_window") if mistral and raw.get("sliding_window") is not None else None
        if window is not None and window < cfg.max_position_embeddings:
            cfg = replace(cfg, max_position_embeddings=window, sliding_window=window)
    except KeyError as e:
        raise MindspecError(f"{where}: missing key {shown(e.args[0])}") from None
    except (TypeError, ValueError) as e:
        raise MindspecError(f"{where}: bad value ({e})") from None
    cfg = replace(cfg, eos_token_ids=_eos_in_vocab(cfg.eos_token_ids, cfg.vocab_size, where))
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise MindspecError(f"{where}: num_attention_heads {heads} is not a multiple of "
                            f"num_key_value_heads {cfg.num_key_value_heads}")
    if cfg.head_dim % 2:
        raise MindspecError(f"{where}: head_dim must be even for RoPE, got {cfg.head_dim}")
    return cfg


def _read_json(path, what):
    try:
        return read_json(path)
    except FileNotFoundError:
        raise MindspecError(f"{what} not found: {path}") from None
    except OSError as e:  # a directory of that name, unreadable
        raise MindspecError(f"cannot read {what}: {path} ({e.strerror})") from None
    except ValueError as e:  # (bad JSON, not UTF-8, nested too deeply)
        raise MindspecError(f"{what} is not valid JSON: {path} ({e})") from None


def load_config(model_dir):
    """Read config.json (+ generation_config.json for EOS ids) from a checkpoint directory."""
    if os.path.isfile(model_dir):  # e.g. a draft's .onnx given as the target
        raise MindspecError(f"{model_dir} is a file: give the model's directory (config.json, safetensors)")
    if not os.path.isdir(model_dir):
        if os.path.exists(model_dir):  # ("not found" misled: /dev/null, a pipe)
            raise MindspecError(f"{model_dir} is not a directory (a device, a pipe or a socket): give the "
                                "model's checkpoint directory")
        raise MindspecError(f"model directory not found: {model_dir}")
    path = os.path.join(model_dir, "config.json")
    raw = _read_json(path, "config.json")
    if not isinstance(raw, dict):
        raise MindspecError(f"config.json is not a JSON object: {path}")
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        gen = _read_json(gen_path, "generation_config.json")
        if isinstance(gen, dict) and gen.get("eos_token_id") is not None:
            if isinstance(raw.get("vocab_size"), int):  # (named by its own file; a bad vocab_size: below)
                _eos_in_vocab(_eos_list(gen["eos_token_id"], gen_path), raw["vocab_size"], gen_path)
            raw = dict(raw, eos_token_id=sorted(set(_eos_list(raw.get("eos_token_id"), path))
                                                | set(_eos_list(gen["eos_token_id"], gen_path))))
    return config_from_dict(raw, path)
