"""The HTTP transport of `mindspec serve`: aiohttp's server on its own thread and event loop (the
engine keeps the main thread). What it adds to aiohttp: a connection limit (MindIE's maxLinkNum: at
it, the connection idle longest is closed to admit a new one; with none idle, the new one gets a 503
and is closed), aiohttp's own errors (a malformed request line,
a bad header) as one line of JSON of at most 300 characters without a traceback in the log, and one
log line per request.
A connection whose request headers have not all arrived within `keepalive` seconds, or that stays
idle that long, is closed (aiohttp's keep-alive timer, armed from the connection's start; it does
not run while a request is being answered); one whose answer does not move for `keepalive` seconds
(a client that does not read it) is aborted, and its answer's memory freed.
A client that shuts its sending side after its last request other than a POST (Connection: close,
or HTTP/1.0: what `nc -N` and socat do) still gets its answer; elsewhere the end of its input means it left
(its handler is cancelled: a generation whose client left ends), since TCP tells a half-close from a
close only once the server writes."""
import asyncio
import json
import os
import resource
import socket
import sys
import threading
import time

from aiohttp import HttpVersion10, HttpVersion11, web
from aiohttp.web_protocol import RequestHandler, _ErrInfo

from .errors import MindspecError, one_line
from .formats import openai_error


VERSION_SENT = web.RequestKey("version_sent", str)  # a request line's HTTP version other than 1.0 and 1.1
ENDED_WITH = web.ResponseKey("ended_with", int)  # the status of the error event that ended a stream (see said)
IDLE_S = 1.0  # seconds a connection waits for a request before it may be closed to make room for another
LINGER_S = 2.0  # seconds a connection refused at --max-connections reads (and drops) what its client still sends
FD_RESERVE = 128  # open files kept beside the connections: the model's loading, logs, connections refused lingering
LINGER_MOST = 32  # connections refused at --max-connections that linger at once; the others are closed at once
PLANE_LINKS = 64  # connections at once on each extra address (health probes, /metrics): not counted in max_connections
ACCEPT_SAID_S = 10.0  # a failed accept (no file left) is said at most once in this many seconds


def said(resp):
    """The status resp gave its client: a stream's 200, or the status of the error event it ended with (the
    access log and /metrics count it as that)."""
    return resp.get(ENDED_WITH, resp.status)


def _json_error(status, message):
    return json.dumps(openai_error(status, message))


