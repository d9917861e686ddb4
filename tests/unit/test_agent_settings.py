"""The agent's settings from the environment: an unknown `TRAINSPEC_AGENT_*` name warns and the
agent starts (a TOML typo exits 2, as before); limits that would spin or refuse everything are
refused."""

from __future__ import annotations

import logging

import pytest

from trainspec.agent.settings import AgentSettings, SettingsError, load_settings


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_misspelt_variable_warns_naming_the_likely_one_and_keeps_the_default(caplog):
    with caplog.at_level(logging.WARNING, logger="trainspec.agent"):
        settings = load_settings(environ={"TRAINSPEC_AGENT_LISTN": "127.0.0.1:9999"})
    assert settings.listen == AgentSettings().listen
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    assert "TRAINSPEC_AGENT_LISTN" in lines[0]
    assert "did you mean TRAINSPEC_AGENT_LISTEN?" in lines[0]


def test_an_unknown_variable_without_a_close_name_still_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="trainspec.agent"):
        load_settings(environ={"TRAINSPEC_AGENT_BOGUS": "1"})
    lines = _warnings(caplog)
    assert len(lines) == 1 and "TRAINSPEC_AGENT_BOGUS" in lines[0], lines
    assert "did you mean" not in lines[0]


def test_known_and_rank_side_variables_are_read_or_left_alone_quietly(caplog):
    environ = {
        "TRAINSPEC_AGENT_NODE_INTERVAL_S": "0.5",
        "TRAINSPEC_AGENT_PENDING_ROWS": "10",
        # The ranks' `agent` section (trainspec.config.AgentConfig) shares the prefix.
        "TRAINSPEC_AGENT_ENDPOINT": "http://127.0.0.1:4318",
        "TRAINSPEC_AGENT_TIMEOUT_S": "5",
        "TRAINSPEC_AGENT_RETRY_AFTER_S": "1",
        "TRAINSPEC_COLLECTOR_MODE": "sidecar",  # another section: not the agent's business
    }
    with caplog.at_level(logging.WARNING, logger="trainspec.agent"):
        settings = load_settings(environ=environ)
    assert (settings.node_interval_s, settings.pending_rows) == (0.5, 10)
    assert not _warnings(caplog), caplog.text


def test_an_unknown_toml_key_is_still_an_error(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text("[agent]\nlistn = '127.0.0.1:9999'\n")
    with pytest.raises(SettingsError, match="unknown setting listn"):
        load_settings(str(path), environ={})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("node_interval_s", 0.0),
        ("node_interval_s", float("nan")),
        ("commit_interval_s", -1.0),
        ("commit_interval_s", float("inf")),
        # Past a day the commit thread's wait raised OverflowError and the agent answered
        # every batch 503; 1e-300 s took a whole core.
        ("commit_interval_s", 1e10),
        ("node_interval_s", 1e300),
        ("node_interval_s", 1e-300),
        ("pending_rows", 0),
        ("forward_buffer", 0),
        ("max_body_bytes", -5),
    ],
)
def test_limits_that_would_spin_or_refuse_everything_are_refused(key, value):
    with pytest.raises(SettingsError, match=f"^{key}: "):
        load_settings(overrides={key: value}, environ={})


def test_a_store_that_cannot_be_created_is_refused_at_start(tmp_path):
    (tmp_path / "afile.txt").write_text("not a directory")
    store = tmp_path / "afile.txt" / "sub"
    with pytest.raises(
        SettingsError, match=f"^store {store}: cannot create: .*afile.txt is not a directory$"
    ):
        load_settings(overrides={"store": str(store)}, environ={})


def test_a_store_that_does_not_exist_yet_is_accepted_and_nothing_is_made(tmp_path):
    store = tmp_path / "a" / "b"
    assert load_settings(overrides={"store": str(store)}, environ={}).store == str(store)
    assert not (tmp_path / "a").exists()  # the writer makes it when it stores


def test_a_store_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "afile.txt").write_text("kept")
    with pytest.raises(SettingsError, match="not a directory$"):
        load_settings(overrides={"store": str(tmp_path / "afile.txt")}, environ={})


