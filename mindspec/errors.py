"""User-facing errors: the CLI prints them on one line and exits 2 (the server maps them to 4xx)."""
import json
import numbers
import os
import re
import stat


class MindspecError(Exception):
    """Bad input a user can fix: a broken checkpoint, a mismatched draft, a prompt too long... A message
    over 1000 characters is cut (found: a library's temperature=10**2000 quoted in 2001 digits)."""

    def __init__(self, message="", *args):
        if isinstance(message, str) and len(message) > 1000:
            message = one_line(message, 1000)
        super().__init__(message, *args)


class NotFinite(MindspecError):
    """A request whose target activations left the dtype's range (float16): its own, said to its caller; the
    engine works (a server's health does not count it)."""


def summary(e):
    """An exception in one line: its type and the first line of words in its message (MindSpore's kernel
    errors open with a "----" / "- Kernel error:" banner and go on with a C++ call stack), at most 300
    characters. For answers and logs that name an internal error; the whole message goes to the server's
    stderr."""
    lines = [line.strip() for line in str(e).splitlines()
             if any(c.isalnum() for c in line) and not line.startswith("- ")]
    return (f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__)[:300]


def shown(v, limit=80):
    """A user's value quoted in JSON's notation (true, null, "text"): the values a message quotes come from
    JSON (request bodies, batch lines, config files), and Python's True, None and 'text' read as another
    language there. Cut at limit characters; numpy's numbers as numbers, anything else JSON lacks (a set, 1j,
    an object) as its repr, unquoted: quoted, it read as a string given."""
    def scalar(o):
        if getattr(o, "ndim", None) == 0:
            return o.item()
        raise TypeError
    try:
        text = json.dumps(v, ensure_ascii=False, default=scalar)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def one_line(msg, limit=300):
    """A message on one line, a long value it quotes cut (a 4 MB field, the 128 kB an HTTP parser error
    quotes, is not echoed back), a lone surrogate it quotes (JSON's "\\ud800") as U+FFFD: no UTF-8 holds one,
    and strict JSON parsers refuse its escape."""
    text = re.sub("[\ud800-\udfff]", "\ufffd", " ".join(str(msg).split()))
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def is_int(v):
    """Whether a user's value counts as an integer in the checks (numpy's too; JSON's true/false are
    not). Callers keep int(v)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_number(v):
    """Whether a user's value counts as a real number in the checks (numpy's too; not true/false)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def env_number(name, default, ok, what):
    """$name as a float (default when unset or empty), refused in one line unless ok(value): "must be {what}"."""
    raw = os.environ.get(name, "")
    try:
        v = float(raw) if raw else default
    except ValueError:
        v = float("nan")  # (fails every ok)
    if not ok(v):
        raise MindspecError(f"${name} must be {what}, got {shown(raw)}")
    return v


def regular(path):
    """path, refused if a pipe, a device or a socket: a model's file that was a FIFO blocked its open for ever,
    deaf to Ctrl-C (a missing one raises FileNotFoundError; a directory is left to its open's IsADirectoryError)."""
    mode = os.stat(path).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise MindspecError(f"{path} is not a regular file (a pipe, a device or a socket)")
    return path


def read_json(path):
    """json.load of a file (UTF-8), which must be a regular file. A document nested deeper than Python's
    stack is a ValueError like any other bad JSON (json raises RecursionError): callers catch (OSError,
    ValueError) for one-line errors."""
    with open(regular(path), encoding="utf-8") as f:
        text = f.read()
    return parse_json(text)


def parse_json(text, **kw):
    """json.loads(text, **kw), nesting deeper than Python's stack a ValueError."""
    try:
        return json.loads(text, **kw)
    except RecursionError:
        raise ValueError("nested deeper than Python's stack") from None
