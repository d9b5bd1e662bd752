"""`mindspec plan`: the reference deployment (Llama-2-70B at TP=8, a Llama-2-7B draft, 8 x 64 GB Atlas 800I
A2), both KV caches, refusals, the speed estimate, checkpoints."""
import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import make_tiny_checkpoint, write_tiny_tokenizer
from mindspec import plan
from mindspec.checkpoint import Checkpoint
from mindspec.errors import MindspecError
from mindspec.export import export_draft

TARGET_70B = ["--params", "70e9", "--layers", "80", "--kv-heads", "8", "--head-dim", "128"]
DRAFT_7B = ["--draft-params", "7e9", "--draft-layers", "32", "--draft-kv-heads", "32", "--draft-head-dim", "128"]
DRAFT_1B = ["--draft-params", "1e9", "--draft-layers", "16", "--draft-kv-heads", "8", "--draft-head-dim", "64"]
CARDS = ["--dtype", "fp16", "--tp", "8", "--devices", "8", "--device-mem", "64GB"]   # an 8-card Atlas 800I A2
SEED = ["plan", *TARGET_70B, *DRAFT_7B, *CARDS]


def run_plan(argv, capsys):
    """Parse with a parser built from add_parser, as `mindspec/cli.py` does; return (stdout, parsed JSON or None)."""
    p = argparse.ArgumentParser(prog="mindspec")
    plan.add_parser(p.add_subparsers(dest="cmd", required=True))
    args = p.parse_args(argv)
    args.func(args)
    out = capsys.readouterr().out
    return out, (json.loads(out) if "--json" in argv else None)


def test_seed_example_memory(capsys):
    _, p = run_plan(SEED + ["--json"], capsys)
    assert p["total_gb"] == pytest.approx(512)
    assert p["target_gb"] == pytest.approx(140) and p["target_shard_gb"] == pytest.approx(17.5)
    assert p["draft_gb"] == pytest.approx(14)
    assert p["kv_gb"] == pytest.approx(260)                  # 512 - 140 - 8 x 14: every rank runs the draft
    # "504 GB without the draft", as the deployment was first described to us, is a slip: 512 - 140 = 372.
    assert p["kv_gb_without_draft"] == pytest.approx(372)
    # Its ~30% cut is what every device loses (32.5 of 46.5 GB free).
    assert p["draft_device_free_gb"] == pytest.approx(32.5)
    assert 1 - p["draft_device_free_gb"] / p["device_free_gb_without_draft"] == pytest.approx(0.30, abs=0.011)


def test_weight_dtypes_and_an_fp16_kv_cache(capsys):
    """Found by mutation testing: no plan was made in bf16 (at 4 bytes the 70B took 280 GB) or with quantized
    weights, whose KV cache stays fp16 (sized at the weights' 1 byte, a token read 163,840 bytes)."""
    _, bf16 = run_plan(["plan", *TARGET_70B, "--dtype", "bf16", "--tp", "8", "--device-mem", "64GB", "--json"], capsys)
    assert bf16["target_gb"] == 140
    _, long = run_plan(["plan", *TARGET_70B, "--dtype", "bfloat16", "--tp", "8", "--device-mem", "64GB", "--json"],
                       capsys)  # (the other commands' spelling)
    assert long == bf16
    # a draft's quantized weights keep an fp16 KV cache (the cpu profile's: the ascend profile takes none)
    _, q8 = run_plan(SEED + ["--draft-dtype", "q8", "--draft-profile", "cpu", "--json"], capsys)
    assert q8["draft_gb"] == 7 and q8["kv_bytes_per_token"]["draft"] == 524_288
    # the planner's prober's: a quantized target (no command runs one), or a quantized draft on the NPU, was planned
    for bad in (["--dtype", "int8"], ["--dtype", "q4"], ["--draft-dtype", "bf16"]):
        with pytest.raises(SystemExit):
            run_plan(SEED + bad, capsys)
    with pytest.raises(MindspecError, match=r"^--draft-dtype q8: the ascend profile takes no quantized draft"):
        run_plan(SEED + ["--draft-dtype", "q8"], capsys)


