"""`mindspec serve`: an HTTP server speaking MindIE Service's request conventions (docs/serve.md).

Endpoints: OpenAI-compatible /v1/chat/completions, /v1/completions, /v1/models; TGI 0.9.4-style
/generate, /generate_stream and POST /; MindIE's native /infer; MindIE's health probes.

Continuous batching: the main thread is the only one that touches the engine (MindSpore and the
signal handlers live there): each turn it takes the requests that arrived and the ones whose client
went away, then runs one engine step over every running row. HTTP handler threads parse a request,
hand it over and relay the engine's events to their client. A client that goes away (streamed or
not) aborts its row at the next step; SIGINT/SIGTERM fail the queued and running requests with 503
and stop the server cleanly.
"""
import itertools
import json
import os
import queue
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .errors import MindspecError
from .request import RequestError, make, parse
from .tp import share

TICK = 0.5  # s: how long an idle worker waits for a request before checking signals (and, under TP, pinging)
WATCH = 0.02  # s: how often a handler waiting for its answer checks that its client is still there
MAX_BODY = 4 * 2 ** 20  # MindIE's limit on a request's text: 4 MB
EXTENSIONS = ("top_k", "repetition_penalty", "k", "draft_temperature")  # beyond each API's own fields


class _Job:
    """One request for the worker. events: ("text", delta)*, then ("done", (prompt_ids, Result)) or
    ("error", MindspecError) or ("fail", Exception) or ("unavailable", None)."""

    def __init__(self, rid, kw):
        self.id, self.kw, self.events, self.cancelled = rid, kw, queue.Queue(), threading.Event()


class App:
    """What the handlers share: the pipeline (once loaded), the request defaults, the job queue."""

    def __init__(self, defaults, model_name=None, tp=False, max_batch=1, max_queue=64):
        self.defaults, self.model_name, self.tp, self.max_batch = defaults, model_name, tp, max_batch
        self.max_queue = max_queue  # requests waiting for a row beyond the running ones; more: 429
        self.pipe, self.started = None, int(time.time())
        self.ready, self.stopping = threading.Event(), threading.Event()
        self.jobs, self.live, self._lock, self._ids = queue.Queue(), {}, threading.Lock(), itertools.count()

    def submit(self, kw):
        with self._lock:
            if self.stopping.is_set():
                raise RequestError("the server is shutting down", 503)
            if len(self.live) + self.jobs.qsize() >= self.max_batch + self.max_queue:
                raise RequestError(f"the server is busy: {self.max_batch} requests running and {self.max_queue} "
                                   "waiting; retry later", 429)
            job = _Job(next(self._ids), kw)
            self.jobs.put(job)
        return job

    def _take(self, block):
        """The new jobs and the ids of live jobs whose client left (waits up to TICK when idle)."""
        new = []
        try:
            new.append(self.jobs.get(timeout=TICK) if block else self.jobs.get_nowait())
            while True:
                new.append(self.jobs.get_nowait())
        except queue.Empty:
            pass
        gone = [rid for rid, job in self.live.items() if job.cancelled.is_set()]
        return [(j.id, j.kw) for j in new if not j.cancelled.is_set()], gone, {j.id: j for j in new}

    def work(self):
        """The worker loop (main thread). Under tensor parallelism this is rank 0: each turn it hands the
        new requests and aborts to the other ranks (see follow), which apply them and step in lock step."""
        eng = self.pipe.engine
        while True:
            new, gone, jobs = self._take(block=not eng.has_work)
            if self.tp:
                share((new, gone))  # also when idle: the other ranks must not wait in a collective for long
            for rid, kw in new:
                self.live[rid] = jobs[rid]
            self.turn(new, gone, self._events)

    def turn(self, new, gone, on_event):
        """Apply one turn's new requests and aborts, then run one engine step (every rank runs this)."""
        eng = self.pipe.engine
        for rid, kw in new:
            try:
                eng.add(make(self.pipe, kw, request_id=rid))
            except MindspecError as e:
                on_event(rid, "error", e)
        for rid in gone:
            eng.abort(rid)
        if eng.has_work:
            for req, text in eng.step():
                if text:
                    on_event(req.id, "text", text)
                if req.done:
                    on_event(req.id, "end", req)

    def _events(self, rid, kind, val):
        job = self.live.get(rid)
        if job is None:
            return
        if kind == "text":
            return job.events.put(("text", val))
        del self.live[rid]
        if kind == "error":
            return job.events.put(("error", val))
        if val.finish_reason == "error":
            print(f"mindspec: request {rid} failed: {val.error}", file=sys.stderr)
            return job.events.put(("fail", val.error))
        if val.finish_reason == "abort":
            print(f"mindspec: request {rid} aborted after {len(val.output)} tokens: the client went away",
                  file=sys.stderr, flush=True)
        else:
            job.events.put(("done", (val.prompt_ids, val.result())))

    def stop(self):
        """Refuse new requests; the running and queued ones answer 503."""
        with self._lock:
            self.stopping.set()
            pending = list(self.live.values())
            while not self.jobs.empty():
                pending.append(self.jobs.get_nowait())
        for job in pending:
            job.events.put(("unavailable", None))


