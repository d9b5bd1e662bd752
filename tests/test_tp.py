"""Tensor-parallel target (msrun on CPU, 127.0.0.1): TP=2 and TP=4 equal TP=1 (greedy tokens, target-only
and speculative; logits within 1e-4), each rank reads only its slice of a sharded checkpoint, a dead rank
ends the job with one line instead of hanging, and only rank 0's output reaches the user.

This file is also the script each rank runs (`python tests/test_tp.py ...` under mindspec.tp.launch).
The model has 6 query heads in 2 KV groups: TP=2 splits the groups exactly, TP=4 has to replicate KV
heads and pad query slots (ranks get 1 or 2 of a group's 3 heads); vocab 322 and intermediate 98 are
not multiples of 4 either, so the padding paths run too."""
import io
import json
import os
import pickle
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import make_tiny_checkpoint  # noqa: E402

PROMPTS = [[5, 6, 7], [100, 3, 250, 17, 9], list(range(10, 50))]
LOGIT_IDS = [7, 200, 13, 5, 99, 300, 42, 8]
NEW_TOKENS = 24
SHAPE = dict(vocab=322, hidden=96, layers=2, heads=6, kv_heads=2, inter=98)


def run_job(target, draft, out):
    """What every rank runs (and the TP=1 reference, in-process): tokens, logits, bytes read.
    The first generate compiles through the pipeline's compile cache (shared by all TP sizes here, as
    on a user's machine): a graph cached by one TP layout must never be loaded by another."""
    import mindspec
    from mindspec.checkpoint import Checkpoint
    from mindspec.graphs.tp import tp_rank, tp_size
    read = {"slice": 0, "whole": 0, "whole_names": []}
    get, get_slice = Checkpoint.get, Checkpoint.get_slice

    def counting_get(self, name):
        arr = get(self, name)
        read["whole"] += arr.nbytes
        read["whole_names"].append(name)
        return arr

    def counting_slice(self, name, axis, start, stop):
        arr = get_slice(self, name, axis, start, stop)
        read["slice"] += arr.nbytes
        return arr

    Checkpoint.get, Checkpoint.get_slice = counting_get, counting_slice
    t0 = time.perf_counter()
    try:
        pipe = mindspec.load(target=target, draft=draft, k=4, max_seq=128, buckets=(4,), max_batch=2,
                             batch_buckets=(2,))
    finally:
        Checkpoint.get, Checkpoint.get_slice = get, get_slice
    res = {"rank": tp_rank(), "size": tp_size(), "read": read, "target_only": [], "speculative": [],
           "accepted": 0, "drafted": 0, "load_s": time.perf_counter() - t0}
    for ids in PROMPTS:
        res["target_only"].append(pipe.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False).token_ids)
        spec = pipe.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS)
        res["speculative"].append(spec.token_ids)
        res["accepted"] += spec.stats["accepted"]
        res["drafted"] += spec.stats["drafted"]
    # every rank steps the same continuous batch (two rows at a time, the rest joining as rows finish)
    res["batched"] = [r.token_ids for r in pipe.generate_many(
        [dict(prompt_ids=ids, max_new_tokens=NEW_TOKENS) for ids in PROMPTS], max_batch=2)]
    res["generate_s"] = time.perf_counter() - t0 - res["load_s"]
    from mindspec.tp import share
    res["shared"] = share({"from": tp_rank(), "seed": 12345, "costs": [0.31, {"4": 1.25}], "pad": "x" * 300})
    # a pickle of 2**24 + 4m + 1 bytes, which one float32 rounds down (a TP probe's: a server's queued requests
    # past 16 MiB arrived cut, and a rank died; so did a batch job's resume of 243,000 finished ids)
    big = "y" * (2 ** 24 + (1 - len(pickle.dumps("y" * 2 ** 24))) % 4)
    assert len(pickle.dumps(big)) % 4 == 1
    res["shared_big"] = share(big if tp_rank() == 0 else None) == big
    logits = pipe.target.logits(0, 0, LOGIT_IDS)  # [T, V]: the gathered vocabulary-parallel logits
    with open(f"{out}.rank{tp_rank()}.json", "w") as f:
        json.dump(res, f)
    np.save(f"{out}.rank{tp_rank()}.npy", logits)
    if tp_rank() == 0:
        print(f"rank0 of {tp_size()}: {res['speculative'][0][:5]}")
        print(f"load {res['load_s']:.1f} s, generate {res['generate_s']:.1f} s, compile {pipe.target.compile_s:.1f} s, "
              f"total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    die = os.environ.get("TP_TEST_DIE_RANK")
    if die == str(tp_rank()):
        with open(f"{out}.died", "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), 9)  # this rank dies ...
    elif die:
        pipe.target.step([[5]], [0], [0], [0])  # ... while the others wait for it in the first AllReduce of a call
    return res, logits


def prepare_job(target, draft, out):
    """What every rank runs in the server's start-up test: prepare as `mindspec serve --max-batch 2` does
    (graphs beyond one row's left pending where the compile cache holds them all and the costs are known),
    then a continuous batch and a sampled generate without a seed. TP_TEST_HOMES="A,B": rank r's MINDSPEC_HOME is the r-th (ranks on machines of
    their own, each with its own compile cache and costs). A rank stuck in a collective dies after 300 s."""
    import signal
    from mindspec.graphs.tp import tp_rank
    signal.alarm(300)
    homes = os.environ.get("TP_TEST_HOMES")
    if homes:
        os.environ["MINDSPEC_HOME"] = homes.split(",")[tp_rank()]
    import mindspec
    from mindspec.errors import MindspecError
    pipe = mindspec.load(target=target, draft=draft, max_seq=128, buckets=(4,), max_batch=2, batch_buckets=(1, 2))
    pipe.prepare([], 2, every_graph=True, rows_now=1)
    res = {"pending": [list(g) for g in pipe.target.pending]}
    res["batched"] = [r.token_ids for r in pipe.generate_many(
        [dict(prompt_ids=ids, max_new_tokens=NEW_TOKENS, k=4) for ids in PROMPTS], max_batch=2)]
    try:  # library use: sampled without a seed
        res["sampled"] = pipe.generate(prompt_ids=PROMPTS[1], max_new_tokens=NEW_TOKENS, temperature=1.0).token_ids
    except MindspecError as e:
        res["sampled"] = str(e)
    with open(f"{out}.rank{tp_rank()}.json", "w") as f:
        json.dump(res, f)


def drafts_job(target, draft, out):
    """Rank r drafts with the r-th file of TP_TEST_DRAFTS="A,B" (a host with another draft): one greedy
    speculative generate, its tokens or its error. A rank stuck in a collective dies after 300 s."""
    import signal
    signal.alarm(300)
    import mindspec
    from mindspec.errors import MindspecError
    from mindspec.graphs.tp import tp_rank
    pipe = mindspec.load(target=target, draft=os.environ["TP_TEST_DRAFTS"].split(",")[tp_rank()], k=4,
                         max_seq=128, buckets=(4,))
    if os.environ.get("TP_TEST_FAULT") and tp_rank() == 1:  # this host's draft calls raise: a proposal, a catch-up
        prop = pipe.engine.proposer
        real, real_feed, calls = prop.get_candidates, prop.prefill, []

        def faulty(*a, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("onnxruntime: failed to allocate memory on this host")
            return real(*a, **kw)

        def faulty_feed(chunks, *a):
            if any(ids[:1] == PROMPTS[2][:1] for ids in chunks.values()):
                raise RuntimeError("onnxruntime: failed to allocate memory for a prompt")
            return real_feed(chunks, *a)
        prop.get_candidates, prop.prefill = faulty, faulty_feed

    def generate(ids):
        try:
            return pipe.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS).token_ids
        except MindspecError as e:
            return str(e)
        except RuntimeError as e:
            return f"RuntimeError: {e}"
    res = {"greedy": generate(PROMPTS[1])}
    if os.environ.get("TP_TEST_FAULT"):  # then every rank goes on
        res["catch_up"] = generate(PROMPTS[2])
        res["after"] = generate(PROMPTS[1])
    with open(f"{out}.rank{tp_rank()}.json", "w") as f:
        json.dump(res, f)


def stuck_job(target, draft, out):
    """Rank 0 ends well; the others hang (a rank stopped, or stuck in a collective rank 0 gave up on)."""
    import signal
    from mindspec.graphs.tp import tp_rank
    if tp_rank():
        signal.alarm(300)
        time.sleep(300)


def crash_job(target, draft, out):
    """Rank 0 raises what MindSpore raises when its collective timed out (it can come before msrun's own
    heartbeat time-out) once rank 1 has stopped (SIGSTOP)."""
    import signal
    from mindspec.graphs.tp import tp_rank
    signal.alarm(300)
    if tp_rank():
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        time.sleep(1)  # (rank 1 stopped)
        raise RuntimeError("Ring ReduceScatter wait receiving [1,2] failed.\n----\nC++ Call Stack: (For framework "
                           "developers)")


def worker_main(argv):
    from mindspec import tp
    target, draft, out = argv
    job_fn = {"prepare": prepare_job, "drafts": drafts_job, "stuck": stuck_job,
              "crash": crash_job}.get(os.environ.get("TP_TEST_JOB"), run_job)

    def job():
        job_fn(target, draft, out)
        return 0
    return tp.run_worker(job)


# ---- the tests (pytest side) ----

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A sharded tiny target (several safetensors files) and a noisy ONNX draft of it."""
    from mindspec.export import export_draft
    root = tmp_path_factory.mktemp("tp")
    target, tensors = make_tiny_checkpoint(root / "target", shard_bytes=60_000, **SHAPE)
    draft_dir, _ = make_tiny_checkpoint(root / "draftckpt", base=tensors, noise=0.1, seed=1, **SHAPE)
    draft = str(root / "draft.onnx")
    export_draft(draft_dir, draft)
    return target, draft, tensors, root


@pytest.fixture(scope="module")
def reference(pair):
    """TP=1, in this process."""
    from mindspec.graphs.runner import init_mindspore
    init_mindspore()
    target, draft, _, root = pair
    old = os.environ.get("MINDSPEC_HOME")
    os.environ["MINDSPEC_HOME"] = str(root / "home")
    try:
        return run_job(target, draft, str(root / "tp1"))
    finally:
        if old is None:
            del os.environ["MINDSPEC_HOME"]
        else:
            os.environ["MINDSPEC_HOME"] = old


def launch(n, pair, env=None, name=None, **kw):
    from mindspec import tp
    target, draft, _, root = pair
    out, err = io.StringIO(), io.StringIO()
    old = dict(os.environ)
    os.environ.update(env or {}, MINDSPEC_HOME=str(root / "home"))  # one compile cache for all TP sizes
    try:
        code = tp.launch([target, draft, str(root / (name or f"tp{n}"))], n, script=os.path.abspath(__file__),
                         stdout=out, stderr=err, timeout=60, **kw)
        return code, out.getvalue(), err.getvalue()
    finally:
        os.environ.clear()
        os.environ.update(old)


@pytest.mark.parametrize("n", [2, 4])
def test_tp_equals_tp1_and_reads_only_its_shard(pair, reference, n):
    """TP=2 ends normally. In the TP=4 job, after writing its results, rank 3 kills itself while the
    others wait for it in a collective: the job must end non-zero with one line, not hang."""
    target, _, tensors, root = pair
    ref, ref_logits = reference
    t = time.time()
    code, out, err = launch(n, pair, env={"TP_TEST_DIE_RANK": "3"} if n == 4 else None)
    print(f"TP={n}: {time.time() - t:.1f} s; rank 0: {err.strip()}", file=sys.stderr)
    if n == 2:
        assert code == 0, (code, out, err)
    else:
        assert code == 1
        assert err.splitlines()[-1].startswith("mindspec: error: tensor-parallel rank 3 of 4 died (killed by signal 9)")
        # seen, not waited out: well inside the launch's 60 s cluster time-out (a few seconds here; on a busy
        # machine msrun's polls and the kill of four ranks and a scheduler take longer)
        assert time.time() - float((root / "tp4.died").read_text()) < 45
    assert out.count("rank0 of") == 1 and f"rank0 of {n}:" in out  # rank 0's stdout only, streamed back
    total = sum(v.nbytes for v in tensors.values())
    norms = {k for k in tensors if k.endswith("norm.weight")}
    for r in range(n):
        res = json.load(open(root / f"tp{n}.rank{r}.json"))
        assert res["size"] == n and res["rank"] == r
        assert res["target_only"] == ref["target_only"], (
            f"rank {r} of TP={n} differs from TP=1; if its tokens are garbage (e.g. all 0), a graph compiled for "
            "another TP layout was loaded from the compile cache: its key must include graphs.tp.tp_layout()")
        assert res["speculative"] == ref["speculative"] == ref["target_only"], r
        assert res["batched"] == ref["batched"] == ref["target_only"], r
        assert np.abs(np.load(root / f"tp{n}.rank{r}.npy") - ref_logits).max() < 1e-4
        assert res["shared"] == dict(ref["shared"], **{"from": 0})  # rank 0's object, on every rank
        assert res["shared_big"]
        # shard-by-shard: whole tensors read are the norm vectors only; the matrices come as slices
        assert set(res["read"]["whole_names"]) <= norms
        assert res["read"]["slice"] < total * 1.2 / n, (res["read"]["slice"], total)
    assert 0.1 < ref["accepted"] / ref["drafted"] < 0.95  # the draft is sometimes wrong: rollbacks happen


def test_ranks_agree_on_what_a_server_start_leaves_pending(pair, reference, tmp_path):
    """A server start leaves the larger batches' graphs pending only where the compile cache holds every
    graph and the costs are known. Ranks decide together: one rank whose machine has neither (a new host,
    a first start stopped midway) makes every rank compile all and use rank 0's costs (found: rank 1
    measured costs alone, its graph runs' collectives met rank 0's next share and the job died; with the
    costs shared, the ranks left different graphs pending). Then, every rank's cache whole, each leaves
    the same graphs pending and loads them in the same order; the batches equal TP=1's. A sampled request
    without a seed (library use) commits the same tokens on every rank (found: each rank drew its own seed
    from os.urandom, drafted and accepted differently, and the request failed on the step check)."""
    import shutil
    ref, _ = reference
    warm, other = tmp_path / "warm", tmp_path / "other"
    runs = {}
    for run, homes in (("fill", [warm, warm]), ("new-host", [warm, other]), ("warm", [warm, other])):
        if run == "new-host":  # rank 1 on a host of its own: no costs file, and a compile cache that holds the
            # graphs (they load fast) with no entry marked whole, as after a first start stopped midway
            shutil.copytree(warm / "compile_cache", other / "compile_cache", ignore=shutil.ignore_patterns("*.whole"))
        code, out, err = launch(2, pair, {"TP_TEST_JOB": "prepare", "TP_TEST_HOMES": ",".join(map(str, homes)),
                                          "MINDSPEC_COSTS_NOISY": "1"},  # (the suite's other worker is busy)
                                name=f"prepare-{run}")
        assert code == 0, (run, code, out, err[-3000:])
        runs[run] = [json.load(open(pair[3] / f"prepare-{run}.rank{r}.json")) for r in range(2)]
        for res in runs[run]:
            assert res["batched"] == ref["target_only"], run
        assert isinstance(runs[run][0]["sampled"], list) and runs[run][0]["sampled"] == runs[run][1]["sampled"], run
    assert runs["fill"][0]["pending"] == runs["fill"][1]["pending"] == []  # a cold cache: every graph first
    assert runs["new-host"][0]["pending"] == runs["new-host"][1]["pending"] == []  # rank 1's was not whole
    assert runs["warm"][0]["pending"] == runs["warm"][1]["pending"] != []  # both whole: the same ones pending
    assert all(B == 2 for _, B, *_ in runs["warm"][0]["pending"])


def test_ranks_whose_drafts_differ_stop_with_one_error(pair):
    """Every rank runs the draft and must propose the same tokens (same file, onnxruntime, processor).
    Found: a host with another draft file made each rank verify its own drafts, their rows moved apart
    until their calls no longer matched, and a rank died in an AllReduce ("rank 1 died", nothing said
    why). Now each step's tokens are checked across ranks: the request fails with one error, every rank."""
    from mindspec.export import export_draft
    target, draft, tensors, root = pair
    other_dir, _ = make_tiny_checkpoint(root / "otherckpt", base=tensors, noise=0.1, seed=2, **SHAPE)
    other = str(root / "other.onnx")
    export_draft(other_dir, other)
    code, out, err = launch(2, pair, {"TP_TEST_JOB": "drafts", "TP_TEST_DRAFTS": f"{draft},{other}"}, name="drafts")
    assert code == 0, (code, out, err[-3000:])
    for r in range(2):
        res = json.load(open(root / f"drafts.rank{r}.json"))
        assert res["greedy"] == ("the tensor-parallel ranks disagree on the tokens to verify: every host needs "
                                 "the same draft file, onnxruntime build and kind of processor"), (r, res)


def test_a_draft_call_that_raises_on_one_rank_ends_its_request_on_every_rank(pair, reference):
    """A review's: a draft call raising on one host alone (its memory, its device) ended the rows on that rank,
    which skipped the verify call the others were inside of: the job hung in a collective until a timeout
    (half an hour on Ascend), or died. Now the ranks agree on it before the call: the request ends with an
    error on every rank (that rank's own words, the others' naming it), and the next request is exact; so does
    a prompt's catch-up feed raising on one rank (a review's)."""
    target, draft, _, root = pair
    code, out, err = launch(2, pair, {"TP_TEST_JOB": "drafts", "TP_TEST_DRAFTS": f"{draft},{draft}",
                                      "TP_TEST_FAULT": "1"}, name="fault")
    assert code == 0, (code, out, err[-3000:])
    res = [json.load(open(root / f"fault.rank{r}.json")) for r in range(2)]
    assert res[0]["greedy"] == ("the draft call for the tokens to verify raised on 1 of the 2 tensor-parallel "
                                "ranks (that rank's log says why)"), res
    assert res[1]["greedy"] == "RuntimeError: onnxruntime: failed to allocate memory on this host", res
    # (a review's: a prompt's catch-up feed raising on one rank split the ranks the same way)
    assert res[0]["catch_up"] == ("the draft call for a prompt's catch-up raised on 1 of the 2 tensor-parallel "
                                  "ranks (that rank's log says why)"), res
    assert res[1]["catch_up"] == "RuntimeError: onnxruntime: failed to allocate memory for a prompt", res
    assert res[0]["after"] == res[1]["after"] == reference[0]["speculative"][1]


def test_a_rank_whose_host_lacks_the_draft_ends_the_job_with_its_own_error(pair):
    """Found: a rank failing with a one-line error (here its host has no draft file) ended the job as
    "tensor-parallel rank 1 of 2 died (exit code 1)", the cause only in msrun's log of that rank. Now the
    launcher says the rank's own words, and exits 2 as for any bad input."""
    target, draft, _, root = pair
    missing = str(root / "missing.onnx")
    code, out, err = launch(2, pair, {"TP_TEST_JOB": "drafts", "TP_TEST_DRAFTS": f"{draft},{missing}"}, name="lacks")
    assert code == 2, (code, out, err[-3000:])
    assert err.splitlines()[-1].startswith(f"mindspec: error: tensor-parallel rank 1 of 2: draft model not found: "
                                           f"{missing}; the job was stopped (logs: "), err[-3000:]
    assert "Traceback" not in err


def test_a_rank_left_running_after_rank_0_ended_is_stopped_and_named(pair):
    """The TP server prober's: a rank stopped (SIGSTOP) while serving made rank 0's collectives fail; rank 0
    ended (exit 0), and the launcher waited for ever on the stopped rank, nothing listening."""
    code, _, err = launch(2, pair, {"TP_TEST_JOB": "stuck"}, name="stuck", stray=2)
    assert code == 1, err
    assert err.startswith("mindspec: error: tensor-parallel rank 1 of 2 was still running 2 s after rank 0 "
                          "ended; the job was stopped (logs: "), err


def test_a_rank_0_that_raised_is_never_a_quiet_exit_code_1(pair):
    """The TP server prober's: rank 1 stopped (SIGSTOP) while an idle server's rank 0 waited in its turn's
    collective, and ~90 lines of Python and C++ stack reached the user's terminal before the launcher's line:
    rank 0's traceback now goes to its log only. Then CI's: MindSpore's collective time-out (~30 s on CPU)
    can come before msrun's heartbeat one (read in msrun's log, tested below on its words); rank 0 then
    raised, wrote exit code 1 as a batch job with failed lines does, and the launcher returned 1 saying
    nothing. Here rank 0 raises as that collective does, at once: the stopped rank is named (rank 0's own
    error when every other rank ended well: tested below on the launcher's words)."""
    code, _, err = launch(2, pair, {"TP_TEST_JOB": "crash"}, name="crash")
    assert code == 1, err
    assert "Traceback" not in err and "Call Stack" not in err, err[-3000:]
    assert err.splitlines()[-1].startswith("mindspec: error: tensor-parallel rank 1 of 2 stopped answering "
                                           "(stuck, stopped, or its host gone); the job was stopped (logs: "), err


def test_tp_refuses_more_ranks_than_heads(pair):
    from mindspec.checkpoint import Checkpoint
    from mindspec.errors import MindspecError
    from mindspec.graphs.tp import shard_plan
    cfg = Checkpoint(pair[0]).config
    with pytest.raises(MindspecError, match="exceeds the target's 6 attention heads"):
        shard_plan(cfg, 8, 0)


def test_shard_plans_cover_every_head_once():
    from mindspec.config import config_from_dict
    from mindspec.graphs.tp import shard_plan
    for H, KV in [(6, 2), (9, 3), (8, 8), (32, 8), (64, 8), (4, 1)]:
        cfg = config_from_dict({"vocab_size": 1000, "hidden_size": 64 * H, "intermediate_size": 100,
                                "num_hidden_layers": 1, "num_attention_heads": H, "num_key_value_heads": KV})
        for n in range(1, min(H, 16) + 1):
            plans = [shard_plan(cfg, n, r) for r in range(n)]
            q = np.concatenate([p.q_slots.ravel() for p in plans])
            assert sorted(q[q >= 0]) == list(range(H)), (H, KV, n)
            for p in plans:  # every query head sits under its own KV head
                kv = np.broadcast_to(p.kv_slots[:, None], p.q_slots.shape)
                assert (kv[p.q_slots >= 0] == p.q_slots[p.q_slots >= 0] // (H // KV)).all()
                assert p.q_slots.shape == plans[0].q_slots.shape
            if H % n == 0 and KV % n == 0:  # the even case is never padded
                assert not any(p.padded for p in plans) and plans[0].kv_local == KV // n
            assert sum(p.inter[1] - p.inter[0] for p in plans) == 100
            assert sum(p.vocab[1] - p.vocab[0] for p in plans) == 1000


# ---- msrun command lines and environments (pure functions) ----

def _msrun_parses(cmd, monkeypatch):
    """MindSpore's own msrun argument parser reads the command line (our flags exist in msrun 2.10)."""
    from mindspore.parallel.cluster.run import get_args
    monkeypatch.setattr(sys, "argv", cmd)
    return get_args()


def test_msrun_command_one_node(monkeypatch):
    from mindspec import tp
    topo = tp.topology(2)
    assert topo == tp.Topology(2, 1, 0, "127.0.0.1", 0) and list(topo.ranks) == [0, 1]
    cmd = tp.msrun_command("msrun", topo._replace(master_port=4567), ["python", "-m", "mindspec", "generate"],
                           "/tmp/logs", timeout=60)
    assert cmd == ["msrun", "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1", "--master_port=4567",
                   "--join=True", "--cluster_time_out=60", "--log_dir=/tmp/logs", "--tail_worker_log=2",
                   "python", "-m", "mindspec", "generate"]  # no --node_rank: msrun ignores it on one node
    args = _msrun_parses(cmd, monkeypatch)
    assert (args.worker_num, args.local_worker_num, args.node_rank, args.task_script) == (2, 2, -1, "python")


def test_msrun_command_two_nodes_and_core_binding(monkeypatch):
    """TP=16 over 2 machines of 8 NPUs: each machine runs msrun with its node rank, node 0's address and
    port; ranks 8..15 live on node 1. Core binding is msrun's own (--bind_core=True, msrun 2.10)."""
    from mindspec import tp
    for rank in (0, 1):
        topo = tp.topology(16, nodes=2, node_rank=rank, master_addr="10.1.2.3", master_port=29500)
        assert list(topo.ranks) == list(range(8 * rank, 8 * rank + 8))
        cmd = tp.msrun_command("msrun", topo, ["python", "-m", "mindspec", "batch"], "/tmp/logs", bind_core=True)
        assert cmd[:6] == ["msrun", "--worker_num=16", "--local_worker_num=8", "--master_addr=10.1.2.3",
                           "--master_port=29500", f"--node_rank={rank}"]
        assert "--bind_core=True" in cmd and cmd[-4:] == ["python", "-m", "mindspec", "batch"]
        assert "--cluster_time_out=600" in cmd  # machines started by hand join minutes apart
        assert "--tail_worker_log=16" in cmd  # a global rank on no node: msrun tails no rank's log
        args = _msrun_parses(cmd, monkeypatch)
        assert (args.worker_num, args.local_worker_num, args.node_rank, args.master_addr, args.master_port,
                args.bind_core) == (16, 8, rank, "10.1.2.3", 29500, True)


def test_topology_refuses_what_msrun_cannot_run():
    from mindspec import tp
    from mindspec.errors import MindspecError
    for kw, needle in [(dict(size=6, nodes=4, master_addr="a", master_port=2000), "do not split evenly"),
                       (dict(size=4, nodes=2), "needs --master-addr"),
                       (dict(size=4, nodes=2, node_rank=2, master_addr="a", master_port=2000), "--node-rank must be"),
                       (dict(size=4, nodes=2, master_addr="a", master_port=80), "--master-port must be")]:
        with pytest.raises(MindspecError, match=needle):
            tp.topology(**kw)


def test_launcher_env_sets_hccl_timeouts_and_drops_other_jobs_identity():
    from mindspec import tp
    user = {"PATH": "/usr/bin", "MS_ROLE": "MS_WORKER", "RANK_ID": "3", "DEVICE_ID": "5", "HOME": "/h"}
    env = tp.launcher_env(user, "/venv/bin", "/tmp/job", 42)
    assert env["PATH"] == "/venv/bin" + os.pathsep + "/usr/bin" and env["HOME"] == "/h"
    assert env[tp.ENV_JOB] == "/tmp/job" and env[tp.ENV_LAUNCHER] == "42" and env[tp.ENV_NODES] == "0/1"
    two = tp.topology(4, nodes=2, node_rank=1, master_addr="10.1.2.3", master_port=29500)
    assert tp.launcher_env(user, "/b", "/j", 1, two)[tp.ENV_NODES] == "1/2"  # node 1's msrun scheduler steps aside
    assert not {"MS_ROLE", "RANK_ID", "DEVICE_ID"} & set(env)
    assert env["HCCL_CONNECT_TIMEOUT"] == env["HCCL_EXEC_TIMEOUT"] == "1800"  # a 70B load outlasts CANN's 120 s
    assert tp.launcher_env(dict(user, HCCL_CONNECT_TIMEOUT="3600"), "/b", "/j", 1)["HCCL_CONNECT_TIMEOUT"] == "3600"
    # ranks learn that every rank joined by their heartbeat, every 3-5 s by MindSpore's default: 1 s starts a job
    # ~2 s sooner (measured on a 2-core CPU: a no-op TP=2 job 11.4 s -> 9.5 s, mean of 4). A user's bound is kept,
    # and the other not set (a lower bound above the upper one is undefined in MindSpore's draw)
    assert env["MS_RETRY_INTERVAL_LOWER"] == env["MS_RETRY_INTERVAL_UPPER"] == "1"
    own = tp.launcher_env(dict(user, MS_RETRY_INTERVAL_UPPER="5"), "/b", "/j", 1)
    assert own["MS_RETRY_INTERVAL_UPPER"] == "5" and "MS_RETRY_INTERVAL_LOWER" not in own


def test_each_ranks_draft_follows_its_rank_not_an_inherited_device():
    """Ascend env scripts often export ASCEND_DEVICE_ID=0: every rank's draft would share NPU 0."""
    from mindspec import tp
    assert tp.rank_device_env({"DEVICE_ID": "3", "ASCEND_DEVICE_ID": "0"}) == {"ASCEND_DEVICE_ID": "3"}
    assert tp.rank_device_env({"ASCEND_DEVICE_ID": "0"}) == {}  # not under msrun: left alone


def test_each_data_parallel_replica_gets_its_own_devices():
    from mindspec.dp import replica_env, replicas_here
    from mindspec.errors import MindspecError
    from mindspec.request import SEED_ENV
    user = {"ASCEND_DEVICE_ID": "0", "DEVICE_ID": "0", "RANK_ID": "1", "PATH": "/p"}
    one = [replica_env(user, i, 1, 100 + i) for i in range(2)]  # DP=2 x TP=1: no msrun, device 0 of its own
    assert [e["ASCEND_RT_VISIBLE_DEVICES"] for e in one] == ["0", "1"]
    assert all(e["DEVICE_ID"] == e["ASCEND_DEVICE_ID"] == "0" and "RANK_ID" not in e for e in one)
    assert [e[SEED_ENV] for e in one] == ["100", "101"] and one[0]["PATH"] == "/p"
    two = [replica_env(dict(user, ASCEND_RT_VISIBLE_DEVICES="4,5,6,7"), i, 2, 1) for i in range(2)]  # DP=2 x TP=2
    assert [e["ASCEND_RT_VISIBLE_DEVICES"] for e in two] == ["4,5", "6,7"]
    assert all("ASCEND_DEVICE_ID" not in e and "DEVICE_ID" not in e for e in two)  # msrun's DEVICE_ID per rank
    with pytest.raises(MindspecError, match="too few"):
        replica_env(dict(user, ASCEND_RT_VISIBLE_DEVICES="0,1,2"), 1, 2, 1)
    assert list(replicas_here(4, nodes=2, node_rank=1)) == [2, 3] and list(replicas_here(2)) == [0, 1]
    with pytest.raises(MindspecError, match="does not split over --nodes 2"):
        replicas_here(3, nodes=2)


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))


