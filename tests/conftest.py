"""Tiny random Llama checkpoints, written by the tests themselves (HF layout, real files)."""
import json
import os
import signal
import tempfile
import time

import numpy as np
import pytest

from mindspec.checkpoint import LAYER_WEIGHTS, QKV_BIASES, expected_shape, write_checkpoint
from mindspec.config import config_from_dict

# A runner that starts the suite with SIGINT ignored (a shell's `cmd &` without job control, nohup) passes that on
# to every command a test starts, and the tests of Ctrl-C then saw it ignored (exit -15, a prompt read at EOF).
# A handler of ours is reset to the default in each child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The test files, slowest first (by their time in a run of the suite on the AVX2-only CPU: tools/test.sh): pytest-xdist
# hands each worker a whole file at a time in this order (--no-loadscope-reorder; its default orders them by how many
# tests they hold), so the long files start first and the short ones fill the end, the workers ending together
SLOWEST_FIRST = ("test_batch.py", "test_pipeline.py", "test_serve.py", "test_tp.py", "test_engine.py", "test_cli.py",
                 "test_float16.py", "test_target.py", "test_default_model.py", "test_sampling.py", "test_bench.py",
                 "test_generate_sampling.py", "test_policy.py", "test_serve_config.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: each file's own order kept)


@pytest.fixture(scope="session", autouse=True)
def _scratch(tmp_path_factory):
    """The temporary files of this process and the commands it starts go under pytest's base directory, which
    keeps the last three runs: a failed --tp job keeps its logs in $TMPDIR for its user, and the suite fails
    many on purpose (~40 directories a run were left in /tmp)."""
    tmp = str(tmp_path_factory.mktemp("tmp"))
    os.environ["TMPDIR"], tempfile.tempdir = tmp, tmp


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
                 " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\n' }}{% endif %}")


def wait_for(what, timeout):
    """Whether what() came true within timeout s (polled: a state to wait for, never a fixed sleep)."""
    deadline = time.time() + timeout
    while not what():
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def write_tiny_tokenizer(model_dir, merges=()):
    """A byte-level BPE tokenizer (3 specials + 256 bytes, and the tokens of `merges`, pairs of byte-level
    spellings), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE,
                   "add_bos_token": False}, f)
    return len(vocab)


# Llama 3.1's RoPE scaling at a tiny model's scale: with head_dim 16 (theta 10000, wavelengths 6.3 to
# 19869 positions) one frequency is kept, two are blended and five are slowed 8x
LLAMA3_ROPE = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}


def make_tiny_checkpoint(model_dir, vocab=320, hidden=64, layers=2, heads=4, kv_heads=2, inter=96,
                         head_dim=None, tie=False, seed=0, shard_bytes=None, scale=0.15, base=None,
                         noise=0.0, eos=2, arch="LlamaForCausalLM", extra=None):
    """Write a random Llama checkpoint. With `base` (a dict of tensors), copy it and add `noise`
    (relative) instead: a same-vocabulary draft that disagrees with its target now and then.
    arch "Qwen2ForCausalLM": with (large, random) q/k/v biases. `extra`: more config.json keys."""
    raw = {"architectures": [arch], "model_type": "qwen2" if arch.startswith("Qwen2") else "llama", "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": tie,
           "bos_token_id": 1, "eos_token_id": eos}
    if head_dim:
        raw["head_dim"] = head_dim
    raw.update(extra or {})
    cfg = config_from_dict(raw)
    rng = np.random.default_rng(seed)
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(layers) for n in LAYER_WEIGHTS]
    names += [f"model.layers.{i}.{n}.bias" for i in range(layers) for n in QKV_BIASES if cfg.qkv_bias]
    if not tie:
        names.append("lm_head.weight")
    tensors = {}
    for n in names:
        shape = expected_shape(cfg, n)
        if base is not None:
            w = base[n]
            t = w + noise * np.abs(w).mean() * rng.standard_normal(shape)
        elif n.endswith("norm.weight"):
            t = 1.0 + 0.1 * rng.standard_normal(shape)
        elif n.endswith(".bias"):
            t = rng.standard_normal(shape)  # as large as the projections' outputs: wrong without them
        elif "embed" in n or "lm_head" in n:
            t = rng.standard_normal(shape)
        else:
            t = scale * rng.standard_normal(shape) / np.sqrt(shape[1] / 64)
        tensors[n] = t.astype(np.float32)
    write_checkpoint(model_dir, raw, tensors, shard_bytes=shard_bytes)
    write_tiny_tokenizer(model_dir)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos, "bos_token_id": 1}, f)
    return str(model_dir), tensors


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """(dir, tensors) of the shared tiny target."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def tiny_draft_ckpt(tmp_path_factory, tiny_target):
    """A noisy copy of the tiny target: same vocabulary, disagrees often."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draftckpt"), base=tiny_target[1], noise=0.1, seed=1)


@pytest.fixture(scope="session")
def noisy_draft(tiny_draft_ckpt, tmp_path_factory):
    """The noisy draft checkpoint exported to ONNX (shared by the pipeline and engine tests)."""
    from mindspec.export import export_draft
    path = str(tmp_path_factory.mktemp("drafts") / "noisy.onnx")
    export_draft(tiny_draft_ckpt[0], path)
    return path
