"""`retrain man`: topics, JSON, paths, and the generated blocks (--check / --sync)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from retrain.cli import man
from retrain.cli.main import main
from retrain.config import schema
from retrain.config.schema import opt


def run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_manual_is_in_sync_with_the_code(capsys):
    """What CI runs: a schema change without `retrain man --sync` fails here."""
    code, out, _ = run(["man", "--check"], capsys)
    assert code == 0, out


def test_index_lists_every_required_topic(capsys):
    code, out, _ = run(["man"], capsys)
    assert code == 0
    for topic in man.REQUIRED_TOPICS:
        assert f"  {topic} " in out
    assert "retrain man --topic quickstart" in out


@pytest.mark.parametrize("topic", man.REQUIRED_TOPICS)
def test_every_topic_renders_with_a_summary(topic, capsys):
    code, out, _ = run(["man", "--topic", topic], capsys)
    assert code == 0
    assert out.startswith("# ") and len(out) > 800
    assert "GENERATED" not in out  # markers are not shown
    t = man.load_topics()[topic]
    assert t.summary and len(t.summary) > 30


def test_list_topics_and_positional_topic(capsys):
    code, out, _ = run(["man", "--list-topics"], capsys)
    assert code == 0
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert set(man.REQUIRED_TOPICS) <= set(names)
    code, out2, _ = run(["man", "sepa"], capsys)
    assert code == 0 and "correct_rate_gate" in out2


def test_topic_prefix_and_unknown_topic(capsys):
    code, out, _ = run(["man", "--topic", "backp"], capsys)
    assert code == 0 and out.startswith("# Back pressure")
    code, _, err = run(["man", "--topic", "sepaa"], capsys)
    assert code == 2 and "did you mean 'sepa'" in err


def test_json_topic_has_sections(capsys):
    code, out, _ = run(["man", "--json", "--topic", "quickstart"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["name"] == "quickstart" and data["title"] == "Quickstart"
    assert data["summary"] and Path(data["path"]).is_file()
    titles = [s["title"] for s in data["sections"]]
    assert "Install" in titles
    assert all({"title", "level", "text"} <= set(s) for s in data["sections"])


def test_json_index(capsys):
    code, out, _ = run(["man", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and {t["name"] for t in data["topics"]} >= set(man.REQUIRED_TOPICS)
    code, out, _ = run(["man", "--list-topics", "--json"], capsys)
    assert code == 0 and isinstance(json.loads(out), list)


def test_path_points_at_editable_sources(capsys):
    code, out, _ = run(["man", "--path"], capsys)
    assert code == 0
    directory = Path(out.strip())
    assert (directory / "quickstart.md").is_file()
    assert directory == man.manual_dir()
    code, out, _ = run(["man", "--path", "--topic", "sepa"], capsys)
    assert code == 0 and out.strip().endswith("sepa.md")


def test_configuration_reference_covers_every_key():
    text = (man.manual_dir() / "configuration.md").read_text()
    for spec in schema.all_fields():
        assert f"| `{spec.key}` |" in text, spec.label
    for table in schema.TABLES:
        assert f"### `[{table}]`" in text
    assert "`--lr`, `--training-lr`" in text  # the flag table


def test_sections_ignore_headings_in_code_fences():
    parts = man.sections("# T\n\nintro\n\n```\n# not a heading\n```\n\n## Real\n\nbody\n")
    assert [p["title"] for p in parts] == ["T", "Real"]
    assert "# not a heading" in parts[0]["text"]


# ---------------------------------------------------------------- check / sync


@dataclass
class _ExtraConfig:
    knob: int = opt(3, "A knob added after the manual was generated", ge=0)


@pytest.fixture
def manual_copy(tmp_path):
    target = tmp_path / "manual"
    shutil.copytree(man.manual_dir(), target)
    return target


def test_check_fails_after_schema_change_until_sync(manual_copy, monkeypatch, capsys):
    code, out, _ = run(["man", "--check", "--dir", str(manual_copy)], capsys)
    assert code == 0 and "up to date" in out

    monkeypatch.setitem(schema.TABLES, "extra", _ExtraConfig)
    code, out, _ = run(["man", "--check", "--dir", str(manual_copy)], capsys)
    assert code == 1
    assert "config-reference" in out and "retrain man --sync" in out

    code, out, _ = run(["man", "--sync", "--dir", str(manual_copy)], capsys)
    assert code == 0 and "rewrote" in out
    text = (manual_copy / "configuration.md").read_text()
    assert "### `[extra]`" in text and "A knob added after" in text

    code, out, _ = run(["man", "--check", "--dir", str(manual_copy)], capsys)
    assert code == 0
    # the prose around the block survived
    assert "## How a config is loaded" in text


def test_check_fails_on_hand_edited_block(manual_copy, capsys):
    path = manual_copy / "backends.md"
    path.write_text(path.read_text().replace("| `local` |", "| `locale` |"))
    code, out, _ = run(["man", "--check", "--dir", str(manual_copy)], capsys)
    assert code == 1 and "backend-tables" in out


def test_missing_block_is_reported(manual_copy, capsys):
    path = manual_copy / "plugins.md"
    text = path.read_text()
    start = text.index("<!-- BEGIN GENERATED: plugin-registry -->")
    end = text.index("<!-- END GENERATED: plugin-registry -->") + len(
        "<!-- END GENERATED: plugin-registry -->"
    )
    path.write_text(text[:start] + text[end:])
    code, out, _ = run(["man", "--check", "--dir", str(manual_copy)], capsys)
    assert code == 1 and "no generated block 'plugin-registry'" in out
    code, out, _ = run(["man", "--sync", "--dir", str(manual_copy)], capsys)
    assert code == 1  # sync cannot invent where the block goes


def test_check_and_sync_are_exclusive(capsys):
    code, _, err = run(["man", "--check", "--sync"], capsys)
    assert code == 2 and "exclusive" in err


def test_man_does_not_import_torch(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from retrain.cli.main import main; "
        "import io, contextlib; buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    main(['man']); main(['man', '--topic', 'configuration']); main(['man', '--check'])\n"
        "    main(['backends']); main(['plugins', '--search-path', '/nonexistent'])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
