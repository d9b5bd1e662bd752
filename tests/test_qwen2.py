"""Qwen2 (q/k/v projections with biases): the target graph, its TP shards and the ONNX draft against
the numpy reference with biases; configurations whose extras are not implemented are refused."""
import numpy as np
import pytest

import mindspec
from mindspec.checkpoint import Checkpoint
from mindspec.config import config_from_dict
from mindspec.export import DraftSession, export_draft
from mindspec.graphs.fuse import fused_weights
from mindspec.graphs.runner import TargetModel, init_mindspore
from mindspec.graphs.tp import shard_plan
from mindspec.reference import reference_logits

from conftest import make_tiny_checkpoint

SEQ = [5, 17, 300, 42, 9, 8, 7, 250, 3, 100, 64, 65]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path, _ = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), arch="Qwen2ForCausalLM", heads=4, kv_heads=2)
    ckpt = Checkpoint(path)
    ref = reference_logits(ckpt.config, ckpt.get, SEQ)
    no_bias = reference_logits(config_from_dict({**_raw(ckpt), "architectures": ["LlamaForCausalLM"]}), ckpt.get, SEQ)
    assert np.abs(ref - no_bias).max() > 0.1 * np.abs(ref).max()  # the biases matter: the tests have teeth
    return path, ckpt, ref


def _raw(ckpt):
    import json
    import os
    with open(os.path.join(ckpt.dir, "config.json")) as f:
        return json.load(f)


def test_target_graph_adds_the_biases(qwen):
    path, ckpt, ref = qwen
    init_mindspore()
    m = TargetModel(ckpt, max_seq=64, k_buckets=(2,))
    got = np.concatenate([m.logits(0, 0, SEQ[:7]), m.logits(0, 7, SEQ[7:])])
    assert np.abs(got - ref).max() < 1e-4


def test_tp_shards_hold_their_heads_biases(qwen):
    """Each rank's fused bias rows are the rows of the whole fold for its heads (q, k, v, rot q, rot k)."""
    _, ckpt, _ = qwen
    cfg, D = ckpt.config, ckpt.config.head_dim
    whole = fused_weights(cfg, ckpt.get)
    for size in (2, 4):
        for r in range(size):
            plan = shard_plan(cfg, size, r)
            part = fused_weights(cfg, ckpt.get, plan)
            for i in range(cfg.num_hidden_layers):
                b, w = part[f"qkv_bias.{i}"], part[f"qkv.{i}"]
                assert b.shape == (w.shape[0],)
                H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
                full = whole[f"qkv_bias.{i}"].reshape(-1, D)  # rows: q heads, k heads, v heads, rot q, rot k, 0
                sections = [full[:H], full[H:H + KV], full[H + KV:H + 2 * KV], full[H + 2 * KV:2 * H + 2 * KV],
                            full[2 * H + 2 * KV:2 * H + 3 * KV]]
                mine = b.reshape(-1, D)
                q_idx, kv_idx = plan.q_slots.ravel(), plan.kv_slots
                want = np.concatenate([
                    np.stack([sections[0][h] if h >= 0 else np.zeros(D) for h in q_idx]),
                    np.stack([sections[1][h] if h >= 0 else np.zeros(D) for h in kv_idx]),
                    np.stack([sections[2][h] if h >= 0 else np.zeros(D) for h in kv_idx]),
                    np.stack([sections[3][h] if h >= 0 else np.zeros(D) for h in q_idx]),
                    np.stack([sections[4][h] if h >= 0 else np.zeros(D) for h in kv_idx]),
                    np.zeros((len(kv_idx), D))])
                assert np.allclose(mine, want, atol=1e-6), (size, r, i)


def test_onnx_draft_adds_the_biases(qwen, tmp_path):
    path, _, ref = qwen
    export_draft(path, str(tmp_path / "q.onnx"))
    s = DraftSession(str(tmp_path / "q.onnx"), max_seq=64)
    out = [s.forward([SEQ[:7]])[0]] + [s.forward([[t]])[0] for t in SEQ[7:]]
    assert np.abs(np.stack(out) - ref[6:]).max() < 1e-4


def test_qwen2_speculative_greedy_equals_target_only(qwen, tmp_path):
    path, _, _ = qwen
    export_draft(path, str(tmp_path / "self.onnx"))
    pipe = mindspec.load(target=path, draft=str(tmp_path / "self.onnx"), k=2, max_seq=64)
    base = pipe.generate(prompt_ids=SEQ, max_new_tokens=12, speculate=False)
    spec = pipe.generate(prompt_ids=SEQ, max_new_tokens=12)
    assert spec.token_ids == base.token_ids and spec.stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("key, arch", [("attention_bias", "LlamaForCausalLM"), ("mlp_bias", "LlamaForCausalLM"),
                                       ("use_sliding_window", "Qwen2ForCausalLM")])
def test_unsupported_extras_are_refused(key, arch):
    raw = {"architectures": [arch], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, key: True}
    with pytest.raises(mindspec.MindspecError, match=f"{key} = true .* is not supported"):
        config_from_dict(raw)


def test_a_mistral_sliding_window_bounds_the_positions(tmp_path):
    """The CLI prober's: Mistral's `sliding_window` was read and ignored, so past the window mindspec
    attended to tokens the model does not (Mistral-7B-v0.1: a window of 4096 in 32768 positions). Up to
    the window both are the same attention; beyond it a cache is refused, by name."""
    import json
    import shutil
    base = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "max_position_embeddings": 4096}
    assert config_from_dict({**base, "sliding_window": 8}).max_position_embeddings == 8
    assert config_from_dict({**base, "sliding_window": None}).max_position_embeddings == 4096
    assert config_from_dict({**base, "sliding_window": 9999}).max_position_embeddings == 4096
    # Qwen2 configs carry a window that applies only with use_sliding_window
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    assert config_from_dict({**qwen, "sliding_window": 8, "use_sliding_window": False}).max_position_embeddings == 4096
    llama = {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}  # (HF's Llama has no window)
    assert config_from_dict({**llama, "sliding_window": 8}).max_position_embeddings == 4096
    with pytest.raises(mindspec.MindspecError, match="sliding_window must be an integer >= 1"):
        config_from_dict({**base, "sliding_window": "8"})
    path, _ = make_tiny_checkpoint(tmp_path / "llama")
    mistral = tmp_path / "mistral"
    shutil.copytree(path, mistral)
    raw = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**raw, **base, "vocab_size": raw["vocab_size"],
                                                     "hidden_size": raw["hidden_size"],
                                                     "intermediate_size": raw["intermediate_size"],
                                                     "num_hidden_layers": raw["num_hidden_layers"],
                                                     "num_attention_heads": raw["num_attention_heads"],
                                                     "sliding_window": 8}))
    with pytest.raises(mindspec.MindspecError, match="16 positions exceed the model's 8 .*sliding window"):
        mindspec.load(target=str(mistral), draft=False, max_seq=16).generate(prompt_ids=[5, 6], max_new_tokens=2)
    with pytest.raises(mindspec.MindspecError, match=r"max_seq must be an integer from 1 to 8 \(the model's "):
        export_draft(str(mistral), str(tmp_path / "d.onnx"), max_seq=16)
    # within the window: the Llama checkpoint's own tokens
    ids = mindspec.load(target=str(mistral), draft=False, max_seq=8).generate(prompt_ids=[5, 6], max_new_tokens=4)
    assert ids.token_ids == mindspec.load(target=path, draft=False, max_seq=8).generate(
        prompt_ids=[5, 6], max_new_tokens=4).token_ids
