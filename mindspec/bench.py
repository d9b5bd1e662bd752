"""`mindspec bench`: target-only vs speculative (each fixed K, dynamic K) vs Hugging Face transformers
(generate and assisted generation, when torch is installed), in one process, interleaved per prompt
so machine noise hits every mode alike. Writes OUT/bench.json and OUT/bench.png, prints a table."""
import json
import os
import sys
import tempfile
import time

from . import scratch, signals
from .errors import MindspecError

PROMPT_SETS = {  # name -> [(prompt, chat)]
    "story": [("Once upon a time, in a small village by the sea,", False),
              ("The old lighthouse keeper climbed the stairs one last time and", False)],
    "chat": [("What are three good habits for staying healthy? Explain briefly.", True),
             ("How do I make a good cup of tea?", True)],
    "code": [("Write a Python function that returns the n-th Fibonacci number.", True),
             ("Write a Python function that checks whether a string is a palindrome.", True)],
}
WARMUP_TOKENS = 8


def load_prompts(spec):
    """'story,chat' (built-in sets) or a JSONL file of {"prompt", "chat"?, "set"?} -> {set: [(prompt, chat)]}."""
    if spec.endswith(".jsonl") or os.path.isfile(spec):
        sets, default = {}, os.path.splitext(os.path.basename(spec))[0]
        try:
            with open(spec, "rb") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise MindspecError(f"cannot read prompts file {spec}: {e.strerror}") from None
        for n, line in enumerate(lines, 1):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError:
                raise MindspecError(f"{spec}: line {n} is not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
            except (ValueError, KeyError, TypeError):
                raise MindspecError(f"{spec}:{n}: expected a JSON object with a \"prompt\" string") from None
            if not isinstance(prompt, str) or not prompt:
                raise MindspecError(f"{spec}:{n}: \"prompt\" must be a non-empty string")
            unknown = sorted(set(row) - {"prompt", "chat", "set"})
            if unknown:
                raise MindspecError(f"{spec}:{n}: unknown field \"{unknown[0]}\" (a line holds \"prompt\", "
                                    f"\"chat\"?, \"set\"?)")
            if not isinstance(row.get("chat", False), bool):
                raise MindspecError(f"{spec}:{n}: \"chat\" must be true or false")
            name = row.get("set", default)
            if not isinstance(name, str) or not name:
                raise MindspecError(f"{spec}:{n}: \"set\" must be a non-empty string")
            sets.setdefault(name, []).append((prompt, row.get("chat", False)))
        if not sets:
            raise MindspecError(f"{spec} holds no prompts")
        return sets
    names = [s for s in spec.split(",") if s]
    bad = [s for s in names if s not in PROMPT_SETS]
    if bad or not names:
        raise MindspecError(f"unknown prompt set {bad[0] if bad else spec!r}: use {','.join(PROMPT_SETS)} "
                            f"or a .jsonl file")
    return {s: PROMPT_SETS[s] for s in names}


class Tally:
    """Sums over the prompts of one (prompt set, batch size, mode, K) row."""

    def __init__(self, **row):
        self.row, self.ids = row, []
        self.new_tokens = self.wall_s = self.target_calls = self.drafted = self.accepted = 0
        self.draft_s = self.verify_s = 0.0
        self.k_used, self.latency = {}, []

    def add_batch(self, results, wall):
        """The results of requests that ran together, the batch's wall time."""
        for r in results:
            self.add(r.token_ids, dict(r.stats, wall_s=0.0))
            self.latency.append(r.stats["queue_s"] + r.stats["wall_s"])
        self.wall_s += wall

    def add(self, ids, stats):
        self.ids.append(ids)
        self.new_tokens += len(ids)
        self.wall_s += stats["wall_s"]
        if "queue_s" not in stats:
            self.latency.append(stats["wall_s"])
        self.target_calls += stats.get("target_calls") or 0
        self.drafted += stats.get("drafted") or 0
        self.accepted += stats.get("accepted") or 0
        self.draft_s += stats.get("draft_s") or 0.0
        self.verify_s += stats.get("verify_s") or 0.0
        for k, n in (stats.get("k_used") or {}).items():
            self.k_used[int(k)] = self.k_used.get(int(k), 0) + n

    def result(self, base):
        tps = self.new_tokens / self.wall_s if self.wall_s else None
        steps = sum(self.k_used.values())
        r = dict(self.row, tokens_per_s=tps, new_tokens=self.new_tokens, wall_s=round(self.wall_s, 4),
                 acceptance_rate=self.accepted / self.drafted if self.drafted else None,
                 tokens_per_target_call=self.new_tokens / self.target_calls if self.target_calls else None,
                 identical_to_target_only=base is not None and self.ids == base.ids,
                 mean_latency_s=round(sum(self.latency) / len(self.latency), 4) if self.latency else None,
                 speedup=tps / base.result(None)["tokens_per_s"] if base and tps and base.wall_s else None)
        if self.k_used:
            r["k_used"] = {str(k): n for k, n in sorted(self.k_used.items())}
            r["mean_k"] = sum(k * n for k, n in self.k_used.items()) / steps
        if self.drafted:
            r["draft_ms_per_token"] = 1000 * self.draft_s / self.drafted
        return r


# -- Hugging Face transformers (optional) ----------------------------------------------------------

def _hf_available():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - a broken torch install must not break the rest of the bench
        return False


def parse_assistant(spec):
    """'layers:N' | 'early-exit:N' | 'prompt-lookup[:N]' -> (kind, N >= 1); N defaults to 10 for prompt-lookup."""
    kind, colon, n = spec.partition(":")
    try:
        n = int(n) if colon or kind != "prompt-lookup" else 10
    except ValueError:
        n = 0
    if kind not in ("layers", "early-exit", "prompt-lookup") or n < 1:
        raise MindspecError(f"unknown HF assistant {spec!r}: use layers:N, early-exit:N or prompt-lookup[:N] "
                            f"(N >= 1)")
    return kind, n


class HF:
    """Target-only and assisted greedy generation with transformers on CPU, counting forward calls
    (hooks) so tokens per target call and acceptance come out as for mindspec."""

    def __init__(self, target_dir, eos):
        import torch
        import transformers
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.eos = sorted(eos)
        self.version = f"transformers {transformers.__version__}, torch {torch.__version__}"
        self.calls = {"target": 0, "assistant": 0}
        self.model.register_forward_hook(lambda *_: self._count("target"))
        self.assistants = {}

    def _count(self, who):
        self.calls[who] += 1

    def assistant(self, spec):
        """'layers:N' (a copy of the first N layers), 'early-exit:N' or 'prompt-lookup' -> generate kwargs."""
        kind, n = parse_assistant(spec)
        if kind == "prompt-lookup":
            return {"prompt_lookup_num_tokens": n}
        if kind == "early-exit":
            return {"assistant_early_exit": n}
        if spec not in self.assistants:
            import copy
            a = copy.deepcopy(self.model)
            a.model.layers = a.model.layers[:n]
            a.config.num_hidden_layers = n
            if isinstance(getattr(a.config, "layer_types", None), list):
                a.config.layer_types = a.config.layer_types[:n]
            a._forward_hooks.clear()  # the deep copy carried the target's counting hook
            a.register_forward_hook(lambda *_: self._count("assistant"))
            self.assistants[spec] = a
        return {"assistant_model": self.assistants[spec]}

    def generate(self, ids, max_new_tokens, extra):
        torch = self.torch
        x = torch.tensor([ids])
        self.calls.update(target=0, assistant=0)
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                      do_sample=False, num_beams=1, eos_token_id=self.eos,
                                      pad_token_id=self.eos[0], **extra)
        wall = time.perf_counter() - t
        new = out[0, len(ids):].tolist()
        calls = self.calls["target"]
        stats = {"wall_s": wall, "target_calls": calls}
        if "assistant_model" in extra:  # each target call emits accepted drafts + 1; one assistant call per draft
            stats.update(drafted=self.calls["assistant"], accepted=max(len(new) - calls, 0))
        return new, stats


