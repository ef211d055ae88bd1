"""The commands besides training against hostile input: outputs that would overwrite saved
files or write into a run, paths that are files, directories or unreadable, damaged
metrics, and keys the migration cannot rewrite. Each refusal comes before any model or
weights load, as `retrain: error: ...` with exit status 2 (a squeeze error: 1), never a
traceback."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from retrain.cli.main import main
from retrain.squeeze import config_problems

pytest.importorskip("scipy")  # compare's statistics


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write_run(path: Path, rates, *, first_line: str | None = None, tail: str = "") -> Path:
    """A run's log directory: metrics.jsonl (its first line replaced by `first_line`,
    `tail` appended unterminated) and run.json."""
    path.mkdir(parents=True)
    lines = [
        json.dumps({"step": s, "condition": "a", "correct_rate": r}) for s, r in enumerate(rates)
    ]
    if first_line is not None:
        lines[0] = first_line
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)
    (path / "run.json").write_text(json.dumps({"status": "finished", "max_steps": len(rates)}))
    return path


def fake_adapter(path: Path, rank: int = 4) -> Path:
    """What the checks read of a PEFT adapter (no weights are read before they pass)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    (path / "adapter_model.safetensors").write_bytes(b"not read by the checks")
    return path


# ------------------------------------------------------------------------ eval --out


@pytest.fixture
def adapter(tmp_path):
    return fake_adapter(tmp_path / "adapter")


def test_eval_out_never_overwrites_a_runs_metrics(tmp_path, adapter, capsys):
    run_dir = write_run(tmp_path / "logs" / "run", [0.1, 0.2])
    before = (run_dir / "metrics.jsonl").read_bytes()
    for out in (run_dir / "metrics.jsonl", run_dir / "eval.json"):
        code, _, err = run(capsys, "eval", str(adapter), "--out", str(out), "--force")
        assert code == 2 and "inside the log directory of a run" in err, err
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    assert not (run_dir / "eval.json").exists()


def test_eval_out_refuses_what_it_cannot_write_before_loading(tmp_path, adapter, capsys):
    existing = tmp_path / "result.json"
    existing.write_text("{}")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "plain").write_text("")
    cases = {
        existing: "already exists; pass --force",
        tmp_path / "emptydir": "is a directory",
        tmp_path / "plain" / "x.json": "is a file, not a directory",
    }
    for out, said in cases.items():
        # a config that does not exist: the check runs before the config (and the model) load
        code, _, err = run(
            capsys, "eval", str(adapter), "--config", str(tmp_path / "none.toml"), "--out", str(out)
        )
        assert code == 2 and said in err and "Traceback" not in err, err
    assert existing.read_text() == "{}"


# ------------------------------------------------------------------------ squeeze


def test_squeeze_output_never_overwrites_a_checkpoint_or_a_file(tmp_path, adapter, capsys):
    checkpoint = fake_adapter(tmp_path / "adapters" / "run" / "checkpoint_step_6", rank=16)
    (checkpoint / "training_state.pt").write_bytes(b"state")
    saved = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    afile = tmp_path / "afile"
    afile.write_text("keep")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    cases = [
        (["--output", str(checkpoint), "--compress-to", "4", "--force"], "training_state.pt"),
        (["--output", str(afile)], "is a file, not a directory"),
        (["--output", str(busy)], "is not empty"),
        (["--output", str(adapter)], "must differ"),
    ]
    for extra, said in cases:
        code, _, err = run(capsys, "squeeze", str(adapter), *extra)
        assert code == 2 and "--output: " in err and said in err, err
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == saved
    assert afile.read_text() == "keep"