class _Protocol(RequestHandler):
    request, sent, watchdog = None, 0, None  # the latest request; the bytes written for those before it
    _seen = b""  # the last bytes received (a head's end may span two reads)
    _held = b""  # received, not yet parsed: past aiohttp's queue of pipelined requests
    _broken = False  # a body failed to parse: nothing after it is (see _to_the_body)
    _refused = False  # answered 503 on connecting (see refuse)
    _body_left = 0  # bytes of the last request's body (by its Content-Length) not yet fed to the parser
    port = None  # the local port it came to

    def connection_made(self, transport):
        self.port = (transport.get_extra_info("sockname") or (None, None))[1]  # (before aiohttp tells _Server)
        super().connection_made(transport)
        if self._keepalive_timeout:
            self._watch(transport, None, self._loop.time())

    def idle_since(self):
        """Since when this connection has waited for a request (kept alive after an answer, or its headers not all
        arrived), None while one is answered or not yet parsed: the time its keep-alive timer was armed."""
        if (self.transport is None or self._force_close or self._refused or self._messages
                or self._request_in_progress or self._waiter is None or self._waiter.done()):
            return None
        return self._next_keepalive_close_time - self._keepalive_timeout

    def data_received(self, data):
        """aiohttp's, fed one request head at a time: its parser drops every message of a chunk it fails on, so
        a valid request pipelined before a malformed one went unanswered (the 400 read as its answer). What
        follows a request that said it was the last, or a malformed one, is not parsed (RFC 9112 9.6); past
        aiohttp's queue of 32 pipelined requests the rest is held here, and fed a head at a time as it drains.
        And the body of a request still arriving once the server stops is let in (aiohttp reads nothing more of
        a connection it closes: the request got no answer, or a false 408), so that its handler answers it."""
        closing = self._close, self._force_close
        if self._refused or any(closing) and (self.transport is None or not self._body_due()):
            return
        before = b"" if self._held else self._seen  # (what is held starts after a head's end)
        self._seen = (self._seen + data)[-3:]
        data, self._held = self._held + data, b""
        pieces = _heads(before, data) if data else [data]  # (b"": aiohttp's own call, to parse what its parser
        while pieces:  # holds back, or what is held here, once its queue has room)
            if self._past_last():
                break
            if len(self._messages) >= self._max_msg_queue_size:  # (aiohttp paused reading: on resuming it calls
                self._held = b"".join(pieces)  # data_received(b""))
                break
            piece = pieces.pop(0)
            if 0 < self._body_left < len(piece):  # a body and the head after it, fed apart: a parser error quotes
                pieces.insert(0, piece[self._body_left:])  # its chunk from the start (it quoted the body before it)
                piece = piece[:self._body_left]
            body, queued = self._body_left > 0, len(self._messages)
            self._close = self._force_close = False  # (only a due body is let in: start() sees the flags again
            try:  # before it takes another message)
                super().data_received(piece)
            finally:
                self._close, self._force_close = self._close or closing[0], self._force_close or closing[1]
            self._body_left = self._body_left - len(piece) if body else _length(self._messages, queued)
            self._to_the_body()

    def _to_the_body(self):
        """A body that fails to parse (a chunk size "ZZ") arrives after its head, fed alone: aiohttp's parser
        then queues its 400 as a message of its own, behind the request still waiting for that body (a 408 at
        the read timeout, a chaos probe's). The error goes to that body's reader (api: a 400 naming it)."""
        if not self._messages or not isinstance(self._messages[-1][0], _ErrInfo):
            return
        waiting = [p for p in [m[1] for m in list(self._messages)[:-1]] +
                   ([self.request.content] if self.request is not None else []) if not p.is_eof()]
        if waiting:
            waiting[0].set_exception(self._messages.pop()[0].exc)
            self._broken = True  # (nothing after it is parsed)
            self._lingering_time = 0.0  # (aiohttp's read of an unread body after the answer would raise it again)

    def refuse(self, answer, linger=True):
        """Send answer (a 503 at --max-connections) before any request is read, and close. Not at once: a socket
        closed with the client's request unread, or with its bytes still arriving, answers them with a reset,
        and most clients then lose the 503 (a chaos probe: 32 of 40 requests of 60 kB got a broken pipe). So it
        half-closes, drops what arrives, and closes when the client does or after LINGER_S (Apache's
        lingering close). linger=False (a flood: each lingering connection holds an open file) closes at once."""
        self._refused = True
        self.transport.write(answer)
        if not linger:
            return self.force_close()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._loop.call_later(LINGER_S, self.force_close)

    def _past_last(self):
        """Whether what arrives now follows the connection's last request (a malformed one, or one whose head
        said so, its body all there): not to be parsed."""
        if self._broken:
            return True
        if self._messages:
            msg, payload = self._messages[-1]
            return isinstance(msg, _ErrInfo) or (getattr(msg, "should_close", False) and payload.is_eof())
        return self.request is not None and not self.request.keep_alive and self.request.content.is_eof()

    def _body_due(self):
        """Whether a request's body is still arriving: the one answered, or one queued (not yet taken)."""
        payloads = [m[1] for m in self._messages] + ([self.request.content] if self.request is not None else [])
        return any(not p.is_eof() for p in payloads)

    def connection_lost(self, exc):
        if self.watchdog is not None:
            self.watchdog.cancel()
        super().connection_lost(exc)

    def _watch(self, transport, sent, since):
        """Every keepalive/4 s: abort the connection if its answer has bytes waiting that have not moved for
        `keepalive` s (else a client that does not read holds the connection and the answer for ever)."""
        now, waiting = self._loop.time(), transport.get_write_buffer_size()
        out = self.sent + (self.request.writer.output_size if self.request else 0) - waiting  # bytes sent
        if not waiting or out != sent:
            sent, since = out, now
        elif now - since >= self._keepalive_timeout:
            peer = (transport.get_extra_info("peername") or ("?",))[0]
            sys.stderr.write(f"mindspec: {peer} did not read its answer for {self._keepalive_timeout:g} s: "
                             "connection closed\n")
            return transport.abort()
        self.watchdog = self._loop.call_later(self._keepalive_timeout / 4, self._watch, transport, sent, since)

    def eof_received(self):
        """The client shut its sending side. After a request other than a POST (a generation) that said it
        was its last (Connection: close, HTTP/1.0) that is how nc -N and socat end it: True keeps the
        socket open to answer. Else the client left, as aiohttp takes it (None: the transport closes, the
        handler is cancelled): TCP tells a half-close from a close only when the server next writes, and a
        generation whose client left must end now (a proxy such as nginx sends HTTP/1.0 with Connection:
        close, then closes when its client gives up), so a POST's end of input always counts as its client
        gone."""
        if self._messages:
            msg, body = self._messages[-1]
            last = getattr(msg, "should_close", True)  # (a parser error's 400: answered, then closed)
            method = getattr(msg, "method", "GET")
        elif self.request is not None:  # (answered, if keep-alive: idle, the client left; a parser error's: UNKNOWN)
            last, body, method = not self.request.keep_alive, self.request.content, self.request.method
        else:
            return None
        return (last and method != "POST" and body.is_eof()) or None

    def handle_error(self, request, status=500, exc=None, message=None):
        """aiohttp's own errors: one line of JSON, no traceback in the log."""
        if request.writer.output_size > 0:
            raise ConnectionError("response already started")
        if isinstance(exc, ConnectionError):  # the client left: nobody to answer, nothing to log
            resp = web.Response(status=499)
            resp.force_close()
            return resp
        text = " ".join(str(message or (getattr(exc, "message", None) or str(exc) if exc else "error")).split())
        # (the words before the bytes it quotes: a bad request line quoting a Content-Length header is no bad header)
        what = "bad Content-Length header" if "Content-Length" in text.split(": b'")[0] else "bad request"
        if "invalid `Transfer-Encoding`" in text or "Invalid `Transfer-Encoding` header" in text:  # (quoting bytes)
            text = ("Transfer-Encoding must end in chunked, once (else the body's length is unknown): "
                    "send it plain or chunked")
        text = one_line(f"{what}: {text}")
        sys.stderr.write(f"mindspec: {request.remote} {text}\n")
        resp = web.Response(status=status, text=_json_error(status, text), content_type="application/json")
        resp.force_close()
        self._manager.on_error(status)
        return resp


