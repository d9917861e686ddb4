"""Who may call what. Health and `/metrics` are open (probes and scrapers); with a token
configured every other route needs `Authorization: Bearer <token>`, compared in constant
time. Without a token the agent is loopback-only (settings refuse anything else), so only
processes on the node can reach it."""

from __future__ import annotations

import hmac

OPEN_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})


def authorized(path: str, header: str | None, token: str) -> bool:
    if not token or path in OPEN_ROUTES:
        return True
    if not header:
        return False
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