def _one_line(msg):
    return " ".join(str(msg).split())


def _stream_flag(body):
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false")
    return stream


def _token(pipe, i):
    text = pipe.tokenizer.decode([i])
    special = i in pipe.eos or (text != "" and pipe.tokenizer.decode([i], skip_special_tokens=True) == "")
    return {"id": i, "text": text, "logprob": None, "special": special}


class _OpenAI:
    """/v1/completions and /v1/chat/completions bodies and SSE chunks (as MindIE's vLLM-style
    OpenAI interface: usage in the final chunk, then `data: [DONE]`)."""
    family, done_marker = "openai", True

    def __init__(self, app, chat):
        self.app, self.chat, self.sent_role = app, chat, False
        self.head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                     "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": app.model_name}

    def _choice(self, text, finish, delta=False):
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "stop_reason": None, "finish_reason": finish}
        msg = {"content": text} if text is not None else {}
        if not delta:
            msg["role"] = "assistant"
        return {"index": 0, "delta" if delta else "message": msg, "logprobs": None, "finish_reason": finish}

    def _stream_head(self):
        return dict(self.head, object="chat.completion.chunk") if self.chat else self.head

    def _tail(self, ids, res):
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(res.token_ids),
                 "total_tokens": len(ids) + len(res.token_ids)}
        return {"usage": usage, "mindspec": res.stats}

    def response(self, ids, res):
        return dict(self.head, choices=[self._choice(res.text, res.finish_reason)], **self._tail(ids, res))

    def _role(self):
        """The chat stream's first chunk, once (also when no text comes at all)."""
        if not self.chat or self.sent_role:
            return []
        self.sent_role = True
        return [dict(self._stream_head(), choices=[dict(self._choice("", None, True),
                                                        delta={"role": "assistant", "content": ""})])]

    def chunk(self, delta):
        return self._role() + [dict(self._stream_head(), choices=[self._choice(delta, None, True)])]

    def last(self, ids, res):
        choice = self._choice(None if self.chat else "", res.finish_reason, True)
        return self._role() + [dict(self._stream_head(), choices=[choice], **self._tail(ids, res))]


