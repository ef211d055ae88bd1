"""Other trainers' config names (retrain/config/peer_names.py): every entry points to a real
key or says retrain has none, and every place a name is suggested (TOML keys and tables,
flags, `[[campaign.conditions]]` keys) answers a peer's name with retrain's, ahead of any
spelling guess."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from retrain import registry
from retrain.config import ConfigError, config_from_dict, flag_table, load_config, table_fields
from retrain.config.hints import closest
from retrain.config.peer_names import INDEX, PEER_NAMES, find
from retrain.config.schema import TABLES

MENTION = re.compile(r"\[(\w+(?:\.\w+)?)\] (\w+)")


def _is_key(table: str, key: str) -> bool:
    if table == "backend.options":  # the local backend's options, which the notes point to
        return key in registry.BACKENDS.entry("local").options
    return table in TABLES and key in {s.key for s in table_fields(table)}


@pytest.mark.parametrize("peer", PEER_NAMES, ids=[p.name for p in PEER_NAMES])
def test_every_peer_name_maps_to_a_real_key_or_says_it_has_none(peer):
    assert peer.source
    if peer.target is None:
        assert peer.note and not peer.convert, "no equivalent: the note says what is close"
    else:
        assert _is_key(*peer.target), peer.target
    for table, key in MENTION.findall(f"{peer.note} {peer.convert}"):
        assert _is_key(table, key), f"{peer.name} mentions [{table}] {key}"
    assert find(peer.name.split(".")) is peer


def test_names_are_listed_once():
    names = [p.name for p in PEER_NAMES]
    assert len(names) == len(set(names))


def _nested(path: list[str], value=1) -> dict:
    out: dict = value
    for part in reversed(path):
        out = {part: out}
    return out


def _toml_placement(peer) -> list[str]:
    """Where a user would write the name: a dotted name as its tables, a flat one in
    [training] (in [optimizer] when it is a [training] key: then it is misplaced)."""
    path = peer.name.split(".")
    if len(path) > 1:
        return path
    table = "optimizer" if _is_key("training", peer.name) else "training"
    return [table, peer.name]


def _toml_text(path: list[str]) -> str:
    return f"[{'.'.join(path[:-1])}]\n{path[-1]} = 1\n"


@pytest.mark.parametrize("peer", PEER_NAMES, ids=[p.name for p in PEER_NAMES])
def test_every_peer_name_in_a_toml_gets_retrains_key_at_its_line(tmp_path, peer):
    path = _toml_placement(peer)
    config = tmp_path / "peer.toml"
    config.write_text(_toml_text(path))
    with pytest.raises(ConfigError) as info:
        load_config(config)
    [problem] = info.value.problems
    assert f"{config}:2" in problem
    if peer.target is None:
        assert "retrain has no such setting. Fix: remove it" in problem
    else:
        assert peer.label in problem
    assert "Fix:" in problem or "did you mean [" in problem


FLAT = [p for p in PEER_NAMES if "." not in p.name]


@pytest.mark.parametrize("peer", FLAT, ids=[p.name for p in FLAT])
def test_every_peer_name_as_a_flag_gets_retrains_flag(peer):
    flag = "--" + peer.name.replace("_", "-")
    flags = flag_table()
    if flag in flags:  # a name retrain shares (or the key dialect aliases): not unknown
        assert flags[flag].key == peer.name or (flags[flag].table, flags[flag].key) == peer.target
        return
    with pytest.raises(ConfigError) as info:
        config_from_dict({}, [flag, "1"])
    [problem] = info.value.problems
    assert problem.startswith(f"unknown flag {flag}")
    if peer.target is None:
        assert "retrain has no such setting" in problem
    else:
        shortest = min((f for f, s in flags.items() if (s.table, s.key) == peer.target), key=len)
        assert re.search(re.escape(shortest) + r"[ ']", problem), problem


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("lerning_rate", "learning_rate"),
        ("batch_szie", "batch_size"),
        ("num_generation", "num_generations"),
        ("entropy_mask_rho", "surprisal_mask_rho"),
        ("lerning_rate", None),  # against retrain's flags alone: nothing shares its words
    ],
)
def test_spelling_guesses_share_words(written, expected):
    flags = [f[2:].replace("-", "_") for f in flag_table()]
    keys = [*flags, "surprisal_mask_rho"]
    candidates = keys if expected is None else [*keys, *INDEX]
    assert closest(written, candidates) == expected


def test_beta_is_not_a_bare_flag_for_gtpo():
    """TRL's `--beta` is the KL coefficient: it must not set [gtpo] beta silently."""
    with pytest.raises(ConfigError) as info:
        config_from_dict({}, ["--beta", "0.04"])
    assert "[training] kl_coef" in str(info.value) and "--kl-coef 0.04" in str(info.value)
    assert config_from_dict({}, ["--gtpo-beta", "0.2"]).gtpo.beta == 0.2


def test_a_key_of_another_table_is_pointed_there_not_called_a_peers():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"training": {"max_grad_norm": 1.0}, "optimizer": {"max_stpes": 3}})
    text = str(info.value)
    assert "did you mean [optimizer] max_grad_norm?" in text
    assert "did you mean [training] max_steps?" in text


def test_a_misspelt_table_stays_a_misspelling():
    with pytest.raises(ConfigError, match=r"unknown table \[trainig\].*did you mean 'training'"):
        config_from_dict({"trainig": {"lr": 1e-4}})


