"""`mindspec.load(...)` -> Pipeline: target + draft + tokenizer, and thin drivers over the one engine:
generate (one request), generate_many (many, continuously batched) and run (what serve and batch
use)."""
import atexit
import functools
import gc
import inspect
import os
import threading
import weakref
from collections import deque

import numpy as np

from .checkpoint import Checkpoint
from .engine import Engine
from .errors import MindspecError, is_int, is_number, shown
from .request import checked_text, stop_strings
from .sampling import SamplingParams
from .sequence import RUNS_ONCE, WAITING, Request, Result
from .device import check_device_env, detect_device
from .spec import BATCH_BUCKETS, K_BUCKETS, PLAN_DTYPE, TOP_LOGPROBS, SpecConfig, cache_positions, resolve_dtype
from .tokenizer import Tokenizer
from .graphs.cache_budget import budget
from .graphs.tp import in_msrun
from .tp import share
from . import signals

# MindSpore's graph runs and builds, process-wide: two pipelines' calls on two threads at once deadlocked in its
# executor (one pipeline's calls take turns by its own _turn). Held per step, so two pipelines' calls interleave.
_GRAPHS = threading.RLock()


def _graphs(fn):
    """The method fn holding _GRAPHS (it builds or runs graphs); refused first in a forked child (where another
    thread's hold at the fork is held for ever)."""
    @functools.wraps(fn)
    def holding(self, *args, **kw):
        self._check_process()
        with _GRAPHS:
            return fn(self, *args, **kw)
    return holding

__all__ = ["Pipeline", "Result", "load"]


_LIVE = weakref.WeakSet()  # pipelines holding graphs (_free_at_exit)
_registered = False


def _free_at_exit(pipe):
    """Free `pipe`'s graphs at the interpreter's exit, while it is whole: freed in its teardown instead (the
    library prober's: with multiprocessing imported), MindSpore's Cell.__del__ found weakref's functions gone,
    six "Exception ignored" tracebacks on stderr. A pipeline a thread still runs keeps them."""
    global _registered
    if not _registered:
        atexit.register(_free_all)  # (after MindSpore's import: runs before whatever it registered)
        _registered = True
    _LIVE.add(pipe)


def _free_all():
    # (not one a call holds: a daemon thread may be in it; nor while another thread runs a graph: two threads in
    # MindSpore's executor at once deadlocked; nor in a forked child, whose MindSpore threads are gone)
    if any(pipe._pid != os.getpid() for pipe in _LIVE) or not _GRAPHS.acquire(timeout=5):
        return
    try:
        for pipe in list(_LIVE):
            if pipe._turn.acquire(blocking=False):
                pipe.target = pipe.engine = None
                pipe._turn.release()
        gc.collect()
    finally:
        _GRAPHS.release()


def _keywords_checked(fn):
    """fn, an unknown keyword refused by name (not as Python's TypeError): a method called with the user's."""
    @functools.wraps(fn)
    def call(self, *args, **kw):
        _known(kw, getattr(self, fn.__name__))  # (bound: "self" is no keyword of it)
        return fn(self, *args, **kw)
    return call