class _TGI:
    """TGI 0.9.4 /generate (+ details) and /generate_stream events, and MindIE's native /infer
    (details: finish_reason, generated_tokens, seed; stream events with prefill_time/decode_time in
    ms). A stream event carries the text of one decoding step (1..K+1 tokens); token ids are known
    only at the end, so stream tokens have "id": null. Streams end without [DONE], as TGI's do."""
    family, done_marker = "tgi", False

    def __init__(self, app, kw, native, details, decoder_input_details=False, full_text_prefix=""):
        self.app, self.kw, self.native, self.details = app, kw, native, details
        self.decoder_input_details, self.prefix = decoder_input_details, full_text_prefix
        self.pending, self.t0 = None, time.perf_counter()

    def _finish(self, res):
        if res.finish_reason == "length":
            return "length"
        return "eos_token" if res.token_ids and res.token_ids[-1] in self.app.pipe.eos else "stop_sequence"

    def _details(self, ids, res, full):
        d = {"finish_reason": self._finish(res), "generated_tokens": len(res.token_ids), "seed": self.kw.get("seed")}
        if full:
            pipe = self.app.pipe
            prefill = [_token(pipe, i) for i in ids] if self.decoder_input_details else []
            d.update(prompt_tokens=len(ids), prefill=prefill, tokens=[_token(pipe, i) for i in res.token_ids])
        return d

    def response(self, ids, res):
        out = {"generated_text": self.prefix + res.text}
        if self.details:
            out["details"] = self._details(ids, res, full=not self.native)
        out["mindspec"] = res.stats
        return out

    def _event(self, pending):
        text, prefill_ms, decode_ms = pending
        if self.native:
            return {"prefill_time": prefill_ms, "decode_time": decode_ms, "token": {"id": None, "text": text}}
        return {"token": {"id": None, "text": text, "logprob": None, "special": False},
                "generated_text": None, "details": None}

    def _timed(self, text):
        """(text, prefill_time, decode_time): ms from the request to its first text, then between steps."""
        now, first = time.perf_counter(), self.pending is None
        ms, self.t0 = round((now - self.t0) * 1000, 2), now
        return text, ms if first else None, None if first else ms

    def chunk(self, delta):
        """Hold one step back, so the last event carries text and the final fields together."""
        out = [] if self.pending is None else [self._event(self.pending)]
        self.pending = self._timed(delta)
        return out

    def last(self, ids, res):
        ev = self._event(self.pending or self._timed(""))
        ev["generated_text"] = self.prefix + res.text
        ev["details"] = self._details(ids, res, full=False) if self.details else None
        ev["mindspec"] = res.stats
        return [ev]


class _SSE:
    """Server-sent events; the 200 header goes out with the first event, so a request that fails
    before producing text still gets a plain JSON error."""

    def __init__(self, handler):
        self.h, self.started = handler, False

    def send(self, obj):
        if not self.started:
            self.h.send_response(200)
            self.h.send_header("Content-Type", "text/event-stream")
            self.h.send_header("Cache-Control", "no-cache")
            self.h.end_headers()
            self.started = True
        self.h.wfile.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n")
        self.h.wfile.flush()

    def done(self):
        self.h.wfile.write(b"data: [DONE]\n\n")
        self.h.wfile.flush()


_PATTERNS = [  # (method, regex, handler name, error family)
    ("GET", r"/health", "get_health", "tgi"),
    ("GET", r"/health/timed(-[0-9]+)?", "get_health_timed", "tgi"),
    ("GET", r"/v2/health/live", "get_live", "tgi"),
    ("GET", r"/v2/health/ready", "get_health", "tgi"),
    ("GET", r"/v2/models/([\w\-.]+)/ready", "get_model_ready", "tgi"),
    ("GET", r"/v1/models", "get_models", "openai"),
    ("GET", r"/v1/models/([\w\-.]+)", "get_model", "openai"),
    ("POST", r"/v1/completions", "post_completions", "openai"),
    ("POST", r"/v1/chat/completions", "post_chat", "openai"),
    ("POST", r"/generate", "post_generate", "tgi"),
    ("POST", r"/generate_stream", "post_generate_stream", "tgi"),
    ("POST", r"/", "post_compat", "tgi"),
    ("POST", r"/infer", "post_infer", "tgi"),
]
_ROUTES = [(m, re.compile(p + r"\Z"), name, fam) for m, p, name, fam in _PATTERNS]
_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0}


