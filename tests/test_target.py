"""The MindSpore target graphs against the numpy reference, and the fused greedy step (per-row
positions, slots, valid-draft counts, padding rows) against the pure acceptance function."""
import math
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from mindspec.acceptance import greedy_accept
from mindspec.checkpoint import Checkpoint
from mindspec.graphs.runner import RowSampling, TargetModel, init_mindspore
from mindspec.config import RopeScaling, config_from_dict
from mindspec.reference import reference_logits, rope_inv_freq

from conftest import LLAMA3_ROPE, make_tiny_checkpoint


@pytest.fixture(scope="module")
def target(tiny_target):
    init_mindspore()
    ckpt = Checkpoint(tiny_target[0])
    return ckpt, TargetModel(ckpt, max_seq=64, k_buckets=(1, 2, 4, 8), batch_buckets=(1, 4), max_batch=4)


def _ref(ckpt, seq):
    return reference_logits(ckpt.config, ckpt.get, seq)


def test_logits_match_reference_per_slot_and_after_rollback(target):
    ckpt, m = target
    rng = np.random.default_rng(0)
    seq = [int(x) for x in rng.integers(3, 300, 40)]
    other = [int(x) for x in rng.integers(3, 300, 9)]
    got = np.concatenate([m.logits(0, 0, seq[:33]), m.logits(0, 33, seq[33:34])])
    m.logits(1, 0, other)  # another slot between the calls changes nothing in slot 0
    got = np.concatenate([got, m.logits(0, 34, seq[34:40])])
    assert np.abs(got - _ref(ckpt, seq)).max() < 1e-4
    # reject the last 5 positions (rollback = feed at an earlier position), feed other tokens
    alt = [7, 8, 9, 10, 11, 12]
    assert np.abs(m.logits(0, 35, alt) - _ref(ckpt, seq[:35] + alt)[35:]).max() < 1e-4
    assert np.abs(m.logits(1, 9, [5]) - _ref(ckpt, other + [5])[-1:]).max() < 1e-4


def test_prefill_chunks_return_the_reference_argmax(target):
    ckpt, m = target
    seq = list(range(5, 5 + 37))  # 37 tokens: a full chunk plus a padded one
    m.prefill([2], [0], [seq[:32]], RowSampling.greedy(1))
    assert m.prefill([2], [32], [seq[32:]], RowSampling.greedy(1))[0] == int(_ref(ckpt, seq)[-1].argmax())


def _drafts(ckpt, prefix, k, rng, corrupt):
    """The target's own greedy continuation, corrupted at a random position when `corrupt`."""
    drafts, seq = [], list(prefix)
    for _ in range(k):
        t = int(_ref(ckpt, seq)[-1].argmax())
        drafts.append(t)
        seq.append(t)
    if corrupt:
        j = int(rng.integers(0, k))
        drafts[j] = (drafts[j] + 1) % 300
    return drafts


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_fused_greedy_step_equals_pure_function(target, k):
    ckpt, m = target
    rng = np.random.default_rng(k)
    for case in range(4):
        prefix = [int(x) for x in rng.integers(3, 300, 6)]
        drafts = _drafts(ckpt, prefix, k, rng, corrupt=case % 2)
        amax = _ref(ckpt, prefix + drafts)[len(prefix) - 1:].argmax(-1)
        m.logits(0, 0, prefix[:-1])
        n, nxt = m.step([[prefix[-1]] + drafts], [0], [len(prefix) - 1], [k])
        assert (int(n[0]), int(nxt[0])) == greedy_accept(amax, drafts)


def test_rows_with_own_positions_slots_and_valid_counts(target):
    """Three rows in a bucket of four (one padding row): each at its own position in its own slot,
    each with its own number of valid drafts; then each cache is still exact."""
    ckpt, m = target
    rng = np.random.default_rng(5)
    prefixes = [[int(x) for x in rng.integers(3, 300, n)] for n in (4, 9, 2)]
    slots, n_valid = [3, 0, 1], [4, 2, 0]
    rows = []
    for slot, prefix, nv in zip(slots, prefixes, n_valid):
        m.logits(slot, 0, prefix[:-1])
        rows.append([prefix[-1]] + _drafts(ckpt, prefix, 4, rng, corrupt=slot == 0))
    n, nxt = m.step(rows, slots, [len(p) - 1 for p in prefixes], n_valid)
    for i, (prefix, nv) in enumerate(zip(prefixes, n_valid)):
        drafts = rows[i][1:]
        amax = _ref(ckpt, prefix + drafts)[len(prefix) - 1:].argmax(-1)
        assert (int(n[i]), int(nxt[i])) == greedy_accept(amax, drafts, nv)
        assert n[i] <= nv
        seq = prefix + drafts[:n[i]] + [int(nxt[i])]
        got = m.logits(slots[i], len(seq) - 1, seq[-1:])
        assert np.abs(got - _ref(ckpt, seq)[-1:]).max() < 1e-4


