"""`mindspec batch`: an offline job over a JSONL file (format, resume rules, exit codes: docs/batch.md).

Each input line is a request as `mindspec serve` parses it (mindspec.request); the command line's flags
are the defaults. Every result is appended to the output as one record as soon as it is finished, in
whatever order lines finish: nothing here assumes input order (records carry their id). A record
starts with {"mindspec_batch": 1, "job": JOB, "id": ...}: JOB fingerprints what makes the results
valid, so a re-run can tell its own finished work from anything else. The output is locked for the
whole job. `generate_records` is the one place that drives the pipeline.
"""
import codecs
import fcntl
import hashlib
import json
import os
import re
import stat
import sys
import time
from typing import NamedTuple

from .errors import MindspecError, read_json, shown, summary
from .omdir import OmDir
from .request import FIELDS, RequestError, loads, make, parse
from .signals import Signals
from .spec import DTYPES

MARKER, VERSION = "mindspec_batch", 1  # the first key of every record, so a torn record is still ours
HEAD = b'{"' + MARKER.encode() + b'": 1, '
PROGRESS_ENV, PROGRESS_S = "MINDSPEC_PROGRESS_S", 30.0  # seconds between progress lines off a terminal


class Item(NamedTuple):
    """One input line to run: its 1-based line number, id, and parsed `run` keywords (None if the
    line is bad) or the error to record."""
    line: int
    rid: object
    kw: object
    err: object = None
    asked: object = None  # a hash of the line's request as written (None: not JSON), kept in its records


def _asked(req):
    """A short hash of a line's request (its fields but the id, as written: a drawn seed is not in it), so
    a resume can tell a line edited since its result was written."""
    return None if req is None else hashlib.sha256(json.dumps(req, sort_keys=True).encode()).hexdigest()[:12]


def _key(rid):
    return json.dumps(rid)  # 1 and "1" are different ids


def check_asked(asked, items, input_path, path):
    """Refuse a line edited since `path` got its result ({id key: request hash}). A bad line (no request
    hash) whose id has one was edited too: results come from good lines only."""
    for item in items:
        was = asked.get(_key(item.rid))
        if was is not None and was != item.asked:
            raise MindspecError(f"{input_path}:{item.line}: this line (id {_key(item.rid)[:40]}) changed since "
                                f"{path} got its result; give the new request a new id, or another --output")


# ---- input ----

