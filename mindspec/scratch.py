"""Scratch directories named with their host and their process's pid: a command killed outright (SIGKILL, the
OOM killer, a closed terminal's SIGHUP) cannot remove its own, so the next command making one on the same
host removes those of processes that are gone. (The host name keeps apart the machines, or the containers,
that share a directory: a pid is only known on its own.)"""
import os
import re
import shutil
import socket
import tempfile


def mkdtemp(prefix, dir=None, only_empty=False):
    """tempfile.mkdtemp(prefix + "<host>-<pid>-") in dir (None: $TMPDIR), after removing the dead processes'
    (only the empty ones with only_empty: a directory a user may still want to read)."""
    dir = dir or tempfile.gettempdir()
    sweep(dir, prefix, only_empty)
    return tempfile.mkdtemp(prefix=name(prefix), dir=dir)


def name(prefix, pid=None):
    """The start of a scratch directory's name: prefix, this host, the pid (default: this process's)."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())  # (no "-": it ends the name's part)
    return f"{prefix}{host}-{os.getpid() if pid is None else pid}-"


def sweep(dir, prefix, only_empty=False):
    try:
        names = os.listdir(dir)
    except OSError:
        return
    ours = re.compile(re.escape(name(prefix, "")[:-1]) + r"(\d+)-")
    for n in names:
        m = ours.match(n)
        if m and not _alive(int(m.group(1))):
            remove(os.path.join(dir, n), only_empty)


def remove(path, only_empty=False):
    if not (only_empty and any(files for _, _, files in os.walk(path))):
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # (another user's; a number no pid can be)
        return True
    return True


def makedirs(path):
    """os.makedirs(path, exist_ok=True); returns the directories it made (outermost first), for unmake: a
    failed command leaves no empty directories of its own behind."""
    made, p = [], os.path.abspath(path)
    while not os.path.lexists(p):
        made.append(p)
        p = os.path.dirname(p)
    try:
        os.makedirs(path, exist_ok=True)
    except BaseException:
        unmake(made[::-1])
        raise
    return made[::-1]


def unmake(made):
    """Remove what makedirs made, innermost first, as long as each is empty."""
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError:
            return