def test_an_interrupted_job_leaves_no_job_directory_and_too_many_ranks_start_none(pair, tmp_path):
    """The TP server prober's: every Ctrl-C or SIGTERM of a --tp job left its $TMPDIR/mindspec-tp-* (rank
    files, logs) behind, though only a failed job's logs are kept (its error line names them); and
    `--tp 1000` started msrun's 1000 ranks (~400 MB each) before each refused the 6-head target. An MS_ROLE
    left exported in the user's shell (the env prober's) made the command a rank: a MindSpore traceback."""
    import signal
    import subprocess
    target, draft = pair[:2]
    # a second Ctrl-C 10-50 ms after the first (the signals prober's) left the directory too; so did a
    # generate's ranks their temporary directory for MindSpore's compile dumps (mindspec.omdir), killed
    (tmp_path / "in.jsonl").write_text("".join(f'{{"prompt_ids": [5, {i}], "max_new_tokens": 60}}\n' for i in range(40)))
    out = tmp_path / "out.jsonl"
    extra = {"serve": ["--port", "0"], "generate": [],
             "batch": ["--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--max-seq", "128"]}
    for cmd, sigs, role in (("serve", [signal.SIGINT], "MS_WORKER"), ("serve", [signal.SIGTERM], None),
                            ("generate", [signal.SIGINT, signal.SIGINT], None), ("batch", [signal.SIGTERM], None)):
        tmp = tmp_path / "-".join([cmd] + [s.name for s in sigs])
        tmp.mkdir()
        p = subprocess.Popen([sys.executable, "-m", "mindspec", cmd, "--target", target, "--draft", draft,
                              "--tp", "2"] + extra[cmd],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, TMPDIR=str(tmp), **({"MS_ROLE": role} if role else {})))
        deadline = time.time() + 240
        while time.time() < deadline and not list(tmp.glob("mindspec-tp-*/rank1.pid")):
            assert p.poll() is None, p.stderr.read()
            time.sleep(0.2)
        for sig in sigs:
            p.send_signal(sig)
            time.sleep(0.02)
        assert p.wait(120) == 130, p.stderr.read()
        assert list(tmp.iterdir()) == [], list(tmp.iterdir())
        if cmd == "batch":  # (a TP probe's: nothing at all was said; at TP=1 the summary)
            assert p.stderr.read().splitlines()[-1:] == [f"mindspec batch: stopped by a signal; what was written to "
                                                         f"{out} is kept: run the same command again to resume"]
    p = subprocess.run([sys.executable, "-m", "mindspec", "generate", "--target", target, "--draft", draft,
                        "--tp", "7", "--prompt-ids", "5"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TMPDIR=str(tmp_path), MS_ROLE="MS_SCHED"))
    assert p.returncode == 2 and p.stderr == ("mindspec: error: --tp 7 exceeds the target's 6 attention heads "
                                              "(a rank holds one at least)\n"), p.stderr