def _read_lines(path):
    """[(line number, text)] of the non-blank lines. Lines end at "\\n" only (a trailing "\\r" is
    dropped): str.splitlines would also split inside JSON strings at a raw U+2028, U+0085, ..."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise MindspecError(f"cannot read input {path}: {e.strerror}") from None
    data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
    out = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        try:
            text = raw.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError:
            raise MindspecError(f"input {path} line {n} is not UTF-8 text") from None
        if text.strip():
            out.append((n, text))
    return out


def _descriptor(path):
    """Whether `path` names an open file of a process (/dev/stdin, /dev/fd/N, /proc/self/fd/N, ...): another
    process opening it gets its own descriptor's file, whatever this one's is."""
    path = os.path.abspath(path)
    for _ in range(40):  # (a loop of links: not a descriptor)
        if re.fullmatch(r"/proc/\d+(/task/\d+)?/fd", os.path.realpath(os.path.dirname(path))):
            return True
        if not os.path.islink(path):
            return False
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    return False


def check_shared_input(path, flag, who):
    """An input every replica (--dp) or rank (--tp) reads for itself: a regular file by its own path (a pipe,
    or /dev/stdin from a file, reached each of them empty: their stdin is not the user's). Also refused here, at
    once, as it would be by every one of them once started (found: 16 s under --tp): an input not readable."""
    if os.path.exists(path) and not os.path.isfile(path):  # (first: a pipe would block the open below)
        raise MindspecError(f"{flag} needs its input as a regular file (every {who} reads it): {path} is not one")
    try:
        open(path, "rb").close()
    except OSError as e:
        raise MindspecError(f"cannot read input {path}: {e.strerror}") from None
    if _descriptor(path):
        raise MindspecError(f"{flag} needs its input by its file's own path (every {who} opens it): {path} is a "
                            "descriptor of this process")


def _row(n, text, input_path):
    """(id, request dict, None) of one input line, or (id, None, error); the id None when the line has no
    usable one (none, not JSON, or not a string or an integer). A line in another format stops the job."""
    try:
        row = loads(text)
    except ValueError as e:
        return None, None, f"line {n}: not valid JSON: {e}"
    except RequestError as e:  # a key given twice
        return None, None, f"line {n}: {e}"
    if not isinstance(row, dict):
        return None, None, f"line {n}: not a JSON object"
    rid = row.get("id")
    if "id" in row and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
        return None, None, f"line {n}: id must be a string or an integer, got {shown(rid)}"
    if {"custom_id", "body"} <= set(row) and "id" not in row:  # (the batch prober's: an error record a line)
        raise MindspecError(f"{input_path}:{n}: an OpenAI Batch API request (custom_id, method, url, body): "
                            "mindspec batch reads the request itself, one a line ({\"id\": ..., \"messages\": [...], "
                            "...}: docs/batch.md); jq -c '{id: .custom_id} + (.body | del(.model))' turns such a file "
                            "into one")
    if unknown := sorted(set(row) - FIELDS - {"id"}):
        return rid, None, f"line {n}: unknown field(s) {', '.join(unknown)}"
    return rid, {k: v for k, v in row.items() if k != "id"}, None


def _rows(lines, input_path):
    """[Item] with the request dict (not yet parsed) in kw. An id used twice stops the job before it
    starts: skipping one of them would lose a prompt silently."""
    items, whose = [], {}
    for n, text in lines:
        rid, req, err = _row(n, text, input_path)
        rid, what = (rid, "id") if rid is not None else (n, "line number")
        if _key(rid) in whose:
            raise MindspecError(f"{input_path}:{n}: its {what} {shown(rid)} is already line {whose[_key(rid)]}; ids "
                                "must be unique (a line without a usable \"id\", a string or an integer, has its "
                                "line number)")
        whose[_key(rid)] = f"{n}'s {what}"
        items.append(Item(n, rid, req, err, _asked(req)))
    return items


def _parse(item, defaults):
    if item.err is not None:
        return item
    try:
        return item._replace(kw=parse(item.kw, defaults))
    except MindspecError as e:
        return item._replace(kw=None, err=f"line {item.line}: {e}")


def check_chat(model):
    """--chat needs the model's chat template: refused before anything loads (found: on a model without one
    the job loaded it, then wrote an error record for every line, exit 1). model None: the embedded one (it
    has a template); a model that cannot be read is left to its load, which says why."""
    if model is None or not os.path.isdir(model):
        return
    from .tokenizer import Tokenizer
    try:
        template = Tokenizer(model).chat_template
    except MindspecError:
        return
    if not template:
        raise MindspecError(f"--chat wraps the prompts in the model's chat template, and {model} has none "
                            "(no chat_template.jinja, no chat_template in tokenizer_config.json): run without --chat")


# ---- the job's identity ----

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


SPEED_ONLY = ("draft_temperature", "draft_min_conf")  # request defaults outside a job's id (job_id)


def job_id(defaults, model=None, dtype=None):
    """A short hash of what makes a result valid: the target model (its checkpoint fingerprint and its
    tokenizer, chat template and EOS, which decide the text as much; None = the embedded default, fixed
    by its pinned package), the target's dtype (float16 rounds to other near-ties; float32 or None, as
    before dtypes counted) and the request defaults (sampling flags, --chat). Not the draft, K, the draft's
    temperature or confidence cut, --max-seq or --tp: they change speed, not the output's distribution (the
    draft's two were hashed as given until the batch prober's; hashed as unset, ids made with their defaults
    stay)."""
    defaults = {k: None if k in SPEED_ONLY else v for k, v in defaults.items()}
    if model is not None:
        from .checkpoint import Checkpoint
        files = [_digest(os.path.join(model, f)) for f in TOKENIZER_FILES]
        template = _jinja(model, defaults)
        model = [Checkpoint(model).fingerprint()] + files + ([template] if template else [])
    def digest(dtype):
        what = {"model": model, "defaults": defaults} | ({"dtype": dtype} if dtype != "float32" else {})
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return JobId(digest(dtype or "float32"), dtype or "float32", {digest(d): d for d in DTYPES})


class JobId(str):
    """A job's id that knows the ids of the same job in the other dtypes (in_dtypes: {id: dtype}), so an
    output made in another precision is named as such, not as another model's."""
    def __new__(cls, job, dtype="float32", in_dtypes=None):  # (defaults: a copy.copy or pickle rebuilds it)
        self = super().__new__(cls, job)
        self.dtype, self.in_dtypes = dtype, in_dtypes or {}
        return self


