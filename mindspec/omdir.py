"""Where MindSpore writes a failed compile's dump (rank_N/om/analyze_fail.ir, by default into the current
directory): a temporary directory ($MS_OM_PATH) a command removes at its end unless something was written
there. A stopped compile writes one too. A user's own MS_OM_PATH is left alone. A command killed (SIGKILL) leaves
its directory: the next command removes those of dead processes that stayed empty."""
import os
import re
import shutil
import tempfile

_NAME = re.compile(r"mindspec-om-(\d+)-")


class OmDir:
    def __init__(self):
        self.path = None  # (remove() may come first: a second signal before __enter__)

    def __enter__(self):
        self.path = None
        if "MS_OM_PATH" not in os.environ:
            _sweep(tempfile.gettempdir())
            self.path = os.environ["MS_OM_PATH"] = tempfile.mkdtemp(prefix=f"mindspec-om-{os.getpid()}-")
        return self

    def __exit__(self, *exc):
        self.remove()

    def remove(self):
        if self.path is not None:
            os.environ.pop("MS_OM_PATH", None)
            _remove_empty(self.path)
            self.path = None


def _remove_empty(path):
    if not any(files for _, _, files in os.walk(path)):
        shutil.rmtree(path, ignore_errors=True)


def _sweep(tmp):
    """Remove the empty directories of `tmp` that processes now gone left (one with a dump stays)."""
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _remove_empty(os.path.join(tmp, name))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # (another user's, or a name not ours)
        return True
    return True