class Pipeline:
    @signals.holding  # a Ctrl-C meanwhile waits for the load's end (its imports: numpy's, tokenizers', MindSpore's,
    # onnxruntime's; see mindspec.signals), or for a safe point (before each graph compile)
    def __init__(self, target, draft=None, k="auto", max_seq=None, buckets=K_BUCKETS, device=None,
                 device_mem=None, tp=1, max_batch=1, batch_buckets=BATCH_BUCKETS, dtype=None, prefix_cache=True):
        target = _path("target", target)
        if max_seq is not None and not (is_int(max_seq) and max_seq >= 1):
            raise MindspecError(f"max_seq must be an integer >= 1 or None (sized for each call), got {shown(max_seq)}")
        if not (is_int(tp) and tp >= 1):
            raise MindspecError(f"tp must be an integer >= 1, got {shown(tp)}")
        if tp > 1 and not in_msrun():  # (it loaded and ran on one device)
            raise MindspecError(f"tp={tp} needs one process per rank, started by msrun: run `mindspec generate`, "
                                f"`serve` or `batch` with --tp {tp}")
        if not isinstance(prefix_cache, (bool, np.bool_)):
            raise MindspecError(f"prefix_cache must be True or False, got {shown(prefix_cache)}")
        max_seq = None if max_seq is None else int(max_seq)
        if device_mem is not None and not (is_number(device_mem) and 0 < device_mem < float("inf")):
            raise MindspecError(f"device_mem must be a number of bytes, got {shown(device_mem)}")
        check_device_env()  # (before MindSpore's import, which aborts on a bad one)
        budget()  # (a bad $MINDSPEC_COMPILE_CACHE_GB: refused before anything loads)
        self.device = detect_device(device)  # target and draft: "CPU" or "Ascend"
        self.dtype = resolve_dtype(dtype, self.device)  # the target's; refused before any weight loads
        self.spec = SpecConfig(k, buckets, batch_buckets, max_batch)
        self._batch_buckets = tuple(batch_buckets)
        self.ckpt = Checkpoint(target)
        self.cfg = self.ckpt.config
        self.tokenizer = Tokenizer(target)
        top, token = self.tokenizer.highest()
        if top >= self.cfg.vocab_size:
            raise MindspecError(f"tokenizer.json has token id {top} ({token!r}), outside the model's vocabulary "
                                f"[0, {self.cfg.vocab_size})")
        self.eos = frozenset(self.cfg.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids)
        self.target = self.proposer = self.engine = self.manifest = self.draft_path = None
        self._turn, self._holder = threading.Lock(), None  # run(): one call at a time, threads take turns (_stream)
        self._pid = os.getpid()  # (_check_process)
        self._mark = object()  # on the requests this pipeline makes (_check_stream)
        self.prefix_cache = bool(prefix_cache)  # a new request reuses the K/V of a prefix a finished one left (engine.py)
        self.set_draft(draft)
        self._check_k(k)
        self.fixed_max_seq = max_seq
        self.device_mem, self.tp = device_mem, tp  # bytes per device: refuse what cannot fit
        from .default import home
        self.cache_dir = os.path.join(home(), "compile_cache")  # see TargetModel.warmup

        # MindSpore only now (~3 s to import): a bad checkpoint, tokenizer or draft is refused before it
        # (raised inside its import, a Ctrl-C aborted the interpreter at exit or failed the import)
        from mindspec.graphs.runner import init_mindspore
        with _GRAPHS:
            init_mindspore(self.device)
        if max_seq:
            self._build(max_seq, max_batch)

    # ---- what callers may read

    @property
    def k(self):
        return self.spec.k

    @property
    def buckets(self):
        return self.spec.k_buckets

    @property
    def model_dir(self):
        return self.ckpt.dir

    @property
    def max_seq(self):
        """Positions a request can fill: the fixed --max-seq, else the current (growable) cache."""
        return self.fixed_max_seq or (self.target.max_seq if self.target else self.max_positions)

    @property
    def max_positions(self):
        """Positions a request (prompt and new tokens) may fill at most: the fixed --max-seq, else the
        smaller of the model's and the draft's (an export may hold fewer)."""
        return self.fixed_max_seq or min(self.cfg.max_position_embeddings,
                                         self.manifest["max_seq"] if self.manifest else float("inf"))

    @property
    def max_seq_said(self):
        """max_positions as a refusal says it: whose limit it is, when the draft's export set it."""
        n, m = self.max_positions, self.manifest
        draft = not self.fixed_max_seq and m and m["max_seq"] < self.cfg.max_position_embeddings
        return f"max_seq {n}" + (" (the positions the draft was exported for)" if draft else "")

    # ---- model setup

    def _check_draft(self, path):
        from mindspec.export import check_profile, read_pair_manifest
        m = read_pair_manifest(path, self.cfg, self.tokenizer)
        check_profile(m, path, self.device)  # (before the target loads)
        return m

    def _check_k(self, k):
        """A fixed k needs a draft (found: without one it ran target-only silently; the CLI refuses it too)."""
        if self.draft_path is None and k is not None and k != "auto":
            raise MindspecError(f"k={k} sets the draft tokens of a step: there is no draft (give one, or set_draft)")

    def set_draft(self, path):
        """Swap the draft (None or False: target-only), keeping the compiled target. Not while a call of this
        pipeline is open (a stream not yet ended, a callback's own call); a draft refused changes nothing."""
        # (the running rows' engine would be dropped: a call on another thread then spun for ever)
        self._check_process()
        if not self._turn.acquire(blocking=False):  # a call runs: on another thread, or this is its callback
            raise MindspecError("cannot change the draft while requests are running")
        try:
            self._set_draft(path)
        finally:
            self._turn.release()

    def _set_draft(self, path):
        path = None if path is None or path is False else _path("draft", path)
        was = self.manifest, self.draft_path
        self.manifest = self._check_draft(path) if path else None
        self.draft_path = path
        try:
            if self.target is not None:
                self._engine()
        except BaseException:
            self.manifest, self.draft_path = was
            raise

    def _engine(self):
        """The draft session and the engine over the current target. The dynamic-K costs depend on the
        pair and the cache size: measured again when next needed."""
        from mindspec.export import DraftSession
        from .proposer import DraftProposer
        t, m = self.target, self.manifest
        if m and self.max_positions > m["max_seq"]:
            raise MindspecError(f"max_seq {self.max_positions} is more than the {m['max_seq']} positions the draft "
                                f"was exported for")
        # a row's draft holds at most max_positions - 2 (its drafts are capped to what the target commits)
        self.proposer = DraftProposer(DraftSession(self.draft_path, max_seq=min(t.max_seq + max(t.k_buckets),
                                                                                m["max_seq"]),
                                                   max_batch=t.max_batch, device=self.device)) \
            if self.draft_path else None
        self.costs = None
        self.engine = Engine(t, self.proposer, self.spec, prefix_cache=self.prefix_cache)

    @_graphs
    def _build(self, max_seq, max_batch):
        """(Re)build the target graphs and the draft cache for `max_seq` positions and `max_batch` rows."""
        from mindspec.graphs.runner import TargetModel
        check_size(self.cfg, self.draft_path, self.manifest, max_seq, max_batch, dtype=self.dtype, device=self.device,
                   device_mem=self.device_mem, tp=self.tp, k_buckets=self.spec.k_buckets)
        if max_batch != self.spec.max_batch:
            self.spec = SpecConfig(self.spec.k, self.spec.k_buckets, self._batch_buckets, max_batch)
        self.target = None  # free the old graphs' memory first
        self.target = TargetModel(self.ckpt, max_seq, self.spec.k_buckets, self.spec.batch_buckets, max_batch,
                                  self.dtype)
        _free_at_exit(self)
        if self.tp > 1:  # every rank has its weights before any starts the first graph's collectives
            from .tp import barrier
            barrier()
        self._engine()

    def _ensure(self, positions, max_batch):
        """A cache of at least `positions` positions and `max_batch` slots (rebuilt only while idle)."""
        t = self.target
        if t is not None and t.max_seq >= positions and t.max_batch >= max_batch:
            return
        if self.engine is not None and self.engine.has_work:
            raise MindspecError("cannot resize the KV cache while requests are running")
        self._build(positions, max(max_batch, t.max_batch if t else 1))

    def encode(self, prompt=None, prompt_ids=None, chat=False, limit=None):
        if (prompt is None) == (prompt_ids is None):
            raise MindspecError("give exactly one of a prompt or prompt ids")
        if prompt_ids is not None:
            if chat:  # (was ignored)
                raise MindspecError("chat=True wraps a text prompt in the chat template: it does not apply to "
                                    "prompt_ids")
            try:  # (a generator is read once; a 0-d array iterates into a TypeError)
                if isinstance(prompt_ids, (str, bytes, dict, set)):
                    raise TypeError
                prompt_ids = list(prompt_ids)
            except TypeError:
                raise MindspecError("prompt_ids must be a list of integer token ids") from None
            if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in prompt_ids):
                raise MindspecError("prompt_ids must be a list of integer token ids")  # not 1.7 -> 1, True -> 1
            ids = [int(i) for i in prompt_ids]
            bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
            if bad:
                raise MindspecError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        else:
            if not isinstance(prompt, str):
                raise MindspecError(f"prompt must be a string, got {type(prompt).__name__}")
            checked_text("prompt", prompt)
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
            ids = self.tokenizer.encode(text, limit, self.max_seq_said if limit == self.max_positions else None)
        if not ids:
            raise MindspecError("the prompt is empty")
        return ids

    @_keywords_checked
    def request(self, prompt=None, prompt_ids=None, max_new_tokens=64, temperature=0.0, seed=None, stop=None,
                chat=False, k=None, speculate=True, top_k=0, top_p=1.0, repetition_penalty=1.0,
                draft_temperature=None, draft_min_conf=None, request_id=None, logprobs=None, presence_penalty=0.0,
                frequency_penalty=0.0):
        """A validated Request (generate's keywords); a sampled request without a seed gets a drawn one.
        logprobs=n: each generated token's logprob under the target (its raw logits) and its n most
        likely alternatives (0..TOP_LOGPROBS), in Result.logprobs."""
        for flag, v in (("speculate", speculate), ("chat", chat)):
            if not isinstance(v, (bool, np.bool_)):
                raise MindspecError(f"{flag} must be True or False, got {shown(v)}")
        if not speculate and k is not None and k != "auto":  # (was ignored; the CLI refuses it too)
            raise MindspecError(f"k={k} sets the draft tokens of a step: it does not apply with speculate=False")
        if not (request_id is None or isinstance(request_id, str) or is_int(request_id)):
            raise MindspecError(f"request_id must be a string or an integer, got {shown(request_id)}")
        self._check_k(k)
        k = self.spec.k_for_request(k)
        stop = stop_strings(stop)
        if seed is None and temperature:
            seed = share(int.from_bytes(os.urandom(7), "little"))  # rank 0's: every rank must draw the same
        params = SamplingParams(temperature, top_k, top_p, repetition_penalty, draft_temperature, seed,
                                presence_penalty, frequency_penalty)
        if draft_min_conf is not None and not (is_number(draft_min_conf) and 0 < draft_min_conf < 1):
            raise MindspecError(f"draft_min_conf must be between 0 and 1, got {shown(draft_min_conf)}")
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise MindspecError(f"max_new_tokens must be an integer >= 1, got {shown(max_new_tokens)}")
        if logprobs is not None and not (is_int(logprobs) and 0 <= logprobs <= TOP_LOGPROBS):
            raise MindspecError(f"logprobs must be an integer in [0, {TOP_LOGPROBS}] (alternatives per token), "
                                f"got {shown(logprobs)}")
        max_new_tokens, logprobs = int(max_new_tokens), None if logprobs is None else int(logprobs)
        limit = self.max_positions
        ids = self.encode(prompt, prompt_ids, chat, limit)
        # (the target's cache is rounded up to a prefill chunk: a request still ends at the pair's limit)
        r = Request(ids, params, min(max_new_tokens, limit - len(ids)), stop=stop, eos=self.eos, k=k,
                    speculate=speculate and self.draft_path is not None, tokenizer=self.tokenizer,
                    draft_min_conf=draft_min_conf, request_id=request_id)
        self._fits(r)
        r.logprobs, r.made_by = logprobs, self._mark
        return r

    @_graphs
    def prepare(self, reqs, max_batch=1, every_graph=False, rows_now=None, penal=False):
        """Size the cache for these requests (read them first, size once), compile what they need
        (every graph of every batch bucket with every_graph) and measure the dynamic-K costs. rows_now:
        where the compile cache holds every graph and the costs are known (measuring them runs every
        graph), load only the graphs of batches up to that many rows now, the others left to
        target.load_next; penal: the graphs of rows with presence/frequency penalties too (a request with
        them asks for them itself). Returns the seconds spent compiling (or loading from the compile cache)."""
        _check_call("prepare", reqs, max_batch)  # (0 rows returned as if done)
        if rows_now is not None and not (is_int(rows_now) and rows_now >= 1):
            raise MindspecError(f"rows_now must be an integer >= 1 or None, got {shown(rows_now)}")
        before = self.target
        compiled = before.compile_s if before else 0.0
        need = max(len(r.prompt_ids) + r.max_new_tokens for r in reqs) if reqs else 1
        positions = self.fixed_max_seq or self.spec.seq_for(need, self.max_positions)
        n = max_batch if every_graph else min(max_batch, max(len(reqs), 1))  # (no slot for rows that cannot come)
        self._ensure(positions, n)
        t, spec = self.target, self.spec
        sizes = [b for b in spec.batch_buckets if b <= spec.batch_bucket(n)]
        drafting = self.proposer is not None and (every_graph or any(r.speculate for r in reqs))
        kinds = {r.graph_kind for r in reqs}
        greedy, sample = every_graph or "greedy" in kinds, every_graph or "sample" in kinds
        ks = [0] + [k for k in t.k_buckets if drafting and (every_graph or any(
            r.speculate and (r.k == "auto" or k <= r.k) for r in reqs))]  # a fixed K runs buckets <= K only
        penal = penal or "penal" in kinds
        names = t.graph_names(sizes, ks, greedy, sample, None if every_graph else need, penal)
        t.warmup(names, self.cache_dir, None if rows_now is None else sum(B <= rows_now for _, B, *_ in names))
        if drafting and (every_graph or any(r.k == "auto" for r in reqs)):
            self._dynamic_for(sizes)
        return self.target.compile_s - (compiled if self.target is before else 0.0)  # (a resize: a new target)

    def _dynamic_for(self, sizes):
        """The engine's DynamicK with measured costs for these batch sizes (kept across requests: its
        acceptance prior carries over)."""
        from .policy import DynamicK, measure_costs
        have = self.costs or {}
        if all(b in have for b in sizes) and self.engine.dynamic is not None:
            return
        if not all(b in have for b in sizes):
            from .policy import Costs
            new = measure_costs(self, [b for b in sizes if b not in have])
            self.costs = Costs({**have, **new}, getattr(have, "feed", None) or new.feed)
        prior = self.engine.dynamic
        # every tensor-parallel rank picks the same K from the same shared costs and acceptance
        self.engine.dynamic = DynamicK(self.spec.k_buckets, self.costs, feed=getattr(self.costs, "feed", 0.0))
        if prior is not None:
            self.engine.dynamic.seen_acc, self.engine.dynamic.seen_trials = prior.seen_acc, prior.seen_trials

    def _check_process(self):
        """Refuse a forked child (the library prober's: its generate hung for ever, silently)."""
        if os.getpid() != self._pid:
            raise MindspecError(f"this pipeline was loaded by process {self._pid}, and a process forked from it "
                                "cannot run it (MindSpore's and onnxruntime's threads do not survive a fork: it "
                                "would hang): start children with multiprocessing's \"spawn\" method, or fork "
                                "before loading")

    def run(self, reqs, on_event=None, max_batch=1):
        """Run requests to the end through the engine, up to max_batch at once (the rest join as rows
        finish). on_event(request, text) gets each step's new text per request, and its end."""
        if on_event is not None and not callable(on_event):  # (raised after the first step)
            raise MindspecError(f"on_event must be a callable (it gets each request's new text), got {shown(on_event)}")
        for r, text in self.stream(reqs, max_batch):
            if on_event is not None:
                on_event(r, text)
        return reqs

    def stream(self, reqs, max_batch=1, ready=None):
        """Run requests (a list or tuple of Requests) to the end through the engine, up to max_batch at once
        (the rest join as rows finish), yielding (request, text) after each step for each request that
        committed text or ended (request.done). ready() is called once the warm-up (compiling, measuring costs) is done. Calls from
        several threads take turns (the graphs and caches are one: a stream holds them until it ends or is
        closed); one left by an exception (Ctrl-C, a consumer that raised) or closed half-way leaves the
        engine empty. A Ctrl-C is held back only while MindSpore runs (each warm-up and step, see _held):
        the consumer's own code between steps gets it as usual. The loop every caller shares. Its arguments
        are checked here (a generator's body runs at its first next(): the error came where it was read)."""
        self._check_stream(reqs, max_batch)
        return self._stream(reqs, max_batch, ready)

    def _check_stream(self, reqs, max_batch):
        self._check_process()
        holder = self._holder  # the thread that last ran or read on the open call (None: none open)
        if holder is threading.current_thread():
            raise MindspecError("generate was called from inside its own callback, or while a stream of this "
                                "pipeline is open: call it after that one ends (or close the stream)")
        self._check_holder()
        _check_call("run and stream", reqs, max_batch)  # (0 rows waited for ever)
        # (another pipeline's request holds its tokenizer and EOS, its ids checked against its vocabulary: found
        # reaching a smaller model's graph as a raw Gather error)
        if any(getattr(r, "made_by", None) is not self._mark for r in reqs):
            raise MindspecError("a request runs on the pipeline that made it: make it with this pipeline's request()")
        if len({id(r) for r in reqs}) < len(reqs):  # (its second turn never came: a spin)
            raise MindspecError("the same request is given twice: make one per generation")
        if any(r.ran for r in reqs):
            raise MindspecError(RUNS_ONCE)
        for r in reqs:
            self._recheck(r)

    def _recheck(self, r):
        """What request() checked of a Request's prompt and length, again: its caller may have changed them since
        (a user probe's: ids outside the vocabulary reached MindSpore's Gather as a many-line RuntimeError, an
        emptied prompt an AssertionError, a max_new_tokens past the cache was cut unsaid)."""
        r.prompt_ids = self.encode(prompt_ids=r.prompt_ids)
        self._fits(r)

    def _fits(self, r):
        """Refuse a request whose prompt and max_new_tokens do not fit the pair's positions."""
        n, room = r.max_new_tokens, self.max_positions - len(r.prompt_ids)
        if room < 1:
            raise MindspecError(f"prompt is {len(r.prompt_ids)} tokens; it does not fit {self.max_seq_said}")
        if not is_int(n) or not 1 <= n <= room:
            raise MindspecError(f"max_new_tokens must be an integer from 1 to {room} (what the {len(r.prompt_ids)}-"
                                f"token prompt leaves of {self.max_seq_said}), got {shown(n)}")

    def _check_holder(self):
        holder = self._holder
        if holder is not None and not holder.is_alive():  # (waiting for it hung: no thread is to read it on)
            raise MindspecError("a stream of this pipeline is open, left half-read by a thread that has ended: "
                                "read it to its end or close it (stream.close()) first")

    def _stream(self, reqs, max_batch, ready):
        self._check_stream(reqs, max_batch)  # (again: what was true when it was made may not be when it starts)
        while not self._turn.acquire(timeout=0.5):  # (its holder may end while this call waits)
            self._check_holder()
        try:
            self._holder = threading.current_thread()
            steps = self._steps(reqs, int(max_batch), ready)
            try:
                for event in steps:
                    yield event
                    self._holder = threading.current_thread()  # (who reads it on: its own call would wait for itself)
            except BaseException:  # (GeneratorExit too: a consumer that stopped reading)
                if any(r.state != WAITING or r.pos for r in reqs):  # (the engine took them; if not, loading failed:
                    for r in reqs:  # they may run again)
                        r.finish("abort")  # (a request ended: no-op)
                if self.engine is not None:
                    self.engine.reset()  # (this call's requests were the only ones in it)
                raise
            finally:
                steps.close()
                self._holder = None
        finally:
            self._turn.release()

    def _steps(self, reqs, max_batch, ready):
        warm_up, held = self._held(lambda: self.prepare(reqs, max_batch))
        signals.stop_here(held)
        compile_s = self.target.compile_s
        if ready is not None:
            ready()
        todo, pending = deque(reqs), set()
        while todo or pending:
            while todo and len(pending) < max_batch:  # the engine may have more slots than max_batch
                pending.add(todo[0])
                self.engine.add(todo.popleft())
            events, held = self._held(self.engine.step)
            for r, text in events:
                if r.done:
                    pending.discard(r)
                    r.stats.compile_s = warm_up + self.target.compile_s - compile_s  # (+ compiled on first need)
                if text or r.done:
                    yield r, text
            signals.stop_here(held)  # (after the step's results went out: a batch job writes their records first)

    def _held(self, fn):
        """(fn(), the library's Signals, holding what came meanwhile): a library call's Ctrl-C or SIGTERM (the
        main thread's, where no command holds the signals) during a warm-up or a step is recorded, and passed
        on after it (signals.stop_here) to the handler the caller had (Python's raises KeyboardInterrupt; a
        script's own handler or an ignored signal stay the script's), and MindSpore's own SIGINT handler,
        which a graph run sets and which sends the process SIGTERM, undone then (a script died on Ctrl-C,
        even in a time.sleep after its last generation). A second one passes on at once. Under a command's
        signal handling nothing is installed here (None)."""
        with _GRAPHS, signals.held() as held:
            out = fn()
        return out, held

    def generate(self, prompt=None, prompt_ids=None, max_new_tokens=64, on_text=None, **kw):
        """Generate (greedy at temperature 0, else speculative sampling: the target's distribution
        exactly, whatever the draft); `on_text(delta)` receives text as it is produced. `k` overrides the
        pipeline's K for this call (a compiled bucket, or "auto" for dynamic K); speculate=False
        decodes with the target alone through the same graphs (the baseline). `draft_min_conf` stops
        drafting before a token the draft itself gives less than that probability (off by default: it
        measured slower for the default self-draft, see README)."""
        if on_text is not None and not callable(on_text):
            raise MindspecError(f"on_text must be a callable (it gets each new piece of text), got {shown(on_text)}")
        return self.run_one(self.request(prompt=prompt, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, **kw),
                            on_text)

    def run_one(self, r, on_text=None):
        """Run one Request alone: its Result (a failure raised); on_text(delta) as generate's."""
        self.run([r], (lambda _, text: text and on_text(text)) if on_text else None)
        if r.error is not None:
            raise r.error
        return r.result()

    def generate_many(self, requests, max_batch=None):
        """requests: a list of dicts of generate's keywords. Results in input order, up to max_batch
        (default: the pipeline's) running at once. A bad entry raises MindspecError naming it before
        anything runs; a request that fails while running has finish_reason "error"."""
        if requests is None or isinstance(requests, (str, bytes, dict)) or not hasattr(requests, "__iter__"):
            raise MindspecError("requests must be a list of dicts of generate's keywords, "
                                f"got {type(requests).__name__}")
        requests = list(requests)  # (a generator is read once)
        reqs = []
        for i, kw in enumerate(requests):
            if not isinstance(kw, dict):
                raise MindspecError(f"requests[{i}] must be a dict of generate's keywords, got {type(kw).__name__}")
            try:
                reqs.append(self.request(**kw))
            except MindspecError as e:
                raise MindspecError(f"requests[{i}]: {e}") from None
        self.run(reqs, max_batch=self.spec.max_batch if max_batch is None else max_batch)
        return [r.result() for r in reqs]


