"""Run a mindspec command with its target split over N ranks (tensor parallelism), launched by msrun.

    mindspec generate --tp 2 ...  ->  launch(argv, 2)
        ->  msrun --worker_num=2 ... python -m mindspec generate --tp 2 ...  (each rank: run_worker -> the command)

Launcher (the user's process): `launch` re-executes the command under MindSpore's own launcher on
127.0.0.1 with the venv's bin first on PATH (msrun starts a bare `python`), streams rank 0's stdout and
stderr to the user's, and returns rank 0's exit code. A rank that dies (crash, kill, OOM) ends the
whole job: msrun notices within a second and kills the others; the launcher prints one line naming
the rank and its log, and returns non-zero; a rank that failed with a one-line error (`fail`) is
named with that error, and the job exits 2. Nothing waits on a dead rank for long: msrun's
cluster time-out bounds the start-up, and a grace period bounds the shutdown after a failure.
A Ctrl-C or SIGTERM stops every rank at once (exit 130), except a server serving (`stoppable`): rank 0
gets it from its machine's launcher and ends the job as at TP=1 (its requests answered 503, the other ranks
told, exit 0).

Several machines (`--nodes N --node-rank R --master-addr A --master-port P`, each machine running the
same command): `topology` checks the flags and `msrun_command` gives each machine its share of the ranks
(`--local_worker_num`, `--node_rank`, node 0's address), so rank 0 is on node 0. `launcher_env` hands
msrun the venv's PATH and HCCL time-outs long enough for a 70B load; each rank's draft follows its own
device (`rank_device_env`). All pure functions, tested as such.

Worker (each rank): `run_worker` initialises collectives (graphs.tp.init_tp: MindSpore's CPU
collectives on CPU, HCCL on Ascend), after which the target graphs split themselves by tp_size() /
tp_rank(). Rank 0's stdout/stderr go to files the launcher streams; what other ranks print stays in
their logs in msrun's log_dir (kept, and named in the error, when the job fails).

The draft is replicated: every rank runs the same ONNX draft on the same committed tokens, so every rank
proposes the same tokens and draws the same seeded uniforms, and the shared loop (generate, serve,
batch) runs unchanged on every rank in lock step. The only per-step communication is the target's own
collectives; there is no broadcast of drafts, q-probabilities or results. Why not "rank 0 drafts and
broadcasts": (1) it would put a broadcast (K ids, for sampling also K x V q-probabilities) on the
critical path of every step while the other ranks sit idle waiting for it, so it saves no latency; (2)
every loop (generate/serve/batch, greedy and sampling) would need a follower mode on ranks > 0 that
mirrors rank 0's decisions. The cost of replication is the draft's memory (weights + its KV cache) on
every device and N-fold draft compute that runs concurrently on separate devices; for the drafts worth
using (small: the draft/target cost ratio must stay well below 1, see `mindspec plan`) that is a
small fraction of a device. Identical proposals rely on ONNX Runtime being deterministic for the same
model, inputs, provider and thread count, which holds for its CPU kernels (tests/test_tp.py checks
TP=N speculative == TP=1 token for token); each decode step checks the tokens it verifies with one small
AllReduce (same_on_every_rank), so a host with another draft file or processor stops the request with one
error. Draft probabilities are not compared: a sampled acceptance they change shows a step later, as
positions that differ.
On a shared CPU the N drafts compete for cores, which the benchmark (tools/bench_tp.py) shows.

Library use: start your script under msrun (or `launch(args, n, script=path)`), call `init_worker()`
before `mindspec.load(...)`, and print only where `is_rank0()`.
"""
import codecs
import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import NamedTuple

from .errors import MindspecError, summary
from .stdout import StdoutError

