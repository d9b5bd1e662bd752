"""Scratch directories named with their process's pid: a command killed outright (SIGKILL, the OOM killer, a
closed terminal's SIGHUP) cannot remove its own, so the next command making one removes those of processes
that are gone."""
import os
import re
import shutil
import tempfile


def mkdtemp(prefix, dir=None, only_empty=False):
    """tempfile.mkdtemp(prefix + "<pid>-") in dir (None: $TMPDIR), after removing the dead processes' (only
    the empty ones with only_empty: a directory a user may still want to read)."""
    dir = dir or tempfile.gettempdir()
    sweep(dir, prefix, only_empty)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=dir)


def sweep(dir, prefix, only_empty=False):
    try:
        names = os.listdir(dir)
    except OSError:
        return
    name = re.compile(re.escape(prefix) + r"(\d+)-")
    for n in names:
        m = name.match(n)
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
