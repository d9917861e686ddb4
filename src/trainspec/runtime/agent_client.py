"""What rank 0 uses to collect operator actions from its node's agent, never blocking a step.

`ActionClient(endpoint).start()` polls `GET /v1/actions?after=<last id>` every `poll_s` on a
daemon thread; the training loop calls `take()` at a step boundary, which only drains a
local list (no I/O on the training thread). An agent that is down costs nothing: the poll
fails quietly and is retried. A restarted agent numbers its actions from 1 again and says
so with a new `epoch`, and the client starts over from 0. Passing what `take()` returns to
every rank at one agreed step is `runtime/operator_actions.py`'s job (the control group).

The bearer token is `TRAINSPEC_AGENT_TOKEN` read as every side reads it
(`collector/sinks/otlp_auth.bearer_token`: a trailing newline dropped). One that no header
can carry is said once, naming the setting and not the value, and the client does not poll
(the agent would refuse every request); a failed poll is logged without header values.

Stdlib only at import (the token reading is imported when a client is made), so any package
may use it without pulling in the agent.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

log = logging.getLogger("trainspec.runtime.agent_client")


class ActionClient:
    def __init__(
        self,
        endpoint: str,
        *,
        run_id: str = "",
        token: str | None = None,
        poll_s: float = 0.5,
        timeout_s: float = 2.0,
    ) -> None:
        self.base = endpoint.rstrip("/")
        self.run_id = run_id
        from trainspec.collector.sinks.otlp_auth import TokenError, bearer_token, env_token

        self.token = ""
        self.token_error = ""  # set: the token is unusable and nothing is polled
        try:
            self.token = bearer_token(token, "token") if token is not None else env_token()
        except TokenError as exc:
            self.token_error = str(exc)
            log.warning("trainspec: agent actions off: %s", exc)
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.last_id = 0
        self.epoch = ""
        self.failures = 0
        self._ready: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> list[dict[str, Any]]:
        """One request; returns the new actions (also queued for `take`). Raises OSError
        (a ValueError naming the setting when the token is unusable)."""
        if self.token_error:
            raise ValueError(self.token_error)
        query = urllib.parse.urlencode({"after": self.last_id, "run_id": self.run_id})
        req = urllib.request.Request(f"{self.base}/v1/actions?{query}")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            doc = json.loads(resp.read())
        if doc["epoch"] != self.epoch:
            if self.epoch:  # a restarted agent: its ids start again
                self.last_id = 0
                self.epoch = doc["epoch"]
                return self.poll()
            self.epoch = doc["epoch"]
        new = [a for a in doc["actions"] if a["id"] > self.last_id]
        if new:
            self.last_id = max(a["id"] for a in new)
            with self._lock:
                self._ready.extend(new)
        return new

    def take(self) -> list[dict[str, Any]]:
        """Actions received since the last call (training thread: no I/O)."""
        with self._lock:
            out, self._ready = self._ready, []
        return out

    def start(self) -> ActionClient:
        """Polls on a daemon thread; not with an unusable token (said at construction)."""
        if self.token_error:
            return self
        self._thread = threading.Thread(
            target=self._loop, name="trainspec-action-client", daemon=True
        )
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as exc:  # any failure is counted and the next poll tried: an
                # answer cut short is an http.client.IncompleteRead, not an OSError
                self.failures += 1
                if self.failures == 1:
                    log.info("trainspec: agent actions unavailable: %s: %s",
                             type(exc).__name__, exc)  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1)
