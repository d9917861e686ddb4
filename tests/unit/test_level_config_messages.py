"""A bad compression level in the configuration says what is wrong with it: one line naming
the setting, the value and `parse_level`'s own reason, from a TOML file, from a variable and
for a ladder's rung. It gave the grammar only: `'int8:65537' must be a compression level
(none, bf16, int8[:B], ...)` where the block size was the trouble (QA)."""

from __future__ import annotations

import logging
import os

import pytest

from trainspec.cli.main import main
from trainspec.config import ConfigError, load_config
from trainspec.levels import LEVEL_RULES, parse_level

CASES = [
    ("int8:65537", "block size must be at most 65536, got 65537"),
    ("topk:2", "the fraction must be a number in (0, 1], got '2'"),
    ("lowrank:2:3:fast", "warm-up must be int8 or exact, got 'fast'"),
    ("int9", "unknown compression level 'int9'"),
]


def _reason(level: str) -> str:
    with pytest.raises(ValueError) as info:
        parse_level(level)
    return str(info.value)


@pytest.mark.parametrize(("level", "reason"), CASES)
def test_a_bad_level_in_the_file_names_the_setting_the_value_and_the_reason(
    tmp_path, level, reason
):
    toml = tmp_path / "c.toml"
    toml.write_text(f'[kernels]\ncompression = "{level}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(toml, environ={}, extra_rules=LEVEL_RULES)
    message = str(info.value)
    assert "\n" not in message
    assert f"kernels.compression: {level!r} must be a compression level" in message
    assert reason in message and _reason(level) in message


@pytest.mark.parametrize(("level", "reason"), CASES)
def test_a_bad_level_from_the_environment_warns_with_the_reason(caplog, level, reason):
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        cfg = load_config(environ={"TRAINSPEC_KERNELS_COMPRESSION": level},
                          extra_rules=LEVEL_RULES)  # fmt: skip
    assert cfg.kernels.compression == "none"
    (record,) = [r for r in caplog.records if "TRAINSPEC_KERNELS_COMPRESSION" in r.getMessage()]
    assert reason in record.getMessage() and "\n" not in record.getMessage()


@pytest.mark.parametrize(("level", "reason"), CASES)
def test_a_bad_rung_of_the_ladder_is_named_with_the_reason(tmp_path, caplog, level, reason):
    ladder = f"none,{level},int8"
    toml = tmp_path / "c.toml"
    toml.write_text(f'[actuator]\ncompression_ladder = "{ladder}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(toml, environ={}, extra_rules=LEVEL_RULES)
    message = str(info.value)
    assert "\n" not in message and f"actuator.compression_ladder: {ladder!r}" in message
    assert f"rung {level!r}: " in message and reason in message
    with caplog.at_level(logging.WARNING, logger="trainspec"):
        load_config(environ={"TRAINSPEC_ACTUATOR_COMPRESSION_LADDER": ladder},
                    extra_rules=LEVEL_RULES)  # fmt: skip
    assert reason in caplog.text


def test_an_empty_ladder_says_so(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[actuator]\ncompression_ladder = " , "\n')
    with pytest.raises(ConfigError, match="no level given"):
        load_config(toml, environ={}, extra_rules=LEVEL_RULES)


def test_the_cli_says_it_in_one_line(tmp_path, capsys, monkeypatch):
    for name in [n for n in os.environ if n.startswith("TRAINSPEC_")]:
        monkeypatch.delenv(name)
    toml = tmp_path / "c.toml"
    toml.write_text('[kernels]\ncompression = "int8:65537"\n')
    assert main(["config", "--file", str(toml)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("trainspec config: error: ")
    assert "kernels.compression: 'int8:65537'" in err
    assert "block size must be at most 65536, got 65537" in err