class Handler(BaseHTTPRequestHandler):
    server_version = "mindspec"

    @property
    def app(self):
        return self.server.app

    def log_message(self, fmt, *args):
        sys.stderr.write(f"mindspec: {self.address_string()} {fmt % args}\n")

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PATCH(self):
        self._dispatch("PATCH")

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (a malformed request line, an unknown method) as JSON too."""
        self.close_connection = True
        self._error(code, message or self.responses.get(code, ("error",))[0], "openai")

    def _dispatch(self, method):
        path = self.path.split("?", 1)[0]
        hits = [(m, rx.match(path), name, fam) for m, rx, name, fam in _ROUTES]
        hits = [(m, mt, name, fam) for m, mt, name, fam in hits if mt]
        route = next((h for h in hits if h[0] == method), None)
        family = route[3] if route else "openai"
        try:
            if route is None:
                if hits:
                    self._allow = ", ".join(sorted({h[0] for h in hits}))
                    raise RequestError(f"{method} is not allowed on {path}", 405)
                raise RequestError(f"no such endpoint: {method} {path}", 404)
            getattr(self, route[2])(*route[1].groups())
        except MindspecError as e:
            self._error(getattr(e, "status", 400), e, family)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # a bug: log it, answer one line, keep serving
            traceback.print_exc()
            self._error(500, f"internal error: {type(e).__name__}: {e}", family)

    # ---- plumbing

    def _json(self, status, obj):
        body = b"" if obj is None else json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        if status == 405 and getattr(self, "_allow", None):
            self.send_header("Allow", self._allow)
        if obj is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status, message, family):
        """One-line JSON errors: OpenAI's shape on /v1/*, TGI/MindIE's {"error", "error_type"}
        elsewhere, where input validation answers 422 as TGI and MindIE do."""
        msg = _one_line(message)
        if family == "tgi":
            status = 422 if status == 400 else status
            kind = "validation" if status < 500 else ("overloaded" if status == 503 else "generation")
            return self._json(status, {"error": msg, "error_type": kind})
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._json(status, {"error": {"message": msg, "type": kind, "param": None, "code": status}})

    def _body(self):
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if n < 0:
            raise RequestError("bad Content-Length header")
        if n > MAX_BODY:
            if n <= 16 * MAX_BODY:
                self.rfile.read(n)  # drain it, so the client reads our answer instead of a reset
            raise RequestError(f"request body is larger than {MAX_BODY} bytes", 413)
        try:
            body = json.loads(self.rfile.read(n)) if n else None
        except ValueError as e:
            raise RequestError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    def _check_ready(self):
        if not self.app.ready.is_set():
            raise RequestError("the model is still loading", 503)

    def _client_gone(self):
        """The client closed its connection (an orderly close reads as b""), so nobody waits for the answer."""
        try:
            if not select.select([self.connection], [], [], 0)[0]:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _generate(self, kw, fmt, stream):
        """Queue the request and relay the worker's events: one JSON body, or SSE events. A client that
        leaves (streamed or not) aborts its request."""
        job = self.app.submit(kw)
        sse = _SSE(self) if stream else None
        checked = time.monotonic()
        try:
            while True:
                try:
                    kind, val = job.events.get(timeout=WATCH)
                except queue.Empty:
                    kind = None
                if not sse and time.monotonic() - checked >= WATCH:  # a stream notices on its next write
                    checked = time.monotonic()
                    if self._client_gone():
                        job.cancelled.set()
                        return
                if kind is None:
                    continue
                if kind == "text":
                    for ev in fmt.chunk(val) if sse else ():
                        sse.send(ev)
                    continue
                if kind == "done":
                    if not sse:
                        return self._json(200, fmt.response(*val))
                    for ev in fmt.last(*val):
                        sse.send(ev)
                    return sse.done() if fmt.done_marker else None
                status, msg = {"error": (getattr(val, "status", 400), val),
                               "fail": (500, f"internal error: {type(val).__name__}: {val}"),
                               "unavailable": (503, "the server is shutting down")}[kind]
                if sse and sse.started:  # too late for a status code: a last event says what happened
                    return sse.send({"error": _one_line(msg), "status": status})
                return self._error(status, msg, fmt.family)
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled.set()  # the worker drops it at its next step

    # ---- health and models (MindIE: /health, /health/timed, Triton-style /v2/health/*)

    def get_health(self, *_):
        """Ready: the model is loaded and every graph compiled."""
        self._json(200 if self.app.ready.is_set() else 503, None)

    def get_live(self):
        """Live: the process answers (it may still be loading)."""
        self._json(200, None)

    def get_health_timed(self, _wait=None):
        self._check_ready()
        self._json(200, {"status": "healthy"})

    def get_model_ready(self, name):
        self._check_ready()
        self._model(name)
        self._json(200, None)

    def _model(self, name=None):
        if name is not None and name != self.app.model_name:
            raise RequestError(f"model {name!r} not found: this server serves {self.app.model_name!r}", 404)
        pipe = self.app.pipe
        return {"id": self.app.model_name, "object": "model", "created": self.app.started, "owned_by": "mindspec",
                "root": pipe.model_dir, "parent": None, "max_model_len": pipe.max_seq}

    def get_models(self):
        self._check_ready()
        self._json(200, {"object": "list", "data": [self._model()]})

    def get_model(self, name):
        self._check_ready()
        self._json(200, self._model(name))

    # ---- OpenAI-compatible

    def _openai(self, body, chat):
        self._check_ready()
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise RequestError("model must be a string")
            self._model(model)
        for key, off in _UNSUPPORTED.items():
            if body.get(key) not in (None, off):
                raise RequestError(f"{key}={body[key]!r} is not supported (one choice per request, no logprobs)")
        stream = _stream_flag(body)
        flat = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "seed", "stop") + EXTENSIONS if k in body}
        if chat:
            flat["messages"] = body.get("messages")
            if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
                flat["max_tokens"] = body["max_completion_tokens"]
        else:
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                p = p[0]  # a batch of one prompt
            if isinstance(p, list):
                flat["prompt_ids"] = p
            elif isinstance(p, str) or p is None:
                flat["prompt"] = p
            else:
                raise RequestError("prompt must be a string or a list of token ids (one prompt per request)")
        fmt = _OpenAI(self.app, chat)
        self._generate(parse(flat, self.app.defaults), fmt, stream)

    def post_completions(self):
        self._openai(self._body(), chat=False)

    def post_chat(self):
        self._openai(self._body(), chat=True)

    # ---- TGI 0.9.4 and MindIE native

    def _tgi(self, body, stream, native=False):
        self._check_ready()
        inputs = body.get("inputs")
        if not isinstance(inputs, str) or not inputs:
            raise RequestError("inputs must be a non-empty string")
        params = body.get("parameters")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise RequestError("parameters must be a JSON object")
        for key in ("details", "return_full_text", "decoder_input_details"):
            if params.get(key) not in (None, True, False):  # null: the default
                raise RequestError(f"{key} must be true or false")
        if params.get("best_of") not in (None, 1):
            raise RequestError("best_of > 1 is not supported (one choice per request)")
        fields = ("max_new_tokens", "temperature", "top_p", "seed", "stop", "do_sample") + EXTENSIONS
        kw = parse(dict({k: params[k] for k in fields if k in params}, prompt=inputs), self.app.defaults)
        fmt = _TGI(self.app, kw, native, params.get("details", False), params.get("decoder_input_details", False),
                   inputs if params.get("return_full_text") else "")
        self._generate(kw, fmt, stream)

    def post_generate(self):
        self._tgi(self._body(), stream=False)

    def post_generate_stream(self):
        self._tgi(self._body(), stream=True)

    def post_compat(self):
        body = self._body()
        self._tgi(body, stream=_stream_flag(body))

    def post_infer(self):
        body = self._body()
        self._tgi(body, stream=_stream_flag(body), native=True)


def _stop_on_signals():
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread: the worker loop ends there."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)


def follow(app):
    """Ranks > 0 of a tensor-parallel server: apply each turn rank 0 shares and step the engine in lock
    step with it (the target's collectives need every rank); answer nobody. Runs until the job is stopped."""
    while True:
        new, gone = share(None)
        app.turn(new, gone, lambda *_: None)


def prepare(pipe, max_batch):
    """Compile every graph a request can need and measure the dynamic-K costs, before the server says
    ready (every tensor-parallel rank runs this)."""
    pipe.prepare([], max_batch, every_graph=True)
    return pipe


def serve(load, defaults, host="127.0.0.1", port=1025, model_name=None, tp=False, max_batch=1, max_queue=64):
    """Listen, load the pipeline and compile its graphs (/health and /v2/health/ready answer 503
    meanwhile, /v2/health/live 200), then generate until SIGINT/SIGTERM."""
    try:
        httpd = ThreadingHTTPServer((host, port), Handler)
    except OSError as e:
        raise MindspecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    httpd.daemon_threads = True
    httpd.app = app = App(defaults, model_name, tp, max_batch, max_queue)
    _stop_on_signals()
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    try:
        app.pipe = prepare(load(), max_batch)
        _stop_on_signals()  # again, over whatever the frameworks loaded meanwhile installed
        app.model_name = app.model_name or os.path.basename(os.path.normpath(app.pipe.model_dir))
        app.ready.set()
        print(f"mindspec: serving {app.model_name} on http://{host}:{httpd.server_address[1]} "
              f"(up to {max_batch} requests at once)", flush=True)
        app.work()
    except KeyboardInterrupt:
        pass
    finally:
        app.stop()
        httpd.shutdown()
        httpd.server_close()
    print("mindspec: server stopped", file=sys.stderr)