class _Server(web.Server):
    def __init__(self, handler, max_connections, on_error, **kw):
        super().__init__(handler, **kw)
        self.max_connections, self.on_error = max_connections, on_error
        self.planes = set()  # the extra addresses' ports (HttpServer._open), each with PLANE_LINKS connections

    def __call__(self):
        return _Protocol(self, loop=self._loop, **self._kwargs)

    def _make_request(self, message, payload, protocol, writer, task):
        if protocol.request is not None:  # (a connection's requests are answered one at a time)
            protocol.sent += protocol.request.writer.output_size
        version = message.version
        if version not in (HttpVersion10, HttpVersion11):  # answered (505) as HTTP/1.1, then closed
            message = message._replace(version=HttpVersion11, should_close=True)
        protocol.request = super()._make_request(message, payload, protocol, writer, task)
        if version != message.version:
            protocol.request[VERSION_SENT] = f"HTTP/{version.major}.{version.minor}"
        return protocol.request

    def _plane(self, handler):
        """The address whose connections handler's counts among: an extra one's port, or None (the main one)."""
        return handler.port if handler.port in self.planes else None

    def connection_made(self, handler, transport):
        super().connection_made(handler, transport)
        # an address's own connections count (health probes on one of their own are not locked out by the main one's);
        # those refused, lingering a moment, do not (a review's: they cost the next client its place)
        most = PLANE_LINKS if handler.port in self.planes else self.max_connections
        plane = [h for h in self._connections if self._plane(h) == self._plane(handler)]
        if most and sum(not h._refused for h in plane) > most:
            # the idle longest makes room, as nginx does; not one idle under IDLE_S, whose next request may be in
            # the kernel's buffer unparsed (a pool's POST, reset, is not retried)
            idle = [(t, h) for h in plane if h is not handler and (t := h.idle_since()) is not None
                    and t <= self._loop.time() - IDLE_S]
            if idle:
                return min(idle, key=lambda x: x[0])[1].force_close()
            body = _json_error(503, f"too many connections (at most {most}); retry later").encode()
            handler.refuse(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                           b"Retry-After: 1\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode()
                           + b"\r\n\r\n" + body, linger=sum(h._refused for h in self._connections) < LINGER_MOST)
            self.on_error(503)


