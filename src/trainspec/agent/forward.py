"""Forward OTLP upstream: a bounded buffer, retries with capped exponential backoff and jitter.

The ranks' OTLP requests (already aggregated by their OTel sinks) are passed on unchanged
to `<upstream>/v1/metrics` on the `trainspec-agent-forward` thread. While upstream is down
requests wait in a buffer of `capacity`; when it is full the oldest is dropped and counted
(newer data is worth more to a dashboard). A 4xx other than 408/429 means upstream will never
take that request: dropped and counted, not retried; so is a request that fails in a way
a retry cannot mend (a URL http.client refuses: `settings` checks it at startup). No failure
ends the thread: each sets `last_error`. Backoff as the OTLP specification's
exporter guidance describes (exponential, jittered, retrying 429/502/503/504).
"""

from __future__ import annotations

import http.client
import logging
import random
import threading
import urllib.error
import urllib.request
from collections import deque

log = logging.getLogger("trainspec.agent")
RETRYABLE = {408, 429, 502, 503, 504}


class Forwarder:
    def __init__(
        self,
        upstream: str,
        *,
        capacity: int = 1000,
        timeout_s: float = 5.0,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.url = upstream.rstrip("/") + "/v1/metrics"
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._queue: deque[tuple[bytes, str]] = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.dropped = 0
        self.retries = 0
        self.last_error = ""

    def start(self) -> Forwarder:
        self._thread = threading.Thread(
            target=self._loop, name="trainspec-agent-forward", daemon=True
        )
        self._thread.start()
        return self

    def offer(self, body: bytes, content_type: str) -> None:
        """Queue one request body (never blocks); the oldest goes when the buffer is full."""
        with self._cond:
            if len(self._queue) >= self.capacity:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append((body, content_type))
            self._cond.notify()

    def buffered(self) -> int:
        with self._cond:
            return len(self._queue)

    def _send(self, body: bytes, content_type: str) -> int:
        req = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": content_type}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def _loop(self) -> None:
        delay = self.backoff_initial_s
        while not self._stop.is_set():
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait(0.5)
                if self._stop.is_set():
                    return
                body, ctype = self._queue[0]
            try:
                status = self._send(body, ctype)
            except http.client.InvalidURL as exc:  # the URL, not upstream: fails every time
                status, self.last_error = -1, f"{type(exc).__name__}: {exc}"
            except (OSError, http.client.HTTPException) as exc:  # down, or a garbled answer
                status, self.last_error = 0, f"{type(exc).__name__}: {exc}"
            except Exception as exc:  # would fail the same way again (a bad URL): dropped
                status, self.last_error = -1, f"{type(exc).__name__}: {exc}"
            if status == -1:
                with self._cond:
                    if self._queue and self._queue[0][0] is body:
                        self._queue.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 100 == 0:
                    log.warning("trainspec-agent: upstream %s: request dropped (%s)",
                                self.url, self.last_error)  # fmt: skip
                continue
            if 200 <= status < 300 or (status and status not in RETRYABLE):
                with self._cond:
                    if self._queue and self._queue[0][0] is body:
                        self._queue.popleft()
                if 200 <= status < 300:
                    self.sent += 1
                else:
                    self.dropped += 1
                    self.last_error = f"upstream refused with {status}"
                delay = self.backoff_initial_s
                continue
            self.retries += 1
            if self.retries == 1 or self.retries % 100 == 0:
                log.warning("trainspec-agent: upstream %s unavailable (%s); retrying",
                            self.url, self.last_error or status)  # fmt: skip
            # Full jitter keeps many agents from retrying in step after an upstream restart.
            self._stop.wait(random.uniform(0, delay))
            delay = min(self.backoff_max_s, delay * 2)

    def stats(self) -> dict[str, object]:
        return {
            "upstream": self.url,
            "sent": self.sent,
            "dropped": self.dropped,
            "retries": self.retries,
            "buffered": self.buffered(),
            "last_error": self.last_error,
        }

    def close(self, *, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