def test_a_master_port_in_use_is_refused_before_msrun_starts(pair, tmp_path):
    """The TP prober's: another program listening on --master-port made msrun's scheduler fail at once, and the
    launcher waited out the cluster time-out (2 min 13 s) to say "a rank (pid N) of 2 died", the port unnamed."""
    import socket
    import subprocess
    target, draft = pair[:2]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "mindspec", "generate", "--target", target, "--draft", draft,
                            "--tp", "2", "--master-port", str(port), "--prompt-ids", "5"], capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert p.returncode == 2 and p.stderr == (f"mindspec: error: --master-port {port} is in use on 127.0.0.1: give "
                                              "another --master-port (on one machine, none: a free one is picked)\n"), \
        p.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_a_tp_job_whose_stdout_fails_says_so_as_at_tp1(pair, tmp_path):
    """The TP prober's: stdout on /dev/full gave a 35-line traceback (the launcher's copy of rank 0's output
    raised inside its own clean-up) and left the job directory; TP=1 says one line, exit 2."""
    import subprocess
    target, draft = pair[:2]
    with open("/dev/full", "wb") as full:
        p = subprocess.run([sys.executable, "-m", "mindspec", "generate", "--target", target, "--draft", draft,
                            "--tp", "2", "--prompt-ids", "5,6,7", "--max-new-tokens", "8"], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=300, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert p.returncode == 2 and p.stderr == "mindspec: error: cannot write to stdout: No space left on device\n", \
        p.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_rank0s_output_copied_to_a_text_stream_keeps_a_character_split_between_reads(tmp_path):
    """A launcher called in-process with a text stream for stdout (a notebook's has no .buffer) decoded each read on
    its own: a character whose bytes two reads split came out as two U+FFFD."""
    from mindspec.tp import _Tail
    path, out = tmp_path / "rank0.out", io.StringIO()
    tail = _Tail(str(path), out)
    with open(path, "wb") as f:
        for piece in (b"caf", "é".encode()[:1], "é".encode()[1:] + b" ok"):
            f.write(piece)
            f.flush()
            tail.pump()
    with open(path, "ab") as f:
        f.write("é".encode()[:1])  # a character its rank never finished
    tail.close()
    assert out.getvalue() == "café ok\ufffd"


def test_a_rank_that_stopped_answering_is_named_not_the_one_msrun_then_ended(tmp_path):
    """A TP probe's: rank 1 stopped (SIGSTOP) was told as "rank 0 of 2 died (killed by signal 15)", the exit
    msrun's scheduler logs first once it ends the ranks left; its own line names the rank that timed out."""
    from mindspec.tp import _who_died
    (tmp_path / "rank0.pid").write_text("3387")
    (tmp_path / "rank1.pid").write_text("3388")
    log = tmp_path / "msrun.log"
    log.write_text(
        "[ERROR] ME(3381): Worker process 3387 exit with exception. Error code: -15.\n"
        "[ERROR] ME(3381): Scheduler process 3386 exit with exception.\n"
        "RuntimeError: The total number of timed out node is 1. Timed out node list is: [const vector]{1}, worker 1 "
        "is the first one timed out, please check its log.\n")
    assert _who_died(str(tmp_path), str(log), [0, 1], {}, 2) == \
        "tensor-parallel rank 1 of 2 stopped answering (stuck, stopped, or its host gone)"
    log.write_text("[ERROR] ME(3381): Worker process 3388 exit with exception. Error code: -9.\n")
    assert _who_died(str(tmp_path), str(log), [0, 1], {}, 2) == "tensor-parallel rank 1 of 2 died (killed by signal 9)"
    # rank 0 raised in a collective that gave up on rank 1: its own exit (code 1) is logged first, and is not it
    log.write_text("[ERROR] ME(3381): Worker process 3387 exit with exception. Error code: 1.\n"
                   "[ERROR] ME(3381): Worker process 3388 exit with exception. Error code: -9.\n")
    assert _who_died(str(tmp_path), str(log), [0, 1], {0: 1}, 2, {0: "RuntimeError: x"}) == \
        "tensor-parallel rank 1 of 2 died (killed by signal 9)"
    # ... and raised alone, every other rank ended well: its own error (a bug; the traceback in its log)
    log.write_text("[ERROR] ME(3381): Worker process 3387 exit with exception. Error code: 1.\n")
    assert _who_died(str(tmp_path), str(log), [0, 1], {0: 1, 1: 0}, 2, {0: "RuntimeError: x"}) == \
        "tensor-parallel rank 0 of 2 failed: RuntimeError: x (its log has the traceback)"


def test_each_data_parallel_replica_runs_its_msrun_on_its_own_master_port():
    """A TP probe's: `--dp 2 --tp 2 --master-port P` was accepted and ignored (each replica a free port), so an
    operator could not keep msrun inside a firewall's range. Replica i now uses P + i."""
    from mindspec.cli import _topology, parser
    from mindspec.errors import MindspecError
    argv = ["batch", "--input", "in.jsonl", "--output", "out.jsonl", "--dp", "2", "--tp", "2"]
    for replica, port in ((0, 20000), (1, 20001)):
        args = parser().parse_args(argv + ["--master-port", "20000", "--dp-replica", str(replica)])
        assert _topology(args).master_port == port
    assert _topology(parser().parse_args(argv + ["--dp-replica", "1"])).master_port == 0  # (a free one)
    with pytest.raises(MindspecError, match=r"^--master-port must be in 1024\.\.65534 with --dp 2"):
        _topology(parser().parse_args(argv + ["--master-port", "65535", "--dp-replica", "0"]))


def test_a_tp_batch_refuses_an_output_in_use_or_a_missing_input_before_its_ranks_start(pair, tmp_path):
    """A TP probe's: under --tp these came after every rank had started MindSpore (16-24 s); batch.md says a
    second job on the same output exits 2 at once."""
    import fcntl
    import subprocess
    target, draft = pair[:2]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt_ids": [5]}\n')
    out.write_text("")
    cmd = [sys.executable, "-m", "mindspec", "batch", "--target", target, "--draft", draft, "--tp", "2"]
    with open(out) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        p = subprocess.run(cmd + ["--input", str(inp), "--output", str(out)], capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert p.returncode == 2 and p.stderr.startswith(f"mindspec: error: output {out} is in use by another job (pid "), \
        p.stderr
    p = subprocess.run(cmd + ["--input", str(tmp_path / "none.jsonl"), "--output", str(out)], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert (p.returncode, p.stderr) == (2, f"mindspec: error: cannot read input {tmp_path / 'none.jsonl'}: No such file "
                                           "or directory\n")
    assert not list(tmp_path.glob("mindspec-tp-*"))  # (no msrun job was started)