def _known(kw, fn):
    """Refuse a keyword fn does not take, by name (not as a TypeError from inside)."""
    unknown = sorted(set(kw) - set(inspect.signature(fn).parameters), key=str)
    if unknown:
        raise MindspecError(f"unknown keyword {shown(unknown[0])}")


def _path(what, p):
    """A path given as a str or a path-like object, as a str."""
    if not isinstance(p, (str, os.PathLike)):
        raise MindspecError(f"{what} must be a path (a str or os.PathLike), got {shown(p)}")
    if not os.fspath(p):  # (an unset "$DRAFT" ran target-only: no draft is None, or False in load)
        raise MindspecError(f"the {what} path is empty")
    return os.fspath(p)


def _check_call(who, reqs, max_batch):
    """reqs a list or tuple of Requests (a generator was read by the check, a lone Request was "not iterable"),
    max_batch an integer >= 1."""
    if not (is_int(max_batch) and max_batch >= 1):
        raise MindspecError(f"max_batch must be an integer >= 1, got {shown(max_batch)}")
    if not isinstance(reqs, (list, tuple)) or not all(isinstance(r, Request) for r in reqs):
        raise MindspecError(f"{who} take{'' if ' and ' in who else 's'} a list of Requests (made by Pipeline.request)")


def check_size(cfg, draft_path, manifest, max_seq, max_batch, *, dtype, device, device_mem, tp, k_buckets=K_BUCKETS,
               replicas=1):
    """Refuse a cache of max_batch slots of max_seq positions that the pair or the device cannot hold, before any
    weight loads (also before a server binds its port): more positions than the model's; on a device of
    `device_mem` bytes, the planner's figure; on a CPU, rows that need more than all of the host's memory (swap
    and the weights aside: a coarse bound), which `replicas` engines share. manifest: the draft's (draft_path),
    read already."""
    if max_seq > cfg.max_position_embeddings:
        raise MindspecError(f"{max_seq} positions exceed the model's {cfg.max_position_embeddings} (its "
                            + ("sliding window: mindspec attends to every position" if cfg.sliding_window
                               else "max_position_embeddings") + ")")
    positions = cache_positions(max_seq, k_buckets)  # per slot, as allocated
    if device_mem:  # in the dtypes really used (the draft's: its manifest)
        from .plan import check_fits, shape_from_config, shape_from_draft
        from mindspec.graphs.fuse import rot_rows_for
        check_fits(shape_from_config(cfg, PLAN_DTYPE[dtype], rot_rows=rot_rows_for(device)),
                   shape_from_draft(draft_path, sha=False) if draft_path else None,
                   tp=tp, device_mem=device_mem, seq_len=positions, rows=max_batch, flag="--max-seq",
                   tail=cache_positions(1, k_buckets) - 1)  # (what a slot adds to any --max-seq, at most)
    elif device == "CPU":
        from .plan import DTYPE_BYTES, GB, host_bytes_per_row, host_memory
        need = host_bytes_per_row(cfg, DTYPE_BYTES[PLAN_DTYPE[dtype]], positions, manifest) * max_batch * replicas
        have = host_memory()
        if need > have:
            many = f"{replicas} replicas of " if replicas > 1 else ""
            raise MindspecError(f"{many}{max_batch} rows of {max_seq} positions need about {need / GB:.1f} GB (KV "
                                f"caches and graph workspace), more than this machine's {have / GB:.1f} GB: "
                                f"lower --max-batch (bench: --batch-sizes){', --dp' if many else ''} or --max-seq")


def load(target=None, draft=None, k="auto", **kw):
    """Load a target checkpoint dir and an ONNX draft (None: target-only). With no target, the
    embedded default pair (SmolLM2-135M-Instruct and its 8-bit self-draft) is used; draft=False
    then loads the default target alone."""
    _known(kw, Pipeline)  # (before the default pair is made)
    if target is None:
        from .default import default_pair
        target, default_draft = default_pair(device=kw.get("device"))
        draft = default_draft if draft is None else draft
    return Pipeline(target, draft, k=k, **kw)
