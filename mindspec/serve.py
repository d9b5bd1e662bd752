"""`mindspec serve`: an HTTP server speaking MindIE Service's request conventions (docs/serve.md).

Continuous batching: the main thread is the only one that touches the engine (MindSpore and the
signal handlers live there): each turn it takes the requests that arrived and the ones whose client
went away, then runs one engine step over every running row. The HTTP side (mindspec.http: aiohttp
on a thread of its own; the endpoints in mindspec.api) parses a request, hands it over here and
relays the engine's events to its client. A client that goes away (streamed or not) aborts its row
at the next step; SIGINT/SIGTERM fail the queued and running requests with 503 and stop the server
cleanly. A first start compiles every graph before it says ready. A warm start (the compile cache holds
every graph, the dynamic-K costs are known) says ready once the one-row graphs are loaded and have run
once (a graph's first run costs ~0.3 s more than the next), and loads the larger batches' while it
serves: one per idle tick, or one per step while a request waits for a batch no loaded graph holds yet;
an idle server also runs each of them once (mindspec_graphs_cold counts what is left).
A failing engine call ends its requests with a 500 and the worker goes on; FAILED_STEPS failed steps in
a row make /health answer 503 until a step succeeds (see App._account), as does a step that hangs past
--step-timeout until it ends (App.stalled).
"""
import asyncio
import contextlib
import itertools
import os
import queue
import sys
import threading
import time
import traceback

from .errors import MindspecError, NotFinite, summary
from .formats import pieces
from .metrics import Metrics
from .mindie_config import QUEUE_DELAY_US, STEP_TIMEOUT
from .request import RequestError, make, parse
from . import signals
from .tp import share, stoppable

TICK = 0.5  # s: how long an idle worker waits for a request before checking signals (and, under TP, pinging)
# Engine steps failing in a row (a target or draft call raised: its requests ended with finish reason "error")
# before /health and /v2/health/ready answer 503. One failing step can be one odd request's (its rows end with
# the error, the others go on); three with nothing succeeding between them is the engine itself (a device
# fault, a broken graph), and a load balancer should stop sending requests here. Small, so it says so within
# a few requests; one successful step makes the server healthy again.
FAILED_STEPS = 3
STOP = "stop"  # what rank 0 of a tensor-parallel server shares when it stops, for the other ranks
PROBE = {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True}  # a prefill and a draft + verify step


class _Job:
    """One request for the worker, created on the HTTP loop. events (an asyncio queue fed from the worker
    thread, shared by the jobs of one HTTP request, each event tagged with its job's index there):
    ("text", (delta, [(id, text)])), then ("done", (prompt_ids, Result, [(id, text)] not yet sent, [(id, text)]
    of every token: the non-streamed answer's)) or
    ("error", MindspecError) or ("fail", Exception) or ("unavailable", None)."""

    def __init__(self, rid, kw, put, events, tag, probe=False):
        self.id, self.kw, self.cancelled, self.tag, self.probe = rid, kw, threading.Event(), tag, probe
        self.events, self._put = events, put
        self.t0 = time.perf_counter()  # arrival (metrics)
        self.sent = self.shown = 0  # tokens and characters handed to the HTTP side
        self.why = "the client went away"  # (why a cancel came, for the log line; the handler may say otherwise)

    def put(self, event):
        if not self.probe:  # a health probe's events go nowhere: the worker's accounting is its answer
            self._put(self.events.put_nowait, (self.tag, event))