@pytest.mark.parametrize("node_id", ["a/b", "x" * 250])
def test_a_node_id_the_store_cannot_name_a_writer_is_refused(tmp_path, node_id):
    environ = {"TRAINSPEC_AGENT_NODE_ID": node_id}
    with pytest.raises(SettingsError, match=f"^node_id '{node_id}': the writer id"):
        load_settings(overrides={"store": str(tmp_path / "s")}, environ=environ)
    assert not (tmp_path / "s").exists()  # nothing made for an agent that does not start


@pytest.mark.parametrize(
    "upstream",
    ["http://[::1", "http://127.0.0.1:abc", "http://", "http://127.0.0.1:99999",
     "http://otel collector:4318", "https://otel:4318/?x=1", "ftp://otel:4318"],
)  # fmt: skip
def test_an_upstream_the_forwarder_cannot_post_to_is_refused_at_start(upstream):
    """Each passed the old prefix check, and the forward thread died on the first request."""
    with pytest.raises(SettingsError, match=r"^upstream .* is not an http\(s\)://HOST"):
        load_settings(overrides={"upstream": upstream}, environ={})


@pytest.mark.parametrize("upstream", ["http://otel:4318", "https://[::1]:4318/otlp", "http://x"])
def test_a_good_upstream_is_accepted(upstream):
    assert load_settings(overrides={"upstream": upstream}, environ={}).upstream == upstream


def test_a_token_file_flag_overrides_the_token_variable(tmp_path):
    """defaults < TOML < environment < flags: TRAINSPEC_AGENT_TOKEN won over --token-file."""
    (tmp_path / "tok").write_text("from-file\n")
    env = {"TRAINSPEC_AGENT_TOKEN": "from-env"}
    flag = load_settings(overrides={"token_file": str(tmp_path / "tok")}, environ=env)
    assert flag.resolved_token() == "from-file"
    # A token file in the TOML is below the environment.
    (tmp_path / "a.toml").write_text(f"[agent]\ntoken_file = '{tmp_path / 'tok'}'\n")
    assert load_settings(str(tmp_path / "a.toml"), environ=env).resolved_token() == "from-env"
    assert load_settings(str(tmp_path / "a.toml"), environ={}).resolved_token() == "from-file"


def test_one_layer_setting_both_token_sources_is_refused(tmp_path):
    (tmp_path / "a.toml").write_text("[agent]\ntoken = 'x'\ntoken_file = '/etc/tok'\n")
    with pytest.raises(SettingsError, match="token and token_file are both set"):
        load_settings(str(tmp_path / "a.toml"), environ={})


@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_an_empty_token_file_is_refused_not_left_unauthenticated(tmp_path, content):
    (tmp_path / "tok").write_text(content)
    env = {"TRAINSPEC_AGENT_TOKEN": "hidden-by-the-file"}
    with pytest.raises(SettingsError, match=f"^token_file {tmp_path / 'tok'}: is empty$"):
        load_settings(overrides={"token_file": str(tmp_path / "tok")}, environ=env)


def test_a_node_level_file_without_an_agent_table_gives_the_defaults(tmp_path):
    """The ranks' TRAINSPEC_CONFIG file shared with the agent: no [agent] table was read as
    the agent's table, and [collector] was an 'unknown setting'."""
    path = tmp_path / "node.toml"
    path.write_text("[collector]\nmode = 'sidecar'\n\n[store]\nroot = '/runs'\n")
    assert load_settings(str(path), environ={}) == load_settings(environ={})


def test_the_flat_form_without_an_agent_table_is_still_read(tmp_path):
    path = tmp_path / "flat.toml"
    path.write_text("commit_interval_s = 0.5\n\n[collector]\nmode = 'sidecar'\n")
    assert load_settings(str(path), environ={}).commit_interval_s == 0.5
    path.write_text("comit_interval_s = 0.5\n")  # a typo there is still an error
    with pytest.raises(SettingsError, match="unknown setting comit_interval_s"):
        load_settings(str(path), environ={})


def test_the_address_an_agent_says_it_listens_on_brackets_an_ipv6_host():
    assert AgentSettings(listen="[::1]:4331").address(4331) == "[::1]:4331"
    assert AgentSettings(listen="127.0.0.1:0").address(5000) == "127.0.0.1:5000"
