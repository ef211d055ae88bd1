"""`retrain init`, `retrain explain`, `--help`, `--version`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from retrain import __version__
from retrain.cli.init import templates
from retrain.cli.main import main
from retrain.config import load_config

REPO = Path(__file__).resolve().parents[2]


def run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_and_version(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "retrain init --template quickstart" in out and "explain" in out
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and __version__ in out
    code, out, _ = run(["--help-flags"], capsys)
    assert code == 0 and "--lr" in out and "--training-lr" in out and "[sepa]" in out


def test_init_list_names_every_template(capsys):
    code, out, _ = run(["init", "--list"], capsys)
    assert code == 0
    for name in ("quickstart", "experiment", "campaign"):
        line = next(line for line in out.splitlines() if line.startswith(name))
        assert len(line.split(None, 1)[1]) > 20  # a real one-line description


@pytest.mark.parametrize("name", ["quickstart", "experiment", "campaign"])
def test_init_writes_valid_template_and_refuses_overwrite(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    out_path = tmp_path / f"{name}.toml"
    code, out, _ = run(["init", "--template", name, "--output", str(out_path)], capsys)
    assert code == 0 and out_path.exists() and "retrain explain" in out
    config = load_config(out_path)
    assert (config.campaign is not None) == (name == "campaign")
    out_path.write_text("# mine\n")
    code, _, err = run(["init", "--template", name, "--output", str(out_path)], capsys)
    assert code == 2 and "--force" in err
    assert out_path.read_text() == "# mine\n"
    code, _, _ = run(["init", "--template", name, "--output", str(out_path), "--force"], capsys)
    assert code == 0 and out_path.read_text() == templates()[name]


def test_init_unknown_template(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["init", "--template", "quikstart"], capsys)
    assert code == 2 and "quickstart" in err


def test_init_interactive_without_tty_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", "init", "--interactive"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2 and "TTY" in proc.stderr
    assert not (tmp_path / "retrain.toml").exists()


def test_init_interactive_on_a_tty(tmp_path):
    """Answer the questions through a real pseudo-terminal."""
    import os
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # child
        os.chdir(tmp_path)
        os.execv(
            sys.executable, [sys.executable, "-m", "retrain.cli.main", "init", "--interactive"]
        )
    answers = iter(["\n", "grpo+none\n", "12\n", "local\n"])
    output = b""
    while True:
        try:
            chunk = os.read(fd, 1024)
        except OSError:
            break
        if not chunk:
            break
        output += chunk
        if chunk.rstrip().endswith(b":"):
            os.write(fd, next(answers, "\n").encode())
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, output.decode(errors="replace")
    config = load_config(tmp_path / "retrain.toml")
    assert config.condition == "grpo+none" and config.training.max_steps == 12
    assert config.model.model == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_init_then_explain_default_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run(["init", "--template", "quickstart"], capsys)[0] == 0
    code, out, _ = run(["explain"], capsys)
    assert code == 0
    assert "Condition:   maxrl+gtpo_sepa" in out
    assert "4 prompts x 8 completions = 32 completions" in out
    assert "SmolLM2-135M-Instruct" in out and "reasoning_gym" in out


def test_explain_json_fields(tmp_path, capsys):
    code, out, _ = run(
        ["explain", str(REPO / "retrain/config/templates/quickstart.toml"), "--json"], capsys
    )
    report = json.loads(out)
    assert code == 0
    assert report["condition"] == "maxrl+gtpo_sepa"
    assert report["backend"]["capabilities"]["preserves_token_advantages"] is True
    assert report["per_step"]["sampled_token_upper_bound"] == 4 * 8 * 24
    assert report["checkpoints"]["periodic"] == 3
    assert "linear" in report["sepa"]


def test_explain_campaign_matrix(capsys):
    code, out, _ = run(
        ["explain", str(REPO / "retrain/config/templates/campaign.toml"), "--json"], capsys
    )
    camp = json.loads(out)["campaign"]
    assert code == 0
    assert camp["runs"] == 40 and camp["total_steps"] == 40 * 500
    assert camp["conditions"] == [
        "grpo+none",
        "maxrl+none",
        "maxrl+gtpo",
        "maxrl+gtpo_hicra",
        "maxrl+gtpo_sepa",
    ]
    assert "maxrl+gtpo_sepa_s707" in camp["matrix"]
    first = camp["condition_details"][0]
    assert first["label"] == "grpo+none" and first["overrides"] == []
    assert first["runs"][0] == "grpo+none_s42" and first["max_steps"] == 500


def test_explain_tinker_ignores_inference(tmp_path, capsys):
    path = tmp_path / "t.toml"
    path.write_text('[backend]\nbackend = "tinker"\n[training]\nseed = 1\n')
    code, out, _ = run(["explain", str(path)], capsys)
    assert code == 0 and "Ignored:" in out and "[inference]" in out
    assert "resume_runtime_dependent=true" in out


def test_explain_refuses_shannon_entropy_on_tinker(tmp_path, capsys):
    """tinker returns no entropies: a config error at load, not a failure at preflight."""
    path = tmp_path / "t.toml"
    path.write_text(
        '[backend]\nbackend = "tinker"\n[algorithm]\nuncertainty_kind = "shannon_entropy"\n'
    )
    code, _, err = run(["explain", str(path)], capsys)
    assert code == 2 and "[algorithm] uncertainty_kind" in err and "shannon_entropy" in err
    assert f"{path}:4" in err and "Fix:" in err


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ('[inference]\nengine = "vllm"\n', "[inference] engine", 2),
        ('[training]\nseed = 1\n[backend]\nbackend = "prime_rl"\n', "[backend] backend", 4),
    ],
)
def test_explain_reports_names_that_are_not_built(tmp_path, capsys, text, key, line):
    path = tmp_path / "t.toml"
    path.write_text(text)
    code, _, err = run(["explain", str(path)], capsys)
    assert code == 2 and key in err and f"{path}:{line}" in err
    assert "not built in this version" in err and "Fix:" in err
    code, out, _ = run(["explain", str(path), "--json"], capsys)
    assert code == 2 and any(key in e for e in json.loads(out)["errors"])


def test_explain_plugin_backend_without_entropies(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_backend2.py").write_text("class B:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "t.toml"
    path.write_text(
        '[backend]\nbackend = "my_backend2.B"\n[algorithm]\nuncertainty_kind = "shannon_entropy"\n'
    )
    code, out, _ = run(["explain", str(path)], capsys)
    assert code == 2 and "ERROR: [algorithm] uncertainty_kind" in out


def test_explain_errors_on_plugin_backend_without_token_advantages(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_backend.py").write_text("class B:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "t.toml"
    path.write_text('[backend]\nbackend = "my_backend.B"\n[algorithm]\ntransform_mode = "gtpo"\n')
    code, out, _ = run(["explain", str(path)], capsys)
    assert code == 2 and "plugin/default" in out and "ERROR" in out
    assert "token-level advantages" in out