def test_condition_keys_answer_with_retrains_key():
    entry = {"advantage_mode": "grpo", "transform_mode": "none"}
    with pytest.raises(ConfigError) as info:
        config_from_dict(
            {
                "campaign": {
                    "conditions": [
                        {**entry, "num_generations": 4},
                        {**entry, "lerning_rate": 1e-4},
                        {**entry, "training": {"beta": 0.01}},
                    ]
                }
            }
        )
    text = str(info.value)
    assert "entry 0: num_generations: unknown key" in text and "group_size = 4 in the entry" in text
    assert "entry 1: lerning_rate: unknown key: did you mean learning_rate?" in text
    assert "lr = ... in the entry" in text
    assert "entry 2: training.beta: unknown key in [training]" in text
    assert "kl_coef = 0.01 in the entry" in text


# ------------------------------------------------------------------ the CLI, as a user runs it


def _retrain(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.fixture
def project(tmp_path):
    (tmp_path / "retrain.toml").write_text("[training]\nmax_steps = 2\n")
    return tmp_path


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--learning-rate", "1e-4"], "learning_rate is the name in transformers'"),
        (["--learning_rate", "1e-4"], "learning_rate is the name in transformers'"),
        (["--lerning-rate", "1e-4"], "did you mean learning_rate?"),
    ],
)
def test_explain_learning_rate_flag_points_to_lr(project, flags, expected):
    proc = _retrain(["explain", *flags], project)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert f"unknown flag {flags[0]}: {expected}" in err
    assert "for [training] lr. Fix: --lr 1e-4" in err
    assert "invalid configuration in retrain.toml" in err
    assert "temperature" not in err and "Traceback" not in err


def test_explain_num_generations_flag_points_to_group_size(project):
    proc = _retrain(["explain", "--num-generations", "8", "--num-train-epochs", "3"], project)
    assert proc.returncode == 2
    assert "unknown flag --num-generations: num_generations is the name in TRL's" in proc.stderr
    assert "Fix: --group-size 8" in proc.stderr
    assert "--num-train-epochs" in proc.stderr and "[training] max_steps" in proc.stderr
    assert "(2 problems)" in proc.stderr


@pytest.mark.parametrize(
    ("table", "line", "expected"),
    [
        ("[training]", "learning_rate = 1e-4", "Fix: lr = 0.0001 under [training]"),
        ("[optimizer]", "lr = 1e-4", "(it belongs to [training]: did you mean [training] lr?)"),
        ("[training]", "num_generations = 8", "Fix: group_size = 8 under [training]"),
        ("[training]", "beta = 0.04", "Fix: kl_coef = 0.04 under [training]"),
        (
            "[training]",
            "per_device_train_batch_size = 8",
            "retrain's [training] batch_size differs: TRL counts completions",
        ),
        ("[training]", "num_train_epochs = 3", "retrain has no such setting. Fix: remove it"),
    ],
)
@pytest.mark.parametrize("command", [["explain"], []], ids=["explain", "run"])
def test_toml_with_a_peers_key_names_file_line_and_fix(tmp_path, command, table, line, expected):
    config = tmp_path / "peer.toml"
    config.write_text(f'[model]\nmodel = "x"\n{table}\n{line}\n')
    proc = _retrain([*command, str(config)], tmp_path)
    assert proc.returncode == 2
    key = line.split(" = ")[0]
    assert f"{table} {key} ({config}:4): unknown key" in proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr


def test_another_trainers_nested_tables_report_each_key_together(tmp_path):
    config = tmp_path / "verl.toml"
    config.write_text(
        "[actor_rollout_ref.actor.optim]\n"
        "lr = 1e-6\n"
        "[actor_rollout_ref.rollout]\n"
        "n = 8\n"
        "gpu_memory_utilization = 0.5\n"
        "[data]\n"
        "train_batch_size = 64\n"
        "[orchestrator]\n"
        "batch_size = 512\n"
    )
    proc = _retrain(["explain", str(config)], tmp_path)
    assert proc.returncode == 2
    err = proc.stderr
    assert "(5 problems)" in err
    assert f"actor_rollout_ref.actor.optim.lr ({config}:2): unknown key" in err
    assert "Fix: lr = 1e-06 under [training]" in err
    assert f"actor_rollout_ref.rollout.n ({config}:4)" in err
    assert "Fix: group_size = 8 under [training]" in err
    assert f"unknown table [actor_rollout_ref] ({config}:5): retrain has no setting for" in err
    assert f"[data] train_batch_size ({config}:7)" in err and "batch_size = 64" in err
    assert f"orchestrator.batch_size ({config}:9)" in err
    assert "batch_size = orchestrator batch_size / group_size" in err


def test_campaign_condition_with_a_peers_key_names_file_line_and_fix(tmp_path):
    config = tmp_path / "campaign.toml"
    config.write_text(
        '[campaign]\nseeds = [1]\n\n[[campaign.conditions]]\nadvantage_mode = "grpo"\n'
        'transform_mode = "none"\nlearning_rate = 1e-4\n'
    )
    proc = _retrain(["explain", str(config)], tmp_path)
    assert proc.returncode == 2
    assert f"[campaign] conditions ({config}:4): [[campaign.conditions]] entry 0" in proc.stderr
    assert "learning_rate: unknown key: learning_rate is the name in" in proc.stderr
    assert "Fix: lr = 0.0001 in the entry" in proc.stderr


@pytest.mark.parametrize(
    "mode",
    ["grpo_std", "grpo", "maxrl", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"],
)
def test_advantage_modes_the_hints_name_exist(mode):
    """TRL's scale_rewards and verl's adv_estimator are answered with these names."""
    said = " ".join(p.convert for p in PEER_NAMES if p.target == ("algorithm", "advantage_mode"))
    assert f'"{mode}"' in said
    assert config_from_dict({"algorithm": {"advantage_mode": mode}}).algorithm.advantage_mode
