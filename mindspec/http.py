"""The HTTP transport of `mindspec serve`: aiohttp's server on its own thread and event loop (the
engine keeps the main thread). What it adds to aiohttp: a connection limit (MindIE's maxLinkNum:
a connection beyond it gets a 503 and is closed), aiohttp's own errors (a malformed request line,
a bad header) as one line of JSON without a traceback in the log, and one log line per request.
A connection whose request headers have not all arrived within `keepalive` seconds, or that stays
idle that long, is closed (aiohttp's keep-alive timer, armed from the connection's start; it does
not run while a request is being answered)."""
import asyncio
import json
import sys
import threading

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .errors import MindspecError
from .formats import openai_error


def _json_error(status, message):
    return json.dumps(openai_error(status, message))


class _Protocol(RequestHandler):
    def handle_error(self, request, status=500, exc=None, message=None):
        """aiohttp's own errors: one line of JSON, no traceback in the log."""
        if request.writer.output_size > 0:
            raise ConnectionError("response already started")
        if isinstance(exc, ConnectionError):  # the client left: nobody to answer, nothing to log
            resp = web.Response(status=499)
            resp.force_close()
            return resp
        text = " ".join(str(message or (getattr(exc, "message", None) or str(exc) if exc else "error")).split())
        what = "bad Content-Length header" if "Content-Length" in text else "bad request"
        if "invalid `Transfer-Encoding`" in text or "Invalid `Transfer-Encoding` header" in text:  # (quoting bytes)
            text = ("Transfer-Encoding must end in chunked, once (else the body's length is unknown): "
                    "send it plain or chunked")
        sys.stderr.write(f"mindspec: {request.remote} {what}: {text}\n")
        resp = web.Response(status=status, text=_json_error(status, f"{what}: {text}"), content_type="application/json")
        resp.force_close()
        return resp


class _Server(web.Server):
    def __init__(self, handler, max_connections, **kw):
        super().__init__(handler, **kw)
        self.max_connections = max_connections

    def __call__(self):
        return _Protocol(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler, transport):
        super().connection_made(handler, transport)
        if self.max_connections and len(self._connections) > self.max_connections:
            body = _json_error(503, f"too many connections (at most {self.max_connections}); retry later").encode()
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            handler.force_close()


class HttpServer:
    """Serve `handle(request) -> response` on host:port from a thread of its own."""

    def __init__(self, handle, host, port, max_connections=None, keepalive=30):
        self.handle, self.host, self.port = handle, host, port
        self.max_connections, self.keepalive = max_connections, keepalive
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)

    async def _logged(self, request):
        resp = await self.handle(request)
        sys.stderr.write(f"mindspec: {request.remote} \"{request.method} {request.path_qs}\" {resp.status}\n")
        return resp

    async def _open(self):
        # auto_decompress off: a compressed body is refused unread (api), never inflated as it arrives
        server = _Server(self._logged, self.max_connections, handler_cancellation=True,
                         keepalive_timeout=self.keepalive, access_log=None, auto_decompress=False)
        self.runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=5)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()
        self.port = self.runner.addresses[0][1]

    def _run(self):
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._open())
        except Exception as e:  # noqa: BLE001 - OSError, and any other (a port out of range: OverflowError)
            self.error = e  # start() raises it: this thread must never die with start() waiting
            return self._opened.set()
        self._opened.set()
        self.loop.run_forever()

    def start(self):
        """Listen (raises MindspecError when the address is taken); returns the port."""
        self._opened, self.error = threading.Event(), None
        self.thread.start()
        self._opened.wait()
        if self.error is not None:
            raise MindspecError(f"cannot listen on {self.host}:{self.port}: "
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
        try:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=15)
        except Exception:  # noqa: BLE001 - stopping anyway
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