def test_greedy_accept_pure_function():
    assert greedy_accept([5, 6, 7], [5, 6]) == (2, 7)  # all accepted: bonus token
    assert greedy_accept([5, 6, 7], [4, 6]) == (0, 5)  # first-token mismatch: recovered token
    assert greedy_accept([5, 6, 7], [5, 9]) == (1, 6)
    assert greedy_accept([5], []) == (0, 5)  # empty draft: plain decode
    assert greedy_accept([5, 6, 7], [5, 6], n_valid=1) == (1, 6)  # capped: the bonus after the valid draft
    assert greedy_accept([5, 6, 7], [5, 6], n_valid=0) == (0, 5)  # a row with no valid draft decodes


def test_tied_embeddings_and_odd_head_dim(tmp_path):
    d, _ = make_tiny_checkpoint(tmp_path / "t", tie=True, head_dim=24, heads=3, kv_heads=1, seed=3)
    ckpt = Checkpoint(d)
    m = TargetModel(ckpt, max_seq=32, k_buckets=(1,))
    seq = [5, 9, 13, 200, 17]
    assert np.abs(m.logits(0, 0, seq) - _ref(ckpt, seq)).max() < 1e-4


def _meta_llama3(freqs, factor, low, high, old):
    """Llama 3.1's frequency scaling as Meta's reference code wrote it, one frequency at a time."""
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def test_rope_scaling_llama3_and_linear_frequencies():
    raw = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072)
    plain = rope_inv_freq(config_from_dict(raw))                                       # [64]
    assert plain[0] == 1.0 and plain[-1] == pytest.approx(500000.0 ** (-126 / 128))
    llama31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)                              # Llama 3.1 8B's config
    got = rope_inv_freq(config_from_dict(dict(raw, rope_scaling=llama31)))
    np.testing.assert_allclose(got, _meta_llama3(plain, 8.0, 1.0, 4.0, 8192), rtol=1e-15, atol=0)
    assert (got == plain).sum() == 29 and (got == plain / 8).sum() == 29  # and 6 blended: all three bands
    linear = rope_inv_freq(config_from_dict(dict(raw, rope_scaling={"type": "linear", "factor": 4.0})))
    np.testing.assert_array_equal(linear, plain / 4)
    assert config_from_dict(dict(raw, rope_scaling=llama31)).rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


def test_llama3_rope_scaling_in_the_graph_matches_the_reference(tmp_path):
    d, _ = make_tiny_checkpoint(tmp_path / "l3", seed=4, extra=LLAMA3_ROPE)
    ckpt = Checkpoint(d)
    m = TargetModel(ckpt, max_seq=64, k_buckets=(1,))
    seq = [int(x) for x in np.random.default_rng(5).integers(0, 320, 40)]
    want = _ref(ckpt, seq)                                                              # [T, V]
    plain = reference_logits(replace(ckpt.config, rope_scaling=None), ckpt.get, seq)
    assert np.abs(want - plain).max() > 0.1  # the scaling changes these logits: the check below has teeth
    assert np.abs(m.logits(0, 0, seq) - want).max() < 1e-4


def test_logits_after_steps_with_rejections(target):
    """Several fused steps (some drafts rejected), then the cache must still be exact."""
    ckpt, m = target
    rng = np.random.default_rng(7)
    seq = [int(x) for x in rng.integers(3, 300, 5)]
    seq.append(int(m.prefill([1], [0], [seq], RowSampling.greedy(1))[0]))
    rejected = 0
    for step in range(6):
        drafts = [int(x) for x in rng.integers(3, 300, 4)]
        ref = _ref(ckpt, seq + drafts)[len(seq) - 1:].argmax(-1)
        if step % 2:  # make some drafts right, so accepted prefixes occur too
            drafts[:2] = [int(ref[0]), int(_ref(ckpt, seq + [int(ref[0])])[-1].argmax())]
        n, nxt = m.step([[seq[-1]] + drafts], [1], [len(seq) - 1], [4])
        rejected += n[0] < 4
        seq += drafts[:n[0]] + [int(nxt[0])]
    assert rejected >= 3
    got = m.logits(1, len(seq) - 1, seq[-1:])
    assert np.abs(got - _ref(ckpt, seq)[-1:]).max() < 1e-4


