"""The agent's bearer token on the OTLP exports that go to the agent, and to nothing else.

An agent started with a token refuses every request without it, OTLP included; the ranks'
batch sink and action client send it, but the OpenTelemetry exporter knows only
OTEL_EXPORTER_OTLP[_METRICS]_HEADERS, so a sidecar deployment as the Kubernetes manifest
writes it had every OTLP export refused with 401. The token is added only where the OTLP
metrics endpoint is the agent's own address, and never over a header the user set.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping

DEFAULT_OTLP_ENDPOINT = "http://localhost:4318"
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def otlp_metrics_endpoint(env: Mapping[str, str]) -> str:
    """The URL the OTLP/HTTP metric exporter posts to, resolved as the SDK does."""
    if env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"]
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_OTLP_ENDPOINT
    return f"{base.removesuffix('/')}/v1/metrics"


def _origin(url: str) -> tuple[str, str, int] | None:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme, 0)
    except ValueError:  # a malformed port
        return None
    host = (parts.hostname or "").lower()
    return parts.scheme, "loopback" if host in _LOOPBACK else host, port


def agent_export_headers(
    env: Mapping[str, str], agent_endpoint: str, token: str | None
) -> dict[str, str] | None:
    """Headers for the OTLP exporter: the user's (OTEL_EXPORTER_OTLP[_METRICS]_HEADERS) plus
    `Authorization: Bearer <token>` when the exports go to `agent_endpoint` and the user set
    no authorization; None when there is nothing to add (the exporter reads its variables)."""
    from opentelemetry.util.re import parse_env_headers

    if not token:
        return None
    target = _origin(otlp_metrics_endpoint(env))
    if target is None or target != _origin(agent_endpoint):
        return None
    raw = env.get("OTEL_EXPORTER_OTLP_METRICS_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS", "")
    headers = {k.lower(): v for k, v in parse_env_headers(raw, liberal=True).items()}
    if "authorization" in headers:
        return None
    return {**headers, "authorization": f"Bearer {token}"}