# -- the benchmark ---------------------------------------------------------------------------------

def run(target=None, draft=None, prompts="story,chat,code", max_new_tokens=128, ks=(1, 2, 4, 8),
        hf=True, hf_assistants=None, repeat=1, batch_sizes=(1,), log=sys.stderr, on_part=None, device=None,
        dtype=None):
    """Run every mode on every prompt (batch 1) or on batches of B requests at once (B > 1: the set's
    prompts cycled to B rows, through generate_many); returns the bench.json dict. on_part(dict) gets
    the results so far ("complete": false) each time a set finishes a batch size, but the last. device, dtype:
    the target's, as mindspec.load takes them."""
    import mindspec
    from .spec import SEQ_ROUND, round_up
    from .tokenizer import Tokenizer
    if target is None:
        from .default import default_pair
        target, default_draft = default_pair(device=device)
        draft = draft or default_draft
    ks = sorted(set(int(k) for k in ks))
    if not ks or ks[0] < 1:
        raise MindspecError(f"--ks must be positive K buckets, got {ks}")
    sizes = sorted(set(int(b) for b in batch_sizes))
    if not sizes or sizes[0] < 1:
        raise MindspecError(f"--batch-sizes must be positive, got {sizes}")
    sets = load_prompts(prompts)
    tok = Tokenizer(target)

    def encode(text, chat):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]) if chat else text)
    enc = {name: [encode(p, c) for p, c in rows] for name, rows in sets.items()}  # set -> [[ids]]
    longest = max((ids for rows in enc.values() for ids in rows), key=len)
    # one cache size for every prompt, so no mode ever recompiles mid-bench
    max_seq = round_up(len(longest) + max_new_tokens + ks[-1] + 1, SEQ_ROUND)
    # no prefix cache: every mode runs the same prompts, and each must pay its own prefill
    pipe = mindspec.load(target=target, draft=draft or False, k=ks[-1], max_seq=max_seq, buckets=tuple(ks),
                         max_batch=sizes[-1], batch_buckets=tuple(sizes), prefix_cache=False, device=device,
                         dtype=dtype)
    notes, costs = [], None
    modes = [("target-only", 0, dict(speculate=False))]
    if pipe.proposer is None:
        notes.append("no draft: speculative modes skipped")
    else:
        modes += [("fixed-k", k, dict(k=k)) for k in ks] + [("dynamic-k", "auto", dict(k="auto"))]
    t0 = time.perf_counter()
    for B in sizes:  # compile every graph, measure the costs and warm ORT before anything is timed
        for _, _, kw in modes:
            pipe.generate_many([dict(prompt_ids=longest, max_new_tokens=WARMUP_TOKENS, **kw)] * B, max_batch=B)
    if pipe.proposer is not None:
        costs = {str(B): {n: {str(k): x for k, x in d.items()} for n, d in zip("cv", cv)}
                 for B, cv in pipe.costs.items()}
    hf_model, hf_modes = None, []
    if hf and pipe.dtype != "float32" and 1 in sizes:  # (torch's rows would be float32's, against another target)
        notes.append(f"hf-generate / hf-assisted skipped: they run float32, the target here {pipe.dtype}")
    elif hf and _hf_available() and 1 in sizes:
        hf_model = HF(target, pipe.eos)
        n_layers = pipe.cfg.num_hidden_layers
        for spec in hf_assistants or [f"layers:{max(1, n_layers // 2)}", "prompt-lookup"]:
            hf_modes.append(("hf-assisted", spec, hf_model.assistant(spec)))
        hf_modes.insert(0, ("hf-generate", None, {}))
        for _, _, extra in hf_modes:
            hf_model.generate(longest, WARMUP_TOKENS, extra)
    elif hf and 1 in sizes:
        notes.append("hf-generate / hf-assisted skipped: torch and transformers are not installed "
                     "(pip install -e .[bench])")
    print(f"warm-up and compile: {time.perf_counter() - t0:.1f} s", file=log)

    tallies, done = {}, []  # (set, B, mode, k) -> Tally; the (set, B) finished

    def result(complete):
        runs = []
        for name, B in done:
            base = tallies[(name, B, "target-only", 0)]
            runs += [t.result(base) for key, t in tallies.items() if key[:2] == (name, B)]
        for r in runs:
            if r["mode"] == "hf-generate":
                r["tokens_per_target_call"] = 1.0
        return {"runs": runs, "complete": complete, "notes": notes, "target": os.path.abspath(target),
                "draft": draft and os.path.abspath(draft), "max_new_tokens": max_new_tokens, "ks": ks,
                "batch_sizes": sizes, "repeat": repeat, "max_seq": max_seq, "costs_vs_decode": costs,
                "prompts": {n: [p for p, _ in rows] for n, rows in sets.items()},
                "hf": hf_model.version if hf_model else None, "cpu_count": os.cpu_count(), "device": pipe.device,
                "dtype": pipe.dtype}

    for name, rows in enc.items():
        for B in sizes:
            batch = [rows[i % len(rows)] for i in range(B)]
            for rnd in range(repeat):
                for j, ids in enumerate(rows if B == 1 else [None]):
                    # every other pass (and each prompt in turn) runs the modes in reverse: a steady drift of the
                    # machine's speed then weighs on every mode alike
                    for mode, k, kw in modes[::-1] if (rnd + j) % 2 else modes:
                        tally = tallies.setdefault((name, B, mode, k), Tally(prompt_set=name, batch_size=B, mode=mode,
                                                                             k=k))
                        t = time.perf_counter()
                        res = pipe.generate_many([dict(prompt_ids=x, max_new_tokens=max_new_tokens, **kw)
                                                  for x in ([ids] if B == 1 else batch)], max_batch=B)
                        tally.add_batch(res, time.perf_counter() - t)
                    for mode, spec, extra in hf_modes if B == 1 else ():
                        new, stats = hf_model.generate(ids, max_new_tokens, extra)
                        signals.check()  # (a Ctrl-C during torch's run waited for this safe point)
                        row = dict(prompt_set=name, batch_size=1, mode=mode, k=None, assistant=spec)
                        tallies.setdefault((name, 1, mode, spec), Tally(**row)).add(new, stats)
            done.append((name, B))
            if on_part is not None and len(done) < len(enc) * len(sizes):
                on_part(result(complete=False))
            print(f"{name} B={B}: done", file=log)
    return result(complete=True)


