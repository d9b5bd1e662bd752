"""`mindspec batch`: an offline job over a JSONL file, one pipeline, one request at a time.

Each input line is a request as `mindspec serve` parses it (mindspec.request): {"id"?, "prompt" |
"messages" | "prompt_ids", sampling fields...}; the command line's flags are the defaults. Each
result is appended to the output as soon as it is done and flushed, so an interrupted job loses
nothing; a re-run skips the ids already in the output (ids default to the line number). A bad
line becomes {"id", "error"} and the job goes on. Exit 0 when every line is done (now or before),
1 when some lines failed (their error records are in the output), 2 when the input or output
file is unusable (nothing is generated then).
"""
import json
import os
import sys
import traceback

from .errors import MindspecError
from .request import FIELDS, parse, run


def _key(rid):
    return json.dumps(rid)  # 1 and "1" are different ids


def _read_input(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except OSError as e:
        raise MindspecError(f"cannot read input {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise MindspecError(f"input {path} is not UTF-8 text") from None


def _done_ids(path):
    """Ids already in the output. A last line without its newline that starts like our records is an
    interrupted write: it is cut off (and redone) unless it is a whole record. Anything else in the
    file means it is not ours: refuse to append to it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return set()
    except OSError as e:
        raise MindspecError(f"cannot read output {path}: {e.strerror}") from None
    lines = data.split(b"\n")  # the last item is b"" or an unfinished line
    ids, whole = set(), len(lines) - 1
    for n, line in enumerate(lines, 1):
        try:
            ids.add(_key(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            if n > whole and line.startswith(b'{"id": '):
                with open(path, "r+b") as f:
                    f.truncate(len(data) - len(line))
            elif line.strip():
                raise MindspecError(f"{path}:{n} is not a mindspec batch record; not appending to that file") \
                    from None
        else:
            if n > whole:
                with open(path, "ab") as f:
                    f.write(b"\n")
    return ids


def _requests(lines, defaults, done, input_path):
    """(id, parsed keywords or None, error or None) per line still to do; and how many were skipped."""
    todo, skipped, line_of = [], 0, {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rid, kw, err = n, None, None
        try:
            row = json.loads(line)
        except ValueError as e:
            row, err = None, f"line {n}: not valid JSON: {e}"
        if row is not None and not isinstance(row, dict):
            err = f"line {n}: not a JSON object"
        elif row is not None:
            rid = row.get("id", n)
            if isinstance(rid, bool) or not isinstance(rid, (str, int)):
                rid, err = n, f"line {n}: id must be a string or an integer, got {row['id']!r}"
            elif unknown := sorted(set(row) - FIELDS - {"id"}):
                err = f"line {n}: unknown field(s) {', '.join(unknown)}"
        if _key(rid) in line_of:  # before any work: skipping one of them would lose a prompt silently
            raise MindspecError(f"{input_path}:{n}: id {rid!r} is already line {line_of[_key(rid)]}'s; ids must be "
                                f"unique (a line without \"id\" has its line number)")
        line_of[_key(rid)] = n
        if _key(rid) in done:
            skipped += 1
            continue
        if err is None:
            try:
                kw = parse({k: v for k, v in row.items() if k != "id"}, defaults)
            except MindspecError as e:
                err = f"line {n}: {e}"
        todo.append((rid, kw, err))
    return todo, skipped


def _record(pipe, rid, kw):
    try:
        ids, res = run(pipe, kw)
    except MindspecError as e:
        return {"id": rid, "error": str(e)}, None
    except Exception as e:  # a bug or a runtime failure: record it, keep going
        traceback.print_exc()
        return {"id": rid, "error": f"internal error: {type(e).__name__}: {e}"}, None
    rec = {"id": rid, "text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
           "prompt_tokens": len(ids), "stats": res.stats}
    if kw.get("seed") is not None:
        rec["seed"] = kw["seed"]
    return rec, res.stats


def _rank0():
    from .tp import is_rank0
    return is_rank0()


def run_batch(load, defaults, input_path, output_path, share=None):
    """share (mindspec.tp.share, under tensor parallelism): rank 0 alone reads and writes the output and
    hands the finished ids to the other ranks, which run the same job in lock step and write nothing."""
    writer = share is None or _rank0()
    done = _done_ids(output_path) if writer else None
    done = share(done) if share else done  # before rank 0 writes anything
    todo, skipped = _requests(_read_input(input_path), defaults, done, input_path)
    try:
        out = open(output_path if writer else os.devnull, "a", encoding="utf-8")
    except OSError as e:
        raise MindspecError(f"cannot write output {output_path}: {e.strerror}") from None
    pipe = load() if any(kw is not None for _, kw, _ in todo) else None
    done = failed = tokens = calls = drafted = accepted = 0
    wall = 0.0
    try:
        with out:
            for rid, kw, err in todo:
                rec, stats = ({"id": rid, "error": err}, None) if err else _record(pipe, rid, kw)
                out.write(json.dumps(rec, ensure_ascii=False) + "\n")
                out.flush()
                if stats is None:
                    failed += 1
                    continue
                done += 1
                tokens += stats["new_tokens"]
                calls += stats["target_calls"]
                drafted += stats["drafted"]
                accepted += stats["accepted"]
                wall += stats["wall_s"]
    finally:  # also when interrupted: what is written is kept, and said
        acc = f"acceptance {accepted / drafted:.2f}" if drafted else "no drafts"
        speed = f"{tokens / wall:.1f} tok/s" if wall else "- tok/s"
        per_call = f"{tokens / calls:.2f}" if calls else "-"
        print(f"mindspec batch: {done} done, {skipped} skipped, {failed} failed -> {output_path}; {tokens} tokens "
              f"in {wall:.2f} s = {speed}; {acc}; {per_call} tokens per target call", file=sys.stderr)
    return 1 if failed else 0
