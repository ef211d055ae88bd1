"""Hostile configs and flags (an audit's findings): every one is a config error naming
the key with its file and line (or the flag), or a warning, never a traceback, a hang or
a run that fails later."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from retrain.cli.advice import advice
from retrain.cli.args import split_config_args
from retrain.cli.main import main
from retrain.config import ConfigError, config_from_dict, load_config, read_toml
from retrain.config.load import locate_keys
from retrain.memory import decoding_batches, sampling_rows


def problems_of(tmp_path: Path, text: str | bytes, flags: tuple[str, ...] = ()) -> list[str]:
    path = tmp_path / "c.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as info:
        load_config(path, list(flags))
    return info.value.problems


def explain(args: list[str], capsys) -> tuple[int, str]:
    code = main(["explain", *args])
    return code, capsys.readouterr().err


# ---------------------------------------------------------------- 1. reading the file


def test_a_byte_order_mark_is_read_as_utf8_with_its_lines(tmp_path):
    path = tmp_path / "c.toml"
    bom = b'\xef\xbb\xbf[training]\nlr = 1e-4\n[data]\nsource = "x y"\n'
    assert problems_of(tmp_path, bom)[0].startswith(f"[data] source ({path}:4)")
    path.write_bytes(b"\xef\xbb\xbf[training]\nlr = 1e-4\n")
    assert load_config(path).training.lr == 1e-4
    assert locate_keys("\ufeff[training]\nlr = 1\n")[("training", "")] == 1


def test_a_file_that_is_not_utf8_names_the_line_of_the_bad_byte(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_bytes(b"[training]\nlr = 1e-4\n# caf\xe9\n")
    code, err = explain([str(path)], capsys)
    assert code == 2 and f"{path}:3: not UTF-8 text (byte 0xe9)" in err
    assert "Traceback" not in err
    path.write_bytes(b"\xff\xfe[\x00t\x00")  # what PowerShell's `>` writes: UTF-16
    with pytest.raises(ConfigError, match=r":1: not UTF-8 text .*UTF-16"):
        read_toml(path)


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc")
def test_a_file_that_cannot_be_read_is_a_config_error():
    # /proc/self/mem exists and is no directory, but reading it from the start fails (EIO)
    with pytest.raises(ConfigError, match=r"/proc/self/mem: cannot read the file"):
        read_toml("/proc/self/mem")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file without permissions")
def test_a_file_without_read_permission_is_a_config_error(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\n")
    path.chmod(0)
    with pytest.raises(ConfigError, match=r"cannot read the file: Permission denied"):
        read_toml(path)


# ---------------------------------------------------------------- 2. upper bounds


def test_rows_decoded_at_once_are_counted_as_the_batches_list_them():
    for b, g, pb, rows in itertools.product(range(6), range(1, 20), range(3), (None, 1, 4, 7)):
        listed = max((p * r for _, p, r in decoding_batches(b, g, pb, rows)), default=0)
        assert sampling_rows(b, g, pb, rows) == listed, (b, g, pb, rows)
    # counted, not listed: this took forever (and the memory) when listed
    assert sampling_rows(10**23, 10**12, 0) == 64


@pytest.mark.parametrize(
    ("text", "flags", "expected"),
    [
        ("[training]\nseed = 99999999999999999999\n", (), "[training] seed ("),
        ("", ("--seed", "18446744073709551616"), "[training] seed (from --seed)"),
        ("[campaign]\nseeds = [99999999999999999999]\n", (), "[campaign] seeds ("),
        ("", ("--batch-size", "99999999999999999999999"), "[training] batch_size"),
        ("[training]\ngroup_size = 1000000000000\n", (), "[training] group_size"),
        ("[training]\nmax_steps = 9223372036854775807\n", (), "[training] max_steps"),
        ("[campaign]\nmax_steps = 9223372036854775807\n", (), "[campaign] max_steps"),
        ("[eval]\nsize = 100000000\n", (), "[eval] size"),
        ("[eval]\nsamples = 100000000\n", (), "[eval] samples"),
        ("[data]\nsize = 1000000000\n", (), "[data] size"),
        ("[backpressure]\nmax_batch_size = 100000000\n", (), "[backpressure] max_batch_size"),
    ],
)
def test_absurd_numbers_are_config_errors(tmp_path, text, flags, expected):
    (problem,) = problems_of(tmp_path, text, flags)
    assert problem.startswith(expected)
    assert "must be <=" in problem or "64-bit integer range" in problem


def test_the_largest_seed_torch_takes_from_toml_is_accepted():
    assert config_from_dict({"training": {"seed": 2**63 - 1}}).training.seed == 2**63 - 1


def test_explain_refuses_a_huge_batch_at_once(capsys):
    code, err = explain(["--batch-size", "99999999999999999999999"], capsys)
    assert code == 2 and "[training] batch_size (from --batch-size)" in err


# ---------------------------------------------------------------- 3. campaign seeds


def test_no_campaign_seeds_is_refused_at_the_key(tmp_path):
    (problem,) = problems_of(tmp_path, "[campaign]\nmax_steps = 3\nseeds = []\n")
    assert problem.startswith(f"[campaign] seeds ({tmp_path / 'c.toml'}:3): must name")
    (problem,) = problems_of(tmp_path, "[campaign]\n", ("--campaign-seeds", "[]"))
    assert problem.startswith("[campaign] seeds (from --campaign-seeds)")


def test_a_bad_campaign_seed_is_reported_once_at_the_key(tmp_path):
    (problem,) = problems_of(tmp_path, "[campaign]\nseeds = [-5, 3]\n")
    assert problem.startswith(f"[campaign] seeds ({tmp_path / 'c.toml'}:2): every seed")


def test_unseeded_campaign_runs_are_warned_about():
    def warned(seeds):
        config = config_from_dict({"backend": {"devices": "cpu"}, "campaign": {"seeds": seeds}})
        return [w for w in advice(config) if "not reproducible" in w]

    assert warned([-1, 3]) and warned([-1, 3])[0].startswith("[campaign] seeds include -1")
    assert warned([3]) == []


# ---------------------------------------------------------------- 4. lines


def test_a_table_written_inline_at_the_top_has_its_line(tmp_path):
    path = tmp_path / "c.toml"
    (problem,) = problems_of(tmp_path, '\ntraining = {max_steps = 3, lr = "bad"}\n')
    assert problem.startswith(f"[training] lr ({path}:2): expected a number")
    (problem,) = problems_of(tmp_path, "\n\ntraining = 3\n")
    assert problem.startswith(f"[training] ({path}:3): expected a table")


def test_an_unknown_top_level_key_is_no_table(tmp_path):
    (problem,) = problems_of(tmp_path, "\nzzz = 1\n")
    assert problem.startswith(f"top-level key 'zzz' ({tmp_path / 'c.toml'}:2): unknown;")
    assert "unknown table" not in problem


MULTILINE = '''[data]
system_prompt = """
Answer briefly. A line such as
lr = 5
[training]
is text of the prompt, as is \\""" this.
"""
instruction = \'\'\'
lr = 6 and a quote " that opens nothing
\'\'\'
few_shot = [
  {user = "brackets ] [ and lr = 7", assistant = 'x'},  # lr = 8
  {user = """two
lr = 9""", assistant = "y"},
]

