"""What `retrain explain` says a config will do, held to what the run does: flags without
./retrain.toml, the checkpoints the trainer writes, `--max-steps` with a campaign, the
LoRA settings a backend takes, keys the flow does not read, an environment's turns in the
per-step bound, a campaign's wall time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from retrain.cli.main import main
from retrain.cli.summaries import periodic_checkpoints
from retrain.config.schema import FALLBACK_MAX_TURNS

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "retrain/config/templates/quickstart.toml"
CAMPAIGN = REPO / "retrain/config/templates/campaign.toml"
FIXTURES = REPO / "tests" / "fixtures"
CPU = ["--devices", "cpu", "--seed", "1"]


def explain(capsys, *args: str) -> tuple[int, str]:
    code = main(["explain", *args])
    return code, capsys.readouterr().out


def report(capsys, *args: str) -> dict:
    return json.loads(explain(capsys, *args, "--json")[1])


def line(text: str, head: str) -> str:
    return next(x for x in text.splitlines() if x.startswith(head))


def test_flags_alone_without_a_config_file_run_on_the_defaults(capsys):
    """As the run takes them (retrain/cli/run.py `config_path`)."""
    assert not Path("retrain.toml").exists()
    code, out = explain(capsys, "--lr", "1e-4", *CPU)
    assert code == 0, out
    assert line(out, "Config:") == "Config:      none: the built-in defaults plus the flags given"
    assert "Training:    lr 0.0001 " in out
    main(["doctor", "--lr", "1e-4", *CPU, "--no-network", "--json"])
    checks = json.loads(capsys.readouterr().out)["checks"]
    (config,) = [c for c in checks if c["name"] == "config"]
    assert config["status"] == "OK" and "built-in defaults plus the flags" in config["detail"]
    # bare, with no config: still asks for one, as the run does
    assert main(["doctor", "--no-network", "--json"]) in (0, 1)
    checks = json.loads(capsys.readouterr().out)["checks"]
    assert [c["status"] for c in checks if c["name"] == "config"] == ["WARN"]


@given(st.integers(0, 200), st.integers(0, 50))
def test_checkpoint_count_is_the_trainers_rule(max_steps, save_every):
    """The trainer's `_loop`: a save after `done` steps when done % save_every == 0 and
    done < max_steps."""
    writes = [
        d for d in range(1, max_steps + 1) if save_every and d % save_every == 0 and d < max_steps
    ]
    assert periodic_checkpoints(max_steps, save_every) == len(writes)


def test_checkpoints_are_the_ones_the_trainer_writes(capsys):
    """The trainer skips the periodic save at the last step: the final one is written."""
    assert periodic_checkpoints(30, 10) == 2 and periodic_checkpoints(25, 10) == 2
    assert periodic_checkpoints(5, 10) == 0 and periodic_checkpoints(10**30, 10**29) == 9
    code, out = explain(capsys, str(QUICKSTART))
    assert code == 0
    assert line(out, "Checkpoints:").startswith("Checkpoints: every 10 steps (2) + final")


def test_max_steps_flag_sets_a_campaigns_runs(capsys, one_gpu):
    """--max-steps, the quick validation run getting-started suggests, is each run's
    steps in a campaign too; with --campaign-max-steps as well, they must agree."""
    data = report(capsys, str(CAMPAIGN), "--max-steps", "20")
    assert data["errors"] == [] and data["campaign"]["max_steps_per_run"] == 20
    assert data["campaign"]["total_steps"] == 40 * 20
    data = report(capsys, str(CAMPAIGN), "--campaign-max-steps", "30")
    assert data["errors"] == [] and data["campaign"]["total_steps"] == 40 * 30
    data = report(capsys, str(CAMPAIGN), "--max-steps", "20", "--campaign-max-steps", "30")
    (error,) = [e for e in data["errors"] if e.startswith("[training] max_steps")]
    assert error.startswith("[training] max_steps (from --max-steps): a campaign's runs take")
    assert error.endswith("Fix: give only one of --max-steps and --campaign-max-steps")


def test_lora_shows_what_the_backend_takes(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    path = tmp_path / "t.toml"
    path.write_text(
        '[backend]\nbackend = "tinker"\nadapter_path = "out/run_t"\n[model]\nlora_rank = 8\n'
        "[training]\nseed = 1\n"
    )
    code, out = explain(capsys, str(path))
    assert line(out, "LoRA:") == (
        "LoRA:        rank 8; alpha, dropout, target_modules: the tinker backend's own"
    )
    assert "(LoRA rank 8)" in line(out, "Model:")
    code, out = explain(capsys, str(path), "--backend", "prime_rl", "--transform-mode", "none")
    assert line(out, "LoRA:") == (
        "LoRA:        rank, alpha, dropout, target_modules: the prime_rl backend's own"
    )
    assert "(LoRA: the prime_rl backend's own)" in line(out, "Model:")
    code, out = explain(capsys, str(QUICKSTART))
    assert line(out, "LoRA:") == "LoRA:        rank 16, alpha 32, dropout 0, modules all-linear"


def test_keys_the_flow_does_not_read_are_warnings(capsys, project):
    flags = ["--transform-mode", "none", "--gtpo-beta", "0.3", "--hicra-alpha", "0.5"]
    warnings = report(capsys, str(QUICKSTART), *flags)["warnings"]
    unread = [w for w in warnings if w.startswith(("[gtpo]", "[hicra]", "[sepa]"))]
    assert unread == [
        "[gtpo] beta = 0.3 is read by every transform but 'none'; transform 'none' ignores it "
        "(remove it, or set the transform that reads it)",
        "[hicra] alpha = 0.5 is read by transform 'gtpo_hicra' only; 'none' ignores it (remove "
        "it, or set the transform that reads it)",
        "[sepa] steps, delay_steps: read by the SEPA transforms (gtpo_sepa, gtpo_sepa_amp, "
        "gtpo_sepa_amp_c) only; 'none' ignores them (remove them, or set a SEPA transform)",
    ]
    # an algorithm alias's transform counts; what it reads is no warning
    warnings = report(capsys, str(QUICKSTART), "--algorithm-mode", "maxrl_gtpo_hicra")["warnings"]
    assert [w.split(" ")[0] for w in warnings if w.startswith(("[gtpo]", "[hicra]", "[sepa]"))] == [
        "[sepa]"
    ]
    # a plugin transform may read anything; so may a campaign's conditions
    (project / "plugins").mkdir()
    (project / "plugins" / "flat_tx.py").write_text(
        "def flat(ctx):\n    return [lp * 0 + a for a, lp in zip(ctx.episode_advantages_G, "
        "ctx.logprobs_G_T)]\n"
    )
    plugin = report(
        capsys, str(QUICKSTART), "--transform-mode", "flat_tx.flat", "--hicra-alpha", "0.5"
    )
    assert not [w for w in plugin["warnings"] if w.startswith(("[hicra]", "[sepa]"))]
    camp = report(capsys, str(CAMPAIGN), "--hicra-alpha", "0.5", "--sepa-steps", "7")
    assert not [w for w in camp["warnings"] if w.startswith(("[hicra]", "[sepa]"))]


def _environment(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "env.toml"
    path.write_text(
        '[backend]\ndevices = "cpu"\n[model]\nmodel = "HuggingFaceTB/SmolLM2-135M-Instruct"\n'
        "[training]\nseed = 1\nbatch_size = 2\ngroup_size = 4\nmax_tokens = 10\n"
        f"[plugins]\nsearch_paths = [{str(FIXTURES / 'multiturn_envs')!r}, "
        f"{str(FIXTURES / 'api_generations')!r}]\n"
        f'[environment]\nprovider = "verifiers"\n{extra}\n'
    )
    return path


def test_an_environment_counts_its_turns_in_the_per_step_bound(tmp_path, capsys):
    pytest.importorskip("verifiers.v1")
    # max_turns = -1: the probed environment's own cap (its AgentConfig: 2 turns)
    path = _environment(tmp_path, 'id = "opening_env"\nargs = { n = 3 }')
    ps = report(capsys, str(path))["per_step"]
    assert ps["sampled_token_upper_bound"] == 2 * 4 * 10 * 2 and ps["turns"] == 2
    assert ps["turns_source"] == "the probed environment's turn cap"
    # one that does not load: the fallback cap, said as such
    path = _environment(tmp_path, 'id = "interim-env"')
    code, out = explain(capsys, str(path))
    assert code == 2
    bound = line(out, "Per step:")
    assert f"<= {2 * 4 * 10 * FALLBACK_MAX_TURNS:,} sampled tokens" in bound
    assert f"the fallback cap of {FALLBACK_MAX_TURNS} turns for max_turns = -1" in bound


def test_a_campaign_says_its_wall_time(capsys, one_gpu, tmp_path):
    """Every run's steps at the step-time estimate over the runs that go at once."""
    flags = ["--campaign-max-steps", "10", "--campaign-parallel", "true"]
    data = report(capsys, str(CAMPAIGN), *flags, "--campaign-max-workers", "4")
    step, camp = data["estimates"]["step_time_s"], data["campaign"]
    assert camp["wall_time"] == {"seconds": pytest.approx(400 * step / 4), "at_once": 4}
    text = explain(capsys, str(CAMPAIGN), *flags, "--campaign-max-workers", "4")[1]
    assert line(text, "Wall time:").endswith(
        f"an estimate: 400 steps x ~{step:g} s/step / 4 runs at once (the base config's step "
        "time; conditions differ; runs sharing a device slow each other)"
    )
    # sequential: one at a time
    camp = report(capsys, str(CAMPAIGN), "--campaign-max-steps", "10")["campaign"]
    assert camp["wall_time"]["at_once"] == 1
    assert camp["wall_time"]["seconds"] == pytest.approx(400 * step)


def test_the_usage_line_names_the_config_and_its_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["explain", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert out.startswith(
        "usage: retrain explain [CONFIG] [--flag value ...] [--json] [--world-size N] "
        "[--overwrite]\n"
    )


def test_prime_rl_samples_on_its_own_inference_server(tmp_path, capsys):
    """prime_rl ignores [inference] engine: its inference server samples, at the url."""
    path = tmp_path / "p.toml"
    path.write_text(
        f'[backend]\nbackend = "prime_rl"\nadapter_path = "{tmp_path / "run_1"}"\n'
        '[inference]\nurl = "http://127.0.0.1:8000"\n[algorithm]\ntransform_mode = "none"\n'
        "[training]\nseed = 1\n"
    )
    assert report(capsys, str(path))["settings"]["inference"] == {
        "engine": "the prime_rl backend's inference server",
        "url": "http://127.0.0.1:8000",
    }
    text = explain(capsys, str(path))[1]
    assert line(text, "Sampling:") == (
        "Sampling:    the prime_rl backend's inference server at http://127.0.0.1:8000"
    )