class App:
    """What the endpoints share: the pipeline (once loaded), the request defaults, the job queue, the
    metrics."""

    def __init__(self, defaults, model_name=None, tp=False, max_batch=1, max_queue=64, queue_delay_us=QUEUE_DELAY_US,
                 step_timeout=STEP_TIMEOUT):
        self.defaults, self.model_name, self.tp, self.max_batch = defaults, model_name, tp, max_batch
        self.step_timeout = step_timeout  # s (0: never); see stalled
        self.busy_since = None  # (monotonic) when the worker's turn running now began (None: waiting for requests)
        self._stall_said = None  # the busy_since whose stall was logged
        self._stall_lock = threading.Lock()  # (the worker ends a turn, the HTTP thread finds it stalled: one at a time)
        self.queue_delay = queue_delay_us / 1e6  # s a freed row waits for a request before the next step
        self.max_queue = max_queue  # requests waiting for a row beyond the running ones; more: 429
        self.pipe, self.started = None, int(time.time())
        self.ready, self.stopping = threading.Event(), threading.Event()
        self.jobs, self.live, self._lock, self._ids = queue.Queue(), {}, threading.Lock(), itertools.count()
        self.metrics = Metrics()
        self.metrics.waiting.set_function(lambda: self.jobs.qsize() + len(self._engine("waiting")))
        self.metrics.running.set_function(lambda: len(self._engine("rows")))
        self.metrics.healthy.set_function(lambda: float(self.ready.is_set() and self.unhealthy() is None))
        self.metrics.cold_graphs.set_function(lambda: self.pipe.target.cold_count() if self.ready.is_set() else 0)
        # (engine steps failed in a row, the last one's error in one line): written by the worker as one
        # tuple, read by the HTTP thread
        self.engine_state, self._probing = (0, None), False
        self.warming = False  # the last turn ran a cold graph (see turn): the next takes no tick's wait
        self.warm_failed = False  # an idle first run failed (_warm_next): none is tried again
        self.call = None  # runs a function on the HTTP loop (set by serve)

    def _engine(self, attr):
        """The engine's waiting queue or rows (empty while loading), for the metrics' gauges."""
        eng = self.pipe.engine if self.pipe is not None else None
        return () if eng is None else getattr(eng, attr)

    def submit(self, kws):
        """Queue the requests of one HTTP request (several: OpenAI's n), all or none; their jobs share
        one event queue."""
        with self._lock:
            if self.stopping.is_set():
                raise RequestError("the server is shutting down", 503)
            if len(self.live) + self.jobs.qsize() + len(kws) > self.max_batch + self.max_queue:
                raise RequestError(f"the server is busy: {self.max_batch} requests running and {self.max_queue} "
                                   "waiting; retry later", 429)
            events = asyncio.Queue()
            jobs = [_Job(next(self._ids), kw, self.call, events, i) for i, kw in enumerate(kws)]
            for job in jobs:
                self.jobs.put(job)
        return jobs

    def _take(self, wait):
        """The new jobs and the ids of live jobs whose client left (waiting up to `wait` s for the first)."""
        new = []
        try:
            new.append(self.jobs.get(timeout=wait) if wait else self.jobs.get_nowait())
            while True:
                new.append(self.jobs.get_nowait())
        except queue.Empty:
            pass
        gone = [rid for rid, job in self.live.items() if job.cancelled.is_set()]
        return [(j.id, j.kw) for j in new if not j.cancelled.is_set()], gone, {j.id: j for j in new}

    def work(self):
        """The worker loop (main thread). Under tensor parallelism this is rank 0: each turn it hands the
        new requests and aborts to the other ranks (see follow), which apply them and step in lock step."""
        if self.tp:
            with stoppable():  # a stop now reaches this rank alone (the launcher's SIGTERM), which ends the others
                return self._work()
        return self._work()

    def _work(self):
        eng, ended = self.pipe.engine, False
        while True:
            try:
                signals.check()  # SIGINT/SIGTERM end the loop here (mindspec.signals)
            except KeyboardInterrupt:
                if self.tp:
                    share(STOP)  # the other ranks wait in follow()'s share: they end
                raise
            free = self.max_batch - len(eng.rows) - len(eng.waiting) - self.jobs.qsize()
            new, gone, jobs = self._take(wait_s(eng.has_work or self.warming, ended and free > 0, self.queue_delay))
            self.busy_since = time.monotonic()  # (the turn's collectives, idle first runs and step: see stalled)
            try:
                if self.tp:
                    share((new, gone))  # also when idle: the other ranks must not wait in a collective for long
                for rid, kw in new:
                    self.live[rid] = jobs[rid]
                with signals.deferred() if self.tp else contextlib.nullcontext():  # (the other ranks run it too)
                    ended = self.turn(new, gone, self._events, account=True)
            finally:
                with self._stall_lock:
                    began, self.busy_since = self.busy_since, None
                    said = self._stall_said == began
                if said:
                    _log(f"mindspec: healthy again: the engine's turn ended after {time.monotonic() - began:.0f} s")

    def turn(self, new, gone, on_event, account=False):
        """Apply one turn's new requests and aborts, then run one engine step (every rank runs this).
        on_event(id, kind, value): ("error", MindspecError) or ("fail", Exception) for a request that could not
        be made, ("text", (delta, request)), ("end", request).
        account (rank 0): the step counts for /health before any client hears of it, so a client that got
        its 500 sees the health that step left. Returns whether a request ended."""
        eng = self.pipe.engine
        for rid, kw in new:
            try:
                job = self.live.get(rid)  # (rank 0's: queued since it arrived, a step before this turn maybe)
                eng.add(make(self.pipe, kw, request_id=rid), arrived=job.t0 if job is not None else None)
            except MindspecError as e:
                on_event(rid, "error", e)
            except Exception as e:  # noqa: BLE001 - a bug: that request's 500, not the worker's end
                on_event(rid, "fail", e)
        for rid in gone:
            eng.abort(rid)
        t = self.pipe.target
        if not eng.has_work:
            # idle (a whole tick with nothing, then back to back until a request comes): compile a graph warm-up
            # left, else run one it compiled for the first time, so no request pays either
            self.warming = not new and not gone and (self._load_next() or self._warm_next())
            return False
        self.warming = False
        if eng.waiting and len(eng.rows) >= t.ready_rows():
            self._load_next()  # a request waits for a larger batch's graphs: one a step, the rows go on between
        decodes = eng.decodes
        events = eng.step()
        if account:
            self._account(events, decoded=eng.decodes > decodes)
        for req, text in events:
            if text:
                on_event(req.id, "text", (text, req))
            if req.done:
                on_event(req.id, "end", req)
        return any(req.done for req, _ in events)

    def _load_next(self):
        """Compile the next graph warm-up left (TargetModel.load_next). One that fails leaves the server serving
        the batches it has, and says so; under tensor parallelism the job ends instead (as a failing warm-up
        before ready does): ranks holding different graphs would admit different rows."""
        t = self.pipe.target
        try:
            return t.load_next()
        except Exception as e:  # noqa: BLE001 - a graph that does not compile must not stop the requests running
            if self.tp:
                raise
            _log(f"mindspec: the graphs for batches larger than {t.ready_rows()} did not compile ({summary(e)}); "
                 f"serving up to {t.ready_rows()} at once")
            return False

    def _warm_next(self):
        """Run a compiled graph's first run while idle (TargetModel.warm_next). One that fails leaves the server
        serving, and says so; no other is tried (the requests that need those graphs run them, and fail or
        not by themselves). Under tensor parallelism the job ends instead, as in _load_next."""
        if self.warm_failed:
            return False
        try:
            return self.pipe.target.warm_next()
        except Exception as e:  # noqa: BLE001 - a dummy run must not stop the requests to come
            if self.tp:
                raise
            self.warm_failed = True
            self.pipe.engine.reset()  # (idle: nothing runs; what the slots cached may be half overwritten)
            _log(f"mindspec: an idle first run of a graph failed ({summary(e)}); no more are run before requests "
                 "need them")
            return False

    def _account(self, events, decoded):
        """Count engine steps failing in a row (rank 0's worker). A step fails when a request ended in it
        with an error (the engine ends the rows of a target or draft call that raised), even if other rows
        went on; it succeeds when none did and its draft + verify call worked (decoded). Other steps (a
        prompt chunk, aborts, requests that ended at the first token their prompt call gave) change
        nothing, so a fault in the decode call alone still counts although every prefill works."""
        failed, last = self.engine_state
        # (not a request's own: a float16 overflow its prompt led to; the engine works)
        errors = [r.error for r, _ in events if r.finish_reason == "error" and not isinstance(r.error, NotFinite)]
        if errors:
            self.metrics.engine_errors.inc()
            self.engine_state = failed + 1, summary(errors[-1])
            if failed + 1 == FAILED_STEPS:
                _log(f"mindspec: unhealthy: {self.failing()}; /health answers 503 until a step succeeds")
        elif failed and decoded:
            self.engine_state = 0, None
            if failed >= FAILED_STEPS:
                _log("mindspec: healthy again: an engine step succeeded")

    def unhealthy(self):
        """Why /health answers 503 once ready (one line), or None: a step hung (stalled) or failing steps."""
        return self.stalled() or self.failing()

    def stalled(self):
        """Why the engine looks hung (one line), or None: the worker's turn running now (rank 0's collectives with
        the other ranks, an idle graph's first run, the engine step) has gone on for more than step_timeout s
        since it began or since the target's last graph compile ended, and the target is not compiling (a
        request's first call of a shape may compile for minutes). Said on stderr once a turn."""
        t = self.pipe.target if self.pipe is not None else None
        with self._stall_lock:
            began = self.busy_since
            if began is None or not self.step_timeout or t is None or t.compiling:
                return None
            s = time.monotonic() - max(began, t.compiled_at)
            if s <= self.step_timeout:
                return None
            why = (f"an engine step has run for {s:.0f} s, past --step-timeout {self.step_timeout:g} s: a device or "
                   "a tensor-parallel rank may hang")
            if self._stall_said != began:
                self._stall_said = began
                _log(f"mindspec: unhealthy: {why}; /health answers 503 until the step ends")
        return why

    def failing(self):
        """Why the server is unhealthy (one line), or None: FAILED_STEPS engine steps failed in a row."""
        failed, last = self.engine_state
        return f"the engine failed {failed} steps in a row; last error: {last}" if failed >= FAILED_STEPS else None

    def probe(self):
        """Queue a tiny request (PROBE) when the server is unhealthy and idle, unless one is pending: a
        load balancer or orchestrator that stops sending requests to a server whose /health says 503
        would otherwise never see it recover. Called by the health endpoints (HTTP thread)."""
        with self._lock:
            if self._probing or self.stopping.is_set() or self.live or not self.jobs.empty():
                return
            self._probing = True
            kw = parse(PROBE)  # greedy, the server's K: its prefill, draft and verify graphs
            self.jobs.put(_Job(next(self._ids), kw, None, None, 0, probe=True))

    def _events(self, rid, kind, val):
        """Rank 0's on_event: hand the request's progress to its HTTP handler (runs on the worker, which
        alone may read the request). A bug in doing so fails that request alone (it ended the worker's loop,
        and the server); a row still running is aborted at the next turn (live and cancelled)."""
        job = self.live.get(rid)  # (before: _event takes an ending request out of live, then may fail)
        if job is None:
            return
        try:
            self._event(rid, job, kind, val)
        except Exception as e:  # noqa: BLE001 - a bug: that request's 500, not the worker's end
            if kind != "text":
                self.live.pop(rid, None)
                self._probing = self._probing and not job.probe
            if not job.probe:
                job.why = f"its answer failed ({summary(e)})"
                job.cancelled.set()
                job.put(("fail", e))
            _log(traceback.format_exc().rstrip())

    def _event(self, rid, job, kind, val):
        if job.probe:
            if kind != "text":
                del self.live[rid]
                self._probing = False
                if kind != "end" or val.finish_reason == "error":
                    _log(f"mindspec: health probe failed: {summary(val if kind != 'end' else val.error)}")
            return
        if kind == "text":
            delta, req = val
            job.shown += len(delta)
            tokens = pieces(req, job.sent, job.shown, final=False)
            job.sent += len(tokens)
            return job.put(("text", (delta, tokens)))
        del self.live[rid]
        if kind == "error":
            return job.put(("error", val))
        if kind == "fail":
            _log(f"mindspec: request {rid} failed: {summary(val)}")
            return job.put(("fail", val))
        res = val.result()
        now = time.perf_counter()
        if res.finish_reason != "abort" or val.output:  # (aborted before its first token: its 499 or 504 only)
            # (n choices share one prompt: counted with the first, as usage counts it)
            self.metrics.finish(len(val.prompt_ids) if job.tag == 0 else None, res,
                                val.first_at and val.first_at - job.t0, now - job.t0)
        if res.finish_reason == "error":
            _log(f"mindspec: request {rid} failed: {val.error}")
            return job.put(("fail", val.error))
        if res.finish_reason == "abort":
            n = len(val.output)
            _log(f"mindspec: request {rid} aborted after {n} token{'s' * (n != 1)}: {job.why}")
        else:
            every = pieces(val, 0, len(res.text), final=True)
            job.put(("done", (val.prompt_ids, res, every[job.sent:], every)))

    def stop(self):
        """Refuse new requests; the running and queued ones answer 503."""
        with self._lock:
            self.stopping.set()
            pending = list(self.live.values())
            while not self.jobs.empty():
                pending.append(self.jobs.get_nowait())
        for job in pending:
            job.put(("unavailable", None))