def _length(messages, before):
    """The bytes of its body (by its Content-Length) not yet fed to aiohttp's parser of the request it queued last,
    when it queued one (more than `before` messages); else 0. (A head and some of its body can come in one piece:
    past _heads' 32 cuts, or a piece aiohttp's paused parser held back.)"""
    if len(messages) <= before or isinstance(messages[-1][0], _ErrInfo) or messages[-1][0].chunked:
        return 0
    length = messages[-1][0].headers.get("Content-Length", "0")
    return max(0, int(length) - messages[-1][1].total_bytes) if length.isdigit() else 0


def _heads(before, data, most=32):
    """data cut after each b"\r\n\r\n" (a blank line that may end a request's head), one begun in `before` (the
    last bytes received before data, at most 3) included; at most `most` cuts (a body of blank lines is not cut
    into thousands of parser calls; aiohttp queues 32 requests)."""
    joined, cuts = before + data, []
    at = joined.find(b"\r\n\r\n")
    while at != -1 and len(cuts) < most:
        cut = at + 4 - len(before)  # (where it ends in data; <= 0: within before, fed already)
        if cut > 0:
            cuts.append(cut)
        at = joined.find(b"\r\n\r\n", at + 4)
    pieces = [data[a:b] for a, b in zip([0] + cuts, cuts)]
    return pieces + [data[cuts[-1] if cuts else 0:]] if not cuts or cuts[-1] < len(data) else pieces


def _room(max_connections, planes=0):
    """(the connections this process can hold open, at most max_connections; the line that says it had to lower
    them, or None). The soft open-files limit is raised toward the hard one as far as they need (as vLLM does:
    the usual soft limit of 1024 held ~1000 connections, and at it the server accepted none, a health probe's
    neither); files open now, the extra addresses' `planes` connections and FD_RESERVE are kept aside."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    now = (len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 64) + planes
    need = max_connections + now + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        try:
            soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        except (ValueError, OSError):
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections, None
    room = max(1, soft - now - FD_RESERVE)
    return room, (f"mindspec: warning: --max-connections {max_connections} lowered to {room}: this process may open "
                  f"{soft} files (ulimit -n, its hard limit {hard}); raise it to serve more")


def _listening(host, port):
    """A listening TCP socket on host's first address (an IPv6 one for "::")."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as asyncio's own servers)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class _Loop(asyncio.SelectorEventLoop):
    """asyncio's loop, accepting one connection per readiness of a listening socket, not up to `backlog`: on a failed
    accept (no file left) asyncio's loop goes on and schedules a retry per failure, and those retries fail alike
    (~10,000 timers and tracebacks within seconds)."""

    def _accept_connection(self, protocol_factory, sock, sslcontext=None, server=None, backlog=100, *args, **kw):
        return super()._accept_connection(protocol_factory, sock, sslcontext, server, 1, *args, **kw)

    def _start_serving(self, protocol_factory, sock, *args, **kw):
        if sock.fileno() == -1:  # (a retry after a failed accept, once the server stopped: a traceback)
            return None
        return super()._start_serving(protocol_factory, sock, *args, **kw)