[training]
lr = "bad"
'''


def test_keys_are_located_outside_multiline_strings_and_arrays():
    lines = locate_keys(MULTILINE)
    assert lines[("data", "system_prompt")] == 2
    assert lines[("data", "instruction")] == 8
    assert lines[("data", "few_shot")] == 11
    assert lines[("training", "")] == 17
    assert lines[("training", "lr")] == 18
    assert ("data", "lr") not in lines


def test_an_error_is_reported_at_its_line_not_inside_a_prompt(tmp_path):
    (problem,) = problems_of(tmp_path, MULTILINE)
    assert problem.startswith(f"[training] lr ({tmp_path / 'c.toml'}:18)")


# ---------------------------------------------------------------- 5, 6. values and files


def test_a_lora_dropout_of_one_is_refused(tmp_path):
    (problem,) = problems_of(tmp_path, "[lora]\ndropout = 1.0\n")
    assert problem.startswith("[lora] dropout") and "must be < 1" in problem
    assert config_from_dict({"lora": {"dropout": 0.5}}).lora.dropout == 0.5


def test_a_directory_given_as_the_jsonl_file_is_named_a_directory(tmp_path):
    (tmp_path / "adir").mkdir()
    text = f'[data]\nsource = "jsonl"\npath = "{tmp_path / "adir"}"\n'
    (problem,) = problems_of(tmp_path, text)
    assert (
        problem.startswith("[data] path")
        and "'" + str(tmp_path / "adir") + "' is a directory" in problem
    )


# ---------------------------------------------------------------- 7. flags


def test_a_flag_never_takes_the_next_flag_as_its_value(capsys):
    assert split_config_args(["--seed", "--lr", "1e-4"]) == (None, ["--seed", "--lr", "1e-4"])
    code, err = explain(["--seed", "--lr", "1e-4"], capsys)
    assert code == 2 and "flag --seed needs a value" in err and "not found" not in err
    code, err = explain(["--model", "--seed", "3"], capsys)
    assert code == 2 and "flag --model needs a value" in err and "not found" not in err


def test_a_key_set_twice_by_flags_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"flags --training-lr and --lr set \[training\] lr"):
        config_from_dict({}, ["--training-lr", "1e-4", "--lr", "2e-4"])
    with pytest.raises(ConfigError, match=r"flag --lr sets \[training\] lr twice"):
        config_from_dict({}, ["--lr", "1e-4", "--lr=2e-4"])
    with pytest.raises(ConfigError, match=r"flag --backend-opt sets threads twice"):
        config_from_dict({}, ["--backend-opt", "threads=2", "--backend-opt", "threads=3"])
    # the same value twice is no conflict
    assert config_from_dict({}, ["--lr", "1e-4", "--training-lr", "1e-4"]).training.lr == 1e-4


# ---------------------------------------------------------------- 8. keys nothing reads


@pytest.mark.parametrize(
    ("table", "extra"),
    [
        ({"training": {"kl_estimator": "k1"}}, "[training] kl_estimator"),
        ({"reward": {"custom_function": "f"}}, "[reward] custom_function"),
        ({"reward": {"type": "math", "custom_module": "m"}}, "[reward] custom_module"),
        ({"reward": {"judge_model": "gpt-4o"}}, "[reward] judge_model"),
        (
            {"reward": {"type": "custom", "custom_module": "m", "judge_base_url": "http://h"}},
            "[reward] judge_base_url",
        ),
        ({"sepa": {"ema_decay": 0.9}}, "[sepa] ema_decay"),
        ({"sepa": {"warmup": 3, "var_threshold": 0.5}}, "[sepa] warmup"),
    ],
)
def test_keys_switched_off_in_their_own_table_are_errors(table, extra):
    with pytest.raises(ConfigError) as info:
        config_from_dict(table)
    assert [p for p in info.value.problems if p.startswith(extra) and "only used with" in p]


def test_the_same_keys_load_where_they_are_read():
    config_from_dict({"training": {"kl_estimator": "k1", "kl_coef": 0.1}})
    config_from_dict({"sepa": {"schedule": "auto", "ema_decay": 0.9, "warmup": 3}})
    config_from_dict({"reward": {"type": "custom", "custom_module": "m", "custom_function": "f"}})
    config_from_dict({"reward": {"type": "judge", "judge_model": "m", "judge_api_key": "k"}})


def test_a_service_url_on_a_backend_that_reads_none_is_an_error():
    with pytest.raises(ConfigError, match=r"\[model\] base_url"):
        config_from_dict({"model": {"base_url": "http://host:1"}})
    config_from_dict({"model": {"base_url": "http://host:1"}, "backend": {"backend": "tinker"}})


def cpu_advice(**tables) -> list[str]:
    return advice(config_from_dict({"backend": {"devices": "cpu"}, **tables}))


def test_eval_keys_no_evaluation_reads_are_warned_about():
    off = cpu_advice(eval={"path": "h.jsonl", "size": 3})
    assert any(w.startswith("[eval] size, path: read only with [eval] every > 0") for w in off)
    math = cpu_advice(eval={"every": 2, "path": "h.jsonl"})
    assert any(w.startswith("[eval] path is read for [data] source 'jsonl' only") for w in math)
    assert not [w for w in cpu_advice(eval={"every": 2}) if w.startswith("[eval]")]
    assert not [w for w in cpu_advice(eval={"every": 2, "split": "dev"}) if w.startswith("[eval]")]
    gym = cpu_advice(
        data={"source": "reasoning_gym", "task": "chain_sum"}, eval={"every": 2, "split": "dev"}
    )
    assert any(
        w.startswith("[eval] split is read for [data] source 'math' and plugin sources only")
        and "reasoning-gym's held-out seed stream" in w
        for w in gym
    )


def test_search_paths_that_are_no_directory_are_warned_about(tmp_path):
    (tmp_path / "plugs").mkdir()
    (tmp_path / "file.py").write_text("")
    paths = [str(tmp_path / "plugs"), str(tmp_path / "file.py"), str(tmp_path / "none"), "plugins"]
    found = [w for w in cpu_advice(plugins={"search_paths": paths}) if "search_paths" in w]
    assert len(found) == 2
    assert "file.py' is a file, not a directory" in found[0]
    assert "none' does not exist" in found[1]


def test_doctor_checks_no_model_for_a_config_that_does_not_load(tmp_path, capsys):
    """The built-in default model is not the one the file names: no FAIL for it."""
    from retrain.cli.main import main

    path = tmp_path / "bad.toml"
    path.write_text('[model]\nmodel = "org/named-here"\n[training]\nlr = "bad"\n')
    code = main(["doctor", str(path), "--no-network", "--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert code == 1 and checks["config"]["status"] == "FAIL"
    assert checks["model"]["status"] == "WARN" and "does not load" in checks["model"]["detail"]