def _other_job(path, n, job, theirs):
    """The refusal of an output holding the records of job `theirs` (line n)."""
    dtype = getattr(job, "in_dtypes", {}).get(theirs)  # (a plain str id: no dtypes known)
    if dtype and dtype != job.dtype:
        return MindspecError(f"{path} holds this job's results in {dtype}, this run is {job.dtype}: run it with "
                             f"--dtype {dtype} or give another --output")
    return MindspecError(f"{path} holds the results of another job (line {n}: job {theirs}, this job is {job}: "
                         "another target model or other request defaults); give another --output")


def _jinja(model, defaults):
    """The digest of chat_template.jinja (read since ids exist) where it decides a job's text and ids made
    before did not count it: a --chat job's, on a model whose template the file is, unlike (or without)
    tokenizer_config.json's (without --chat such a model was refused then; with the same template, the id
    already holds it)."""
    path = os.path.join(model, "chat_template.jinja")
    if not defaults.get("chat") or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, ValueError):  # (the job's load says what is wrong with it)
        return None
    try:
        key = read_json(os.path.join(model, "tokenizer_config.json")).get("chat_template")
    except (OSError, ValueError, AttributeError):
        key = None
    return None if text == key else _digest(path)


def _digest(path):
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


# ---- output ----

def _ours(line):
    """The record a whole output line holds, or None if it is not a mindspec batch record."""
    try:
        rec = loads(line)
    except (ValueError, RequestError):
        return None
    if not isinstance(rec, dict) or rec.get(MARKER) != VERSION or not isinstance(rec.get("job"), str):
        return None
    rid = rec.get("id")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or not isinstance(rec.get("error", ""), str):
        return None  # (a hand-edited record: an id or error of another type)
    return rec


def _torn(tail):
    """A last line without its newline that starts like our records but is no whole JSON: a write cut short
    (a whole one is checked like any record), or blanks (an editor's)."""
    if not tail.strip():
        return True
    if not HEAD.startswith(tail[:len(HEAD)]):
        return False
    try:
        json.loads(tail)
    except ValueError:
        return True
    except RecursionError:  # (nested past Python's stack: not a record of ours, whole or cut)
        pass
    return False


def _scan(data, path, job):
    """(ids with a result, {id: error messages}, {id: its result's request hash}, bytes to keep) of an
    output file's content. Refuses a file holding anything but this job's records; duplicates are fine
    (the first result wins)."""
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    zeros = len(tail) - len(tail.rstrip(b"\0"))  # a power cut's zero-filled end (ext4, XFS: the length written,
    tail = tail[:len(tail) - zeros]  # not the data): never kept
    if tail and _ours(tail) is not None:  # a whole record whose newline was lost (an editor, $(cat ...)): kept
        lines, tail = lines + [tail], b""
    done, errors, asked = set(), {}, {}
    for n, line in enumerate(lines, 1):
        if not line.strip():  # a blank line (an editor's): nothing
            continue
        rec = _ours(line)
        if rec is None:
            raise MindspecError(f"{path}:{n} is not a mindspec batch record; not writing to that file")
        if rec["job"] != job:
            raise _other_job(path, n, job, rec["job"])
        if "error" in rec:
            errors.setdefault(_key(rec["id"]), set()).add(rec["error"])
        else:
            if _key(rec["id"]) not in done and isinstance(rec.get("request"), str):  # (the first result wins)
                asked[_key(rec["id"])] = rec["request"]
            done.add(_key(rec["id"]))
    if tail and not _torn(tail):
        raise MindspecError(f"{path}:{len(lines) + 1} is not a mindspec batch record; not writing to that file")
    return done, errors, asked, len(data) - len(tail) - zeros


def _in_use(path, pid):
    return MindspecError(f"output {path} is in use by another job{f' (pid {pid})' if pid else ''}; wait for it to "
                         "end or give another --output")


