"""SIGINT and SIGTERM as a stop recorded at once and raised (KeyboardInterrupt) at safe points only.

Raised anywhere inside MindSpore instead, a KeyboardInterrupt breaks its import half-way (the interpreter
then aborts at exit: `Fatal Python error: PyThreadState_Get`), is swallowed by its graph compiler (the
process runs on: a server that was told to stop went on to serve), or aborts a compile with an error
dump and rank_0/om/analyze_fail.ir. (MindSpore's own SIGINT handler, set on every graph run, sends the
process SIGTERM.) Safe points: `check()` — the batch job's between records and steps, the server's
between turns, a library call's between engine steps (Pipeline.stream), and before each graph compile
(graphs.runner). A second signal stops at once (`hard_stop`). A library call passes what it recorded on
to the handler its caller had in force (`pass_on`), rather than raising; so do the library's first
imports (`holding`): raised inside an import, a KeyboardInterrupt breaks it for the rest of the process
(numpy's: ImportError), and raised inside an exec() of a string (dataclasses, namedtuple, scipy) it is
remembered as unhandled: the script that caught it is killed by SIGINT at its exit."""
import contextlib
import ctypes
import functools
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_active = None  # the Signals in force (main thread), for check() from code that holds none
_deferred = 0  # inside deferred(): check() raises nothing


class Signals:
    def __init__(self, active, hard_stop=None, final=False):
        """active False: a command that leaves signals to its launcher (a tensor-parallel rank): it installs
        nothing, and library calls inside it install nothing either. hard_stop(): a second signal's (None,
        a library call's: pass_on at once). final: a command's (only its exit follows a stop): once a stop
        was recorded, a later signal exits at once, quietly (raised in the teardown, it printed tracebacks
        from MindSpore's Cell.__del__ after the summary)."""
        self.asked, self.command = active, hard_stop is not None
        self.active = active and threading.current_thread() is threading.main_thread()
        self.hard_stop, self.got, self.old, self.final = hard_stop or self.pass_on, None, {}, final
        self.took = self.ours = None  # took_sigint once exited; the kernel's SIGINT handler once entered
        self.off_main = False  # a library call off the main thread (_OffMain puts the kernel's action back)

    def __enter__(self):
        global _active
        if self.active:
            self.old = {s: signal.signal(s, self._record) for s in SIGNALS}
            self.ours = _os_handler(signal.SIGINT)
        elif self.asked:  # off the main thread Python sets no handler: the kernel's action is put back instead
            self.off_main = _OFF_MAIN.enter()
        if self.active or not self.asked:
            _active = self
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # if the command line held them back until now
        return self

    def reinstall(self):
        """Record again, over the handlers a framework loaded meanwhile installed."""
        if self.active:
            for s in SIGNALS:
                signal.signal(s, self._record)

    def _record(self, sig, frame):
        if self.got is not None:
            self.hard_stop()
        self.got = sig

    def check(self):
        """A command's recorded stop raised (KeyboardInterrupt); a library call's passed on."""
        if self.got is not None:
            if not self.command:
                return self.pass_on()
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def waiting(self):
        """A wait with nothing to undo (a batch job's read of an input FIFO that has no writer yet): a command's
        signal raises KeyboardInterrupt in it at once, not at the next safe point (found: the first Ctrl-C was
        recorded, the read went on waiting, and a second one exited 130 without a word)."""
        if not (self.active and self.command):
            yield
            return
        for s in SIGNALS:
            signal.signal(s, signal.default_int_handler)
        try:
            self.check()  # (after: a signal in between would only be recorded)
            yield
        finally:
            self.reinstall()

    def pass_on(self):
        """A library call's recorded signal, after its step: to the handler the caller had in force (Python's
        KeyboardInterrupt, a script's own, or nothing for an ignored one; SIGTERM's default ends the process)."""
        sig, self.got = self.got, None
        if sig == signal.SIGTERM and self.took_sigint and self.old.get(signal.SIGTERM) == signal.SIG_DFL \
                and self.old.get(signal.SIGINT) != signal.SIG_IGN:
            sig = signal.SIGINT  # most likely a Ctrl-C MindSpore's handler sent as SIGTERM: taken as one where
            # the script leaves SIGTERM alone and heeds SIGINT (else its own SIGTERM handling stays in force)
        h = self.old.get(sig)
        if h is None:  # (not Python's: MindSpore's, which a graph run set outside a call, or nothing recorded)
            h = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        if h == signal.SIG_DFL:
            signal.signal(sig, h)
            signal.raise_signal(sig)
        elif h != signal.SIG_IGN:
            h(sig, sys._getframe(1))

    @property
    def took_sigint(self):
        """Whether MindSpore's SIGINT handler (a graph run sets it, underneath Python's; it sends the process
        SIGTERM) replaced ours; unknown counts as yes."""
        if self.took is None:
            now = _os_handler(signal.SIGINT)
            return self.active and (now is None or now != self.ours)
        return self.took

    def __exit__(self, *exc):
        global _active
        self.took = self.took_sigint
        if self.final and self.got is not None:
            stopping()
        elif not self.final:  # (a command's go on recording until its exit code is known: stopping(code))
            for s, h in self.old.items():
                signal.signal(s, h)
        if self.off_main:
            _OFF_MAIN.exit()
        if _active is self:
            _active = None


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _sigaction(sig, new=None):
    """The kernel's action for sig (a struct sigaction's bytes; None: unknown), after setting `new` (such
    bytes) if given. Unlike signal.signal(), from any thread, and it sees what C code installed."""
    try:
        old = ctypes.create_string_buffer(512)  # (room for a struct sigaction)
        if _libc().sigaction(int(sig), new, old) == 0:
            return old.raw
    except (OSError, AttributeError):
        pass
    return None