def test_both_kv_caches_are_counted(capsys):
    _, p = run_plan(SEED + ["--json", "--seq-len", "4096"], capsys)
    kv = p["kv_bytes_per_token"]
    assert kv["target"] == 2 * 80 * 8 * 128 * 2 == 327_680
    # the MHA 7B costs more per token than the 70B; the planner's prober's: the NPU's (ascend profile) draft holds
    # its cache twice (double-buffered), and the plan counted it once: 14 sequences where 7 fit
    assert kv["draft"] == 2 * (2 * 32 * 32 * 128 * 2) == 1_048_576
    assert kv["target_per_device"] == kv["target"] / 8
    # every device holds its shard of the target cache and the whole draft cache
    assert p["kv_tokens"] == int(32.5e9 // (327_680 / 8 + 1_048_576)) == 29_829
    assert p["kv_tokens_without_draft"] == int(46.5e9 // (327_680 / 8))
    # ... and a sequence takes a slot of its length rounded up to 32 and a verify's tail (4128: 14 were 13)
    assert p["slot_positions"] == 4128 and p["max_sequences"] == 29_829 // 4128 == 7
    assert p["max_sequences_without_draft"] == 1_135_253 // 4128 == 275
    assert any("cut the KV tokens" in w for w in p["warnings"])
    _, cpu = run_plan(SEED + ["--json", "--draft-profile", "cpu"], capsys)
    assert cpu["kv_bytes_per_token"]["draft"] == 524_288 and cpu["max_sequences"] == 57_496 // 4128 == 13


def test_groups_and_reserve(capsys):
    _, p = run_plan(SEED + ["--tp", "4", "--reserve", "0.1", "--json"], capsys)
    assert p["total_gb"] == pytest.approx(512) and p["usable_gb"] == pytest.approx(460.8)
    assert p["kv_gb"] == pytest.approx(460.8 - 2 * 140 - 8 * 14)    # two TP=4 groups, a draft on every device
    assert p["max_sequences"] == 2 * (p["kv_tokens"] // 2 // 4128)
    # whole sequences per group (found by mutation testing: 2 * 24,743 // 5000 counted 9, a sequence split
    # over the two groups)
    _, p = run_plan(SEED + ["--tp", "4", "--seq-len", "5000", "--draft-profile", "cpu", "--json"], capsys)
    assert p["kv_tokens"] == 2 * 24_743 and p["max_sequences"] == 8
    # the fit check holds the reserve back too (found by mutation testing: it was ignored there, and half of
    # 64 GB accepted with 0 sequences)
    with pytest.raises(MindspecError) as e:
        run_plan(SEED + ["--reserve", "0.5", "--draft-profile", "cpu"], capsys)
    assert str(e.value) == ("does not fit: each device needs 17.5 GB target shard + 14.0 GB draft + 2.33 GB KV cache "
                            "for one row of 4128 positions = 33.8 GB > 32.0 GB usable; try --tp 16 (on as many devices), "
                            "or --seq-len 821 or less, or a smaller draft, or devices with more memory")


def test_a_length_whose_slot_fits_no_device_is_refused_and_the_advice_plans_a_sequence(capsys):
    """A float16 probe's: --seq-len 2845 at TP=3 (the refusal's own advice) planned 0 sequences, rc 0: the fit
    check took the length, the sequences its slot (the length rounded up, and the verify's tail). A float32
    draft on the ascend profile (which no export makes) was planned too."""
    base = ["plan", *TARGET_70B, *DRAFT_7B, "--device-mem", "64GB", "--tp", "3"]
    with pytest.raises(MindspecError) as e:
        run_plan(base, capsys)
    n = int(re.search(r"--seq-len (\d+) or less", str(e.value))[1])
    _, p = run_plan(base + ["--seq-len", str(n), "--json"], capsys)
    assert p["max_sequences"] >= 1
    for seq_len in (n + 64, 2845):
        with pytest.raises(MindspecError, match="does not fit"):
            run_plan(base + ["--seq-len", str(seq_len)], capsys)
    with pytest.raises(MindspecError, match=r"^--draft-dtype fp32: the ascend profile's draft is float16"):
        run_plan(SEED + ["--draft-dtype", "fp32"], capsys)
    _, fp32 = run_plan(SEED + ["--dtype", "fp32", "--json"], capsys)  # (the draft's dtype followed it)
    assert fp32["draft_gb"] == 14 and fp32["target_gb"] == 280
    _, cpu = run_plan(SEED + ["--draft-dtype", "fp32", "--draft-profile", "cpu", "--json"], capsys)
    assert cpu["draft_gb"] == 28


def test_refusal_says_what_to_change(capsys):
    t = plan.shape(70e9, 80, 8, 128, "fp16")
    d = plan.shape(7e9, 32, 32, 128, "fp16")
    assert plan.fits(t, d, tp=8, device_mem=64e9, seq_len=4096)
    assert not plan.fits(t, d, tp=2, device_mem=64e9, seq_len=4096)
    with pytest.raises(MindspecError) as e:
        plan.check_fits(t, d, tp=2, device_mem=64e9, seq_len=4096)
    msg = str(e.value)
    assert "\n" not in msg and "does not fit" in msg and "--tp 4" in msg
    # weights fit but a long sequence does not: suggest a shorter one
    with pytest.raises(MindspecError, match=r"--seq-len \d+ or less"):
        plan.check_fits(t, d, tp=8, device_mem=64e9, seq_len=100_000)
    with pytest.raises(MindspecError, match="does not fit"):
        run_plan(["plan", *TARGET_70B, "--tp", "1", "--device-mem", "64GB"], capsys)
    # the bounds (found by mutation testing): a plan that fits exactly fits, --tp up to the 64 heads assumed
    # without a config and a one-token sequence are offered
    exact = 17.5e9 + 4096 * 40_960  # the 70B's shard and one sequence's KV cache on each of 8 devices
    assert plan.fits(t, tp=8, device_mem=exact, seq_len=4096) and not plan.fits(t, tp=8, device_mem=exact - 1,
                                                                                  seq_len=4096)
    with pytest.raises(MindspecError, match=r"> 3\.0 GB usable; try --tp 64 \(on as many devices\), or devices"):
        plan.check_fits(t, tp=8, device_mem=3e9, seq_len=4096)
    with pytest.raises(MindspecError, match=r"try --tp 16 \(on as many devices\), or --seq-len 1 or less, or devices"):
        plan.check_fits(t, tp=8, device_mem=17.5e9 + 1.5 * 40_960, seq_len=2)


@pytest.mark.parametrize("bad, match", [(["--device-mem", "64"], "bad size"), (["--device-mem", "lots"], "bad size"),
                                        (["--device-mem", "0GB"], "bad size '0GB' for --device-mem"),
                                        (["--device-bw", "fast"], "bad size"), (["--devices", "12"], "multiple of"),
                                        (["--reserve", "1"], "reserve"), (["--draft-layers", "-1"], "--draft-layers must be an integer in 1.."),
                                        (["--device-tflops", "0"], "device-tflops"),
                                        (["--draft-layers", "32", "--draft", "x.onnx"], "not both"),
                                        (["--draft-params", "seven"], "bad parameter count"),
                                        # a rate for a size and a size for a rate were taken as given
                                        (["--device-mem", "64GB/s"], "a size, not a rate"),
                                        (["--device-bw", "64GiB"], "a rate: e.g. 1.6TB/s"),
                                        (["--allreduce-us", "inf"], "allreduce-us not negative"),
                                        (["--device-tflops", "nan"], "device-tflops"),
                                        (["--tp", "0"], "--tp must be >= 1, got 0"),  # named --devices (0)
                                        # numbers a float holds only as inf: NaN tracebacks further on
                                        (["--device-mem", "1e300GB"], "out of range"),
                                        (["--device-mem", "1e400GB"], "out of range"),
                                        (["--params", "1e400"], "out of range"),
                                        (["--device-bw", "1e20TB/s"], "out of range"),
                                        # the dp prober's: OverflowError tracebacks, and inf / NaN (invalid --json)
                                        (["--devices", "8" + "0" * 311], "--devices 80* is out of range"),
                                        (["--seq-len", "1" + "0" * 311], "--seq-len 10* is out of range"),
                                        (["--layers", "1" + "0" * 311], "--layers must be an integer in 1..1,000,000"),
                                        (["--draft-layers", "0"], "--draft-layers must be an integer in 1..1,000,000"),
                                        (["--device-bw", "1e-300B/s"], "--device-bw must be at least 1B/s"),
                                        (["--device-tflops", "5e-324"], "--device-tflops must be in"),
                                        (["--allreduce-us", "1e308"], "--allreduce-us must be in")])
def test_bad_input(bad, match, capsys):
    with pytest.raises(MindspecError, match=match):
        run_plan(SEED + bad, capsys)                # argparse: the last value given wins


def test_counts_up_to_max_count():
    """Found by mutation testing: nothing asked for MAX_COUNT itself, which is in range."""
    m = plan.shape(1e9, plan.MAX_COUNT, plan.MAX_COUNT, plan.MAX_COUNT)
    assert (m.layers, m.kv_heads, m.head_dim) == (plan.MAX_COUNT,) * 3
    plan._check_layout(plan.MAX_COUNT, plan.MAX_COUNT, 0.0, 10 ** 9)


def test_sizes():
    assert plan.parse_size("64GB", "x") == 64e9
    assert plan.parse_size("64GiB", "x") == 64 * 2 ** 30
    assert plan.parse_size("1.6TB/s", "x", rate=True) == pytest.approx(1.6e12)
    assert plan.parse_size("800 GB/s", "x", rate=True) == 800e9
    assert plan.parse_count("70e9", "x") == 70e9 and plan.parse_count("1.1B", "x") == pytest.approx(1.1e9)


def test_worked_speed_example(capsys):
    _, big = run_plan(SEED + ["--device-bw", "1.6TB/s", "--json"], capsys)
    assert big["target_gb_read_per_device"] == pytest.approx(17.5, abs=0.2)   # ~17.5 GB per card at TP=8
    assert 13.5 <= big["draft_gb_read"] <= 15.5                               # ~13.5-14 GB weights + its KV
    assert 0.6 <= big["c"] <= 0.8
    assert big["draft_ms"] == pytest.approx(big["c"] * big["target_ms"])
    assert set(big["speedup"]) == {"0.6", "0.7", "0.8", "0.9"}
    assert set(big["speedup"]["0.8"]) == {"1", "2", "4", "8"}
    assert max(big["speedup"]["0.8"].values()) < 1.1                          # no real gain
    assert big["speedup"]["0.8"]["4"] < 1
    assert any("slower than the target alone" in w for w in big["warnings"])
    _, small = run_plan(["plan", *TARGET_70B, *DRAFT_1B, *CARDS, "--json"], capsys)
    assert small["draft_params"] == 1e9 and 0.08 <= small["c"] <= 0.13
    assert small["speedup"]["0.8"]["4"] == pytest.approx(2.2, abs=0.3)         # ~2x at a = 0.8, K = 4
    # the draft's cut warns from 25% (found by mutation testing: only past 50%; 44.5 GB free / (40,960 + 2 x 32,768))
    assert small["warnings"] == ["the draft's weights and KV cache on every device cut the KV tokens that fit by "
                                 "63% (417,856 vs 1,135,253): a smaller draft, or one with fewer KV heads, leaves "
                                 "more room"]
    # the estimate's formula: E(a,K) / (K*c + v(K)), E = (1 - a^(K+1)) / (1 - a)
    e = (1 - 0.8 ** 5) / 0.2
    assert small["speedup"]["0.8"]["4"] == pytest.approx(e / (4 * small["c"] + small["verify_cost"]["4"]))


def test_verify_roofline():
    # a small model on a slow-compute device: K+1 tokens cost more than one once FLOPs dominate
    t = plan.shape(1e9, 16, 8, 64, "fp16")
    s = plan.speed_estimate(t, None, tp=1, device_bw=1.6e12, device_tflops=4)
    v = s["verify_cost"]
    assert v["1"] == pytest.approx(1.0, abs=0.01) and v["8"] > v["4"] > 1.5
    assert s["allreduces_per_token"] == 0 and s["speedup"] is None
    # a rank computes params/tp of the FLOPs (found by mutation testing: all of them): at 1 TFLOPS the 70B's
    # 17.5 ms of FLOPs per rank outweigh its 11 ms of bytes, + 160 AllReduces of 10 us
    s = plan.speed_estimate(plan.shape(70e9, 80, 8, 128), None, tp=8, device_tflops=1)
    assert s["target_ms"] == pytest.approx(17.5 + 1.6)


def test_table(capsys):
    out, _ = run_plan(SEED, capsys)
    for text in ("512.0", "140.0", "112.0", "260.0", "372.0", "29,829", "c = 0.75", "a=0.8", "K=4", "warning:"):
        assert text in out
    # the cut column is the share lost (found by mutation testing: the share kept, 70%, passed)
    free = next(line for line in out.splitlines() if line.startswith("  free per device"))
    assert free.split() == ["free", "per", "device", "32.5", "46.5", "30%"]


def test_count_params_matches_checkpoint(tmp_path):
    # (Qwen2's q/k/v biases were left out: 102,720 of its 102,976 weights)
    for tie, arch in ((False, "LlamaForCausalLM"), (True, "LlamaForCausalLM"), (False, "Qwen2ForCausalLM")):
        d, tensors = make_tiny_checkpoint(tmp_path / f"{arch}{tie}", tie=tie, arch=arch)
        assert plan.count_params(Checkpoint(d).config) == sum(t.size for t in tensors.values())


def test_shapes_from_checkpoint_and_exported_draft(tiny_target, tmp_path, capsys):
    target_dir, tensors = tiny_target
    onnx_path = str(tmp_path / "draft.onnx")
    m = export_draft(target_dir, onnx_path, layers=1, max_seq=64)
    cfg = Checkpoint(target_dir).config
    assert plan.kv_bytes_per_token(cfg) == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    assert plan.kv_bytes_per_token(m, 4) == 2 * 1 * m["num_key_value_heads"] * m["head_dim"] * 4

    _, p = run_plan(["plan", "--target", target_dir, "--draft", onnx_path, "--dtype", "fp32",
                     "--device-mem", "1GB", "--seq-len", "64", "--json"], capsys)
    n = sum(t.size for t in tensors.values())
    assert p["target_params"] == n and p["target_gb"] == pytest.approx(n * 4 / 1e9)
    assert p["draft_params"] == plan.count_params(cfg, layers=1) < n
    assert p["draft_gb"] * 1e9 == os.path.getsize(onnx_path) + (
        os.path.getsize(onnx_path + ".data") if os.path.exists(onnx_path + ".data") else 0)
    assert p["kv_bytes_per_token"]["draft"] == 2 * 1 * m["num_key_value_heads"] * m["head_dim"] * 4  # fp32 ORT cache
    assert p["kv_tokens"] > 0 and p["c"] < 1
    with pytest.raises(MindspecError, match="not both"):
        run_plan(["plan", "--target", target_dir, "--params", "1e6", "--device-mem", "1GB"], capsys)
    with pytest.raises(MindspecError, match="draft model not found"):
        run_plan(["plan", "--target", target_dir, "--draft", str(tmp_path / "none.onnx"), "--device-mem", "1GB"],
                 capsys)
    # a CLI probe's: a pair no command would run (another vocabulary) was planned, exit 0
    other = make_tiny_checkpoint(tmp_path / "other", vocab=400)[0]
    export_draft(other, str(tmp_path / "other.onnx"), layers=1, max_seq=64)
    for draft in (str(tmp_path / "other.onnx"), other):  # (the user probe's: its checkpoint, to be exported, was planned)
        with pytest.raises(MindspecError, match="has vocabulary size 400, the target has 320: a draft must share"):
            run_plan(["plan", "--target", target_dir, "--draft", draft, "--device-mem", "1GB"], capsys)
    renamed = make_tiny_checkpoint(tmp_path / "renamed")[0]  # (its vocabulary's size, another tokenizer: a review's)
    write_tiny_tokenizer(renamed, merges=[("a", "b")])
    with pytest.raises(MindspecError, match="has a different tokenizer than the target's: a draft must share"):
        run_plan(["plan", "--target", target_dir, "--draft", renamed, "--device-mem", "1GB"], capsys)


def test_seq_len_is_within_the_drafts_positions(tiny_target, tmp_path, capsys):
    """A drafts probe's: a draft exported for 64 positions was planned with 128-token sequences (and with the
    default 4096), which generate and serve then refuse."""
    onnx_path = str(tmp_path / "short.onnx")
    export_draft(tiny_target[0], onnx_path, layers=1, max_seq=64)
    args = ["plan", "--target", tiny_target[0], "--draft", onnx_path, "--dtype", "fp32", "--device-mem", "1GB",
            "--json"]
    assert run_plan(args, capsys)[1]["seq_len"] == 64
    assert run_plan(args + ["--seq-len", "64"], capsys)[1]["seq_len"] == 64
    with pytest.raises(MindspecError, match=r"^--seq-len 128 is more than the 64 positions the draft was exported "
                                            r"for \(mindspec export --max-seq\)$"):
        run_plan(args + ["--seq-len", "128"], capsys)


WRAPPER = """
import argparse, sys
from mindspec import plan
from mindspec.errors import MindspecError
p = argparse.ArgumentParser(prog="mindspec")
plan.add_parser(p.add_subparsers(dest="cmd", required=True))
a = p.parse_args(sys.argv[1:])
try:
    a.func(a)
except MindspecError as e:
    print(f"mindspec: error: {e}", file=sys.stderr)
    sys.exit(2)
"""


def test_seq_len_is_within_the_targets_positions(tmp_path, capsys):
    """Found by a probe: a plan of 5000-token sequences for a model of 512 positions (generate refuses such a
    sequence); without --seq-len the default 4096 was planned for it too."""
    d, _ = make_tiny_checkpoint(tmp_path / "short", extra={"max_position_embeddings": 512})
    args = ["plan", "--target", d, "--dtype", "fp32", "--device-mem", "1GB", "--json"]
    assert run_plan(args, capsys)[1]["seq_len"] == 512
    assert run_plan(args + ["--seq-len", "100"], capsys)[1]["seq_len"] == 100
    with pytest.raises(MindspecError, match=r"^--seq-len 5000 exceeds the model's 512 positions \(its "
                                            r"max_position_embeddings\)$"):
        run_plan(args + ["--seq-len", "5000"], capsys)
    assert run_plan(SEED + ["--json"], capsys)[1]["seq_len"] == 4096  # (no checkpoint: the default)


def test_cli_subprocess():
    """Through a real process, the way `mindspec/cli.py` main() runs a subcommand."""
    ok = subprocess.run([sys.executable, "-c", WRAPPER, *SEED, "--json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    p = json.loads(ok.stdout)
    assert {"total_gb", "target_gb", "draft_gb", "kv_gb", "kv_gb_without_draft", "kv_tokens", "kv_tokens_without_draft",
            "max_sequences", "draft_ms", "target_ms", "c", "speedup", "warnings"} <= set(p)
    assert np.isfinite(p["c"])
    bad = subprocess.run([sys.executable, "-c", WRAPPER, *SEED, "--device-mem", "64XB"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("mindspec: error: bad size '64XB'") and bad.stderr.count("\n") == 1


def test_missing_numbers(capsys):
    with pytest.raises(MindspecError, match="go together"):
        run_plan(["plan", *TARGET_70B, "--draft-params", "7e9", "--device-mem", "64GB"], capsys)
    with pytest.raises(MindspecError, match="give the target"):
        run_plan(["plan", "--device-mem", "64GB"], capsys)


def test_kv_heads_replicated_beyond_tp(capsys):
    t = plan.shape(70e9, 80, 8, 128, "fp16")
    _, kv16, _, _ = plan._per_device(t, None, 16)      # 8 KV heads over 16 devices: one head each
    assert kv16 == plan.kv_bytes_per_token(t) / 8
    # and a token costs the 16 of them twice the model's 327,680 bytes (the table showed 327,680; the
    # JSON's per-device figure was found untested by mutation testing)
    args = ["plan", *TARGET_70B, "--tp", "16", "--device-mem", "64GB"]
    _, p = run_plan(args + ["--json"], capsys)
    assert p["kv_bytes_per_token"] == {"target": 655_360, "target_per_device": 40_960, "draft": 0}
    out, _ = run_plan(args, capsys)
    row = next(line for line in out.splitlines() if line.startswith("  KV bytes/token, target"))
    assert row.split()[-2:] == ["-", "655,360"]


def test_llama2_70b_config_count():
    from mindspec.config import LlamaConfig
    cfg = LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128)
    assert plan.count_params(cfg) == pytest.approx(68.98e9, rel=1e-3)
    assert plan.kv_bytes_per_token(cfg) == 327_680


def test_planner_counts_what_the_graphs_allocate(tiny_target):
    """Bytes of the Parameters the target graphs create (TP=1) and of each rank's folded weights (TP=2)
    equal the planner's per-device figures, with and without the rotate-half rows."""
    from mindspec.checkpoint import Checkpoint
    from mindspec.graphs.fuse import fused_weights
    from mindspec.graphs.llama import LlamaDecoder
    from mindspec.graphs.runner import init_mindspore
    from mindspec.graphs.tp import shard_plan
    init_mindspore()
    ckpt = Checkpoint(tiny_target[0])
    cfg, S, slots = ckpt.config, 40, 3
    for rot in (True, False):
        m = plan.shape_from_config(cfg, "fp32", rot_rows=rot)
        dec = LlamaDecoder(cfg, ckpt.get, S, slots=slots, rot_rows=rot)
        params = list(dec.get_parameters())
        cache = sum(p.nbytes for p in params if "_cache." in p.name)
        shard, t_kv = plan.target_per_device(m, 1)
        assert sum(p.nbytes for p in params if "_cache." not in p.name) == shard
        assert cache == t_kv * S * slots
        shard2, t_kv2 = plan.target_per_device(m, 2)
        ranks = [sum(w.nbytes for w in fused_weights(cfg, ckpt.get, shard_plan(cfg, 2, r), rot_rows=rot).values())
                 for r in range(2)]
        assert max(ranks) == shard2 and t_kv2 == t_kv / 2
    assert plan.target_per_device(plan.shape_from_config(cfg, "fp32", rot_rows=True), 1)[0] > shard  # rot rows cost


def test_a_cpu_row_counts_both_caches_and_the_graphs_workspace():
    """What a CPU host's KV-cache row costs at least (the check before a cache is built): the target's
    K/V, the draft's (at its own dtype, up to its own positions) and the prompt graph's workspace, which
    for a tiny model outweighs its cache (measured: ~560 KB a row of 96 positions, 48 KB of it K/V)."""
    from mindspec.config import config_from_dict
    cfg = config_from_dict({"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "num_key_value_heads": 2})
    kv = plan.kv_bytes_per_token(cfg, 4)
    alone = plan.host_bytes_per_row(cfg, 4, 96)
    assert kv * 96 * 3 < alone < 560e3
    draft = {"num_layers": 2, "num_key_value_heads": 2, "head_dim": 16, "max_seq": 64}
    assert plan.host_bytes_per_row(cfg, 4, 96, dict(draft, dtype="float32")) - alone == kv * 64
    assert plan.host_bytes_per_row(cfg, 4, 96, dict(draft, dtype="float16")) - alone == kv * 64 // 2


def test_a_draft_or_target_that_is_a_device_says_so_not_not_found(tmp_path, capsys):
    """Found by a user probe: `plan --draft /dev/null` said "draft model not found" (it is there, but neither a
    file nor a checkpoint directory); a pipe was the same, and a target of /dev/null "model directory not found"."""
    os.mkfifo(tmp_path / "fifo")
    for path in ("/dev/null", str(tmp_path / "fifo")):
        with pytest.raises(MindspecError) as e:
            run_plan(["plan", *TARGET_70B, "--draft", path, "--device-mem", "64GB"], capsys)
        assert str(e.value) == (f"draft {path} is not a file (a device, a pipe or a socket): give the .onnx file "
                                "`mindspec export` wrote")
        with pytest.raises(MindspecError) as e:
            run_plan(["plan", "--target", path, "--device-mem", "64GB"], capsys)
        assert str(e.value) == (f"{path} is not a directory (a device, a pipe or a socket): give the model's "
                                "checkpoint directory")


def test_host_memory_is_the_machines_or_its_containers_limit():
    """What the CPU's memory checks (export's RoPE tables, a pipeline's rows) compare with."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        if os.path.exists(path) and open(path).read().strip().isdigit():
            limits.append(int(open(path).read()))
    assert plan.host_memory() == min([physical] + limits)


def test_the_engines_refusal_names_its_own_flags_and_rows(tmp_path):
    """The planner's prober's: generate and serve refused with plan's `--seq-len` (not theirs), called 8 rows "one
    33024-token sequence", and said "0.4 GB > 0.4 GB usable"; following the advice was refused again."""
    from mindspec.pipeline import check_size
    from mindspec.spec import cache_positions, K_BUCKETS
    cfg = Checkpoint(make_tiny_checkpoint(tmp_path)[0]).config
    t = plan.shape_from_config(cfg, "fp16")
    per_token = plan.kv_bytes_per_token(t)
    mem = t.weight_bytes + 8 * cache_positions(100, K_BUCKETS) * per_token  # 8 rows of --max-seq 100 fit exactly
    check_size(cfg, None, None, 100, 8, dtype="float16", device="Ascend", device_mem=mem, tp=1)
    with pytest.raises(MindspecError) as e:
        check_size(cfg, None, None, 200, 8, dtype="float16", device="Ascend", device_mem=mem, tp=1)
    msg = str(e.value)
    assert "KV cache for 8 rows of 256 positions" in msg and "--seq-len" not in msg, msg  # (200 rounded, and a tail)
    n = int(re.search(r"--max-seq (\d+) or less \(or fewer rows: --max-batch\)", msg)[1])
    check_size(cfg, None, None, n, 8, dtype="float16", device="Ascend", device_mem=mem, tp=1)  # the advice fits
    need, usable = re.search(r"= ([\d.]+) GB > ([\d.]+) GB usable", msg).groups()
    assert need != usable


def test_sizes_and_the_header_say_what_was_given(capsys):
    """The planner's prober's: ".5GB" was refused where "64.GB" was taken; a plan without a draft said "the draft
    on every device"."""
    assert plan.parse_size(".5GB", "--device-mem") == 0.5e9 and plan.parse_size("64.GB", "--device-mem") == 64e9
    out, _ = run_plan(["plan", *TARGET_70B, *CARDS], capsys)
    assert out.splitlines()[0] == "8 device(s) x 64.0 GB, reserve 0%, TP=8 (1 group(s)); decimal GB"
    with pytest.raises(MindspecError, match="--draft-dtype and --draft-profile describe a draft"):
        run_plan(["plan", *TARGET_70B, *CARDS, "--draft-dtype", "q4"], capsys)
