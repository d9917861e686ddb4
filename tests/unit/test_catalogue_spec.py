"""docs/SPEC.md is generated from the catalogue and must stay in step with it."""

from __future__ import annotations

from pathlib import Path

from trainspec.cli.main import main
from trainspec.schema import load_catalogue
from trainspec.schema.catalogue import CatalogueError, parse_catalogue
from trainspec.schema.markdown import render_markdown

SPEC = Path(__file__).resolve().parents[2] / "docs" / "SPEC.md"


def test_spec_md_is_in_sync_with_the_catalogue():
    expected = render_markdown(load_catalogue())
    assert SPEC.read_text() == expected, (
        "docs/SPEC.md is stale: run `trainspec schema --markdown > docs/SPEC.md`"
    )


def test_spec_md_documents_every_metric_with_its_prometheus_name():
    text = SPEC.read_text()
    for m in load_catalogue():
        assert f"#### `{m.name}`" in text
        assert f"`{m.prometheus_name}`" in text


def test_schema_command_prints_every_metric(capsys):
    assert main(["schema"]) == 0
    out = capsys.readouterr().out
    cat = load_catalogue()
    assert f"catalogue {cat.version}: {len(cat)} metrics" in out
    assert all(m.name in out for m in cat)
    assert main(["schema", "--prometheus"]) == 0
    assert "trainspec_comm_bytes_total" in capsys.readouterr().out


def test_schema_markdown_command_prints_spec_md(capsys):
    assert main(["schema", "--markdown"]) == 0
    assert capsys.readouterr().out == SPEC.read_text()


def test_a_malformed_catalogue_is_refused_naming_the_metric():
    bad = """
version: '9'
families: {step: steps}
metrics:
- {name: trainspec.step.x, unit: furlongs, instrument: gauge, family: step,
   store: samples, required_when: always, source: s, interval: 1}
"""
    try:
        parse_catalogue(bad)
    except CatalogueError as exc:
        assert "trainspec.step.x" in str(exc) and "furlongs" in str(exc)
    else:
        raise AssertionError("a unit outside UCUM was accepted")
