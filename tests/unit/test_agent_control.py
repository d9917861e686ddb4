"""The control API: bind policy, bearer token, action validation, delivery to rank 0's client."""

from __future__ import annotations

import json
import time

import pytest

from tests.unit.agent_fixtures import call, call_json, running_agent
from trainspec.agent.main import main
from trainspec.agent.settings import SettingsError, load_settings
from trainspec.runtime.agent_client import ActionClient

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    with running_agent(tmp_path_factory.mktemp("store"), token=TOKEN) as agent:
        yield agent


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
     {"Authorization": "Basic " + TOKEN}, {"Authorization": "Bearer "}],
)  # fmt: skip
def test_requests_without_the_token_get_401(secured, headers):
    for method, path in [("POST", "/v1/actions"), ("GET", "/v1/actions"), ("GET", "/v1/status"),
                         ("POST", "/v1/metrics")]:  # fmt: skip
        status, body = call_json(secured.port, method, path, {"action": "checkpoint"},
                                 headers=headers)  # fmt: skip
        assert status == 401, (method, path, body)
    assert secured.actions.count() == 0
    assert secured.counters.snapshot()["rejected"]["unauthorized"] >= 4


def test_health_and_metrics_stay_open_for_probes_and_scrapers(secured):
    assert call(secured.port, "GET", "/healthz")[0] == 200
    assert call(secured.port, "GET", "/readyz")[0] == 200
    assert call(secured.port, "GET", "/metrics")[0] == 200


@pytest.mark.parametrize(
    "doc",
    [
        ["checkpoint"],
        {"action": "reboot"},
        {"action": "set_compression"},
        {"action": "set_compression", "level": "int4"},
        {"action": "set_compression", "level": "lowrank:0"},
        {"action": "set_compression", "level": "lowrank:4:x"},
        {"action": "set_compression", "level": "int8:0"},
        {"action": "set_compression", "level": "topk:2"},
        {"action": "set_compression", "level": "topk:0"},
        {"action": "set_compression", "level": "lowrank:" + "9" * 5000},  # was a 500
        {"action": "dry_run", "enabled": "yes"},
        {"action": "checkpoint", "extra": 1},
        {"action": "checkpoint", "run_id": 5},
    ],
)
def test_malformed_actions_get_400(secured, doc):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, body = call_json(secured.port, "POST", "/v1/actions", doc, headers=auth)
    assert status == 400 and body["error"]
    status, _ = call(secured.port, "POST", "/v1/actions", b"\xff{", {**auth,
                     "Content-Type": "application/json"})  # fmt: skip
    assert status == 400


def test_an_action_reaches_rank_zeros_client(tmp_path):
    with running_agent(tmp_path, token=TOKEN) as agent:
        base = f"http://127.0.0.1:{agent.port}"
        client = ActionClient(base, run_id="run-a", token=TOKEN, poll_s=0.05).start()
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for doc in (
            {"action": "set_compression", "level": "int8", "run_id": "run-a"},
            {"action": "checkpoint", "run_id": "run-b"},  # another run: not for this client
            {"action": "dry_run", "enabled": True},
        ):
            assert call_json(agent.port, "POST", "/v1/actions", doc, headers=auth)[0] == 202
        deadline = time.monotonic() + 5
        got: list[dict] = []
        while len(got) < 2 and time.monotonic() < deadline:
            got += client.take()
            time.sleep(0.05)
        client.close()
    assert [(a["action"], a["args"]) for a in got] == [
        ("set_compression", {"level": "int8"}),
        ("dry_run", {"enabled": True}),
    ]


def test_client_survives_a_dead_agent_and_restarts_numbering(tmp_path):
    with running_agent(tmp_path) as agent:
        port = agent.port
        client = ActionClient(f"http://127.0.0.1:{port}", timeout_s=0.5)
        call_json(port, "POST", "/v1/actions", {"action": "checkpoint"})
        assert [a["id"] for a in client.poll()] == [1]
    with pytest.raises(OSError):
        client.poll()  # agent gone: an OSError for the poll thread to count, never a hang
    with running_agent(tmp_path, listen=f"127.0.0.1:{port}") as again:
        call_json(again.port, "POST", "/v1/actions", {"action": "pause_actuator"})
        assert [a["action"] for a in client.poll()] == ["pause_actuator"]