ENV_JOB = "MINDSPEC_TP_JOB"  # the launcher's job directory: rank 0's stdout/stderr/exit code, pids
ENV_LAUNCHER = "MINDSPEC_TP_LAUNCHER"  # the launcher's pid: ranks (and msrun's scheduler) die with it
ENV_NODES = "MINDSPEC_TP_NODES"  # "R/N": this machine's --node-rank R of --nodes N
ENDED = "ended"  # in the job directory once the launcher stopped the job itself: its watchers then leave it be
STOPPABLE = "stoppable"  # in the job directory once rank 0 ends the job itself on a stop (a server serving)
STOP_GRACE = 30  # s: after a stop was handed to rank 0, how long the job may take to end itself
CLUSTER_TIMEOUT = 120  # s: msrun's cluster time-out (ranks that never join / stop answering)
NODES_TIMEOUT = 600  # s: the same over several machines, each started by hand (msrun's own default)
FAILURE_GRACE = 3  # s: after a rank died msrun kills the others at once, then waits for its scheduler: not for long
EXIT_GRACE = 1  # s: after every rank recorded its exit code, how long they may take to exit before we stop them
STRAY_GRACE = 30  # s: after rank 0 ended, how long the others may still run (in lock step they end with it)
# HCCL's time-outs (s; CANN's defaults: connect 120, exec 1800). The first collective (HCCL's link set-up)
# comes only after every rank has loaded its weights and compiled: a 70B load takes minutes, and a rank that
# compiles a graph the others already have makes them wait in a collective. A user's own values win.
HCCL_TIMEOUTS = {"HCCL_CONNECT_TIMEOUT": "1800", "HCCL_EXEC_TIMEOUT": "1800"}
# MindSpore's ranks learn that every rank joined from their heartbeat's answer, sent every 3-5 s by default: every
# 1 s starts a job ~2 s sooner (a no-op TP=2 job on 2 CPU cores: 11.4 s -> 9.5 s)
HEARTBEAT = {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}
IDENTITY = ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_NODE_ID", "RANK_ID", "DEVICE_ID",
            "RANK_SIZE")  # what msrun sets per job and rank: never inherited from another job


class Topology(NamedTuple):
    """Where one msrun job's ranks run: `size` ranks over `nodes` machines, this one being `node_rank`
    (each machine runs the same command with its own --node-rank)."""
    size: int
    nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port of this machine (one node only)

    @property
    def local(self):
        return self.size // self.nodes

    @property
    def ranks(self):
        """The global ranks on this machine: msrun numbers node_rank * local_worker_num + local rank."""
        return range(self.node_rank * self.local, (self.node_rank + 1) * self.local)


def check_node_rank(nodes, node_rank):
    """--node-rank against --nodes; not given (None): 0 on one machine, an error on several (every machine
    that forgot it ran as node 0)."""
    if node_rank is None and nodes > 1:
        raise MindspecError(f"--nodes {nodes} needs --node-rank: this machine's index, 0..{nodes - 1}")
    node_rank = node_rank or 0
    if nodes < 1 or not 0 <= node_rank < nodes:
        raise MindspecError(f"--node-rank must be in 0..{nodes - 1} for --nodes {nodes}, got {node_rank}")
    return node_rank


def topology(size, nodes=1, node_rank=0, master_addr=None, master_port=None):
    """A checked Topology of the command-line flags (--tp/--nodes/--node-rank/--master-addr/--master-port)."""
    size, nodes = int(size), int(nodes)
    check_node_rank(nodes, node_rank)
    if size % nodes:
        raise MindspecError(f"{size} ranks do not split evenly over --nodes {nodes}: every node runs the same number")
    if master_port is not None and not 1024 <= master_port <= 65535:
        raise MindspecError(f"--master-port must be in 1024..65535, got {master_port}")
    if nodes > 1 and (not master_addr or master_port is None):
        raise MindspecError("--nodes > 1 needs --master-addr (node 0's address, reachable from every node) and "
                            "--master-port, the same on every node")
    return Topology(size, nodes, node_rank, master_addr or "127.0.0.1", master_port or 0)


def msrun_command(msrun, topo, task, log_dir, timeout=CLUSTER_TIMEOUT, bind_core=False):
    """msrun's command line for this machine's share of `topo` running `task` (a list)."""
    cmd = [msrun, f"--worker_num={topo.size}", f"--local_worker_num={topo.local}",
           f"--master_addr={topo.master_addr}", f"--master_port={topo.master_port}"]
    if topo.nodes > 1:  # fixed rank ids (node_rank * local + i), so rank 0, the writer, is on node 0
        cmd.append(f"--node_rank={topo.node_rank}")
    timeout = timeout if topo.nodes == 1 else max(timeout, NODES_TIMEOUT)
    cmd += ["--join=True", f"--cluster_time_out={int(timeout)}", f"--log_dir={log_dir}",
            f"--tail_worker_log={topo.size}"]  # msrun compares it with global ranks: `size` is none of them
    if bind_core:  # each rank on the cores next to its NPU (msrun >= 2.5 works the map out itself)
        cmd.append("--bind_core=True")
    return cmd + list(task)


