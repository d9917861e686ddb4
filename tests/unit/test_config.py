from __future__ import annotations

import logging

import pytest

from trainspec.cli.main import main
from trainspec.config import ConfigError, load_config, render_toml


def test_precedence_override_env_toml_default(tmp_path):
    toml = tmp_path / "t.toml"
    toml.write_text("[collector]\ninterval_s = 0.2\nqueue_capacity = 7\n")
    env = {"TRAINSPEC_COLLECTOR_INTERVAL_S": "0.1"}
    cfg = load_config(toml, environ=env, overrides={"collector": {"queue_capacity": 9}})
    assert cfg.collector.interval_s == 0.1  # env beats TOML
    assert cfg.collector.queue_capacity == 9  # argument beats TOML
    assert cfg.store.flush_interval_s == 2.0  # default


def test_bad_environment_value_warns_and_keeps_default(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load_config(environ={"TRAINSPEC_COLLECTOR_PROBE": "maybe"})
    assert cfg.collector.probe is True
    assert "collector.probe" in caplog.text


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[nope]\nx = 1\n", "unknown section"),
        ("nope = 3\n", "unknown section"),
        ("[to_dict]\nx = 1\n", "unknown section"),  # a method of the config, not a section
        # a known section that is not a table is named as such, not as unknown
        ("collector = 3\n", r"\[collector\] must be a table, got int"),
        ("store = [1, 2]\n", r"\[store\] must be a table, got list"),
        ("[store]\nbogus = 1\n", "store.bogus"),
        ("[store\n", "t.toml"),
        # a value of the wrong kind is named, not converted
        ("[store]\nroot = 5\n", "store.root"),
        ("[checkpoint]\nkeep_last = 1.5\n", "checkpoint.keep_last"),
        ("[collector]\nqueue_capacity = true\n", "collector.queue_capacity"),
    ],
)
def test_bad_toml_raises_naming_the_key(tmp_path, text, needle):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_config(path, environ={})


def test_render_round_trips(tmp_path):
    cfg = load_config(environ={"TRAINSPEC_KERNELS_COMPRESSION": "int8"})
    path = tmp_path / "out.toml"
    path.write_text(render_toml(cfg))
    assert load_config(path, environ={}) == cfg


def test_cli_config_prints_and_rejects_missing_file(capsys, tmp_path):
    assert main(["config"]) == 0
    assert "[collector]" in capsys.readouterr().out
    assert main(["config", "--file", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not found" in err[0]


@pytest.mark.parametrize("kind", ["directory", "not-utf8"])
def test_unreadable_config_file_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path, kind):
    path = tmp_path / "dir.toml"
    if kind == "directory":
        path.mkdir()
        reason = "Is a directory"
    else:
        path.write_bytes(b"\xff\xfe[store]\n")
        reason = "not UTF-8 text"
    with pytest.raises(ConfigError, match=f"config file {path}: {reason}"):
        load_config(path, environ={})
    assert main(["config", "--file", str(path)]) == 2
    monkeypatch.setenv("TRAINSPEC_CONFIG", str(path))
    assert main(["run", "--", "true"]) == 2  # the file named by the environment too
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(f"config file {path}: {reason}" in line for line in err), err


@pytest.mark.parametrize(
    ("value", "off", "warned"),
    [("off", True, False), ("DISABLED", True, False), ("0", True, False), ("on", False, False),
     ("1", False, False), ("", False, False), ("maybe", True, True)],
)  # fmt: skip
def test_the_kill_switch_reads_off_on_and_errs_off(value, off, warned, caplog):
    """`TRAINSPEC_ACTUATOR=disabled` left the actuator on without a word, and `trainspec
    config` showed `enabled = true` under any value."""
    import trainspec.config as config

    config._warned_switch.clear()
    cfg = load_config(environ={"TRAINSPEC_ACTUATOR": value})
    assert cfg.actuator.enabled is not off
    assert ("neither on nor off" in caplog.text) is warned


def test_a_config_file_is_read_to_a_limit_and_a_pipe_without_waiting(tmp_path):
    """`--file /dev/zero` read without end and a FIFO blocked for ever; `/dev/null`, a FIFO
    nobody writes and process substitution (`--file <(...)`) read as files do."""
    import os
    import subprocess
    import sys

    big = tmp_path / "big"
    big.write_text("# " + "x" * (1 << 21))
    for path in (big, "/dev/zero"):
        with pytest.raises(ConfigError, match="larger than 1024 KiB"):
            load_config(path, environ={})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert load_config(fifo, environ={}).store.root == "runs"  # empty: the defaults
    assert load_config("/dev/null", environ={}).store.root == "runs"
    code = "import sys; from trainspec.config import load_config; print(load_config(sys.argv[1], environ={}).store.root)"
    out = subprocess.run(["bash", "-c", f'{sys.executable} -c "{code}" <(printf "[store]\\nroot = \\"piped\\"\\n")'],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.stdout.strip() == "piped", out.stderr


@pytest.mark.parametrize("run_id", ["../../etc", "a/b", ".hidden", "x" * 129])
def test_a_run_id_that_is_not_a_directory_name_is_refused(run_id, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f'[store]\nrun_id = "{run_id}"\n')
    with pytest.raises(ConfigError, match="store.run_id"):
        load_config(path, environ={})
    assert load_config(environ={"TRAINSPEC_STORE_RUN_ID": "ok-1.2"}).store.run_id == "ok-1.2"


def test_init_passes_over_a_bad_environment_run_id_to_the_files(caplog):
    """`load_config` said it kept the file's id; `init` read the variable again and took a
    new one."""
    from trainspec.runtime.init import _run_id_from

    assert _run_id_from("../bad", "toml-id") == "toml-id"
    assert "passed over" in caplog.text
    assert _run_id_from("env-id", "toml-id") == "env-id"
    assert _run_id_from(None, "") is None


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("actuator.window_steps", "five", "is not an int"),  # was "is not a int"
        ("collector.interval_s", "fast", "is not a float"),
    ],
)
def test_a_value_of_the_wrong_type_is_named_with_the_right_article(key, value, words, tmp_path):
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"{key}: '{value}' {words}$"):
        load_config(environ={}, overrides={section: {name: value}})
    path = tmp_path / "t.toml"
    path.write_text(f'[{section}]\n{name} = "{value}"\n')
    with pytest.raises(ConfigError, match=f"{key}: '{value}' {words}$"):
        load_config(path, environ={})