def test_rotate_half_in_the_graph_matches_the_reference(target):
    """The Ascend layout (q|k|v only, rotate-half computed in the graph) on the CPU."""
    from mindspec.graphs.llama import LlamaDecoder, Logits
    from mindspore import Tensor
    ckpt, _ = target
    seq = [int(x) for x in np.random.default_rng(1).integers(3, 300, 12)]
    cell = Logits(LlamaDecoder(ckpt.config, ckpt.get, 64, slots=1, rot_rows=False))
    cell.set_train(False)
    i32 = lambda a: Tensor(np.asarray(a, np.int32))  # noqa: E731
    got = cell(i32([seq]), i32([0]), i32([0]), i32(np.arange(64))).asnumpy()[0]
    assert np.abs(got - _ref(ckpt, seq)).max() < 1e-4


def test_warm_next_runs_each_graph_warm_up_only_compiled(tiny_target):
    """Warm-up compiles without running; a graph's first run is counted (cold_runs) and warm_next runs
    the compiled graphs nothing ran yet, one per call, until none is left."""
    init_mindspore()
    m = TargetModel(Checkpoint(tiny_target[0]), max_seq=32, k_buckets=(1,), batch_buckets=(1,), max_batch=1)
    names = m.graph_names((1,), (0, 1))
    m.warmup(names)
    assert m.cold() == names == [("prefill", 1, 32, 64), ("greedy", 1, 2, 64)] and m.cold_runs == 0
    assert m.warm_next() and m.cold() == names[1:] and m.cold_runs == 1
    m.step([[5, 6]], [0], [3], [1])  # a request reaching the last cold graph first: its first run
    assert m.cold() == [] and m.cold_runs == 2 and not m.warm_next()
    m.step([[5, 6]], [0], [3], [1])
    assert m.cold_runs == 2


SPLIT = '''
import json, sys
from mindspec.checkpoint import Checkpoint
from mindspec.graphs.runner import RowSampling, TargetModel, init_mindspore
target, cache, mode = sys.argv[1:]
init_mindspore()
m = TargetModel(Checkpoint(target), max_seq=32, k_buckets=(1,), batch_buckets=(1, 2), max_batch=2)
names = m.graph_names((1, 2), (0, 1))  # prefill, decode and verify K=1 of one row and of two: 5 graphs
m.warmup(names, cache, now=2)  # the first process, on an empty cache, compiles all five here
assert (m.ready_rows(), m.pending) == ((2, []) if mode == "first" else (1, names[2:])), m.pending
while m.warm_next():  # the compiled graphs run (a server's idle ticks) before the rest compile
    pass
if mode == "between":  # a graph outside warm-up compiles between (without the cache)
    m.logits(0, 0, [5, 6])
if mode == "outside":  # a pending graph compiles outside warm-up: the rest cannot use the cache
    m.prefill([0, 1], [0, 0], [[5], [6]], RowSampling.greedy(2))
while m.load_next():
    pass
assert m.ready_rows() == 2 and m.cold_count() == len(m.cold())
g = RowSampling.greedy
out = [m.prefill([1], [0], [[5, 6, 7]], g(1)), *m.step([[7]], [1], [3], [0]),
       m.prefill([0, 1], [0, 0], [[5, 6, 7], [9, 8]], g(2)), *m.step([[5], [6]], [0, 1], [3, 2], [0, 0]),
       *m.step([[5, 6], [7, 8]], [0, 1], [4, 3], [1, 1])]
print(json.dumps([o.tolist() for o in out]))
'''


