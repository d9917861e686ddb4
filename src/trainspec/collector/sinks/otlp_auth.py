"""The agent's bearer token as the ranks send it, and on the OTLP exports that go to the
agent, and to nothing else.

An agent started with a token refuses every request without it, OTLP included; the ranks'
batch sink and action client send it, but the OpenTelemetry exporter knows only
OTEL_EXPORTER_OTLP[_METRICS]_HEADERS, so a sidecar deployment as the Kubernetes manifest
writes it had every OTLP export refused with 401. The token is added only where the OTLP
metrics endpoint is the agent's own address, and never over a header the user set.

`bearer_token` is the one reading of a token every side shares (the agent's settings, the
batch sink, the action client, the exporter headers): surrounding whitespace is dropped, as
the agent drops it from its token file, since `openssl rand -hex 16 > token` and a Secret
made with `kubectl create secret --from-file` both end in a newline (the ranks sent it, the
header was invalid, and every batch went to the ranks' own segments, the token in the log).
Anything else that is not printable ASCII is refused with `TokenError`, naming the setting,
never the value.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping

DEFAULT_OTLP_ENDPOINT = "http://localhost:4318"
_LOOPBACK = {"localhost", "127.0.0.1", "::1"}
TOKEN_ENV = "TRAINSPEC_AGENT_TOKEN"


class TokenError(ValueError):
    """A bearer token no HTTP header can carry; the message names the setting, not the value."""


def bearer_token(value: str | None, setting: str = TOKEN_ENV) -> str:
    """`value` without surrounding whitespace ("" when unset). `TokenError` when what is left
    holds a space, a control character or anything outside printable ASCII: a header cannot
    carry it as it is, and the agent would never match it."""
    token = (value or "").strip()
    if any(not "!" <= ch <= "~" for ch in token):
        raise TokenError(
            f"{setting}: the token holds whitespace, control or non-ASCII characters inside "
            "(a bearer token is printable ASCII without spaces)"
        )
    return token


def env_token(env: Mapping[str, str] | None = None) -> str:
    """`TRAINSPEC_AGENT_TOKEN` as `bearer_token` reads it."""
    return bearer_token((os.environ if env is None else env).get(TOKEN_ENV))


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


def exports_to(env: Mapping[str, str], endpoint: str) -> bool:
    """Whether the OTLP metric exports go to `endpoint` (scheme, host and port alike; any
    loopback name the same)."""
    target = _origin(otlp_metrics_endpoint(env))
    return target is not None and target == _origin(endpoint)


def agent_export_headers(
    env: Mapping[str, str], agent_endpoint: str, token: str | None
) -> dict[str, str] | None:
    """Headers for the OTLP exporter: the user's (OTEL_EXPORTER_OTLP[_METRICS]_HEADERS) plus
    `Authorization: Bearer <token>` when the exports go to `agent_endpoint` and the user set
    no authorization; None when there is nothing to add (the exporter reads its variables).
    `token` is read by `bearer_token` (a trailing newline dropped); `TokenError` when it is
    one no header can carry and the exports go to the agent."""
    from opentelemetry.util.re import parse_env_headers

    if not token or not token.strip():
        return None
    if not exports_to(env, agent_endpoint):
        return None
    token = bearer_token(token)
    raw = env.get("OTEL_EXPORTER_OTLP_METRICS_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS", "")
    headers = {k.lower(): v for k, v in parse_env_headers(raw, liberal=True).items()}
    if "authorization" in headers:
        return None
    return {**headers, "authorization": f"Bearer {token}"}