class HttpServer:
    """Serve `handle(request) -> response` on host:port from a thread of its own."""

    def __init__(self, handle, host, port, max_connections=None, keepalive=30, on_error=None, extra=(),
                 on_bound=None):
        """on_error(status): an answer made here, not by `handle` (a parser's 400, a 503 beyond the limit).
        extra: more (host, port) to listen on, for the same handler (which can tell them by the socket's port);
        on_bound(extra as bound, port 0 the system's) before a request is served."""
        self.handle, self.host, self.port, self.on_error = handle, host, port, on_error or (lambda status: None)
        self.extra, self.failed, self.on_bound = list(extra), (host, port), on_bound or (lambda extra: None)
        self.max_connections, self.keepalive, self.stopping = max_connections, keepalive, False
        self.loop = _Loop()
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)

    async def _logged(self, request):
        if VERSION_SENT in request:  # (HTTP/2.0, HTTP/0.9: a request line aiohttp parses but no HTTP/1 server
            resp = web.Response(status=505, content_type="application/json", text=_json_error(  # answers as one)
                505, f"HTTP version not supported: {request[VERSION_SENT]} (HTTP/1.1 and HTTP/1.0 are)"))
            self.on_error(505)
        else:
            try:
                resp = await self.handle(request)
            except asyncio.CancelledError:  # (its client left: /metrics counts a 499, so does the log; or the
                self._log(request, 503 if self.stopping else 499)  # server stops)
                raise
        self._log(request, said(resp))
        return resp

    @staticmethod
    def _log(request, status):
        sys.stderr.write(f"mindspec: {request.remote} \"{request.method} {request.raw_path}\" {status}\n")

    async def _open(self):
        # auto_decompress off: a compressed body is refused unread (api), never inflated as it arrives
        server = _Server(self._logged, self.max_connections, self.on_error, handler_cancellation=True,
                         keepalive_timeout=self.keepalive, access_log=None, auto_decompress=False)
        self.runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=5)
        await self.runner.setup()
        for host, port in self.extra:  # bound first, so on_bound knows every port before any request is served
            self.failed = (host, port)  # (named if it cannot listen)
            self._socks.append(_listening(host, port))
        self.extra = [(host, sock.getsockname()[1]) for (host, _), sock in zip(self.extra, self._socks)]
        server.planes = {port for _, port in self.extra}
        self.on_bound(self.extra)
        self.failed = (self.host, self.port)
        await web.TCPSite(self.runner, self.host, self.port).start()
        self.port = self.runner.addresses[0][1]  # (port 0: the one the system gave)
        for sock in self._socks:
            await web.SockSite(self.runner, sock).start()

    def _loop_error(self, loop, context):
        """asyncio's errors; a failed accept (no file left: its connections wait in the kernel's queue, asyncio tries
        again a second later) one line at most every ACCEPT_SAID_S, not a traceback each time (~10,000 in seconds)."""
        e = context.get("exception")
        if not (isinstance(e, OSError) and context.get("message", "").startswith("socket.accept()")):
            return loop.default_exception_handler(context)
        if time.monotonic() - self._accept_said >= ACCEPT_SAID_S:
            self._accept_said = time.monotonic()
            sys.stderr.write(f"mindspec: cannot accept a connection: {e.strerror or e}; new ones wait\n")

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self._accept_said = -ACCEPT_SAID_S
        self.loop.set_exception_handler(self._loop_error)
        self._socks, self.runner = [], None
        try:
            self.loop.run_until_complete(self._open())
        except Exception as e:  # noqa: BLE001 - OSError, and any other (a port out of range: OverflowError)
            self.error = e  # start() raises it: this thread must never die with start() waiting
            for sock in self._socks:  # (nothing left listening: a library's caller goes on)
                sock.close()
            if self.runner is not None:
                self.loop.run_until_complete(self.runner.cleanup())
            self.loop.close()
            return self._opened.set()
        self._opened.set()
        self.loop.run_forever()

    def start(self):
        """Listen (raises MindspecError when the address is taken); returns the port."""
        if self.max_connections:
            self.max_connections, lowered = _room(self.max_connections, PLANE_LINKS * len(self.extra))
            if lowered:
                sys.stderr.write(lowered + "\n")
        self._opened, self.error = threading.Event(), None
        self.thread.start()
        self._opened.wait()
        if self.error is not None:
            raise MindspecError(f"cannot listen on {self.failed[0]}:{self.failed[1]}: "
                                f"{getattr(self.error, 'strerror', None) or self.error}")
        return self.port

    def call(self, fn, *args):
        """Run fn(*args) on the event loop (from another thread); False once the loop is gone."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:
            return False

    def stop(self):
        """Close the listening socket and the connections (handlers get up to 5 s to finish)."""
        self.stopping = True
        try:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=15)
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
