"""Data-parallel batch jobs: `mindspec batch --dp D [--tp T]` (format, resume rules: docs/batch.md).

    launcher (the user's process): locks the output, starts D replicas, merges their parts
        replica i = `mindspec batch ... --dp-replica i`: input lines i, i+D, i+2D, ... -> OUTPUT.partIofD
            (at --tp T each replica is itself a tensor-parallel launcher with its own msrun)

A replica is an ordinary batch job over its share of the lines (mindspec.batch.run_batch with `part`):
its part file is a batch output of the same job (same records, fingerprint, lock, torn-line rule), so it
resumes on its own; ids the output already holds count as done. When every input id has a record in the
output or a part, the parts are appended to the output in input order (a result over errors, nothing the
output already holds) and removed: a merge cut short is simply merged again. Replicas die with their
launcher (PR_SET_PDEATHSIG; a tensor-parallel replica's ranks follow their own launcher, mindspec.tp).

Several machines (`--nodes N --node-rank R`, D a multiple of N): machine R runs replicas R*D/N .. (R+1)*D/N - 1
on its own devices; the parts meet on a shared file system, and the launcher that finds every part
complete merges (the others say so and exit 0), or `mindspec batch --merge` with the job's flags."""
import ctypes
import fcntl
import glob
import os
import random
import re
import signal
import subprocess
import sys
import time

from .batch import (Output, Tally, _key, _read_lines, _rows, check_asked, check_free, check_shared_input, held,
                    part_path, read_records)
from .device import check_tp, detect_device, narrowed, visible_list
from .errors import MindspecError
from .request import SEED_ENV
from .tp import IDENTITY

REPLICA_FLAG = "--dp-replica"


def replicas_here(dp, nodes=1, node_rank=0):
    """The replicas this machine runs: every machine runs dp / nodes whole replicas."""
    if dp % nodes:
        raise MindspecError(f"--dp {dp} does not split over --nodes {nodes}: give a multiple of the nodes (each node "
                            f"runs whole replicas), or --dp 1 with a --tp that spans the nodes")
    per = dp // nodes
    return range(node_rank * per, (node_rank + 1) * per)


def replica_env(env, local_index, tp, seed_base):
    """Replica `local_index` (on this machine) of `tp` devices: the local_index-th group of tp NPUs of the
    visible ones (the user's ASCEND_RT_VISIBLE_DEVICES, else 0, 1, ...), which it sees as 0..tp-1 (so msrun's
    per-rank DEVICE_ID and the draft's ASCEND_DEVICE_ID stay local ranks); its own seed base, so sampled
    lines without a seed do not share random streams across replicas."""
    ids = visible_list(env)
    ids = [str(i) for i in range((local_index + 1) * tp)] if ids is None else ids
    mine = ids[local_index * tp:(local_index + 1) * tp]
    if len(mine) < tp:
        raise MindspecError(f"ASCEND_RT_VISIBLE_DEVICES={env.get('ASCEND_RT_VISIBLE_DEVICES')} has {len(ids)} "
                            f"devices: too few for replica {local_index + 1} of {tp} devices on this node")
    out = {k: v for k, v in env.items() if k not in IDENTITY}
    out[SEED_ENV] = str(seed_base)
    out.update(narrowed(mine, tp))  # (tp > 1: each rank sets its own device, mindspec.tp.rank_device_env)
    return {k: v for k, v in out.items() if v is not None}


def replica_command(argv, i):
    return [sys.executable, "-m", "mindspec"] + list(argv) + [REPLICA_FLAG, str(i)]


# ---- parts and the merge ----

def parts_found(output_path):
    """{d: [paths]} of the part files beside the output."""
    found = {}
    for path in glob.glob(glob.escape(output_path) + ".part*of*"):
        m = re.fullmatch(r"\.part(\d+)of(\d+)", path[len(output_path):])
        if m:
            found.setdefault(int(m[2]), []).append(path)
    return found


def check_parts(output_path, dp):
    """Parts of a run with another --dp would hold lines this run also gives out: refuse."""
    other = sorted(d for d in parts_found(output_path) if d != dp)
    if other:
        check_free(output_path)  # (a --dp job still writing them: in use, not to be finished or merged)
        raise MindspecError(f"{output_path} has unmerged parts of a --dp {other[0]} run: finish it with "
                            f"--dp {other[0]}, or merge them with --merge")