def launcher_env(env, bin_dir, job, launcher_pid, topo=None):
    """The environment msrun (and so every rank) gets: the venv first on PATH (msrun starts a bare `python`),
    the job's directory and launcher, this machine's place among the nodes, no other job's identity, HCCL
    time-outs for slow loads, a 1 s heartbeat."""
    topo = topo or Topology(1)
    out = {k: v for k, v in env.items() if k not in IDENTITY}
    out.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), **{ENV_JOB: job, ENV_LAUNCHER: str(launcher_pid),
                                                                   ENV_NODES: f"{topo.node_rank}/{topo.nodes}"})
    for k, v in HCCL_TIMEOUTS.items():
        out.setdefault(k, v)
    if not set(HEARTBEAT) & set(env):  # (a user's bound kept alone: a lower above the upper is undefined)
        out.update(HEARTBEAT)
    out.setdefault("MS_OM_PATH", os.path.join(job, "om"))  # a rank's compile dumps (mindspec.omdir): kept or
    return out                                             # removed with the job's logs, killed ranks or not


def rank_device_env(env):
    """This rank's device for the draft: msrun's DEVICE_ID (the rank's local index), overriding an inherited
    ASCEND_DEVICE_ID (Ascend env scripts often export 0: every rank's draft would share NPU 0)."""
    return {"ASCEND_DEVICE_ID": env["DEVICE_ID"]} if "DEVICE_ID" in env else {}


def is_worker():
    """True in a process msrun started for `launch` (a rank, or msrun's scheduler, which runs the same command).
    MS_ROLE alone is not enough: one left exported in the user's shell made every --tp command a rank."""
    from mindspec.graphs.tp import in_msrun
    return in_msrun() and bool(os.environ.get(ENV_JOB) and os.environ.get(ENV_LAUNCHER))