def test_squeeze_adapter_that_is_a_file_and_bad_rank_lists(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    code, _, err = run(capsys, "squeeze", str(afile))
    assert code == 2 and "is a file, not a directory" in err
    for ranks, said in (("4,,8", "empty entry"), ("4,8,4", "lists 4 twice")):
        code, _, err = run(capsys, "squeeze", str(afile), "--target-ranks", ranks)
        assert code == 2 and said in err, err


def test_config_problems_of_a_standalone_squeeze(tmp_path, adapter):
    empty = tmp_path / "empty"
    empty.mkdir()

    def problems(**options) -> dict[str, str]:
        path = options.pop("adapter_path", adapter)
        found = config_problems(path, count_cuda=lambda: 0, **options)
        return {key: text for key, text in found}

    assert problems() == {}
    assert "not found" in problems(adapter_path=tmp_path / "nope")["[squeeze] adapter_path"]
    assert (
        "adapter_config.json is missing" in problems(adapter_path=empty)["[squeeze] adapter_path"]
    )
    assert "no CUDA device" in problems(device="gpu:0")["[squeeze] device"]
    assert (
        "[8] above the adapter's rank 4" in problems(target_ranks=[2, 8])["[squeeze] target_ranks"]
    )
    assert "more than once" in problems(target_ranks=[2, 2])["[squeeze] target_ranks"]
    assert (
        "above the adapter's rank 4"
        in problems(compress_to=64, output_path=tmp_path / "out")["[squeeze] compress_to"]
    )
    assert "needs an output directory" in problems(compress_to=2)["[squeeze] compress_to"]


def test_standalone_squeeze_names_the_key_file_and_line(tmp_path, adapter, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("sq.toml").write_text(f'[squeeze]\nadapter_path = "{adapter}"\ncompress_to = 2\n')
    from retrain.cli.squeeze import run_standalone
    from retrain.config import load_config
    from retrain.errors import RetrainError

    with pytest.raises(RetrainError, match=r"\[squeeze\] compress_to \(sq.toml:3\): 2 needs"):
        run_standalone(load_config("sq.toml"), "sq.toml")
    # the run, explain and doctor say the same, before any weights load
    code, _, err = run(capsys, "sq.toml")
    # a problem with what was asked exits 2 like the config error explain calls it
    assert code == 2 and "[squeeze] compress_to (sq.toml:3): 2 needs" in err, err
    code, _, err = run(capsys, "squeeze", "no/such/adapter")
    assert code == 2 and "adapter directory not found" in err, err
    code, out, _ = run(capsys, "explain", "sq.toml")
    assert code == 2 and "ERROR: [squeeze] compress_to (sq.toml:3): 2 needs" in out
    code, out, _ = run(capsys, "doctor", "sq.toml", "--no-network")
    assert code == 1 and "FAIL  run checks  [squeeze] compress_to (sq.toml:3)" in out
    # a squeeze trains nothing: no model, backend or training device is checked
    assert not any(
        line.split()[1:2] in (["model"], ["cuda"], ["backend"]) for line in out.splitlines()
    )


# ------------------------------------------------------------------------ init, main


def test_init_outputs_that_are_directories_files_or_unwritable(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("plain").write_text("")
    Path("d1").mkdir()
    assert run(capsys, "init", "-o", "d1", "--force")[0] == 0
    assert tomllib.loads(Path("d1/retrain.toml").read_text())  # the name a directory gets
    assert run(capsys, "init", "-o", "newdir/")[0] == 0
    assert Path("newdir/retrain.toml").is_file()
    code, _, err = run(capsys, "init", "-o", "plain/x.toml")
    assert code == 2 and "plain is a file, not a directory" in err
    Path(".gitignore").mkdir()
    code, _, err = run(capsys, "init", "-o", "g.toml", "--gitignore")
    assert code == 2 and ".gitignore is not a file" in err
    assert not Path("g.toml").exists()  # refused before the config was written


def test_an_os_error_is_one_line_not_a_traceback(tmp_path, capsys):
    code, _, err = run(capsys, "status", str(tmp_path / ("a" * 300)))
    assert code == 2 and err.startswith("retrain: error: ") and "File name too long" in err


# ------------------------------------------------------------------------ compare, status


def test_compare_shows_damaged_metrics_and_missing_steps(tmp_path, capsys):
    damaged = write_run(
        tmp_path / "run", [0.1 * s for s in range(8)], first_line="\0\0\0", tail='{"step": 8, "co'
    )
    (damaged / "run.json").write_text("{not json")
    code, out, _ = run(capsys, "compare", str(damaged))
    assert code == 0
    assert "skipped 2 corrupt line(s)" in out and "line(s) 1, 9" in out
    assert "cannot read" in out and "run.json" in out
    assert "Steps 0..7 (1 run(s) lack some of these steps" in out
    assert "7 of the 8 steps 0..7" in out and "missing step(s) 0" in out


def test_compare_blames_unreadable_metrics_not_the_metric_name(tmp_path, capsys):
    garbage = tmp_path / "run"
    garbage.mkdir()
    (garbage / "metrics.jsonl").write_text("garbage\n\0\0\nmore\n")
    code, _, err = run(capsys, "compare", str(garbage))
    assert code == 2 and "no run has a readable metrics row" in err
    assert "check the name" not in err


def test_compare_out_refuses_a_runs_log_directory(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", [0.1, 0.2])
    before = sorted(p.name for p in run_dir.iterdir())
    code, _, err = run(capsys, "compare", str(run_dir), "--out", str(run_dir))
    assert code == 2 and "inside the log directory of a run" in err
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_status_of_a_file_or_an_unreadable_metrics_file(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", [0.1, 0.2])
    code, _, err = run(capsys, "status", str(run_dir / "metrics.jsonl"))
    assert code == 2 and "is a file, not a directory" in err and f"status {run_dir}" in err
    broken = tmp_path / "broken"
    (broken / "metrics.jsonl").mkdir(parents=True)  # cannot be read as a file
    (broken / "run.json").write_text(json.dumps({"status": "running"}))
    code, out, _ = run(capsys, "status", str(broken))
    assert code == 0 and f"warning: cannot read {broken / 'metrics.jsonl'}: Is a directory" in out


# ------------------------------------------------------------------------ migrate-config


def test_migrate_config_unknown_keys_comments_and_conflicts(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nlrr = 1e-4\n")
    code, out, _ = run(capsys, "migrate-config", "--check", str(path))
    assert code == 1 and "nothing to migrate" not in out
    assert "[training] lrr" in out and "did you mean 'lr'" in out

    path.write_text("[algorithm]\nentropy_mask_rho = 0.1  # keep me\n")
    assert run(capsys, "migrate-config", "--write", str(path))[0] == 0
    assert path.read_text() == "[algorithm]\nsurprisal_mask_rho = 0.1  # keep me\n"

    path.write_text("[optimizer]\ngrad_clip_norm = 1.0\nmax_grad_norm = 2.0\n")
    code, out, _ = run(capsys, "migrate-config", str(path))
    assert code == 1 and "conflict" in out and "not support" not in out


# ------------------------------------------------------------------------ plugins


def test_plugins_warns_of_a_search_path_that_is_not_a_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("")
    code, out, _ = run(capsys, "plugins", "--search-path", "nonexist", "--search-path", "afile")
    assert code == 0
    assert "warning: --search-path nonexist: no such directory" in out
    assert "warning: --search-path afile: a file, not a directory" in out


def test_eval_takes_the_adapters_lora_shape_and_refuses_a_flag_against_it(tmp_path):
    from retrain.cli.eval import _adapter_overrides
    from retrain.errors import UsageError

    path = tmp_path / "a"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    assert _adapter_overrides(str(path), []) == ["--model-lora-rank", "4", "--lora-alpha", "8"]
    assert _adapter_overrides(str(path), ["--lora-rank", "4"]) == ["--lora-alpha", "8"]
    with pytest.raises(UsageError, match=r"--lora-rank 8 contradicts the adapter's r = 4"):
        _adapter_overrides(str(path), ["--lora-rank", "8"])


def test_blocked_at_names_the_part_of_the_path_in_the_way(tmp_path):
    """The one check behind init's, eval's, squeeze's and the run's output paths."""
    from retrain.logs.rundir import blocked_at, cannot_write_in

    (tmp_path / "plain").write_text("")
    assert blocked_at(tmp_path / "plain" / "a" / "b") == (tmp_path / "plain", "file")
    assert blocked_at(tmp_path / "plain") == (tmp_path / "plain", "file")
    assert blocked_at(tmp_path / "new" / "dir") is None and cannot_write_in(tmp_path) is None
    assert (
        cannot_write_in(tmp_path / "plain" / "x")
        == f"{tmp_path / 'plain'} is a file, not a directory"
    )
