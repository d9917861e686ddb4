"""The agent's one HTTP port: routing, body limits, authentication, answers.

`ThreadingHTTPServer` (a thread per connection, so a rank waiting for its group commit
never holds up a scrape). Handlers are a table `(method, path) -> function(Request) ->
Response`; a route that raises `Rejected` answers its status, anything unexpected answers
500 and is counted, and the server keeps serving. Every method goes through the table, so a
method no route serves (DELETE, PUT, PATCH, HEAD...) gets a JSON 405 with `Allow` on a known
path and a JSON 404 elsewhere, and a request http.server cannot parse gets a JSON refusal
too, not http.server's HTML page.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from trainspec.agent.auth import authorized
from trainspec.agent.ingest import IngestCounters, Rejected

log = logging.getLogger("trainspec.agent")


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Any
    body: bytes = b""


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def json(doc: Any, status: int = 200) -> Response:
        return Response(status, json.dumps(doc, sort_keys=True).encode() + b"\n")


Route = Callable[[Request], Response]


class AgentHTTPServer(ThreadingHTTPServer):
    """Counts the requests being handled, so that `drain` can let them answer at shutdown
    (connection threads are daemons: an idle keep-alive connection never holds up exit)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: Any) -> None:
        # An IPv6 literal ("[::1]:4318", brackets stripped by the settings) needs AF_INET6.
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._in_flight = 0
        self._idle = threading.Condition()
        self.draining = False  # answers say Connection: close once set
        super().__init__(address, handler)

    def request_started(self) -> None:
        with self._idle:
            self._in_flight += 1

    def request_done(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until no request is being handled; True if none is.
        Called after the final commit, so the batches it stored get their 200 before the
        process exits instead of a dropped connection (the rank would write them again)."""
        self.draining = True
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout_s)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """socketserver prints a traceback to stderr for whatever a connection's handler
        raised: a client that drops its connection (reset, broken pipe) is routine and a
        debug line; anything else is one warning line, its traceback at debug."""
        exc = sys.exc_info()[1]
        peer = _peer(client_address)
        if isinstance(exc, ConnectionError):  # reset, aborted, broken pipe
            log.debug("trainspec-agent: client %s dropped its connection: %s", peer, exc)
            return
        log.warning(
            "trainspec-agent: connection from %s failed: %s: %s", peer, type(exc).__name__, exc
        )
        log.debug("trainspec-agent: connection from %s failed", peer, exc_info=exc)


def _peer(client_address: Any) -> str:
    if isinstance(client_address, tuple) and len(client_address) >= 2:
        return f"{client_address[0]}:{client_address[1]}"
    return str(client_address)


def make_server(
    host: str,
    port: int,
    routes: dict[tuple[str, str], Route],
    *,
    token: str,
    max_body_bytes: int,
    counters: IngestCounters,
) -> AgentHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a rank reuses one connection
        timeout = 30.0  # a sender that stalls mid-body loses its connection, not a thread

        def _answer(self, resp: Response) -> None:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.content_type)
            self.send_header("Content-Length", str(len(resp.body)))
            for k, v in resp.headers.items():
                self.send_header(k, v)
            draining = isinstance(self.server, AgentHTTPServer) and self.server.draining
            if draining and "Connection" not in resp.headers:
                self.send_header("Connection", "close")  # the agent is stopping
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":  # a HEAD answer has headers only (RFC 9110 9.3.2)
                self.wfile.write(resp.body)

        def _refuse(
            self,
            status: int,
            reason: str,
            counter: str,
            *,
            close: bool = False,
            headers: dict[str, str] | None = None,
        ) -> None:
            counters.reject(counter)
            resp = Response.json({"error": reason}, status)
            resp.headers.update(headers or {})
            if close:  # the unread body makes the connection unusable
                resp.headers["Connection"] = "close"
                self.close_connection = True
            self._answer(resp)

        def _read_body(self, *, required: bool) -> bytes | None:
            """The request's body (b"" when it has none), or None once refused. A body on
            a GET is read and dropped: left unread it would be parsed as the next request
            on this keep-alive connection."""
            lengths = self.headers.get_all("Content-Length") or []
            if len(lengths) > 1 or lengths and self.headers.get("Transfer-Encoding"):
                # Which one frames the body is what request smuggling plays on (RFC 9112
                # 6.3): the first had been used and the connection kept.
                self._refuse(400, "one Content-Length, without Transfer-Encoding, required",
                             "length", close=True)  # fmt: skip
                return None
            length = lengths[0] if lengths else None
            if length is None:
                if self.headers.get("Transfer-Encoding"):  # chunked: not read here
                    self._refuse(411, "Content-Length required (no Transfer-Encoding)",
                                 "length", close=True)  # fmt: skip
                    return None
                if required:
                    self._refuse(411, "Content-Length required", "length", close=True)
                    return None
                return b""
            if not (length.isascii() and length.isdigit()):  # "²" is a digit to isdigit
                self._refuse(400, f"Content-Length {length!r} is not a byte count",
                             "length", close=True)  # fmt: skip
                return None
            if int(length) > max_body_bytes:
                self._refuse(413, f"body over {max_body_bytes} bytes", "too_large", close=True)
                return None
            try:
                body = self.rfile.read(int(length))
            except OSError:
                body = b""
            if len(body) < int(length):
                self._refuse(400, "body shorter than Content-Length", "truncated", close=True)
                return None
            return body

        def _handle(self, method: str) -> None:
            # Counted from here to the answer, so that `drain` waits for it at shutdown; an
            # idle keep-alive connection waiting for its next request is not counted.
            server = self.server
            assert isinstance(server, AgentHTTPServer)
            server.request_started()
            try:
                self._dispatch(method)
            finally:
                server.request_done()

        def _dispatch(self, method: str) -> None:
            url = urlsplit(self.path)
            route = routes.get((method, url.path))
            if route is None:
                allowed = sorted(m for m, p in routes if p == url.path)
                if not allowed:
                    self._refuse(404, f"{url.path}: no such route", "route", close=True)
                    return
                self._refuse(
                    405,
                    f"{method} {url.path}: method not allowed (allowed: {', '.join(allowed)})",
                    "route",
                    close=True,
                    headers={"Allow": ", ".join(allowed)},
                )
                return
            if not authorized(url.path, self.headers.get("Authorization"), token):
                self._refuse(401, "missing or wrong bearer token", "unauthorized", close=True)
                return
            body = self._read_body(required=method == "POST")
            if body is None:
                return
            req = Request(method, url.path, parse_qs(url.query), self.headers, body)
            try:
                resp = route(req)
            except Rejected as exc:
                self._refuse(exc.status, exc.reason, exc.counter)
                return
            except Exception as exc:  # a bug in one route must not take the port down
                log.exception("trainspec-agent: %s %s failed", method, url.path)
                self._refuse(500, f"internal error: {type(exc).__name__}", "internal")
                return
            self._answer(resp)

        def __getattr__(self, name: str) -> Callable[[], None]:
            # http.server calls do_<METHOD> and answers an HTML 501 where there is none:
            # every method goes through the route table instead.
            if name.startswith("do_"):
                return lambda: self._handle(name[3:])
            raise AttributeError(name)

        def send_error(
            self, code: int, message: str | None = None, explain: str | None = None
        ) -> None:
            # http.server's own refusals (bad request line, URI or headers too long) as JSON.
            phrase = self.responses.get(code, ("error",))[0]
            self._refuse(code, message or phrase, "protocol", close=True)

        def log_message(self, *args: object) -> None:
            pass

    return AgentHTTPServer((host, port), Handler)


def serve(server: AgentHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="trainspec-agent-http", daemon=True)
    thread.start()
    return thread