def _collect(output, rows, d):
    """{id key: (first result record or None, [error records])} of the d parts. Refuses a line edited since the
    output or a part got its result: a merge would give it the old one (a line inserted above moves the lines
    below to other replicas' shares)."""
    output.check_asked(rows)
    got = {}
    for i in range(d):
        path = part_path(output.path, i, d)
        recs, _, _, asked = read_records(path, output.job)
        check_asked(asked, rows, output.input_path, path)
        for rec in recs:
            res, errs = got.get(_key(rec["id"]), (None, []))
            if "error" in rec:
                errs.append(rec)
            elif res is None:
                res = rec
            got[_key(rec["id"])] = (res, errs)
    return got


def _body(rec):
    return {k: v for k, v in rec.items() if k not in ("mindspec_batch", "job", "id")}


def unmerged(output, rows, d):
    """(the d parts' records by id, the number of input ids with no record in the output or a part). A line
    edited since its result was written is refused here."""
    got = _collect(output, rows, d)
    return got, sum(_key(r.rid) not in got and _key(r.rid) not in output.done and _key(r.rid) not in output.errors
                    for r in rows)


def merge(output, rows, d, got):
    """Append to the (open, locked) output, in input order, each id's record from the d parts (got: unmerged's)
    unless the output has it, then remove the parts. Running again after a cut-short merge writes nothing
    twice."""
    for row in rows:
        k = _key(row.rid)
        res, errs = got.get(k, (None, []))
        if k in output.done:
            continue
        if res is not None:
            output.put(row._replace(asked=res.get("request")), _body(res))  # its own request hash, as the part holds
            output.done.add(k)
        for rec in ([] if res is not None else errs):
            output.put(row, _body(rec))  # an error already in the output in those words is not written again
            output.errors.setdefault(k, set()).add(rec["error"])
    if output.fd is not None:
        os.fsync(output.fd)
    for path in parts_found(output.path).get(d, []):
        os.unlink(path)


def merge_command(input_path, output_path, job):
    """`mindspec batch --merge`: merge the parts found beside the output (of one --dp run)."""
    found = parts_found(output_path)
    if len(found) != 1:
        raise MindspecError(f"no part files beside {output_path} to merge" if not found else
                            f"{output_path} has parts of several --dp runs ({', '.join(map(str, sorted(found)))})")
    (d,) = found
    rows = _rows(_read_lines(input_path), input_path)
    out, ok = Output(output_path, job, input_path), False
    try:
        code, ok = _finish(out, rows, d), True
        return code
    finally:
        out.close(failed=not ok)  # an output this created and left empty is removed


def _running(paths):
    """The first part whose lock a running replica holds (on another machine, or a job started by hand)."""
    return next((path for path in paths if held(path, fcntl.LOCK_SH)[0]), None)


def _finish(out, rows, d, node=False):
    """Merge and print the summary of the whole output; the job's exit code. Lines with no record yet, or
    a part still being written: an error, unless other machines may still be running their replicas."""
    busy = _running(parts_found(out.path).get(d, []))
    if busy and not node:
        raise MindspecError(f"{busy} is being written by a running replica; merge once it has ended")
    got, left = ({}, len(rows)) if busy else unmerged(out, rows, d)
    if left and node:
        print(f"mindspec batch: this node's replicas are done; {left} of {len(rows)} lines are left to other nodes: "
              f"the last to finish merges (or run the job with --merge)", file=sys.stderr, flush=True)
        return 0
    if left:
        raise MindspecError(f"{left} of {len(rows)} lines have no record in {out.path} or its --dp {d} parts yet: "
                            f"run the job to finish them")
    merged = False
    try:
        merge(out, rows, d, got)
        merged = True
    finally:  # (a write that failed, a full disk: what the output holds, then the error, as without --dp)
        tally = Tally(rows, out.done, out.errors)
        n, done, failed = len(rows), tally.count("done"), tally.count("failed")
        print(f"mindspec batch: {n} lines: {done} done, {failed} failed, {n - done - failed} left -> {out.path} "
              + (f"(merged from {d} parts)" if merged else f"(a merge of {d} parts cut short; they are kept)"),
              file=sys.stderr, flush=True)
    return tally.exit_code()


# ---- the launcher ----

