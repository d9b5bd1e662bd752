"""`mindspec serve`'s endpoints: OpenAI-compatible /v1/*, TGI 0.9.4 (/generate, /generate_stream,
POST /), MindIE's native /infer, health probes, /metrics, vLLM's /tokenize, /detokenize and
/version. Each turns its API's body into one flat request (mindspec.request), queues it on the App
and answers with its formatter (mindspec.formats). Runs on the HTTP thread's event loop."""
import asyncio
import hmac
import json
import re
import sys
import traceback

from aiohttp import HttpVersion11, web
from aiohttp.http_exceptions import HttpProcessingError

from . import __version__
from .errors import MindspecError, is_int, is_number, one_line, shown, summary
from .formats import TGI, OpenAI, openai_error, tgi_error
from .http import ENDED_WITH, said
from .request import RequestError, int_list, loads, make, parse, prompt_cut
from .spec import TOP_LOGPROBS

MAX_BODY = 4 * 2 ** 20  # MindIE's limit on a request's text: 4 MB
EXTENSIONS = ("top_k", "repetition_penalty", "k", "draft_temperature", "min_tokens", "ignore_eos",
              "stop_token_ids", "truncate_prompt_tokens")  # beyond each API's own fields (the last: vLLM's)
_TEXT, _FLAG = (lambda v: isinstance(v, str), "a string"), (lambda v: isinstance(v, bool), "true or false")
# accepted and without effect (clients and MindIE's examples send them) when of their type and range
# (TGI's): name -> (check, what it must be)
IGNORED = {"user": _TEXT, "priority": (is_int, "an integer"), "service_tier": _TEXT, "store": _FLAG,
           "metadata": (lambda v: isinstance(v, dict), "an object"), "parallel_tool_calls": _FLAG,
           "typical_p": (lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]"), "watermark": _FLAG,
           "skip_special_tokens": _FLAG, "verbosity": _TEXT, "reasoning_effort": _TEXT}  # (the last two: OpenAI's)
MAX_TIMEOUT = 3600  # s: a request's own timeout, MindIE's range (0, 3600]
# known but not implemented: refused unless they hold their "off" value
OFF = {"best_of": (1,), "echo": (False,),
       "logit_bias": ({},), "suffix": ("",),
       "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
       "function_call": ("none",), "grammar": (),
       # vLLM's, in MindIE's OpenAI examples
       "include_stop_str_in_output": (False,), "use_beam_search": (False,), "chat_template_kwargs": ({},),
       "modalities": (["text"],)}  # (OpenAI's)
SAMPLING = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty") + EXTENSIONS
COMPLETION_KEYS = frozenset(("model", "prompt", "max_tokens", "stream", "stream_options", "n", "logprobs", "timeout")
                            + SAMPLING)
CHAT_KEYS = frozenset(("model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n",
                       "logprobs", "top_logprobs", "timeout") + SAMPLING)
TGI_PARAMS = frozenset(("max_new_tokens", "do_sample", "details", "return_full_text", "decoder_input_details",
                        "top_n_tokens", "truncate", "adapter_id", "timeout") + SAMPLING)
NO_ADAPTER = ("", "None")  # adapter_id values that ask for the base model (MindIE's default is "None")


def _local_port(request):
    """The port the request came in on (None once the connection is gone)."""
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    return sock[1] if sock else None


# MindIE's planes on ports of their own: the management port's probes, the metrics port's Prometheus page
MANAGEMENT = frozenset(("health", "health_timed", "live", "model_ready"))
METRICS = frozenset(("metrics_text",))


def _stream_flag(body):
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", param="stream")
    return stream


def _logprobs(body, chat):
    """The flat request's logprobs (alternatives per token, None: off) from OpenAI's fields: chat's
    logprobs (true/false) with top_logprobs (0..20), completions' logprobs (0..20)."""
    if not chat:
        n = body.get("logprobs")
        if n is None or n is False:
            return None
        if not (is_int(n) and 0 <= n <= TOP_LOGPROBS):  # (true: chat's form, and an int to Python)
            raise RequestError(f"logprobs must be an integer from 0 to {TOP_LOGPROBS} on /v1/completions (the "
                               f"alternatives per token), got {shown(n)}", param="logprobs")
        return n
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise RequestError("logprobs must be true or false (top_logprobs says how many alternatives)",
                           param="logprobs")
    if top is not None and not (type(top) is int and 0 <= top <= TOP_LOGPROBS):
        raise RequestError(f"top_logprobs must be an integer from 0 to {TOP_LOGPROBS}, got {shown(top)}",
                           param="top_logprobs")
    if top and not on:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if on else None