def test_graphs_left_pending_load_from_the_compile_cache_in_order(tiny_target, tmp_path):
    """A server says ready after its one-row graphs and compiles the rest while it serves, through the same
    compile cache once it holds them all (a first start, on an empty cache, compiles everything at once):
    MindSpore numbers cached graphs in compile order, so every graph must still get its own file — with
    graphs run between, and with another graph compiled between (no number: the cache goes on); a pending
    graph compiled outside warm-up ends the cache for the rest. Every graph's outputs equal those of a
    fresh compile (the first process, which fills the cache; without that guard the last process crashed
    on the wrong graph)."""
    import os
    script = tmp_path / "split.py"
    script.write_text(SPLIT)
    env = dict(os.environ, GLOG_v="2")  # MindSpore says each time it loads a graph from the cache
    outs = {}
    for mode, hits in (("first", 0), ("between", 5), ("outside", 2)):
        p = subprocess.run([sys.executable, str(script), tiny_target[0], str(tmp_path / "cache"), mode], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stderr.count("Use the compilation cache") == hits, mode
        outs[mode] = p.stdout
    assert outs["between"] == outs["outside"] == outs["first"]


MEMORY = """
import sys
import numpy as np
from mindspec.checkpoint import Checkpoint
from mindspec.graphs.runner import RowSampling, TargetModel, init_mindspore
from conftest import LLAMA3_ROPE, make_tiny_checkpoint

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1e3  # MB

init_mindspore()
ckpt = Checkpoint(make_tiny_checkpoint(sys.argv[1], layers=int(sys.argv[2]), heads=8, kv_heads=2)[0])
m = TargetModel(ckpt, max_seq=2048, k_buckets=(1,), batch_buckets=(8,), max_batch=8)
before = rss()
for _ in range(2):
    m.prefill(list(range(8)), [1100] * 8, [list(range(3, 35))] * 8, RowSampling.greedy(8))  # the whole cache's window
print(rss() - before)
"""


def test_a_graph_holds_no_memory_per_layer(tmp_path):
    """A compiled graph's memory must not grow with its layers: on CPU a broadcasting elementwise kernel keeps
    a workspace of its own, ~4x its output, for the life of the graph, so a mask added by broadcast in every
    layer made each prompt graph of the default model hold ~1.1 GB at 1024 positions (a server at --max-seq
    2048 and 8 slots, 17.7 GB). Here a tiny model's [8, 32] prompt graph over 2048 positions, 2 layers against
    12: its attention scores are 17 MB a layer."""
    import os
    script = tmp_path / "memory.py"
    script.write_text(MEMORY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    grew = {}
    for layers in (2, 12):
        p = subprocess.run([sys.executable, str(script), str(tmp_path / f"m{layers}"), str(layers)], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        grew[layers] = float(p.stdout.split()[-1])
    assert (grew[12] - grew[2]) / 10 < 15, grew  # MB a layer: ~70 with the broadcast, ~2.5 without


def test_attention_windows_halve_what_a_step_reads_or_are_not_made():
    from mindspec.spec import attention_windows
    assert attention_windows(288) == (288,)  # a 256 window would save too little for its graphs
    assert attention_windows(544) == (256, 544)
    assert attention_windows(1056) == (256, 1056)
    assert attention_windows(2080) == (256, 1024, 2080)


def test_rows_near_the_start_attend_over_a_window_of_the_cache(tiny_target):
    """A cache of 512 positions: calls whose rows all sit below 256 run the 256-window graphs, a call
    with a row past it the whole cache's; both exact against the reference, the cache shared."""
    ckpt = Checkpoint(tiny_target[0])
    m = TargetModel(ckpt, max_seq=480, k_buckets=(2,), batch_buckets=(2,), max_batch=2)
    assert m.windows == (256, 512)
    seq = [int(x) for x in np.random.default_rng(11).integers(3, 300, 320)]
    ref = _ref(ckpt, seq)
    got = np.concatenate([m.logits(0, p, seq[p:p + 32]) for p in range(0, 320, 32)])
    assert np.abs(got - ref).max() < 1e-4
    assert {"logits(1, 32, 256)", "logits(1, 32, 512)"} <= m.ran
    other = seq[:100]
    m.logits(1, 0, other[:96])
    for pos, W in ((300, 512), (250, 256)):  # (the later first: a step overwrites what follows pos)
        rows = [[other[96], 5, 6], [seq[pos], 7, 8]]
        n, nxt = m.step(rows, [1, 0], [96, pos], [2, 2])
        for i, prefix in enumerate((other[:97], seq[:pos + 1])):
            amax = _ref(ckpt, prefix + rows[i][1:])[len(prefix) - 1:].argmax(-1)
            assert (int(n[i]), int(nxt[i])) == greedy_accept(amax, rows[i][1:])
        assert f"greedy(2, 3, {W})" in m.ran
    # warm-up names every window up to the one a run's rows reach; dummy rows run each in its own window
    names = m.graph_names((2,), (2,))
    assert names == [("prefill", 2, 32, 256), ("greedy", 2, 3, 256), ("prefill", 2, 32, 512), ("greedy", 2, 3, 512)]
    assert m.graph_names((2,), (2,), reach=200) == names[:2]
    m.warmup(names)
    while m.warm_next():
        pass
    assert m.cold() == [] and {f"prefill(2, 32, {W})" for W in (256, 512)} <= m.ran
