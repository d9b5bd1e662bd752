"""The embedded default pair (SmolLM2-135M-Instruct and its q8 self-draft), end to end."""
import pytest

import mindspec


@pytest.fixture(scope="module")
def pipe():
    return mindspec.load(k=4, max_seq=256)  # converts/exports on first use (tools/setup.sh does it once)


def test_default_pair_answers_and_speculation_is_exact(pipe):
    q = "What is the capital of France?"
    base = pipe.generate(prompt=q, chat=True, max_new_tokens=24, speculate=False)
    spec = pipe.generate(prompt=q, chat=True, max_new_tokens=24)
    assert "Paris" in base.text
    assert spec.token_ids == base.token_ids and spec.text == base.text
    assert base.finish_reason == "stop" and base.token_ids[-1] == 2  # <|im_end|>
    assert spec.stats["acceptance_rate"] > 0.7  # the q8 self-draft agrees ~97% with its target
    assert spec.stats["target_calls"] < base.stats["target_calls"]


def test_default_tokenizer_and_manifest(pipe):
    tok = pipe.tokenizer
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert pipe.manifest["quantize"] == "q8" and pipe.manifest["vocab_size"] == 49152
