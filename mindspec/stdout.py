"""The command line's stdout: a failed write (a full disk, an I/O error, a closed descriptor) is told apart
from any other file's OSError, so that a command says it in one line and exits 2 (cli._exit_code). A closed
stderr is /dev/null's."""
import errno
import io
import os
import sys


class StdoutError(OSError):
    """A write to stdout failed (a full disk, an I/O error, a closed descriptor): the command's output is lost."""


class _Stdout:
    """sys.stdout as main() runs a command: its failed writes raise StdoutError, told apart from any other
    file's OSError (a reader gone stays a BrokenPipeError), and a failure swallowed (argparse's --help drops
    it) is raised again by the next flush."""

    def __init__(self, f):
        self._f, self._failed = f, None

    def _call(self, fn, *a):
        try:
            return fn(*a)
        except BrokenPipeError:
            raise
        except OSError as e:
            self._failed = StdoutError(e.errno, e.strerror)
            raise self._failed from None

    def write(self, s):
        return self._call(self._f.write, s)

    def writelines(self, lines):
        return self._call(self._f.writelines, lines)

    def flush(self):
        self._call(self._f.flush)
        if self._failed is not None:
            raise self._failed

    def __getattr__(self, name):
        return getattr(self._f, name)


class _Closed(io.TextIOBase):
    """sys.stdout when descriptor 1 was closed (`>&-`: Python leaves sys.stdout None, and print() drops its
    text): a write fails as on a closed descriptor."""
    encoding = "utf-8"

    def writable(self):
        return True

    def write(self, s):
        raise OSError(errno.EBADF, "it is closed")

    def fileno(self):
        return 1

    def reconfigure(self, **kw):
        pass


def _take(fd, flags):
    """A closed descriptor fd taken by /dev/null, so that no file opened later lands there (a library's printf,
    MindSpore's C++ log, would write into it)."""
    try:
        os.fstat(fd)
    except OSError:
        null = os.open(os.devnull, flags)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)


def hold():
    """Wrap sys.stdout (_Stdout); a closed descriptor 1 is /dev/null opened read-only, so writes to it fail (EBADF).
    A closed descriptor 2 (`2>&-`: Python leaves sys.stderr None; a batch job's progress asked it whether it was a
    terminal, and the job ran nothing) is /dev/null's for writing: what would be said there is dropped."""
    if sys.stderr is None:
        _take(2, os.O_WRONLY)
        sys.stderr = open(2, "w", errors="replace", closefd=False)  # noqa: SIM115 - until the process ends
    if sys.stdout is None:
        _take(1, os.O_RDONLY)
        sys.stdout = _Closed()
    if not isinstance(sys.stdout, _Stdout):
        if hasattr(sys.stdout, "reconfigure"):  # what the terminal's encoding lacks (a GBK locale: emoji, in a
            sys.stdout.reconfigure(errors="replace")  # generated text or a path) prints as '?', not a traceback
        sys.stdout = _Stdout(sys.stdout)


def to_devnull():
    """Descriptor 1 onto /dev/null: what is left in stdout's buffer goes nowhere (Python flushes it at exit)."""
    fd = os.open(os.devnull, os.O_WRONLY)
    if fd != 1:
        os.dup2(fd, 1)
        os.close(fd)


def forget():
    """A failed write, said: not raised again by the flushes to come."""
    if isinstance(sys.stdout, _Stdout):
        sys.stdout._failed = None