def table(result):
    """Markdown table of the runs."""
    out = ["| prompt set | B | mode | K | tokens/s | speedup | acceptance | tokens/call | latency s | identical |",
           "|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt):
        return "" if x is None else format(x, fmt)
    for r in result["runs"]:
        k = r.get("assistant") or ("" if r["k"] in (0, None) else r["k"])
        if r["mode"] == "dynamic-k" and "mean_k" in r:
            k = f"auto (mean {r['mean_k']:.1f})"
        out.append(f"| {r['prompt_set']} | {r.get('batch_size', 1)} | {r['mode']} | {k} | "
                   f"{f(r['tokens_per_s'], '.1f')} | {f(r['speedup'], '.2f')}{'x' if r['speedup'] else ''} | "
                   f"{f(r['acceptance_rate'], '.2f')} | {f(r['tokens_per_target_call'], '.2f')} | "
                   f"{f(r.get('mean_latency_s'), '.2f')} | {'yes' if r['identical_to_target_only'] else 'no'} |")
    return "\n".join(out)


def plot(result, path):
    """Tokens/s and tokens per target call vs K, one colour per prompt set: fixed K as a line,
    dynamic K as a star at its mean K, target-only (and HF generate) as horizontal references."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    sets = list(dict.fromkeys(r["prompt_set"] for r in result["runs"]))
    for i, name in enumerate(sets):
        color = f"C{i}"
        rows = [r for r in result["runs"] if r["prompt_set"] == name]
        fixed = sorted((r for r in rows if r["mode"] == "fixed-k"), key=lambda r: r["k"])
        for ax, key in zip(axes, ("tokens_per_s", "tokens_per_target_call")):
            if fixed:
                ax.plot([r["k"] for r in fixed], [r[key] for r in fixed], "o-", color=color, label=f"{name}: fixed K")
            for r in rows:
                if r["mode"] == "dynamic-k" and r.get("mean_k") is not None:
                    ax.plot([r["mean_k"]], [r[key]], "*", ms=14, color=color, label=f"{name}: dynamic K")
                elif r["mode"] == "target-only":
                    ax.axhline(r[key], ls="--", color=color, lw=1, label=f"{name}: target-only")
                elif r["mode"] == "hf-generate" and key == "tokens_per_s":
                    ax.axhline(r[key], ls=":", color=color, lw=1, label=f"{name}: HF generate")
    axes[0].set(xlabel="K (draft tokens per target call)", ylabel="tokens / s", title="Speed")
    axes[1].set(xlabel="K (draft tokens per target call)", ylabel="tokens per target call",
                title="Tokens per target call")
    for ax in axes:
        ax.set_xticks(result["ks"])
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=7, loc="center right")
    fig.suptitle(f"mindspec bench: {os.path.basename(result['target'])}, "
                 f"{result['max_new_tokens']} new tokens", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.87, 1))  # room on the right for the legend
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_batch(result, path):
    """Aggregate tokens/s against the batch size: target-only, the best fixed K and dynamic K per set."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.4))
    sets = list(dict.fromkeys(r["prompt_set"] for r in result["runs"]))
    sizes = result["batch_sizes"]
    for i, name in enumerate(sets):
        rows = [r for r in result["runs"] if r["prompt_set"] == name]

        def line(pick):
            return [max((r["tokens_per_s"] for r in rows if r["batch_size"] == B and pick(r)), default=None)
                    for B in sizes]
        for label, pick, style in (("target-only", lambda r: r["mode"] == "target-only", "--"),
                                   ("best fixed K", lambda r: r["mode"] == "fixed-k", ":"),
                                   ("dynamic K", lambda r: r["mode"] == "dynamic-k", "-")):
            ax.plot(sizes, line(pick), "o" + style, color=f"C{i}", label=f"{name}: {label}")
    ax.set(xlabel="requests running at once (B)", ylabel="aggregate tokens / s", xticks=sizes,
           title=f"mindspec bench: {os.path.basename(result['target'])}, {result['max_new_tokens']} new tokens")
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cmd_bench(a):
    from .device import detect_device
    from .spec import resolve_dtype
    load_prompts(a.prompts)  # a bad prompts file (or a dtype the device lacks) is refused before --out is made
    resolve_dtype(a.dtype, detect_device(a.device))
    if os.path.isfile(a.out):  # found only after the whole run, its results lost
        raise MindspecError(f"--out {a.out} is a file: give a directory for bench.json and its plots")
    try:
        made = scratch.makedirs(a.out)  # (removed again if the run fails before saving anything)
    except OSError as e:
        raise MindspecError(f"cannot write --out {a.out}: {e.strerror}") from None
    try:  # (an existing directory that takes no files failed only after the whole run)
        tempfile.TemporaryFile(dir=a.out).close()
    except OSError as e:
        scratch.unmake(made)
        raise MindspecError(f"cannot write in --out {a.out}: {e.strerror}") from None
    out, partial, saved = os.path.join(a.out, "bench.json"), os.path.join(a.out, "bench.partial.json"), []
    unsaved = []  # a save that failed: its error says it all (one line)

    def save(result):  # whole or not at all: a run stopped half way keeps the sets it finished, beside
        # (never over) an earlier run's complete bench.json
        path = out if result["complete"] else partial
        tmp = f"{path}.{os.getpid()}.tmp"  # (two benches on one --out)
        try:
            with open(tmp, "w") as f:
                json.dump(result, f, indent=1)
            os.replace(tmp, path)
        except OSError as e:  # (a full disk: found as a traceback, the results lost) the runs so far on stdout
            unsaved.append(path)
            show(result)
            raise MindspecError(f"cannot write {path}: {e.strerror or e} (the results so far are on stdout)") \
                from None
        finally:
            if os.path.lexists(tmp):
                os.remove(tmp)
        saved.append(len({(r["prompt_set"], r["batch_size"]) for r in result["runs"]}))

    try:
        result = run(target=a.target, draft=a.draft, prompts=a.prompts, max_new_tokens=a.max_new_tokens, ks=a.ks,
                     hf=not a.no_hf, hf_assistants=a.hf_assistants, repeat=a.repeat, batch_sizes=a.batch_sizes,
                     on_part=save, device=a.device, dtype=a.dtype)
    except BaseException as e:  # stopped, or failed (its own error follows): say what was kept
        if saved and not unsaved:
            print(f"mindspec bench: {'stopped' if isinstance(e, KeyboardInterrupt) else 'failed'}; {partial} holds "
                  f"the {saved[-1]} finished (prompt set, batch size) runs (\"complete\": false)", file=sys.stderr)
        if not saved:  # the directories it made, if still empty (found: a draft refused at load left --out)
            scratch.unmake(made)
        raise
    save(result)
    if os.path.exists(partial):
        os.remove(partial)
    show(result)  # before the plots: a plot that cannot be written loses no results
    plots = [("bench.png", plot)] + ([("bench-batch.png", plot_batch)] if len(result["batch_sizes"]) > 1 else [])
    files = ["bench.json"] + [name for name, _ in plots]
    for name, draw in plots:
        path = os.path.join(a.out, name)
        try:
            draw(result, path)
        except OSError as e:  # (a full disk: found as a traceback after bench.json, the table never printed and
            # a 0-byte bench.png left)
            if os.path.lexists(path):
                os.remove(path)
            raise MindspecError(f"cannot write {path}: {e.strerror or e} (bench.json was written)") from None
    print(f"wrote {', '.join(os.path.join(a.out, f) for f in files)}", file=sys.stderr)


def show(result):
    """The results table and notes, on stdout."""
    print(table(result))
    for n in result["notes"]:
        print(f"note: {n}")


def _counts(what):
    """An argparse type: comma-separated integers >= 1 -> [int]."""
    import argparse

    def check(text):
        try:
            ns = [int(k) for k in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma-separated list of {what}: {text!r}") from None
        if min(ns) < 1:
            raise argparse.ArgumentTypeError(f"{what} must be >= 1: {text!r}")
        return ns
    return check


def _assistants(text):
    """An argparse type: comma-separated HF assistant specs -> [spec], each checked (even under --no-hf)."""
    import argparse
    specs = text.split(",")
    for spec in specs:
        try:
            parse_assistant(spec)
        except MindspecError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return specs


def add_parser(subparsers):
    from .cli import path_arg, positive_int
    from .device import CHOICES
    from .spec import DTYPES
    b = subparsers.add_parser("bench", help="benchmark target-only, fixed K, dynamic K (and HF transformers)")
    b.add_argument("--target", type=path_arg, default=None, help="target checkpoint dir (default: the embedded model)")
    b.add_argument("--draft", type=path_arg, default=None, help="draft .onnx (default: the embedded draft)")
    b.add_argument("--prompts", default="story,chat,code", help="built-in sets (story,chat,code) or FILE.jsonl")
    b.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens per prompt (default %(default)s)")
    b.add_argument("--out", type=path_arg, default="bench-out",
                   help="directory for bench.json and bench.png (default %(default)s)")
    b.add_argument("--ks", type=_counts("K buckets"), default="1,2,4,8",
                   help="fixed K buckets to run (each its own verify graph; any K >= 1, e.g. 3 or 16), also the "
                        "buckets dynamic K chooses among (default %(default)s)")
    b.add_argument("--repeat", type=positive_int, default=1, help="rounds over each prompt set (default %(default)s)")
    b.add_argument("--batch-sizes", type=_counts("batch sizes"), default="1",
                   help="requests running at once, comma-separated (e.g. 1,2,4,8); B > 1 runs the set's prompts "
                        "cycled to B rows together (default %(default)s)")
    b.add_argument("--device", choices=CHOICES, default=None,
                   help="auto (default: Ascend when an NPU is visible, else CPU), cpu or ascend; target and draft")
    b.add_argument("--dtype", choices=DTYPES, default=None,
                   help="the target's (default: float16 on Ascend, float32 on CPU); HF's rows run only in float32")
    b.add_argument("--no-hf", action="store_true", help="skip Hugging Face transformers even if installed")
    b.add_argument("--hf-assistants", type=_assistants, default=None,
                   help="HF assistants, comma-separated: layers:N, early-exit:N, prompt-lookup[:N] "
                        "(default: half the layers, prompt-lookup)")
    b.set_defaults(func=cmd_bench)
    return b
