"""The compile cache's size bound: each (weights, cache size, slots, graphs...) key is an entry of its own
(a server's is 0.5-0.9 GB for the default model), so a user trying --max-seq or --max-batch values filled
the disk for good. Before a warm-up writes an entry, the least recently used others go until the rest fits
in $MINDSPEC_COMPILE_CACHE_GB (default 8). An entry in use (its lock held) or used in the last RECENT_S stays
(a tensor-parallel rank decides whether an entry is whole before it locks it, with the other ranks); lock
files stay, so two processes never lock different files of one entry. Also MindSpore's cache switch, set by
each compile for itself (compile_env)."""
import contextlib
import fcntl
import os
import shutil
import time

from mindspec.errors import env_number

ENV = "MINDSPEC_COMPILE_CACHE_GB"
DEFAULT_GB = 8.0
RECENT_S = 600
MIN_FREE = 256 << 20  # bytes a disk must have free for a warm-up to write an entry
FULL = 16 << 20  # free bytes left after a graph's save under which its files may have been cut short


@contextlib.contextmanager
def compile_env(path):
    """MindSpore's compile cache (read per compile) on at `path` for what compiles inside, off without one;
    the host's settings back after. A host's MS_COMPILER_CACHE_ENABLE=1 turned it on for every graph: a
    `python -c` script crashed on it (MindSpore opens sys.argv[0]), and it maps cached files to graphs by
    compile order (graphs/runner.py, TargetModel.warmup). `False`: untouched (nothing compiles)."""
    if path is False:
        yield
        return
    saved = {name: os.environ.get(name) for name in ("MS_COMPILER_CACHE_ENABLE", "MS_COMPILER_CACHE_PATH")}
    if path:
        os.environ.update(MS_COMPILER_CACHE_ENABLE="1", MS_COMPILER_CACHE_PATH=path)
    else:
        os.environ.pop("MS_COMPILER_CACHE_ENABLE", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def free_bytes(path):
    """Bytes free for this user on path's disk. A full disk made MindSpore log two [ERROR] lines per graph it
    could not save, and the entry cut short was marked whole: every later start logged more loading it."""
    return shutil.disk_usage(path).free


def budget():
    """Bytes the other entries may hold."""
    return int(env_number(ENV, DEFAULT_GB, lambda gb: 0 <= gb < float("inf"), "a number of gigabytes >= 0") * 1e9)


def evict(cache_dir, keep):
    """Remove the least recently used entries of cache_dir other than `keep` (a name) until the rest fit in
    budget(). Use = the last open of an entry's lock (each warm-up opens it for writing)."""
    limit = budget()
    entries = []
    for name in os.listdir(cache_dir):
        path = os.path.join(cache_dir, name)
        if name != keep and "." not in name and os.path.isdir(path) and not os.path.islink(path):
            try:
                used = os.stat(path + ".lock").st_mtime
            except OSError:
                used = 0.0  # (no lock: never used since)
            entries.append((used, path, _size(path)))
    total, now = sum(size for *_, size in entries), time.time()
    for used, path, size in sorted(entries):
        if total <= limit or used > now - RECENT_S:
            break
        if _remove_unused(path, used):
            total -= size


def _size(path):
    n = 0
    for top, _, files in os.walk(path):
        for f in files:
            try:
                n += os.lstat(os.path.join(top, f)).st_size
            except OSError:
                pass
    return n


def _remove_unused(path, used):
    """Remove an entry nobody holds (its lock taken without waiting) nor opened since `used`; whether it went."""
    try:
        with open(path + ".lock", "a") as lock:  # ("a": its mtime, the entry's last use, stays)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if used and os.fstat(lock.fileno()).st_mtime != used:  # (used 0: it had no lock, "a" made one)
                return False
            try:  # not whole first: a reader that comes meanwhile compiles afresh
                os.remove(path + ".whole")
            except FileNotFoundError:
                pass
            shutil.rmtree(path, ignore_errors=True)
        return True
    except OSError:  # BlockingIOError: in use
        return False