def test_bind_policy():
    with pytest.raises(SettingsError, match="allow-remote"):
        load_settings(overrides={"listen": "0.0.0.0:4318"}, environ={})
    with pytest.raises(SettingsError, match="token"):
        load_settings(overrides={"listen": "0.0.0.0:4318", "allow_remote": True}, environ={})
    ok = load_settings(
        overrides={"listen": "0.0.0.0:4318", "allow_remote": True},
        environ={"TRAINSPEC_AGENT_TOKEN": TOKEN},
    )
    assert ok.resolved_token() == TOKEN
    with pytest.raises(SettingsError, match="HOST:PORT"):
        load_settings(overrides={"listen": "nope"}, environ={})


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--listen", "0.0.0.0:4318"], "allow-remote"),
        (["--listen", "10.0.0.1:4318", "--allow-remote"], "token"),
        (["--config", "/nonexistent.toml"], "not found"),
        (["--upstream", "ftp://x"], "upstream"),
        (["--config", "{tmp}", "--listen", "127.0.0.1:0"], "Is a directory"),
        (["--config", "{tmp}/agent-is-a-number.toml", "--listen", "127.0.0.1:0"], "not a table"),
        (["--config", "{tmp}/binary.toml", "--listen", "127.0.0.1:0"], "binary.toml"),
        (["--token-file", "{tmp}/absent", "--listen", "127.0.0.1:0"], "token_file"),  # loopback
        (["--store", "{tmp}/binary.toml", "--listen", "127.0.0.1:0"], "not a directory"),
        (["--upstream", "http://[::1", "--listen", "127.0.0.1:0"], "upstream"),
        (["--upstream", "http://127.0.0.1:abc", "--listen", "127.0.0.1:0"], "upstream"),
        (["--token-file", "{tmp}/empty", "--listen", "127.0.0.1:0"], "is empty"),
    ],
)
def test_console_script_refuses_bad_settings_in_one_line(
    argv, message, capsys, monkeypatch, tmp_path
):
    monkeypatch.delenv("TRAINSPEC_AGENT_TOKEN", raising=False)

    def started(settings):
        raise AssertionError(f"the agent started with {settings}")  # main() would block

    monkeypatch.setattr("trainspec.agent.app.Agent", started)
    (tmp_path / "agent-is-a-number.toml").write_text("agent = 5\n")
    (tmp_path / "binary.toml").write_bytes(b"\xfe\xff\x00junk")
    (tmp_path / "empty").write_text("\n")
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_levels_are_checked_without_torch():
    """The agent, `trainspec config` and `trainspec run` check level names with the kernels'
    own parser (`trainspec.levels`) and import no torch: the agent had a regular expression
    of its own, kept in step by a test, and the CLI imported torch (3 s) to check a name."""
    import subprocess
    import sys

    code = ("import sys, trainspec.agent.control, trainspec.levels, trainspec.cli.config, "
            "trainspec.cli.run; assert 'torch' not in sys.modules, 'torch imported'; "
            "from trainspec.agent.control import is_compression_level as ok; "
            "assert ok('lowrank-bf16:12:3:exact') and ok('topk:.5') and not ok('int4')")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_console_script_refuses_an_unknown_log_level(capsys, monkeypatch):
    monkeypatch.setattr("trainspec.agent.app.Agent", None)  # never reached, never blocks
    with pytest.raises(SystemExit) as exc:
        main(["--log-level", "chatty", "--listen", "127.0.0.1:0", "--no-nvml"])
    assert exc.value.code == 2
    assert "--log-level" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"action": "checkpoint", "run_id": "../../etc"}', "run_id"),
        (b'{"action": "checkpoint", "run_id": "a/b"}', "run_id"),
        (b'{"action": "checkpoint", "run_id": ".hidden"}', "run_id"),
    ],
    ids=["nested", "dot-dot", "slash", "hidden"],
)
def test_hostile_actions_get_a_clean_400_and_are_not_kept(secured, body, message):
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    before = secured.actions.count()
    status, raw = call(secured.port, "POST", "/v1/actions", body, auth)
    assert status == 400, raw
    assert message in json.loads(raw)["error"]
    assert secured.actions.count() == before
    assert secured.counters.snapshot()["rejected"].get("internal", 0) == 0


@pytest.mark.parametrize("action", [["checkpoint"], {"name": "checkpoint"}, 5, None, True])
def test_an_action_that_is_not_a_string_gets_400_naming_it(secured, action):
    """A list or an object was looked up in the action table and answered 500."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, body = call_json(secured.port, "POST", "/v1/actions", {"action": action},
                             headers=auth)  # fmt: skip
    assert status == 400, body
    assert body["error"].startswith("action must be a string, one of ['checkpoint'")
    assert secured.counters.snapshot()["rejected"].get("internal", 0) == 0


@pytest.mark.timeout(30)
def test_the_action_client_keeps_polling_after_an_answer_cut_short():
    """An agent killed mid-answer: http.client.IncompleteRead (no OSError) ended the client's
    thread for good, and no operator action reached the job again."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 60\r\n\r\n{\"epoch\": ")  # fmt: skip

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = ActionClient(f"http://127.0.0.1:{server.getsockname()[1]}", poll_s=0.02).start()
    try:
        deadline = time.monotonic() + 10
        while client.failures < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.failures >= 3
        assert client._thread is not None and client._thread.is_alive()
    finally:
        client.close()
        stop.set()
        thread.join(5)
        server.close()


@pytest.mark.parametrize(
    ("level", "reason"),
    [
        ("int8:0", "block size must be a positive integer"),
        ("topk:2", "the fraction must be a number in (0, 1]"),
        ("int4", "unknown compression level 'int4'"),
        ("lowrank:" + "9" * 5000, "a level of 5008 characters is no compression level"),
    ],
)
def test_a_bad_level_is_refused_with_the_parsers_reason(secured, level, reason):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    doc = {"action": "set_compression", "level": level}
    status, body = call_json(secured.port, "POST", "/v1/actions", doc, headers=auth)
    assert status == 400 and reason in body["error"] and len(body["error"]) < 300
