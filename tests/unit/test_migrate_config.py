"""`retrain migrate-config`: rewrite the original retrain's spellings, list what is unsupported."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from retrain.cli.main import main
from retrain.config import load_config

LEGACY = """\
# my experiment: keep this comment
[backend]
backend = "local"   # where it trains
prime_rl_transport = "zmq"
devices = "gpu:0"

[algorithm]
advantage_mode = "maxrl"
entropy_mask_rho = 0.2

[algorithm.params]
alpha = 0.1

[optimizer]
grad_clip_norm = 0.3  # the paper's value

[training]
lr = 1e-5      # small

[plugins]
search_paths = "plugins, more"
"""

UNSUPPORTED = """\
[training]
lr = 1e-5
kl_cov_coef = 0.2

[echo]
enabled = true

[campaign]
seeds = [1]

[[campaign.conditions]]
advantage_mode = "grpo"
transform_mode = "none"
batch_advantage_norm = true
"""

CLEAN = "[training]\nlr = 1e-5\n\n[algorithm]\nsurprisal_mask_rho = 0.1\n"


def _write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_check_exit_codes(tmp_path, capsys):
    assert main(["migrate-config", "--check", str(_write(tmp_path, LEGACY))]) == 1
    assert main(["migrate-config", "--check", str(_write(tmp_path, CLEAN, "ok.toml"))]) == 0
    out = capsys.readouterr().out
    assert "nothing to migrate" in out and "entropy_mask_rho" in out


def test_default_mode_previews_a_diff_and_writes_nothing(tmp_path, capsys):
    path = _write(tmp_path, LEGACY)
    assert main(["migrate-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "-entropy_mask_rho = 0.2" in out and "+surprisal_mask_rho = 0.2" in out
    assert "nothing written" in out
    assert path.read_text() == LEGACY
    assert not list(tmp_path.glob("*.bak*"))


def test_write_rewrites_in_place_with_a_backup(tmp_path, capsys):
    path = _write(tmp_path, LEGACY)
    assert main(["migrate-config", "--write", str(path)]) == 0
    assert (tmp_path / "c.toml.bak").read_text() == LEGACY
    text = path.read_text()
    for comment in ("# my experiment: keep this comment", "# where it trains", "# small"):
        assert comment in text
    data = tomllib.loads(text)
    assert data["backend"]["options"] == {"transport": "zmq"}
    assert "prime_rl_transport" not in data["backend"]
    assert data["algorithm"]["surprisal_mask_rho"] == 0.2
    assert data["algorithm"]["transform_params"] == {"alpha": 0.1}
    assert "params" not in data["algorithm"] and "entropy_mask_rho" not in data["algorithm"]
    assert data["optimizer"] == {"max_grad_norm": 0.3}
    assert data["plugins"]["search_paths"] == ["plugins", "more"]
    assert "wrote" in capsys.readouterr().out
    # the migrated file is in the canonical form: nothing left to do
    assert main(["migrate-config", "--check", str(path)]) == 0


def test_migrated_file_loads_like_the_original(tmp_path):
    text = LEGACY.replace('prime_rl_transport = "zmq"\n', "")
    path = _write(tmp_path, text)
    before = load_config(path)
    assert main(["migrate-config", "--write", str(path)]) == 0
    after = load_config(path)
    assert after == before


def test_a_second_backup_does_not_overwrite_the_first(tmp_path):
    path = _write(tmp_path, LEGACY)
    (tmp_path / "c.toml.bak").write_text("older backup\n")
    assert main(["migrate-config", "--write", str(path)]) == 0
    assert (tmp_path / "c.toml.bak").read_text() == "older backup\n"
    assert (tmp_path / "c.toml.bak1").read_text() == LEGACY


def test_stdout_prints_the_rewritten_toml(tmp_path, capsys):
    path = _write(tmp_path, LEGACY)
    assert main(["migrate-config", "--stdout", str(path)]) == 0
    out, err = capsys.readouterr()
    assert tomllib.loads(out)["optimizer"] == {"max_grad_norm": 0.3}
    assert "grad_clip_norm" in err  # the report goes to stderr
    assert path.read_text() == LEGACY


def test_json_report(tmp_path, capsys):
    path = _write(tmp_path, LEGACY)
    assert main(["migrate-config", "--json", "--write", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["written"] is True and report["backup"].endswith("c.toml.bak")
    moved = {(c["table"], c["key"]): (c["new_table"], c["new_key"]) for c in report["changes"]}
    assert moved[("backend", "prime_rl_transport")] == ("backend.options", "transport")
    assert moved[("algorithm", "entropy_mask_rho")] == ("algorithm", "surprisal_mask_rho")
    assert moved[("optimizer", "grad_clip_norm")] == ("optimizer", "max_grad_norm")
    assert report["unsupported"] == []


def test_unsupported_keys_are_listed_and_kept(tmp_path, capsys):
    path = _write(tmp_path, UNSUPPORTED)
    assert main(["migrate-config", "--json", "--write", str(path)]) == 1
    report = json.loads(capsys.readouterr().out)
    where = {u["where"]: u for u in report["unsupported"]}
    assert set(where) == {
        "[training] kl_cov_coef",
        "[echo] enabled",
        "[[campaign.conditions]] entry 0",
    }
    assert where["[training] kl_cov_coef"]["line"] == 3
    assert "after 2026-02-25" in where["[echo] enabled"]["message"]
    assert "batch_advantage_norm" in where["[[campaign.conditions]] entry 0"]["message"]
    assert report["written"] is False and path.read_text() == UNSUPPORTED


def test_conflicting_spellings_are_left_for_you(tmp_path, capsys):
    path = _write(tmp_path, "[algorithm]\nentropy_mask_rho = 0.1\nsurprisal_mask_rho = 0.2\n")
    assert main(["migrate-config", "--check", str(path)]) == 1
    assert "keep one" in capsys.readouterr().out


def test_existing_backend_option_wins_over_the_legacy_key(tmp_path):
    text = '[backend]\nprime_rl_transport = "zmq"\n\n[backend.options]\ntransport = "filesystem"\n'
    path = _write(tmp_path, text)
    assert main(["migrate-config", "--write", str(path)]) == 0
    data = tomllib.loads(path.read_text())
    assert data["backend"] == {"options": {"transport": "filesystem"}}


@pytest.mark.parametrize("content", [None, "[training\nlr = 1\n"])
def test_unreadable_config_exits_2(tmp_path, capsys, content):
    path = tmp_path / "c.toml"
    if content is not None:
        path.write_text(content)
    assert main(["migrate-config", str(path)]) == 2
    assert "c.toml" in capsys.readouterr().err


def test_default_path_is_retrain_toml(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "retrain.toml").write_text(CLEAN)
    assert main(["migrate-config"]) == 0
    assert "retrain.toml: nothing to migrate" in capsys.readouterr().out