def held(path, mode=fcntl.LOCK_EX):
    """(whether another process holds the flock of file `path` that `mode` would wait for, its pid or None);
    (False, None) for a file not there or not readable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False, None
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return False, None
    except BlockingIOError:
        return True, _lock_holder(fd)
    finally:
        os.close(fd)


def check_free(path):
    """Refuse an output a running job holds (its lock, as Output takes it), before what the file's state says
    (a job of several machines locks it only to check it and to merge)."""
    taken, pid = held(path)
    if taken:
        raise _in_use(path, pid)


def _lock_holder(fd):
    """The pid holding an flock on fd's file (from Linux's /proc/locks), or None."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii") as f:
            for line in f:
                p = line.split()
                if len(p) > 5 and p[1] == "FLOCK" and p[5] == want:
                    return int(p[4])
    except (OSError, ValueError):
        pass
    return None


def _dump(rec):
    try:
        return (json.dumps(rec, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (from a request's JSON) has no UTF-8: escape it
        return (json.dumps(rec) + "\n").encode("ascii")


class Output:
    """The output file, locked (flock) from opening to close: its records are read once (a torn last
    record is cut), then each result is appended with one write. path=None: a rank that writes nothing."""

    def __init__(self, path, job, input_path, wait=False):
        self.path, self.job, self.fd, self.created, self.wrote = path, job, None, False, False
        self.input_path = input_path  # (whose lines its results are checked against)
        self.wait = wait  # for the lock (machines merging one shared output), instead of refusing
        self.done, self.errors, self.asked = set(), {}, {}  # asked: {id: request hash} of the results
        self.here = None  # (st_dev, st_ino) of a regular file: checked at its path before each write
        if path is None:
            return
        self._open()
        try:
            self._check_not_input(input_path)
            self.size = 0
            st = os.fstat(self.fd)
            if stat.S_ISREG(st.st_mode):  # not /dev/null or a pipe: nothing to lock or resume
                self.here = st.st_dev, st.st_ino
                self._lock()
                self.size = self._read()
        except BaseException:
            os.close(self.fd)
            raise

    def _open(self):
        flags = os.O_RDWR | os.O_APPEND | os.O_CLOEXEC  # never O_TRUNC: a foreign file stays untouched
        # O_EXCL refuses any symlink: a link to a file not yet made is followed, as a shell's `>` does
        # (a process's open file, /dev/stdout: opened as named; its real path, /proc/PID/fd/pipe:[N], is no file)
        descriptor = _descriptor(self.path)
        self.real = self.path if descriptor else os.path.realpath(self.path)
        try:
            if descriptor:  # write-only: a pipe opened for reading too would never tell its reader left (EPIPE)
                self.fd = os.open(self.real, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
                if stat.S_ISREG(os.fstat(self.fd).st_mode):  # a file: read back too, to resume
                    os.close(self.fd)
                    self.fd = os.open(self.real, flags)
                return
            try:
                self.fd, self.created = os.open(self.real, flags | os.O_CREAT | os.O_EXCL, 0o666), True
            except FileExistsError:
                self.fd = os.open(self.real, flags)
        except OSError as e:
            raise MindspecError(f"cannot write output {self.path}: {e.strerror}") from None

    def _check_not_input(self, input_path):
        st, inp = os.fstat(self.fd), os.stat(input_path)
        if (st.st_dev, st.st_ino) == (inp.st_dev, inp.st_ino):  # also through a symlink or a hard link
            raise MindspecError(f"--input and --output are the same file ({self.path}); give another --output")

    def _lock(self):
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise _in_use(self.path, _lock_holder(self.fd)) from None

    def _read(self):
        try:
            with open(self.fd, "rb", closefd=False) as f:
                data = f.read()
        except OSError as e:
            raise MindspecError(f"cannot read output {self.path}: {e.strerror}") from None
        self.done, self.errors, self.asked, keep = _scan(data, self.path, self.job)
        if keep < len(data):
            self._truncate(keep)
        if keep and data[keep - 1:keep] != b"\n":  # the next record starts on a line of its own
            try:
                os.write(self.fd, b"\n")
            except OSError as e:
                raise MindspecError(f"cannot write output {self.path}: {e.strerror}") from None
            keep += 1
        return keep

    def _truncate(self, size):
        try:
            os.ftruncate(self.fd, size)
        except OSError as e:
            raise MindspecError(f"cannot write output {self.path}: {e.strerror}") from None

    def _here(self):
        if self.here is None:
            return True
        try:
            st = os.stat(self.real)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError:  # (a directory made unreadable, a network file system's hiccup: no sign of a new file)
            return True
        return (st.st_dev, st.st_ino) == self.here

    def check_here(self):
        """The output must still be the file at its path: one removed or replaced while the job runs (a
        cleanup, a moved directory) takes the records with it, and the job went on writing into nothing."""
        if not self._here():
            raise MindspecError(f"output {self.path} was removed, replaced or moved while this job wrote it; run "
                                f"the same command again to write its records there anew")

    def check_asked(self, items):
        """Refuse a line edited since its result was written (its id would keep the old result)."""
        check_asked(self.asked, items, self.input_path, self.path)

    def absorb(self, done, errors):
        """Count another file's finished ids and error messages as this output's (a replica's part: the
        output's own records)."""
        self.done |= done
        for k, msgs in errors.items():
            self.errors.setdefault(k, set()).update(msgs)

    def put(self, item, body):
        """Append the record of `item` with `body` ({"text", ...} or {"error"}); an error already recorded
        for that id in those words is not written again."""
        if self.fd is None or body.get("error") in self.errors.get(_key(item.rid), ()):
            return
        self.check_here()
        asked = {"request": item.asked} if item.asked is not None and "error" not in body else {}
        data = _dump({MARKER: VERSION, "job": self.job, "id": item.rid, **body, **asked})
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as e:
            try:
                os.ftruncate(self.fd, self.size)  # no torn record (truncating needs no free space)
            except OSError:
                pass  # the next run cuts it
            raise MindspecError(f"cannot write output {self.path}: {e.strerror or os.strerror(e.errno)}") from None
        self.size += len(data)
        self.wrote = True

    def close(self, failed=False):
        """Release the lock; a file this run created and left empty is removed when the job failed."""
        if self.fd is None:
            return
        if failed and self.created and not self.wrote and self._here():  # (not a file put in its place)
            try:
                os.unlink(self.real)  # what this run created, not a link to it
            except OSError:
                pass
        os.close(self.fd)
        self.fd = None


# ---- generation: the one place that drives the pipeline ----

def _body(item, r):
    """The record body of a finished engine Request: {"text", "token_ids", ...} or {"error"}."""
    if isinstance(r.error, MindspecError):  # (its own words: a float16 overflow's)
        return {"error": f"line {item.line}: {r.error}"}
    if r.error is not None:
        return {"error": f"line {item.line}: internal error: {summary(r.error)}"}  # (not MindSpore's C++ stack)
    res = r.result()
    body = {"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
            "prompt_tokens": len(r.prompt_ids), "stats": res.stats}
    if item.kw.get("seed") is not None:
        body["seed"] = item.kw["seed"]
    if res.logprobs is not None:  # per token: [logprob, [[id, logprob], ...] of its best alternatives]
        body["logprobs"] = [[lp, [list(t) for t in top]] for lp, top in res.logprobs]
    return body


def generate_records(pipe, items, check=lambda: None, max_batch=1, ready=lambda: None):
    """Run every parsed item on the loaded pipeline, up to max_batch at once (the rest join as rows
    finish); yield (item, record body) as each one finishes, in any order. The job is read first and
    the cache sized once for its longest line; `ready()` is called once the warm-up (compiling, and on
    a machine's first job measuring dynamic K's costs) is done. `check()` raises KeyboardInterrupt once
    a stop was asked: it runs before the warm-up (then the stream checks between engine steps, never
    inside MindSpore). Each record's compile_s is the compiling since the record before (their sum is the
    job's)."""
    reqs = {}
    for item in items:
        try:
            reqs[make(pipe, item.kw)] = item
        except MindspecError as e:
            yield item, {"error": f"line {item.line}: {e}"}
    if not reqs:
        return
    check()
    counted = 0.0  # compile time the records written so far carry: each the part since the last (a sum is the job's)
    for r, _ in pipe.stream(list(reqs), max_batch, ready):  # (stops between steps, never between a step's records)
        if r.done:
            r.stats.compile_s, counted = r.stats.compile_s - counted, r.stats.compile_s
            yield reqs[r], _body(reqs[r], r)


# ---- bookkeeping ----

class Tally:
    """Where every input id stands in the whole output (earlier runs and this one) and this run's
    counts and generation stats."""

    def __init__(self, items, done, errors):
        self.state = {_key(i.rid): "done" if _key(i.rid) in done else "failed" if _key(i.rid) in errors else None
                      for i in items}
        self.skipped = sum(s == "done" for s in self.state.values())
        self.now_done = self.now_failed = self.tokens = self.calls = self.drafted = self.accepted = 0
        self.t0, self.t1 = None, None

    def start(self):
        """(Again once the warm-up is done: the rates are the generation's.)"""
        self.t0 = time.monotonic()

    def add(self, item, body):
        ok = "error" not in body
        self.state[_key(item.rid)] = "done" if ok else "failed"
        self.now_done += ok
        self.now_failed += not ok
        if ok:
            s = body["stats"]
            self.tokens += s["new_tokens"]
            self.calls += s["target_calls"]
            self.drafted += s["drafted"]
            self.accepted += s["accepted"]

    def count(self, what):
        return sum(s == what for s in self.state.values())

    def seconds(self):
        """Generation wall time so far, from the end of the warm-up."""
        if self.t0 is None:
            return 0.0
        return max((self.t1 or time.monotonic()) - self.t0, 0.0)

    def rates(self):
        wall = self.seconds()
        return (self.tokens / wall if wall and self.tokens else None), \
            (self.accepted / self.drafted if self.drafted else None)

    def exit_code(self):
        return 1 if self.count("failed") else 0

    def summary(self, path):
        speed, acc = self.rates()
        n, done, failed = len(self.state), self.count("done"), self.count("failed")
        return (f"mindspec batch: {n} lines: {done} done, {failed} failed, {n - done - failed} left -> {path}; "
                f"this run: {self.now_done} done, {self.now_failed} failed, {self.skipped} skipped; "
                f"{self.tokens} tokens in {self.seconds():.2f} s = "
                f"{f'{speed:.1f}' if speed is not None else '-'} tok/s; "
                f"{f'acceptance {acc:.2f}' if acc is not None else 'no drafts'}; "
                f"{f'{self.tokens / self.calls:.2f}' if self.calls else '-'} tokens per target call")


def _interval():
    try:
        return max(float(os.environ.get(PROGRESS_ENV, PROGRESS_S)), 0.0)
    except ValueError:
        return PROGRESS_S


def _eta(seconds):
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


class Progress:
    """A tqdm bar (lines, tokens/s, acceptance, ETA) when stderr is a terminal; else one line every
    PROGRESS_S seconds ($MINDSPEC_PROGRESS_S)."""

    def __init__(self, tally, bar=True):
        self.tally, self.bar, self.every = tally, None, _interval()
        self.due = time.monotonic() + self.every
        if bar and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=len(tally.state), initial=tally.skipped, unit="line", file=sys.stderr,
                            dynamic_ncols=True, desc="mindspec batch")

    def update(self):
        speed, acc = self.tally.rates()
        if self.bar is not None:
            self.bar.set_postfix_str(f"{speed or 0:.1f} tok/s, acceptance {acc if acc is not None else 0:.2f}",
                                     refresh=False)
            self.bar.update(1)
        elif time.monotonic() >= self.due:
            self.due = time.monotonic() + self.every
            print(self._line(speed, acc), file=sys.stderr, flush=True)

    def _line(self, speed, acc):
        t = self.tally
        n, done, failed = len(t.state), t.count("done"), t.count("failed")
        left = n - done - failed
        # (by the lines generated: a bad line's error record is written at once, and 300 of them said ETA 0m00s)
        eta = _eta(left * t.seconds() / t.now_done) if t.now_done and left and t.t0 is not None else "-"
        return (f"mindspec batch: {done + failed}/{n} lines ({failed} failed), "
                f"{f'{speed:.1f}' if speed is not None else '-'} tok/s, "
                f"acceptance {f'{acc:.2f}' if acc is not None else '-'}, ETA {eta}")

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# ---- the job ----

def _rank0():
    from .tp import is_rank0
    return is_rank0()


class _Job:
    """One run: setup (read, lock, load), then the generation phase, which ends with the summary."""

    def __init__(self, output_path, bar=True):
        self.path, self.tally, self.out, self.bar, self.begun = output_path, None, None, None, False
        self.summarised = False
        self.om, self.bar_ok = OmDir(), bar

    def say(self, line):
        os.write(2, (line + "\n").encode("utf-8", "replace"))  # also from a signal handler

    def hard_stop(self):
        """A second signal: no waiting for a safe point. Records are whole (one write each)."""
        if self.bar is not None and self.bar.bar is not None:
            self.say("")
        if self.tally is not None and not self.summarised:
            self.say(self.tally.summary(self.path))
        if self.out is not None:
            self.out.close(failed=True)
        self.om.remove()
        os._exit(130)

    def run(self, load, items, sig, max_batch=1):
        """Load the model if a line needs it (a model that fails to load: the job never began), then
        write the bad lines' errors and run the rest."""
        todo = [i for i in items if i.err is None]
        pipe = load() if todo else None
        self.begun = True
        sig.check()
        self.bar = Progress(self.tally, self.bar_ok)
        try:
            for item in (i for i in items if i.err is not None):
                self.finish(item, {"error": item.err})
            for item, body in generate_records(pipe, todo, sig.check, max_batch, ready=self.tally.start):
                self.finish(item, body)
        finally:
            self.tally.t1 = time.monotonic()
            self.bar.close()

    def finish(self, item, body):
        self.out.put(item, body)
        self.tally.add(item, body)
        if self.bar is not None:
            self.bar.update()


def run_batch(load, defaults, input_path, output_path, share=None, model=None, max_batch=1, part=None, dtype=None):
    """Run a batch job; returns the exit code (0 all done, 1 some lines failed; MindspecError = 2,
    KeyboardInterrupt = 130, both with the summary once the job has begun). `model` is the target
    checkpoint directory (None: the embedded default), part of the job's fingerprint.
    share (mindspec.tp.share, under tensor parallelism): rank 0 alone reads and writes the output and
    hands the finished ids to the other ranks, which run the same job in lock step and write nothing.
    part (i, d): data-parallel replica i of d runs its share of the lines (mindspec.dp) into its own part
    file, a batch output of the same job; ids the output itself already holds count as done."""
    job_key = job_id(defaults, model, dtype)
    path = part_path(output_path, *part) if part else output_path
    job = _Job(path, bar=part is None)
    writer = share is None or _rank0()
    with Signals(share is None, job.hard_stop, final=True) as sig, job.om:
        with sig.waiting():  # (an input FIFO: its writer may never come)
            lines = _read_lines(input_path)
        rows = _rows(lines, input_path)
        job.out = Output(path if writer else None, job_key, input_path)
        if part:
            rows = rows[part[0]::part[1]]
            job.out.absorb(*earlier(output_path, job_key))
        ok = False
        try:
            job.out.check_asked(rows)
            done = share(job.out.done) if share else job.out.done  # before rank 0 writes anything
            job.tally = Tally(rows, done, job.out.errors)
            job.run(load, [_parse(i, defaults) for i in rows if _key(i.rid) not in done], sig, max_batch)
            job.out.check_here()  # (also after the last record: the summary names it)
            ok = True
        except KeyboardInterrupt:
            job.begun = True  # also while loading
            raise
        finally:
            if job.begun and job.tally is not None:
                print(job.tally.summary(path), file=sys.stderr, flush=True)
                job.summarised = True  # (a second signal from here on must not print it again)
            job.out.close(failed=not ok)
    return job.tally.exit_code()


# ---- data-parallel parts ----

def part_path(output_path, i, d):
    """Replica i of d writes here, beside the output."""
    return f"{output_path}.part{i}of{d}"


def read_records(path, job):
    """(records, done ids, {id: error messages}, {id: its result's request hash}) of a batch output that may
    not exist, read without taking its lock (a data-parallel launcher holds it); a torn last line is left
    out. Refused like any output when it holds anything but this job's records."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return [], set(), {}, {}
    except OSError as e:
        raise MindspecError(f"cannot read output {path}: {e.strerror}") from None
    done, errors, asked, keep = _scan(data, path, job)
    return [json.loads(line) for line in data[:keep].split(b"\n") if line.strip()], done, errors, asked


def earlier(output_path, job):
    """(done ids, {id: error messages}) the output already holds."""
    return read_records(output_path, job)[1:3]