def is_rank0():
    from mindspec.graphs.tp import tp_rank
    return tp_rank() == 0


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port(topo):
    """Refuse a master port another program holds where this machine runs msrun's scheduler (node 0): msrun's
    scheduler fails at once, but the launcher would see it only at the cluster time-out."""
    if topo.node_rank:  # (a scheduler of another node steps aside: init_worker)
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a past job's TIME_WAIT is no holder)
        try:
            s.bind((topo.master_addr, topo.master_port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:  # (another error: an address of another machine, msrun's to judge)
                raise MindspecError(f"--master-port {topo.master_port} is in use on {topo.master_addr}: give "
                                    "another --master-port (on one machine, none: a free one is picked)") from None


def _msrun():
    bin_dir = os.path.dirname(sys.executable)
    path = os.path.join(bin_dir, "msrun")
    path = path if os.path.exists(path) else shutil.which("msrun")
    if not path:
        raise MindspecError("tensor parallelism needs MindSpore's `msrun` launcher, not found next to "
                            f"{sys.executable} or on PATH")
    return bin_dir, path


class _Tail:
    """Copy what a growing file gains to a stream (rank 0's output to the user's terminal). A failed write
    (the reader left, a full disk, a closed descriptor) is kept in `error`, not raised: nothing more is
    written, and the launcher stops the job where that output was its product (launch's `product`)."""

    def __init__(self, path, stream):
        self.path, self.stream, self.f, self.error = path, stream, None, None
        self.text = codecs.getincrementaldecoder("utf-8")("replace")  # (a text stream: a read may split a character)

    def pump(self):
        if self.error is not None:
            return
        if self.f is None:
            if not os.path.exists(self.path):
                return
            self.f = open(self.path, "rb")
        data = self.f.read()
        if data:
            try:
                out = getattr(self.stream, "buffer", None)
                if out is not None:
                    self.stream.flush()
                    out.write(data)
                    out.flush()
                else:
                    self.stream.write(self.text.decode(data))
                    self.stream.flush()
            except OSError as e:
                self.error = e

    def close(self):
        self.pump()
        rest = self.text.decode(b"", final=True)  # (a character its rank never finished)
        if rest and self.error is None:
            try:
                self.stream.write(rest)
                self.stream.flush()
            except OSError as e:
                self.error = e
        if self.f:
            self.f.close()


def _read(path, default=None):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return default


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def launch(argv, n, script=None, timeout=CLUSTER_TIMEOUT, log_dir=None, grace=FAILURE_GRACE,
           stdout=None, stderr=None, topo=None, device=None, stray=STRAY_GRACE, product=True, died=(1, ""),
           stopped=""):
    """Run `python -m mindspec ARGV` (or `python SCRIPT ARGV`) on n ranks under msrun; return rank 0's
    exit code, or non-zero with one line on stderr when a rank died. Rank 0's output is streamed to
    stdout/stderr (default: this process's). `topo` (several machines): this machine's share of the n
    ranks; on a machine without rank 0, 0 when its ranks all ended well. `device`: --device (None: auto).
    `stray`: seconds the other ranks may run on once rank 0 ended, before they are stopped and named.
    `product`: rank 0's stdout is what the command makes (generate's text): a failed write of it stops the
    job as at TP=1; otherwise (serve's "serving" line) what cannot be written is dropped. `died`: (exit code,
    words after the line) when a rank died or was left running (a batch job: 2, and that it resumes). `stopped`:
    the line said when a signal stopped the job (exit 130; a batch job's ranks end before rank 0's summary)."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    n = int(n)
    if n < 1:
        raise MindspecError(f"--tp must be >= 1, got {n}")
    topo = topo or Topology(n)
    if topo.master_port == 0:
        topo = topo._replace(master_port=free_port())
    check_port(topo)
    bin_dir, msrun = _msrun()
    job = tempfile.mkdtemp(prefix="mindspec-tp-")
    log_dir = log_dir or os.path.join(job, "logs")
    env = launcher_env(os.environ, bin_dir, job, os.getpid(), topo)
    task = ([script] if script else ["python", "-m", "mindspec"]) + list(argv)
    cmd = msrun_command(msrun, topo, task, log_dir, timeout, bind_core=_on_ascend(device))
    out, err = _Tail(os.path.join(job, "rank0.out"), stdout), _Tail(os.path.join(job, "rank0.err"), stderr)
    msrun_log = os.path.join(job, "msrun.log")
    with open(msrun_log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    failed_at, done_at, ended0, stuck, interrupted, seen = None, None, None, [], False, 0
    main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None  # SIGTERM = Ctrl-C

    def watch(until=float("inf")):
        """Follow the job until it ended or must be stopped (True), or `until` (time.monotonic()) came (False)."""
        nonlocal failed_at, done_at, ended0, stuck, seen
        while proc.poll() is None:
            if time.monotonic() > until:
                return False
            out.pump()
            err.pump()
            if out.error is not None and product:
                break  # the output is lost: stop, as a command at TP=1 stops at its failed write
            if failed_at is None and os.path.getsize(msrun_log) > seen:
                with open(msrun_log, "rb") as f:
                    f.seek(max(seen - 64, 0))
                    chunk = f.read()
                seen += len(chunk) - min(seen, 64)
                if b"exit with exception" in chunk:
                    failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace:
                break  # msrun is stuck stopping the job: stop it ourselves
            rcs = _rcs(job, topo.ranks)
            if done_at is None and len(rcs) == topo.local:
                done_at = time.monotonic()  # every rank finished its work and flushed its output
            if ended0 is None and 0 in rcs:
                ended0 = time.monotonic()
            if done_at is None and ended0 is not None and time.monotonic() - ended0 > stray:
                stuck = [r for r in topo.ranks if r not in rcs]
                break  # a rank stopped or stuck in a collective rank 0 gave up on: msrun would wait for ever
            if done_at is not None and (time.monotonic() - done_at > EXIT_GRACE or _all_exited(job, topo.ranks)):
                break  # MindSpore's finalize (ranks unregistering, the scheduler polling) takes ~7 s: skip it
            time.sleep(0.05)
        return True

    try:
        try:
            watch()
        except KeyboardInterrupt:
            # a server serving ends itself as at TP=1 (its requests answered 503, the other ranks told, exit 0):
            # the stop goes to rank 0 alone; else, or when the job does not end within STOP_GRACE, msrun stops it
            if not (_hand_stop(job) and watch(time.monotonic() + STOP_GRACE)):
                raise
    except KeyboardInterrupt:
        interrupted = True
        _wind_down(proc, main)
    finally:
        if main:
            signal.signal(signal.SIGTERM, old_term)
        _stop(proc, job)
        try:
            open(os.path.join(job, ENDED), "wb").close()  # kept (logs) or removed below, not by a watcher
        except OSError:
            pass
        out.close()
        err.close()
    if interrupted:  # (its logs are a failed job's only)
        shutil.rmtree(job, ignore_errors=True)
        if stopped:
            print(stopped, file=stderr, flush=True)
        return 130
    if out.error is not None and product:  # said as at TP=1 (cli._exit_code): a reader gone, quietly; else one line
        shutil.rmtree(job, ignore_errors=True)
        e = out.error
        raise e if isinstance(e, (BrokenPipeError, StdoutError)) else StdoutError(e.errno, e.strerror)
    rcs, crashed = _rcs(job, topo.ranks), _kept(job, topo.ranks, "crash")
    if not crashed and (rcs.get(0) or (len(rcs) == topo.local and set(rcs.values()) <= {0, 1})):
        # the job ended itself: rank 0's code (1: a batch job with failed lines; else an error it printed
        # itself), or on a node without rank 0 that of its own ranks, which ran in lock step with rank 0
        shutil.rmtree(job, ignore_errors=True)
        return rcs.get(0, max(rcs.values()))
    said = next(iter(_kept(job, topo.ranks, "error").items()), None)  # a one-line error: its words, its code
    what = f"tensor-parallel rank {said[0]} of {n}: {said[1]}" if said else \
        f"tensor-parallel rank {stuck[0]} of {n} was still running {stray:g} s after rank 0 ended" \
        if stuck and not crashed else _who_died(job, msrun_log, topo.ranks, rcs, n, crashed)
    print(f"mindspec: error: {what}; the job was stopped (logs: {log_dir}){'' if said else died[1]}", file=stderr,
          flush=True)
    return rcs.get(said[0], 2) if said else died[0]


def _hand_stop(job):
    """SIGTERM to rank 0 where it ends the job itself on a stop (STOPPABLE); returns whether it was sent."""
    if not os.path.exists(os.path.join(job, STOPPABLE)) or os.path.exists(os.path.join(job, "rank0.rc")):
        return False
    try:
        pid = int(_read(os.path.join(job, "rank0.pid"), "0"))
        if pid > 0:  # (never 0: that would be this process's group)
            os.kill(pid, signal.SIGTERM)
            return True
    except (ValueError, OSError):  # (gone)
        pass
    return False


def _on_ascend(device):
    from .device import detect_device
    return detect_device(device) == "Ascend"


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except OSError:
        pass


def _wind_down(proc, main):
    """A stopped job: msrun stops its workers on SIGINT, given 5 s. A second signal meanwhile skips the wait
    (_stop kills what is left); raised here, it left the job's directory behind."""
    hurry = []
    old = {s: signal.signal(s, lambda *_: hurry.append(True)) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        _signal_group(proc, signal.SIGINT)
        deadline = time.monotonic() + 5
        while proc.poll() is None and not hurry and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop(proc, job):
    """Make sure nothing of the job survives: msrun with its scheduler, and every rank."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
    for name in os.listdir(job):
        m = re.fullmatch(r"rank(\d+)\.pid", name)
        pid = m and int(_read(os.path.join(job, name), "0") or 0)
        if pid and _alive(pid):
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)  # msrun starts each rank in its own session
            except OSError:
                pass


def _rcs(job, ranks):
    """{rank: exit code} of the ranks (of this machine) that finished through worker_exit."""
    out = {}
    for r in ranks:
        rc = _read(os.path.join(job, f"rank{r}.rc"))
        if rc is not None:
            out[r] = int(rc)
    return out


def _all_exited(job, ranks):
    if len(_rcs(job, ranks)) < len(ranks):
        return False
    pids = [int(_read(os.path.join(job, f"rank{r}.pid"), "0") or 0) for r in ranks]
    return not any(pid and _alive(pid) for pid in pids)


def _kept(job, ranks, kind):
    """{rank: line} of the ranks that kept a line as rank<r>.<kind> (_keep), the first written first: "error" a
    one-line error (fail), "crash" an exception raised (run_worker)."""
    found = []
    for r in ranks:
        path = os.path.join(job, f"rank{r}.{kind}")
        line = _read(path)
        if line:
            found.append((os.path.getmtime(path), r, line))
    return {r: line for _, r, line in sorted(found)}


def _who_died(job, msrun_log, ranks, rcs, n, crashed=None):
    """The words for what ended the job. `crashed` ({rank: line}): the ranks that raised. A rank raising is
    most often a collective that gave up on another rank, so a rank that died or stopped answering is named
    before it (found: MindSpore's collective time-out, before msrun's heartbeat one, named nothing)."""
    crashed = crashed or {}
    pids = {}
    for r in ranks:
        pid = _read(os.path.join(job, f"rank{r}.pid"))
        if pid:
            pids[int(pid)] = r
    log = _read(msrun_log, "") or ""
    late = re.search(r"worker (\d+) is the first one timed out", log)  # (msrun's scheduler: it then ends the
    if late:  # others, whose exits come first in its log: a TP probe's stopped rank 1 was told as rank 0's death)
        return f"tensor-parallel rank {late[1]} of {n} stopped answering (stuck, stopped, or its host gone)"
    found = re.findall(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)", log)
    for pid, code in found:
        rank = pids.get(int(pid))
        code = int(code)
        if rank in crashed:
            continue  # (its exit code 1 is its own raise)
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        name = f"rank {rank}" if rank is not None else f"a rank (pid {pid})"
        return f"tensor-parallel {name} of {n} died ({how})"
    silent = [r for r in ranks if r not in rcs and r not in crashed]
    if crashed and silent:
        return f"tensor-parallel rank {silent[0]} of {n} stopped answering (stuck, stopped, or its host gone)"
    if crashed:
        rank, line = next(iter(crashed.items()))
        return f"tensor-parallel rank {rank} of {n} failed: {line} (its log has the traceback)"
    bad = [r for r, rc in sorted(rcs.items()) if rc]
    if bad:
        return f"tensor-parallel rank {bad[0]} of {n} exited with code {rcs[bad[0]]}"
    if len(pids) < len(ranks):
        return f"only {len(pids)} of {n} tensor-parallel ranks started" + (
            "" if len(ranks) == n else f" ({len(ranks)} on this node)")
    return f"the tensor-parallel job of {n} ranks failed"


# ---- worker side ----

def share(obj):
    """Rank 0's `obj` (picklable) on every rank; `obj` itself without TP.

    Every rank runs the same program on the same inputs, so almost everything is identical by
    construction. What is not must be shared: anything measured (the draft/target costs that dynamic K
    is chosen from), anything drawn from fresh entropy (a seed), anything only rank 0 receives (a
    server request). Costs two AllReduces (length, then bytes padded to a power of two >= 256)."""
    import pickle

    import numpy as np
    from mindspec.graphs.tp import all_reduce_sum, tp_rank, tp_size
    if tp_size() == 1:
        return obj
    data = pickle.dumps(obj) if tp_rank() == 0 else b""
    # the length in 12-bit digits, each exact in float32 (found: one float rounded a length past 2**24, 16 MiB,
    # and the pickle arrived cut: a server's queued requests, a batch job's finished ids)
    digits = all_reduce_sum(np.array([len(data) >> s & 0xFFF for s in range(0, 60, 12)], np.float32))
    n = sum(int(d) << s for d, s in zip(digits, range(0, 60, 12)))
    buf = np.zeros(max(256, 1 << (n - 1).bit_length()), np.float32)
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    got = all_reduce_sum(buf)[:n].astype(np.uint8).tobytes()
    return pickle.loads(got)  # noqa: S301 - bytes from rank 0 of this very job


def same_on_every_rank(what, *arrays, failed=None):
    """Raise MindspecError where the ranks hold different integer arrays: a checksum c < m per rank, one
    AllReduce of [c, c², failed] (all equal exactly when n·Σc² = (Σc)²; m as large as float32 keeps that
    exact, 2896 at TP=2, so a difference goes unseen once in m checks). The replicated draft is trusted to
    propose the same tokens on every rank; a rank whose draft file, onnxruntime build or processor differs
    would verify other tokens than the rest: every rank's output garbage, until the ranks' calls no longer
    match and one dies inside a collective. failed: the exception that kept this rank from making the
    arrays (its draft call raised: its host's memory, its device), raised here once every rank knows, the
    others raising a MindspecError: every rank ends the same rows and skips the same call, where one rank
    alone skipping it left the rest waiting in its collectives."""
    from mindspec.graphs.tp import all_reduce_sum, tp_rank, tp_size
    n = tp_size()
    if n == 1:  # (every decode step calls this)
        if failed is not None:
            raise failed
        return
    import math
    import zlib

    import numpy as np
    data = b"".join(np.ascontiguousarray(a, np.int64).tobytes() for a in arrays)
    c = zlib.crc32(data) % math.isqrt((2 ** 24 - 1) // n)
    s = all_reduce_sum(np.array([c, c * c, failed is not None], np.float32))  # n·c² < 2**24: exact in float32
    if failed is not None:  # (said here: a server's or batch job's other ranks answer nobody)
        sys.stderr.write(f"mindspec: tensor-parallel rank {tp_rank()}: the draft call for {what} raised: "
                         f"{summary(failed)}\n")
        raise failed
    if s[2]:
        raise MindspecError(f"the draft call for {what} raised on {int(s[2])} of the {n} tensor-parallel ranks "
                            "(that rank's log says why)")
    if int(s[0]) ** 2 != n * int(s[1]):
        raise MindspecError(f"the tensor-parallel ranks disagree on {what}: every host needs the same draft file, "
                            "onnxruntime build and kind of processor")


_WATCHER = """
import os, shutil, signal, sys, time
launcher, me, job, ended = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
while alive(me):
    if not alive(launcher):
        if job and not os.path.exists(os.path.join(job, ended)):  # else the launcher kept it (a failed job's logs)
            shutil.rmtree(job, ignore_errors=True)
        try:  # msrun, the process's parent, would wait on for its cluster time-out
            with open(f"/proc/{me}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{parent}/cmdline", "rb") as f:
                if b"msrun" in f.read():
                    os.kill(parent, signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
        os.kill(me, signal.SIGKILL)
        break
    time.sleep(0.5)
"""


def _die_with_launcher():
    """msrun starts each rank in its own session, so a launcher killed with SIGKILL (which cannot clean
    up) would leave the ranks running, writing output a resumed job writes again. A small watcher
    process per rank (and per msrun scheduler) ends it, its msrun and the job directory once the
    launcher is gone: a process, not a thread, since a rank may sit in a collective holding the GIL.
    A launcher that stopped the job itself marks the directory (ENDED): a failed job's logs, which its
    error line names, stay (a killed rank is a zombie until reaped: its watcher still sees it alive)."""
    pid = int(os.environ.get(ENV_LAUNCHER) or 0)
    if pid:
        job = os.environ.get(ENV_JOB, "")
        subprocess.Popen([sys.executable, "-c", _WATCHER, str(pid), str(os.getpid()), job, ENDED],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)


def init_worker(n=None):
    """In an msrun rank: initialise collectives (the scheduler process exits inside, when the job is
    done), check the group size, and send rank 0's stdout/stderr to the launcher (other ranks' stay in
    their msrun logs). Returns (size, rank)."""
    from mindspec.graphs.tp import init_tp
    node, nodes = map(int, os.environ.get(ENV_NODES, "0/1").split("/"))
    if os.environ.get("MS_ROLE") == "MS_SCHED" and node > 0:
        # msrun starts a scheduler wherever --master_addr is one of the machine's own addresses (msrun 2.10:
        # is_master = _is_local_ip(master_addr), no option against it): on separate machines node 0 alone;
        # with several "nodes" on one machine each would, racing node 0's for the port. Node 0's is the job's.
        raise SystemExit(0)
    _die_with_launcher()  # before init_tp: msrun's scheduler never returns from it
    os.environ.update(rank_device_env(os.environ))  # the replicated ONNX draft runs beside its target shard
    size, rank = init_tp()
    if n is not None and size != int(n):
        raise MindspecError(f"--tp {n} but msrun started {size} ranks")
    barrier()
    if nodes > 1:  # each machine's launcher drew its own seed base: rank 0's for all
        from .request import SEED_ENV
        base = share(os.environ.get(SEED_ENV))
        if base:
            os.environ[SEED_ENV] = base
    job = os.environ.get(ENV_JOB)
    if job:
        with open(os.path.join(job, f"rank{rank}.pid"), "w", encoding="utf-8") as f:
            f.write(str(os.getpid()))
        if rank == 0:  # at the descriptor level: MindSpore's graph compiler replaces sys.stderr
            for stream, fd, name in ((sys.stdout, 1, "rank0.out"), (sys.stderr, 2, "rank0.err")):
                stream.flush()
                _saved_fds[fd] = os.dup(fd)
                target = os.open(os.path.join(job, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(target, fd)
                os.close(target)
                stream.reconfigure(line_buffering=True)
    return size, rank


@contextlib.contextmanager
def stoppable():
    """Inside, rank 0 (of a launched job) ends the job itself on a stop: the launcher hands a Ctrl-C or SIGTERM
    to it alone (a server's worker loop, which tells the other ranks)."""
    job = os.environ.get(ENV_JOB)
    path = os.path.join(job, STOPPABLE) if job and is_worker() and is_rank0() else None
    if path:
        open(path, "w").close()
    try:
        yield
    finally:
        if path:
            with contextlib.suppress(OSError):
                os.remove(path)


def barrier():
    """Every rank gets here before any goes on. HCCL sets its links up at the first collective: run one
    while the ranks are in step (just started), not only after each has spent minutes loading weights."""
    import numpy as np
    from mindspec.graphs.tp import all_reduce_sum, tp_size
    got = int(all_reduce_sum(np.ones(1, np.float32))[0])
    if got != tp_size():
        raise MindspecError(f"a collective of {tp_size()} ranks counted {got}")


_saved_fds = {}  # rank 0's original stdout/stderr (msrun's log), restored when the command is done


def worker_exit(rc):
    """Record this rank's exit code for the launcher; returns rc."""
    from mindspec.graphs.tp import tp_rank
    job = os.environ.get(ENV_JOB)
    if job:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in _saved_fds.items():  # MindSpore's shutdown chatter goes to the log, not the user
            os.dup2(saved, fd)
        path = os.path.join(job, f"rank{tp_rank()}.rc")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(str(int(rc or 0)))
        os.replace(path + ".tmp", path)  # never read half-written
    return rc


def fail(e):
    """Report a one-line error (exit code 2). In a rank it is also kept for the launcher, which shows only
    rank 0's stderr: a rank whose host lacks a file or holds a broken one is named with its own words, not
    as a rank that "died" (found: "rank 1 of 2 died (exit code 1)", the cause in msrun's log only)."""
    print(f"mindspec: error: {e}", file=sys.stderr, flush=True)
    _keep("error", str(e).replace("\n", " "))
    return 2


def _keep(kind, line):
    """In a launched rank: `line` in the job directory as rank<r>.<kind>, for the launcher's last line."""
    job = os.environ.get(ENV_JOB)
    if job and is_worker():
        from mindspec.graphs.tp import tp_rank
        with contextlib.suppress(OSError), open(os.path.join(job, f"rank{tp_rank()}.{kind}"), "w",
                                                 encoding="utf-8") as f:  # (a full disk: the launcher says less)
            f.write(line)


def run_worker(fn, n=None):
    """One rank of a `launch`ed command: init_worker(n), then rc = fn() (a MindspecError: fail), recorded
    for the launcher. Any other exception's traceback goes to the rank's log (rank 0's stderr is the user's):
    most often a collective that failed because another rank died or stopped, which the launcher names in
    one line (found: ~90 lines of Python and C++ stack first)."""
    init_worker(n)
    crash = None
    try:
        rc = fn()
    except MindspecError as e:
        rc = fail(e)
    except Exception as e:  # noqa: BLE001 - logged below, the launcher's line says what ended the job
        rc, crash = 1, traceback.format_exc()
        _keep("crash", summary(e))
    rc = worker_exit(rc)
    if crash is not None:
        sys.stderr.write(crash)  # (after worker_exit: into msrun's log of this rank, under a launcher)
        sys.stderr.flush()
    return rc