def _include_usage(body, stream):
    """stream_options' include_usage: None when not given (usage in the final chunk, as MindIE's), else
    OpenAI's true (a chunk of its own) or false (none)."""
    opts = body.get("stream_options")
    if opts is None:
        return None
    if not isinstance(opts, dict):
        raise RequestError('stream_options must be an object ({"include_usage": true or false})',
                           param="stream_options")
    _check_keys(opts, {"include_usage", "continuous_usage_stats"}, "stream_options.")
    if opts.get("continuous_usage_stats") not in (None, False):  # (vLLM's usage on every chunk)
        raise RequestError("stream_options.continuous_usage_stats is not supported (false only)",
                           param="stream_options.continuous_usage_stats")
    usage = opts.get("include_usage", False)  # (OpenAI's default: {} asks for none)
    if not isinstance(usage, bool):
        raise RequestError("stream_options.include_usage must be true or false", param="stream_options.include_usage")
    if not stream:  # (OpenAI's and vLLM's rule)
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
    return usage


def _at_most(body, name, limit, why):
    """A list longer than any request can use is refused before its items are read (a 4 MB body holds a
    million ids or 120000 messages: seconds of checks on this loop, then on the engine's thread)."""
    n = len(body[name]) if isinstance(body.get(name), list) else 0
    if n > limit:
        raise RequestError(f"{name}: {n} items, at most {limit} ({why})", param=name)


def _prompt(p, pipe, cut=None):
    """OpenAI's prompt as the flat request's {"prompt": text} or {"prompt_ids": ids}; a list of ids that
    leaves none of the pipeline's positions for the answer is refused unread, in Pipeline.request's words,
    unless `cut` (truncate_prompt_tokens) keeps its last ids only."""
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise RequestError(f"prompt is a list of {len(p)} prompts: send one prompt per request "
                           "(a string or a list of token ids)", param="prompt")
    if isinstance(p, str) or p is None:
        return {"prompt": p}
    if not isinstance(p, list):
        raise RequestError("prompt must be a string or a list of token ids (one prompt per request)", param="prompt")
    if prompt_cut("truncate_prompt_tokens", cut) is not None:  # (the ids before the cut are not read)
        p = p[-cut:]
    if len(p) >= pipe.max_positions:
        raise RequestError(f"prompt is {len(p)} tokens; it does not fit {pipe.max_seq_said}", param="prompt")
    if not p or not int_list(p):
        raise RequestError("prompt must be a string or a non-empty list of integer token ids", param="prompt")
    return {"prompt_ids": p}


def _timeout(obj, where=""):
    """A request's own timeout in seconds (MindIE's "timeout"), or None."""
    v = obj.get("timeout")
    if v is not None and not (is_number(v) and 0 < v <= MAX_TIMEOUT):
        raise RequestError(f"{where}timeout must be a number in (0, {MAX_TIMEOUT}], got {shown(v)}",
                           param=where + "timeout")
    return v


def _check_keys(body, known, where=""):
    """Unknown keys and known-but-unsupported values are a 400 naming the field, never silently dropped (`where`:
    the path of a nested object's fields, "stream_options.", also in error.param)."""
    for key, value in body.items():
        if key in known or value is None:
            continue
        if key in IGNORED:
            check, kind = IGNORED[key]
            if not check(value):
                raise RequestError(f"{where}{key} must be {kind}, got {shown(value)}", param=where + key)
            continue
        if key in OFF:
            if not any(value == off and isinstance(value, bool) == isinstance(off, bool) for off in OFF[key]):
                raise RequestError(f"{where}{key}={shown(value)} is not supported by mindspec serve",
                                   param=where + key)
            continue
        raise RequestError(f"unknown field '{where}{key}'", param=where + key)