def _die_with_parent(parent):
    """In the child before exec: SIGKILL when the launcher dies, even by SIGKILL (it cannot clean up)."""
    def set_it():
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before that
            os._exit(137)
    return set_it


def _start(argv, here, tp):
    envs = [replica_env(os.environ, local, tp, random.randrange(2 ** 31)) for local in range(len(here))]  # all, or none
    return {i: subprocess.Popen(replica_command(argv, i), env=env, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent(os.getpid()))
            for i, env in zip(here, envs)}


def _wait(procs):
    """{replica: exit code}; Ctrl-C/SIGTERM: the replicas are stopped (they print their summaries) and
    KeyboardInterrupt goes on."""
    try:
        while any(p.poll() is None for p in procs.values()):
            time.sleep(0.1)
    except KeyboardInterrupt:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.send_signal(signal.SIGCONT)  # (a stopped replica was killed after 60 s, unsaid)
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        raise
    return {i: p.returncode for i, p in procs.items()}


KEPT = "its part is kept: run the same command again to finish what is missing"


def _failure(rcs, dp):
    """One line about the worst replica, or None when all ended with 0 or 1 (1: some lines failed)."""
    for i, rc in sorted(rcs.items()):
        if rc < 0:
            return 2, f"mindspec: error: data-parallel replica {i} of {dp} died (killed by signal {-rc}); {KEPT}"
    for i, rc in sorted(rcs.items()):
        if rc == 130:  # (its summary says what it left, not that it was told to stop)
            return 130, (f"mindspec: error: data-parallel replica {i} of {dp} was stopped by a signal "
                         f"(exit code 130); {KEPT}")
    bad = [rc for rc in rcs.values() if rc not in (0, 1)]
    return (max(bad), None) if bad else None  # a replica that ended with 2 printed its own line


def _unfinished(rcs, rows, output_path, job, dp):
    """One line about the first replica that ended well (0 or 1) but left lines of its share without a record:
    a --tp replica whose rank died exits 1 like one whose lines failed (its launcher printed the rank's line).
    The parts are read before the output: a part that another node merged (and removed) is then in it."""
    have = {}
    for i in rcs:
        _, done, errors, _ = read_records(part_path(output_path, i, dp), job)
        have[i] = done | set(errors)
    _, done, errors, _ = read_records(output_path, job)
    for i, rc in sorted(rcs.items()):
        mine, got = rows[i::dp], have[i] | done | set(errors)
        left = sum(_key(r.rid) not in got for r in mine)
        if left:
            return 2, (f"mindspec: error: data-parallel replica {i} of {dp} ended (exit code {rc}) with {left} of "
                       f"its {len(mine)} lines unfinished; {KEPT}")
    return None


def launch(argv, input_path, output_path, job, dp, tp=1, nodes=1, node_rank=0):
    """The data-parallel launcher; returns the job's exit code."""
    here = replicas_here(dp, nodes, node_rank)
    check_shared_input(input_path, "--dp", "replica")
    asked = f"--dp {dp}" + (f" over --nodes {nodes} ({len(here)} replicas on this machine)" if nodes > 1 else "")
    check_tp(tp, detect_device(), replicas=len(here), dp=asked)  # (replicas past the NPUs saw none: ran on the host)
    rows = _rows(_read_lines(input_path), input_path)  # a bad input stops here, before any replica starts
    check_parts(output_path, dp)
    out = Output(output_path, job, input_path, wait=nodes > 1)  # checked, and locked from here on (one machine)
    try:
        _collect(out, rows, dp)  # its lines checked against the parts too: a re-run's replicas would keep theirs
    except MindspecError:
        out.close(failed=True)  # (an output this made is not left behind, as without --dp)
        raise
    if nodes > 1:
        out.close()  # several machines share the output: each locks it only to check it and to merge
    ok = False
    try:
        rcs = _wait(_start(argv, here, tp))
        failed = _failure(rcs, dp) or _unfinished(rcs, rows, output_path, job, dp)
        if failed:
            if failed[1]:
                print(failed[1], file=sys.stderr, flush=True)
            return failed[0]
        if nodes > 1:
            out = Output(output_path, job, input_path, wait=True)
        ok = True
        return _finish(out, rows, dp, node=nodes > 1)
    finally:
        out.close(failed=not ok)