def _os_handler(sig):
    """The address of sig's handler as the kernel has it (None: unknown); on Linux a struct sigaction
    starts with it. signal.getsignal() gives only what Python installed, not what C code installed since."""
    action = _sigaction(sig)
    return None if action is None else int.from_bytes(action[:ctypes.sizeof(ctypes.c_void_p)], sys.byteorder)


class _OffMain:
    """Library calls off the main thread, which may overlap (two pipelines): the first to start saves the
    kernel's SIGINT action, the last to end puts it back (each its own, one put back another's stale one)."""

    def __init__(self):
        self.lock, self.calls, self.saved = threading.Lock(), 0, None

    def enter(self):
        with self.lock:
            if self.calls == 0:
                self.saved = _sigaction(signal.SIGINT)
            self.calls += 1
        return True

    def exit(self):
        with self.lock:
            self.calls -= 1
            if self.calls == 0 and self.saved is not None:
                _sigaction(signal.SIGINT, self.saved)


_OFF_MAIN = _OffMain()


class _ExitNow:
    """A handler: exit at once with `code` (os._exit: no teardown left to raise in)."""

    def __init__(self, code):
        self.code = code

    def __call__(self, sig, frame):
        os._exit(self.code)


def stopping(code=130):
    """A command about to exit with `code` (130: stopped by a signal): a later signal exits at once with it,
    quietly (raised in the interpreter's teardown, it printed tracebacks from MindSpore's Cell.__del__)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _ExitNow(code))


def held():
    """A library call's Signals, holding a Ctrl-C or SIGTERM back until it ends (passed on by stop_here);
    under a command's, which holds them already, nothing (None)."""
    return contextlib.nullcontext() if active() else Signals(True)


def stop_here(held):
    """A signal held back during the last call passed on (held: held()'s Signals), or a command's stop
    raised (KeyboardInterrupt)."""
    if held is not None:
        held.check()
    check()


def holding(fn):
    """fn as a library call that holds a Ctrl-C or SIGTERM until it returns (then passes it on)."""
    @functools.wraps(fn)
    def call(*args, **kw):
        with held() as h:
            out = fn(*args, **kw)
        stop_here(h)
        return out
    return call


def active():
    """Whether a Signals is in force (a command's, or a library call's)."""
    return _active is not None


def check():
    """Raise KeyboardInterrupt if a signal was recorded (nothing when no Signals is in force, or deferred)."""
    if _active is not None and not _deferred:
        _active.check()


@contextlib.contextmanager
def deferred():
    """check() raises nothing inside: a stop stays recorded for the first check() after. For work every rank
    of a tensor-parallel job runs in lock step (a server's turn): rank 0 leaving it half-way would leave the
    others waiting in a collective for ever."""
    global _deferred
    _deferred += 1
    try:
        yield
    finally:
        _deferred -= 1
