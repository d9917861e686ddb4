"""The agent's bearer token is read alike on every side: a token file's trailing newline
(`openssl rand -hex 16 > tok`, a Secret made with `--from-file`) is dropped by the agent AND
by the ranks (batch sink, action client, OTLP exporter headers); a token no header can carry
is refused naming the setting; no log line ever holds the token (found 2026-11-27: the ranks
sent "Bearer <token>\\n", http.client refused it, every batch went to the ranks' own
segments, and the warning quoted the header, token and all)."""

from __future__ import annotations

import logging
import time

import pyarrow as pa
import pytest

from tests.unit.agent_fixtures import running_agent
from trainspec.agent.settings import SettingsError, load_settings
from trainspec.collector.records import Batch
from trainspec.collector.sinks.agent import AgentSink
from trainspec.collector.sinks.otlp_auth import TokenError, agent_export_headers, bearer_token
from trainspec.config import load_config
from trainspec.runtime.agent_client import ActionClient
from trainspec.runtime.identity import RankIdentity
from trainspec.runtime.wiring import build_sinks
from trainspec.store.tables import SAMPLES

TOKEN = "07c4d1e2f3a4b5c6d7e8f90a1b2c3d4e"
BAD = [f"{TOKEN[:8]} {TOKEN[8:]}", f"{TOKEN[:8]}\n{TOKEN[8:]}", f"{TOKEN}\x01", f"{TOKEN}é"]


def _batch() -> Batch:
    rows = [{"ts": time.time(), "rank": 0, "metric": "trainspec.host.memory.used",
             "value": 1e9, "attrs": "{}"}]  # fmt: skip
    return Batch(pa.Table.from_pylist(rows, schema=SAMPLES), [], [])


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


@pytest.fixture
def file_agent(tmp_path):
    """An agent whose token file ends in a newline, as such files do."""
    (tmp_path / "tok").write_text(TOKEN + "\n")
    with running_agent(tmp_path / "store", token_file=str(tmp_path / "tok")) as agent:
        yield agent


def test_bearer_token_drops_surrounding_whitespace_and_refuses_the_rest():
    assert bearer_token(f"  {TOKEN}\r\n") == TOKEN
    assert bearer_token(None) == "" and bearer_token("\n") == ""
    for bad in BAD:
        with pytest.raises(TokenError, match="^TRAINSPEC_AGENT_TOKEN: ") as info:
            bearer_token(bad)
        assert TOKEN[8:] not in str(info.value) and "\n" not in str(info.value)


def test_a_rank_with_the_token_files_newline_reaches_the_agent(file_agent, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSPEC_AGENT_TOKEN", TOKEN + "\n")
    sink = AgentSink(f"http://127.0.0.1:{file_agent.port}", run_id="tok-run", rank=0,
                     run_dir=tmp_path / "run", writer="rank-0", timeout_s=5.0)  # fmt: skip
    sink.write(_batch())
    sink.close()
    assert (sink.sent_batches, sink.fallback_batches) == (1, 0)
    assert file_agent.counters.snapshot()["rejected"].get("unauthorized", 0) == 0


def test_the_action_client_with_the_token_files_newline_is_let_in(file_agent, monkeypatch):
    monkeypatch.setenv("TRAINSPEC_AGENT_TOKEN", TOKEN + "\n")
    client = ActionClient(f"http://127.0.0.1:{file_agent.port}", run_id="tok-run")
    assert client.poll() == []  # a 401 raises
    assert client.epoch


def test_the_otlp_headers_carry_the_token_without_its_newline():
    headers = agent_export_headers({}, "http://127.0.0.1:4318", TOKEN + "\n")
    assert headers == {"authorization": f"Bearer {TOKEN}"}
    with pytest.raises(TokenError, match="TRAINSPEC_AGENT_TOKEN"):
        agent_export_headers({}, "http://127.0.0.1:4318", BAD[0])
    # Not the agent's exports: the token is not theirs to judge.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert agent_export_headers(env, "http://127.0.0.1:4318", BAD[0]) is None


@pytest.mark.parametrize("bad", BAD)
def test_a_rank_with_an_unusable_token_says_so_once_without_the_token(
    bad, tmp_path, monkeypatch, caplog
):
    """Sidecar mode off (the rank writes its store), OTLP off, actions off: each one line
    naming TRAINSPEC_AGENT_TOKEN, none quoting the token; training goes on."""
    env = {"TRAINSPEC_COLLECTOR_MODE": "sidecar", "TRAINSPEC_AGENT_TOKEN": bad,
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = load_config(environ=env)
    resource = {"service.name": "t", "trainspec.run.id": "tok-run", "trainspec.rank": 0}
    with caplog.at_level(logging.INFO):
        sinks, store = build_sinks(cfg, RankIdentity(0, 0, 1, "h"), tmp_path / "run", resource)
        client = ActionClient("http://127.0.0.1:9", run_id="tok-run").start()
    try:
        assert store is not None and store.name != "agent"
        assert client._thread is None
        with pytest.raises(ValueError, match="TRAINSPEC_AGENT_TOKEN"):
            client.poll()
    finally:
        for sink in sinks:
            sink.close()
    said = [r.getMessage() for r in caplog.records if "TRAINSPEC_AGENT_TOKEN" in r.getMessage()]
    assert any("sidecar mode off" in line for line in said), said
    assert any("agent actions off" in line for line in said), said
    assert all("\n" not in line for line in said)
    assert TOKEN[8:] not in _logged(caplog)


def test_a_header_http_refuses_is_named_in_the_log_never_quoted(tmp_path, caplog):
    """http.client's ValueError quotes the header value; the sink logs which header, and
    what to check, instead."""
    secret = "svc\nsecret-looking-value"
    sink = AgentSink("http://127.0.0.1:9", run_id="tok-run", rank=0, run_dir=tmp_path / "run",
                     writer="rank-0", timeout_s=2.0, service=secret)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        sink.write(_batch())
        sink.close()
    assert sink.fallback_batches == 1
    line = next(r.getMessage() for r in caplog.records if "unavailable" in r.getMessage())
    assert "invalid X-Trainspec-Service header (check service.name)" in line, line
    assert "secret-looking-value" not in _logged(caplog)


@pytest.mark.parametrize("source", ["env", "file"])
def test_the_agent_reads_its_token_as_the_ranks_do(source, tmp_path):
    (tmp_path / "tok").write_text(TOKEN + "\n")
    env = {"TRAINSPEC_AGENT_TOKEN": TOKEN + "\n"} if source == "env" else {}
    overrides = {"token_file": str(tmp_path / "tok")} if source == "file" else {}
    assert load_settings(overrides=overrides, environ=env).resolved_token() == TOKEN
    (tmp_path / "tok").write_text(BAD[0] + "\n")
    env = {"TRAINSPEC_AGENT_TOKEN": BAD[0]} if source == "env" else {}
    with pytest.raises(SettingsError) as info:
        load_settings(overrides=overrides, environ=env)
    text = str(info.value)
    assert ("TRAINSPEC_AGENT_TOKEN" if source == "env" else str(tmp_path / "tok")) in text
    assert TOKEN[8:] not in text