class Api:
    """The endpoints over one App (mindspec.serve); `routes` maps (method, path) to them."""

    def __init__(self, app, api_key=None, strict_model_name=False, read_timeout=30):
        self.app, self.strict = app, strict_model_name
        try:  # as the header's bytes are compared (a key from argv keeps its undecodable bytes as surrogates)
            self.api_key = api_key.encode("utf-8", "surrogateescape") if api_key else None
        except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800") no request could send
            raise MindspecError("the API key is not valid text (a lone surrogate?)") from None
        self.read_timeout = read_timeout  # s: the whole body must arrive within this (else 408)
        self.metrics = app.metrics
        self.routes = [(m, re.compile(p + r"\Z"), getattr(self, name), fam, name)
                       for m, p, name, fam in _ROUTES]
        self.planes = {}  # {local port: the endpoints (route names) it serves}: MindIE's management/metrics ports

    # ---- the one entry point of the transport

    async def handle(self, request):
        method = "GET" if request.method == "HEAD" else request.method  # aiohttp leaves a HEAD's body out
        path = request.path
        plane = self.planes.get(_local_port(request)) if self.planes else None  # (None: every endpoint)
        hits = [(m, rx.match(path), fn, fam, name) for m, rx, fn, fam, name in self.routes
                if plane is None or name in plane]
        hits = [h for h in hits if h[1]]
        route = next((h for h in hits if h[0] == method), None)
        family, name = (route[3], route[4]) if route else (hits[0][3] if hits else "openai", "other")
        # the methods of this path, as OPTIONS lists them and a 405 says
        allow = ", ".join(sorted({h[0] for h in hits} | {"OPTIONS"} | ({"HEAD"} if any(
            h[0] == "GET" for h in hits) else set())))
        try:
            if method == "OPTIONS" and (hits or path == "*"):
                resp = web.Response(status=204, headers={"Allow": allow})
            elif route is None:
                if hits and self.api_key and not any(h[4] in _OPEN for h in hits):  # (a keyed route's 405 comes
                    self._check_key(request)  # after the key, as its 200: no route is shown to a caller without it)
                if hits:
                    raise _Refused(f"{request.method} is not allowed on {path}", 405, {"Allow": allow})
                raise RequestError(f"no such endpoint: {request.method} {path}", 404)
            else:
                if self.api_key and name not in _OPEN:
                    self._check_key(request)
                resp = await route[2](request, *route[1].groups())
        except MindspecError as e:
            resp = self.error(getattr(e, "status", 400), e, family, getattr(e, "param", None),
                              getattr(e, "headers", None))
        except ConnectionError:  # the client left while we read or wrote (nginx's code for it)
            resp = web.Response(status=499)  # aiohttp drops it quietly: nobody listens
        except asyncio.CancelledError:  # the client left while we waited (aiohttp's handler cancellation)
            self.metrics.answered(name, 499)
            raise
        except Exception as e:  # a bug: log it (one write: the worker logs meanwhile), answer one line, keep serving
            sys.stderr.write(traceback.format_exc())
            resp = self.error(500, f"internal error: {summary(e)}", family)
        if resp.status >= 400 and not request.content.is_eof():
            _close_unread(request, resp)
        self.metrics.answered(name, said(resp))
        return resp

    def _check_key(self, request):
        # the scheme is case-insensitive and may be followed by several spaces (RFC 9110 §11.4: 1*SP); aiohttp
        # keeps a header's undecodable bytes as surrogates
        scheme, _, got = request.headers.get("Authorization", "").partition(" ")
        got = got.lstrip(" ").encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(got, self.api_key):
            raise _Refused("missing or wrong API key (Authorization: Bearer KEY)", 401,
                           {"WWW-Authenticate": "Bearer"})  # (RFC 9110 §15.5.2: a 401 names the scheme)

    @staticmethod
    def error(status, message, family, param=None, headers=None):
        """One-line JSON errors: OpenAI's shape on /v1/* and the rest, TGI/MindIE's {"error", "error_type"}
        on theirs, where input validation answers 422 as TGI and MindIE do."""
        if status in (429, 503):  # busy, loading or stopping: a client's retry loop waits a second, not at once
            headers = {"Retry-After": "1", **(headers or {})}
        status, body = Api.error_body(status, message, family, param)
        return web.json_response(body, status=status, headers=headers)

    @staticmethod
    def error_body(status, message, family, param=None):
        """(status, body) of error(); a stream's last event is the body alone (the status went out with its
        first text)."""
        msg = one_line(message)
        if family == "tgi":
            status = 422 if status == 400 else status
            return status, tgi_error(status, msg)
        if param is None and status < 500:  # the field a message starts with ("temperature must be ...")
            m = re.match(r"(?:unknown field ')?(\w+)", msg)
            param = m.group(1) if m and m.group(1) in _FIELDS else None
        return status, openai_error(status, msg, param if param is None else one_line(param))

    # ---- plumbing

    async def _body(self, request):
        """The JSON object of a POST body (chunked or with Content-Length), at most MAX_BODY bytes, read
        within read_timeout."""
        coding = request.headers.get("Content-Encoding", "").strip().lower() or "identity"  # (empty: none)
        if coding != "identity":  # (aiohttp would inflate it first: 2 MB of gzip can be 2 GB of text)
            raise RequestError(f"Content-Encoding {coding} is not accepted: send the body uncompressed", 415)
        te = request.headers.get("Transfer-Encoding")
        if te is not None and te.strip().lower() != "chunked":  # (aiohttp reads the chunks, ignores the rest)
            raise RequestError(f"Transfer-Encoding {one_line(te, 80)} is not supported: send the body plain or "
                               "chunked", 501)
        if (request.content_length or 0) > MAX_BODY:
            raise RequestError(f"request body is larger than {MAX_BODY} bytes", 413)
        if _awaits_continue(request):  # curl asks so for bodies over 1 kB
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request["continued"] = True
        data = bytearray()

        async def read():
            while chunk := await request.content.read(2 ** 16):
                data.extend(chunk)
                if len(data) > MAX_BODY:
                    raise RequestError(f"request body is larger than {MAX_BODY} bytes", 413)

        try:
            await asyncio.wait_for(read(), self.read_timeout)
        except asyncio.TimeoutError:
            raise RequestError(f"the request body did not arrive within {self.read_timeout:g} s", 408) from None
        except HttpProcessingError as e:  # (a chunk that does not parse: http._Protocol._to_the_body)
            raise RequestError(one_line(f"bad chunked body: {e.message}")) from None
        try:
            body = loads(data) if data else None
        except ValueError as e:
            raise RequestError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    def _check_ready(self):
        if not self.app.ready.is_set():
            raise RequestError("the model is still loading", 503)

    async def _generate(self, request, kws, fmts, stream, timeout=None):
        """Queue the requests (one per choice, fmts[i] formats choice i) and relay the worker's events:
        one JSON body, or SSE events. A client that leaves (streamed or not) cancels this handler
        (aiohttp's handler cancellation); the requests still running are aborted at the engine's next
        step, as they are when one choice fails or the request's `timeout` (s) passes: a 504."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        # every check of the request made now: a bad one is a 400 even while the queue is full (the engine makes
        # it again, on its thread; n's choices differ by their seed alone, and one is given here, so that no
        # rank-wide draw happens on this thread)
        make(self.app.pipe, dict(kws[0], seed=0) if kws[0].get("seed") is None else kws[0])
        jobs = self.app.submit(kws)
        resp, done, timed_out = None, [None] * len(jobs), False
        try:
            while None in done:
                try:  # (what the worker already sent is taken before the deadline is looked at)
                    tag, (kind, val) = jobs[0].events.get_nowait()
                except asyncio.QueueEmpty:
                    try:
                        tag, (kind, val) = await asyncio.wait_for(
                            jobs[0].events.get(), None if deadline is None else max(deadline - loop.time(), 0))
                    except asyncio.TimeoutError:
                        timed_out = True
                        tag, kind, val = 0, "error", RequestError(
                            f"the request did not finish within its timeout of {timeout:g} s", 504, param="timeout")
                fmt = fmts[tag]
                if kind in ("text", "done"):
                    if kind == "done":
                        done[tag] = val
                    for ev in (fmt.chunk(*val) if kind == "text" else fmt.last(done)) if stream else ():
                        resp = await _sse(request, resp, ev)
                    continue
                for job in jobs:  # (why the rows still running are cancelled below, for their log lines)
                    if timed_out or job.tag != tag:
                        job.why = "its timeout passed" if timed_out else "another choice of its request failed"
                status, msg = {"error": (getattr(val, "status", 400), val),
                               "fail": (500, one_line(str(val)) if isinstance(val, MindspecError)  # (said already:
                                        else f"internal error: {summary(val)}"),  # a float16 overflow's)
                               "unavailable": (503, "the server is shutting down")}[kind]
                if resp is not None:  # too late for a status code: a last event says what happened, in the
                    # API's error shape (OpenAI's SDK reads error.message from an object only)
                    await resp.write(_event(self.error_body(status, msg, fmt.family, getattr(val, "param", None))[1]))
                    await resp.write_eof()
                    resp[ENDED_WITH] = status
                    return resp
                return self.error(status, msg, fmt.family, getattr(val, "param", None))
            if not stream:
                return web.json_response(fmts[0].response(done), dumps=_dumps)
            if fmts[0].done_marker:
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            for job in jobs:  # those still queued or running are dropped (finished ones are unaffected)
                job.cancelled.set()

    # ---- health, models, metrics, version (MindIE: /health, /health/timed, Triton-style /v2/health/*)

    def _unhealthy(self):
        """None, or the 503 of a server whose engine step hangs (App.stalled) or keeps failing (serve.FAILED_STEPS
        steps in a row): one line of JSON saying why. Such a check also queues a health probe (App.probe), so a
        server nobody sends requests to any more still finds out that its engine works again."""
        why = self.app.unhealthy()
        if why is None:
            return None
        self.app.probe()
        return web.json_response({"status": "unhealthy", "error": why}, status=503)

    async def health(self, request, *_):
        """Ready: the model is loaded, its graphs compiled (a warm start: the one-row ones, the rest compile while
        it serves), the engine is not failing step after step and no step has hung past --step-timeout."""
        if not self.app.ready.is_set():
            return web.Response(status=503)
        return self._unhealthy() or web.Response(status=200)

    async def live(self, request):
        """Live: the process answers (it may still be loading, or its engine failing)."""
        return web.Response(status=200)

    async def health_timed(self, request, _wait=None):
        self._check_ready()
        return self._unhealthy() or web.json_response({"status": "healthy"})

    async def model_ready(self, request, name):
        self._check_ready()
        self._model(name, exact=True)
        return self._unhealthy() or web.Response(status=200)

    def _model(self, name=None, exact=False):
        """The served model's card. A request may name any model unless --strict-model-name (one model
        is served, as single-model servers do); the model endpoints themselves want its name."""
        if name is not None and name != self.app.model_name and (exact or self.strict):
            raise RequestError(f"model {shown(name)} not found: this server serves {shown(self.app.model_name)}", 404,
                               param="model")
        pipe = self.app.pipe
        return {"id": self.app.model_name, "object": "model", "created": self.app.started, "owned_by": "mindspec",
                "root": pipe.model_dir, "parent": None, "max_model_len": pipe.max_seq}

    async def models(self, request):
        self._check_ready()
        return web.json_response({"object": "list", "data": [self._model()]})

    async def model(self, request, name):
        self._check_ready()
        return web.json_response(self._model(name, exact=True))

    async def metrics_text(self, request):
        return web.Response(body=self.metrics.text(), headers={"Content-Type": self.metrics.content_type})

    async def version(self, request):
        return web.json_response({"version": __version__})

    # ---- vLLM's tokenizer endpoints

    async def tokenize(self, request):
        self._check_ready()
        body = await self._body(request)
        _check_keys(body, {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                           "return_token_strs"})
        strs = body.get("return_token_strs")
        if strs is not None and not isinstance(strs, bool):
            raise RequestError("return_token_strs must be true or false", param="return_token_strs")
        if body.get("add_special_tokens") not in (None, True):  # the tokenizer's own rule (BOS) always applies
            raise RequestError("add_special_tokens=false is not supported", param="add_special_tokens")
        generation_prompt = True if body.get("add_generation_prompt") is None else body["add_generation_prompt"]
        if not isinstance(generation_prompt, bool):
            raise RequestError("add_generation_prompt must be true or false", param="add_generation_prompt")
        self._openai_model(body)
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise RequestError("give exactly one of \"prompt\" or \"messages\"")
        kw = self._parse({k: body[k] for k in ("prompt", "messages") if body.get(k) is not None})
        ids = await self._ids(kw, generation_prompt)
        return web.json_response({"count": len(ids), "max_model_len": self.app.pipe.max_seq, "tokens": ids,
                                  "token_strs": self.app.pipe.tokenizer.pieces(ids) if strs else None})

    async def detokenize(self, request):
        self._check_ready()
        body = await self._body(request)
        _check_keys(body, {"model", "tokens"})
        self._openai_model(body)
        ids, vocab = body.get("tokens"), self.app.pipe.cfg.vocab_size
        _at_most(body, "tokens", self.app.pipe.max_positions, "max_seq")  # (590000 ids decoded to 48 MB)
        if not int_list(ids):
            raise RequestError("tokens must be a list of integer token ids", param="tokens")
        if any(not 0 <= i < vocab for i in ids):
            raise RequestError(f"tokens: an id is outside the vocabulary [0, {vocab})", param="tokens")
        return web.json_response({"prompt": self.app.pipe.tokenizer.decode(ids)})

    # ---- requests

    def _parse(self, flat, defaults=None):
        """parse(flat, defaults), after the lists no request can use are refused unread (_at_most)."""
        pipe = self.app.pipe
        _at_most(flat, "stop_token_ids", pipe.cfg.vocab_size, "the vocabulary's size")
        _at_most(flat, "messages", pipe.max_positions, "max_seq: each message takes a position at least")
        return parse(flat, defaults)

    async def _ids(self, kw, generation_prompt=True):
        """The token ids of a parsed request's text prompt or chat messages, made on a worker thread: not on
        the engine's, where a chat template over many messages or a long prompt stalled every running row,
        nor on this loop."""
        pipe = self.app.pipe

        def encode():
            text = kw.get("prompt")
            if text is None:
                text = pipe.tokenizer.apply_chat_template(kw["messages"], add_generation_prompt=generation_prompt)
            return pipe.encode(text, limit=pipe.max_positions)
        return await asyncio.get_running_loop().run_in_executor(None, encode)

    async def _encoded(self, kw):
        """A parsed request with its prompt as token ids (see _ids)."""
        if "prompt_ids" in kw:
            return kw
        ids = await self._ids(kw)
        return dict({k: v for k, v in kw.items() if k not in ("prompt", "messages")}, prompt_ids=ids,
                    prompt_field="messages" if "messages" in kw else "prompt")  # (what an error names)

    # ---- OpenAI-compatible

    def _openai_model(self, body):
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise RequestError("model must be a string", param="model")
            self._model(model)

    async def _openai(self, request, chat):
        self._check_ready()
        body = await self._body(request)
        _check_keys(body, CHAT_KEYS if chat else COMPLETION_KEYS)
        field = "messages" if chat else "prompt"  # (the endpoint's own: found, the other's named too)
        if body.get(field) is None:
            raise RequestError(f"{field} is required", param=field)
        self._openai_model(body)
        stream, timeout = _stream_flag(body), _timeout(body)
        usage = _include_usage(body, stream)
        flat = {k: body[k] for k in ("max_tokens",) + SAMPLING if k in body}
        if chat:
            flat["messages"] = body.get("messages")
            flat["max_completion_tokens"] = body.get("max_completion_tokens")  # (both given: refused by parse)
        else:
            flat.update(_prompt(body.get("prompt"), self.app.pipe, body.get("truncate_prompt_tokens")))
        lp = _logprobs(body, chat)
        if lp is not None:
            flat["logprobs"] = lp
        kw, n = self._parse(flat, self.app.defaults), 1 if body.get("n") is None else body["n"]
        if type(n) is not int or not 1 <= n <= self.app.max_batch:
            raise RequestError(f"n must be an integer from 1 to {self.app.max_batch} (the server's --max-batch: "
                               f"the choices run side by side), got {shown(n)}", param="n")
        kw = await self._encoded(kw)
        # choice i samples with seed + i (a greedy request gives n equal choices, as vLLM's; a seed that is
        # not an integer is left for the engine's check to refuse)
        kws = [kw if i == 0 or type(kw.get("seed")) is not int else dict(kw, seed=(kw["seed"] + i) % 2 ** 64)
               for i in range(n)]  # (the last seeds wrap: every seed the request may give works with any n)
        first = OpenAI(self.app, chat, include_usage=usage)
        fmts = [first] + [OpenAI(self.app, chat, index=i, head=first.head, include_usage=usage) for i in range(1, n)]
        return await self._generate(request, kws, fmts, stream, timeout)

    async def completions(self, request):
        return await self._openai(request, chat=False)

    async def chat(self, request):
        return await self._openai(request, chat=True)

    # ---- TGI 0.9.4 and MindIE native

    async def _tgi(self, request, stream=None, native=False, listed=False):
        self._check_ready()
        body = await self._body(request)
        _check_keys(body, {"inputs", "parameters", "stream"})
        flag = _stream_flag(body)  # checked everywhere; /generate and /generate_stream decide by their route
        if stream is not None and body.get("stream") is not None and flag != stream:  # (a route's own: as asked)
            route, other = ("/generate", "/generate_stream") if flag else ("/generate_stream", "/generate")
            raise RequestError(f"stream {shown(flag)} does not go with {route}: POST {other} (or / with "
                               f"stream {shown(flag)})", param="stream")
        stream = flag if stream is None else stream
        inputs = body.get("inputs")
        if not isinstance(inputs, str) or not inputs:
            raise RequestError("inputs must be a non-empty string")
        params = body.get("parameters")
        params = {} if params is None else params
        if not isinstance(params, dict):
            raise RequestError("parameters must be a JSON object")
        _check_keys(params, TGI_PARAMS, "parameters.")
        for key in ("details", "return_full_text", "decoder_input_details"):
            if params.get(key) is not None and type(params[key]) is not bool:  # null: the default (1 == True)
                raise RequestError(f"parameters.{key} must be true or false, got {shown(params[key])}",
                                   param=f"parameters.{key}")
        if stream and params.get("decoder_input_details"):  # (TGI's and MindIE's rule)
            raise RequestError("parameters.decoder_input_details must be false on a stream (the prompt's tokens come "
                               "in a non-streamed answer's details)", param="parameters.decoder_input_details")
        adapter = params.get("adapter_id")
        if adapter is not None and not isinstance(adapter, str):
            raise RequestError(f"parameters.adapter_id must be a string, got {shown(adapter)}",
                               param="parameters.adapter_id")
        if adapter is not None and adapter not in NO_ADAPTER:
            raise RequestError(f"parameters.adapter_id {shown(adapter)} is not supported: no LoRA adapters are served "
                               "(null or \"None\": the model itself)", param="parameters.adapter_id")
        timeout = _timeout(params, "parameters.")
        fields = ("max_new_tokens", "do_sample") + SAMPLING
        flat = dict({k: params[k] for k in fields + ("typical_p",) if k in params}, prompt=inputs)  # (see _warps)
        cut = prompt_cut("parameters.truncate_prompt_tokens", params.get("truncate_prompt_tokens"))
        if prompt_cut("parameters.truncate", params.get("truncate")) is not None:  # (TGI's name of it)
            if cut not in (None, params["truncate"]):
                raise RequestError("give one of parameters.truncate or parameters.truncate_prompt_tokens, not both",
                                   param="parameters.truncate")
            flat["truncate_prompt_tokens"] = params["truncate"]
        top_n = params.get("top_n_tokens") or 0  # (TGI's: each token's n likeliest, with the logprobs)
        if type(top_n) is not int or not 0 <= top_n <= TOP_LOGPROBS or top_n and native:
            raise RequestError(f"parameters.top_n_tokens must be an integer from 0 to {TOP_LOGPROBS}"
                               f"{' (0 on /infer)' if native else ''}, got {shown(top_n)}", param="top_n_tokens")
        if top_n:
            flat["logprobs"] = top_n
        kw = self._parse(flat, self.app.defaults)
        prefill = params.get("decoder_input_details") or False  # (either one asks for the details: MindIE's)
        fmt = TGI(self.app, kw, native, params.get("details") or prefill, prefill,
                  inputs if params.get("return_full_text") else "", listed)  # (its clock starts before the tokenizer)
        return await self._generate(request, [await self._encoded(kw)], [fmt], stream, timeout)

    async def generate(self, request):
        return await self._tgi(request, stream=False)

    async def generate_stream(self, request):
        return await self._tgi(request, stream=True)

    async def compat(self, request):
        return await self._tgi(request, listed=True)

    async def infer(self, request):
        return await self._tgi(request, native=True)


_FIELDS = COMPLETION_KEYS | CHAT_KEYS | set(OFF) | {"prompt_ids", "tokens"}
_OPEN = {"health", "health_timed", "live", "model_ready", "metrics_text", "version"}  # no API key needed


class _Refused(RequestError):
    """An error answered with headers of its own (a 405's Allow, a 401's WWW-Authenticate)."""

    def __init__(self, message, status, headers):
        super().__init__(message, status)
        self.headers = headers


def _awaits_continue(request):
    """Whether the client waits for a 100 Continue before it sends the body (never sent to HTTP/1.0, whose
    clients do not know it: RFC 9110 §10.1.1)."""
    return request.version >= HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue"


def _close_unread(request, resp):
    """An error answered before the body all came (a 413 on its length, a 408, any error while the client
    waits for 100 Continue): what follows on the connection may not be that body (such a client sends its
    next request instead), so the connection closes after the answer (Connection: close). A body on its way
    is first read and dropped (aiohttp's lingering read, up to 10 s, so that a client still sending sees the
    answer); one the client waits to send is not waited for."""
    resp.force_close()
    if _awaits_continue(request) and not request.get("continued"):
        request.protocol.close()  # (what arrives now is dropped unparsed) ...
        request.content.feed_eof()  # ... and taken for no body: no lingering read


def _dumps(obj):
    return json.dumps(obj, ensure_ascii=False)


def _event(obj):
    return b"data: " + _dumps(obj).encode("utf-8") + b"\n\n"


async def _sse(request, resp, ev):
    """Write one server-sent event; the 200 header goes out with the first, so a request that fails
    before producing text still gets a plain JSON error."""
    if resp is None:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        if request.version < HttpVersion11:  # no chunks in HTTP/1.0: the stream's end is the connection's
            resp.force_close()
        await resp.prepare(request)
    await resp.write(_event(ev))
    return resp


_ROUTES = [  # (method, regex, Api method, error family); the method's name labels the metrics
    ("GET", r"/health", "health", "tgi"),
    ("GET", r"/health/timed(-[0-9]+)?", "health_timed", "tgi"),
    ("GET", r"/v2/health/live", "live", "tgi"),
    ("GET", r"/v2/health/ready", "health", "tgi"),
    ("GET", r"/v2/models/(.+)/ready", "model_ready", "tgi"),  # any name ("org/model:v1"; %2F-encoded too)
    ("GET", r"/v1/models", "models", "openai"),
    ("GET", r"/v1/models/(.+)", "model", "openai"),
    ("POST", r"/v1/completions", "completions", "openai"),
    ("POST", r"/v1/chat/completions", "chat", "openai"),
    ("POST", r"/generate", "generate", "tgi"),
    ("POST", r"/generate_stream", "generate_stream", "tgi"),
    ("POST", r"/", "compat", "tgi"),
    ("POST", r"/infer", "infer", "tgi"),
    ("GET", r"/metrics", "metrics_text", "openai"),
    ("GET", r"/version", "version", "openai"),
    ("POST", r"/tokenize", "tokenize", "openai"),
    ("POST", r"/detokenize", "detokenize", "openai"),
]

