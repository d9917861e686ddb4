"""An in-process agent on a free loopback port, and a small HTTP helper, for the agent tests."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainspec.agent.app import Agent
from trainspec.agent.settings import load_settings


@contextmanager
def running_agent(store: Path, **overrides: Any) -> Iterator[Agent]:
    settings = load_settings(
        overrides={"listen": "127.0.0.1:0", "store": str(store), **overrides}, environ={}
    )
    agent = Agent(settings).start()
    try:
        yield agent
    finally:
        agent.close()


def call(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def call_json(port: int, method: str, path: str, doc: Any = None, **kw: Any) -> tuple[int, Any]:
    body = None if doc is None else json.dumps(doc).encode()
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    status, raw = call(port, method, path, body, headers)
    return status, json.loads(raw) if raw else None