def wait_s(busy, freed, delay):
    """How long the worker waits for a request before its next turn: TICK when idle; `delay` (MindIE's
    maxQueueDelayMicroseconds) after a step that ended a request and left a row free with nobody queued for
    it, as rows run on: a client answered at the end of that step usually sends its next request within a
    few ms, and joining this step instead of the next saves it a step's time and the batch a step one row
    short; else none (the rows step at once)."""
    if not busy:
        return TICK
    return delay if freed else 0


def follow(app):
    """Ranks > 0 of a tensor-parallel server: apply each turn rank 0 shares and step the engine in lock
    step with it (the target's collectives need every rank); answer nobody. Runs until rank 0 stops (or the
    job is stopped)."""
    while (turn := share(None)) != STOP:
        app.turn(*turn, lambda *_: None)


def _url(host, port):
    """The base URL of an address (an IPv6 one in brackets, as URLs write it)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def prepare(pipe, max_batch, defaults=None):
    """Before the server says ready: compile the one-row graphs (every graph where the compile cache does not
    hold them all or the dynamic-K costs must be measured), run each once (a graph's first run is slower,
    so the first request is not) and know those costs; App.turn loads the rest (every tensor-parallel rank
    runs this). The graphs of rows with presence/frequency penalties are among them only where the defaults
    set one (else a request with them compiles each of its shapes on first need)."""
    penal = any((defaults or {}).get(k) for k in ("presence_penalty", "frequency_penalty"))
    pipe.prepare([], max_batch, every_graph=True, rows_now=1, penal=penal)
    while (cold := pipe.target.cold()) and cold[0][1] == 1:  # (in warm-up's order: one row's graphs first)
        pipe.target.warm_next()
    return pipe


def serve(load, defaults, host="127.0.0.1", port=1025, model_name=None, tp=False, max_batch=1, max_queue=64,
          max_connections=None, api_key=None, strict_model_name=False, read_timeout=30, queue_delay_us=QUEUE_DELAY_US,
          management=None, metrics=None, step_timeout=STEP_TIMEOUT):
    """Listen, load the pipeline and compile its graphs, or on a warm start its one-row graphs (/health and
    /v2/health/ready answer 503 meanwhile, /v2/health/live 200), then generate until SIGINT/SIGTERM.
    management, metrics: (host, port) of MindIE's management plane (the health probes) and metrics plane
    (/metrics), each also served on the main port; None, or the main port: there alone."""
    from .api import MANAGEMENT, METRICS, Api
    from .http import HttpServer
    app = App(defaults, model_name, tp, max_batch, max_queue, queue_delay_us, step_timeout)
    api = Api(app, api_key, strict_model_name, read_timeout)
    planes = {}  # (host, port) -> route names
    for where, names in ((management, MANAGEMENT), (metrics, METRICS)):
        if where is not None and (where[1] != port or port == 0):  # (port 0: each a port of its own)
            planes[where] = planes.get(where, frozenset()) | names
    http = HttpServer(api.handle, host, port, max_connections, keepalive=read_timeout,
                      on_error=lambda status: app.metrics.answered("other", status), extra=list(planes),
                      on_bound=lambda bound: setattr(api, "planes", {p: names for (_, p), names in
                                                                     zip(bound, planes.values())}))
    app.call = http.call
    port = http.start()
    lines = [f"mindspec: listening on {_url(host, port)}; ready once the model is loaded and its graphs compiled "
             "(from a warm compile cache: its one-row graphs)"]
    for (h, p), names in zip(http.extra, planes.values()):
        what = " and ".join(w for w, plane in (("health probes", MANAGEMENT), ("/metrics", METRICS)) if names & plane)
        lines.append(f"mindspec: {what} also on {_url(h, p)}")
    # one write: the access log's lines come from the HTTP thread meanwhile (found: one cut a line in two;
    # print writes a line and its newline apart)
    sys.stderr.write("".join(line + "\n" for line in lines))
    sys.stderr.flush()
    with signals.Signals(True, _hard_stop, final=True) as sig:
        try:
            app.pipe = prepare(load(), max_batch, defaults)
            sig.reinstall()  # over whatever the frameworks loaded meanwhile installed
            sig.check()
            app.model_name = app.model_name or os.path.basename(os.path.normpath(app.pipe.model_dir))
            app.ready.set()
            _say(f"mindspec: serving {app.model_name} on {_url(host, port)} (up to {max_batch} requests at once; "
                 f"{app.pipe.dtype} on {app.pipe.device})")
            app.work()
        except KeyboardInterrupt:
            pass
        finally:
            app.stop()
            http.stop()
    _log("mindspec: server stopped")


def _log(line):
    """One line on stderr in one write: the HTTP thread logs each request meanwhile (print writes a line's
    text and its newline apart, and lines were joined under load)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _say(line):
    """The "serving" line, on stdout for whoever waits for it. With stdout closed or full the server serves
    all the same: the line goes nowhere (the command line's failed write forgotten with its stdout)."""
    try:
        print(line, flush=True)
    except OSError:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - stdout until the process ends


def _hard_stop():
    """A second SIGINT/SIGTERM: no waiting for the graph being compiled or run."""
    os.write(2, b"mindspec: server stopped\n")
    os._exit(0)
