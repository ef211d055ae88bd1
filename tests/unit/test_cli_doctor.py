"""`retrain doctor`: one OK/WARN/FAIL line per check, exit 1 on a FAIL, no secrets shown."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from retrain.cli import doctor
from retrain.cli.main import main

SECRET = "sk-very-secret-value-123"


def run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An isolated working directory, caches and home; the network is never touched.
    The process environment is restored afterwards, including variables the test's
    `retrain doctor` loaded from a .env (monkeypatch.delenv of an unset name records
    nothing, so it alone would let a loaded WANDB_API_KEY leak into later tests)."""
    before = dict(os.environ)
    yield _isolate(tmp_path, monkeypatch)
    os.environ.clear()
    os.environ.update(before)


def _isolate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RETRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    for name in (
        "WANDB_API_KEY",
        "WANDB_MODE",
        "NETRC",
        "HF_HUB_OFFLINE",
        "HF_TOKEN",
        "OPENAI_API_KEY",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: unreachable
    (tmp_path / "home").mkdir()
    return tmp_path


def checks_by_name(out_json: str) -> dict:
    data = json.loads(out_json)
    return {c["name"]: c for c in data["checks"]}


def write_config(path: Path, model: str, **logging) -> Path:
    """A local run on the CPU of `model`, on data.jsonl (written beside it when absent)."""
    data = path.parent / "data.jsonl"
    if not data.exists():
        data.write_text('{"question": "1+1", "answer": "2"}\n')
    lines = [
        "[backend]",
        'backend = "local"',
        'devices = "cpu"',
        "[model]",
        f'model = "{model}"',
        "[data]",
        'source = "jsonl"',
        'path = "data.jsonl"',
    ]
    if logging:
        lines.append("[logging]")
        lines += [f'{k} = "{v}"' for k, v in logging.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_every_line_has_a_status_and_fixes_are_shown(env, capsys):
    code, out, _ = run(["doctor", "--no-network"], capsys)
    lines = [line for line in out.splitlines() if line and not line.startswith(" ")]
    body = [line for line in lines[:-1]]
    assert body and all(line.split()[0] in ("OK", "WARN", "FAIL") for line in body)
    names = {line.split()[1] for line in body}
    for name in ("python", "retrain", "config", "torch", "model", "cache", "wandb"):
        assert name in names, name
    assert "fix: retrain init --template quickstart" in out  # no retrain.toml here
    assert code in (0, 1)


def test_json_output_and_exit_status(env, capsys):
    code, out, _ = run(["doctor", "--json", "--no-network"], capsys)
    data = json.loads(out)
    assert data["ok"] == (code == 0)
    assert all(c["status"] in ("OK", "WARN", "FAIL") for c in data["checks"])
    checks = checks_by_name(out)
    assert checks["python"]["status"] == "OK"
    assert "extra [local]" in checks and "extra [plots]" in checks
    assert checks["cache"]["status"] == "OK" and str(env / "cache") in checks["cache"]["detail"]


def test_local_model_directory_ok(env, capsys):
    model = env / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = write_config(env / "retrain.toml", str(model))
    code, out, _ = run(["doctor", str(cfg), "--json", "--no-network"], capsys)
    checks = checks_by_name(out)
    assert checks["config"]["status"] == "OK"
    assert checks["model"]["status"] == "OK" and "local directory" in checks["model"]["detail"]


def test_model_in_hf_cache_ok(env, capsys):
    snap = env / "hf" / "models--org--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    cfg = write_config(env / "retrain.toml", "org/tiny")
    code, out, _ = run(["doctor", str(cfg), "--json"], capsys)
    assert checks_by_name(out)["model"]["detail"].startswith("org/tiny: in the Hugging Face cache")


def test_model_in_retrain_cache_ok(env, capsys):
    converted = env / "cache" / "models" / "org--other" / "safetensors"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    cfg = write_config(env / "retrain.toml", "org/other")
    code, out, _ = run(["doctor", str(cfg), "--json"], capsys)
    assert "retrain cache" in checks_by_name(out)["model"]["detail"]


def test_unreachable_uncached_model_fails(env, capsys):
    cfg = write_config(env / "retrain.toml", "org/not-here")
    code, out, _ = run(["doctor", str(cfg)], capsys)
    assert code == 1
    line = next(line for line in out.splitlines() if line.split()[1:2] == ["model"])
    assert line.startswith("FAIL") and "the hub (http://127.0.0.1:9) cannot be reached" in line
    assert "fix: `hf download org/not-here` once connected" in out
    assert "huggingface-cli" not in out


def test_reachable_hub_is_ok(env, capsys, monkeypatch, hub):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    cfg = write_config(env / "retrain.toml", "org/not-here")
    code, out, _ = run(["doctor", str(cfg), "--json"], capsys)
    model = checks_by_name(out)["model"]
    assert model["status"] == "OK" and "downloaded on first use" in model["detail"]
    assert hub.asked == ["org/not-here"]  # one metadata request


def test_a_model_the_hub_does_not_have_fails(env, capsys, monkeypatch, hub):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    hub.missing.add("org/not-here")
    cfg = write_config(env / "retrain.toml", "org/not-here")
    code, out, _ = run(["doctor", str(cfg)], capsys)
    line = next(line for line in out.splitlines() if line.split()[1:2] == ["model"])
    assert code == 1 and line.startswith("FAIL  model")
    assert "[model] model: 'org/not-here' is not a local directory" in line
    assert "has no model repository of that name" in line


def test_invalid_config_fails(env, capsys):
    (env / "retrain.toml").write_text("[training]\nlr = -1\n")
    code, out, _ = run(["doctor", "--no-network"], capsys)
    assert code == 1
    line = next(line for line in out.splitlines() if line.split()[1:2] == ["config"])
    assert line.startswith("FAIL") and "lr" in line


def test_a_campaign_config_names_its_conditions(env, capsys):
    """The base config's condition (maxrl+gtpo_sepa by default) is no run's."""
    (env / "retrain.toml").write_text(
        '[campaign]\nseeds = [1, 2]\n[[campaign.conditions]]\nadvantage_mode = "grpo"\n'
        'transform_mode = "none"\n'
    )
    out = run(["doctor", "--no-network"], capsys)[1]
    line = next(line for line in out.splitlines() if line.split()[1:2] == ["config"])
    assert "is valid (a campaign of grpo+none x 2 seeds, backend local)" in line


def test_a_server_engine_whose_server_is_down_fails_with_the_url_and_start_command(env, capsys):
    # nothing listens on port 9
    (env / "retrain.toml").write_text('[inference]\nengine = "vllm"\nurl = "http://127.0.0.1:9"\n')
    code, out, _ = run(["doctor"], capsys)
    assert code == 1
    probe = [line for line in out.splitlines() if "backend probe" in line]
    assert probe and probe[0].startswith("FAIL") and "http://127.0.0.1:9" in probe[0]
    assert "scripts/vllm_server/start.sh" in out


def test_missing_config_argument_fails(env, capsys):
    code, out, _ = run(["doctor", "nope.toml", "--no-network"], capsys)
    assert code == 1 and "nope.toml not found" in out


def test_wandb_login_never_prints_the_key(env, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    cfg = write_config(env / "retrain.toml", "org/x", wandb_project="proj")
    code, out, err = run(["doctor", str(cfg), "--no-network"], capsys)
    assert SECRET not in out and SECRET not in err
    line = next(line for line in out.splitlines() if line.split()[1:2] == ["wandb"])
    assert line.startswith("OK") and "WANDB_API_KEY is set" in line
    code, out, _ = run(["doctor", str(cfg), "--json", "--no-network"], capsys)
    assert SECRET not in out
    assert "HF_TOKEN" in checks_by_name(out)["secrets"]["detail"]


def test_secret_in_dotenv_is_loaded_but_not_shown(env, capsys):
    (env / ".env").write_text(f"WANDB_API_KEY={SECRET}\n")
    cfg = write_config(env / "retrain.toml", "org/x", wandb_project="proj")
    code, out, _ = run(["doctor", str(cfg), "--no-network"], capsys)
    assert SECRET not in out and "WANDB_API_KEY is set" in out
    assert os.environ.get("WANDB_API_KEY") == SECRET  # loaded; the env fixture removes it


def test_the_dotenv_secret_did_not_leak_into_later_tests():
    """Runs after the test above (pytest keeps file order)."""
    assert os.environ.get("WANDB_API_KEY") != SECRET


def test_wandb_netrc_and_not_logged_in(env, capsys, monkeypatch):
    cfg = write_config(env / "retrain.toml", "org/x", wandb_project="proj")
    code, out, _ = run(["doctor", str(cfg), "--json", "--no-network"], capsys)
    assert checks_by_name(out)["wandb"]["status"] == "WARN"
    (env / "home" / ".netrc").write_text(
        f"machine api.wandb.ai\n  login user\n  password {SECRET}\n"
    )
    code, out, _ = run(["doctor", str(cfg), "--json", "--no-network"], capsys)
    wandb_check = checks_by_name(out)["wandb"]
    assert wandb_check["status"] == "OK" and ".netrc" in wandb_check["detail"]
    assert SECRET not in out


def test_explain_warns_where_wandb_will_not_take_the_run(env, capsys, monkeypatch):
    cfg = write_config(env / "retrain.toml", "org/x", wandb_project="proj")
    code, out, _ = run(["explain", str(cfg), "--json"], capsys)
    (warning,) = [w for w in json.loads(out)["warnings"] if "wandb" in w]
    assert warning.startswith("[logging] wandb_project: not logged in: runs with wandb_project")
    assert warning.endswith("Fix: wandb login, set WANDB_API_KEY in .env, or WANDB_MODE=offline")
    monkeypatch.setenv("WANDB_MODE", "offline")
    code, out, _ = run(["explain", str(cfg), "--json"], capsys)
    assert not [w for w in json.loads(out)["warnings"] if "wandb" in w]
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
    )
    code, out, _ = run(["explain", str(cfg), "--json"], capsys)
    (warning,) = [w for w in json.loads(out)["warnings"] if "wandb" in w]
    assert warning == (
        "[logging] wandb_project: is set but wandb is not installed, so the run logs to "
        "JSONL only. Fix: pip install 'retrain[wandb]'"
    )


def test_needed_extra_missing_fails(env, capsys, monkeypatch):
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda d: None if d == "wandb" else real(d))
    cfg = write_config(env / "retrain.toml", "org/x", wandb_project="proj")
    code, out, _ = run(["doctor", str(cfg), "--json", "--no-network"], capsys)
    checks = checks_by_name(out)
    assert checks["extra [wandb]"]["status"] == "FAIL"
    assert checks["extra [wandb]"]["fix"] == "pip install 'retrain[wandb]'"
    assert code == 1


def test_extras_from_metadata_cover_the_pyproject():
    extras = doctor.extras()
    assert {"local", "plots", "wandb"} <= set(extras)
    assert "torch" in extras["local"] and "scipy" in extras["plots"]
    assert "dev" not in extras


def test_an_install_older_than_retrain_runs_with_is_named(env, capsys, monkeypatch):
    """An extra's distribution below the floor in retrain's metadata (pyproject's
    `torch>=2.11`, ...): FAIL where the config needs the extra, WARN where not, naming
    each old version, its floor and the upgrade."""
    requires = [
        'torch>=2.11; extra == "local"',
        'transformers>=5.17; extra == "local"',
        'peft>=0.21; extra == "local"',
        'wandb>=0.19; extra == "wandb"',
    ]
    monkeypatch.setattr(doctor.md, "requires", lambda dist: requires)
    have = {"torch": "2.6.0+cu124", "transformers": "5.24.0", "peft": "0.21.2", "wandb": "0.18.7"}
    monkeypatch.setattr(doctor, "_version", have.get)
    cfg = write_config(env / "retrain.toml", "org/x")
    code, out, _ = run(["doctor", str(cfg), "--json", "--no-network"], capsys)
    checks = checks_by_name(out)
    local, wandb = checks["extra [local]"], checks["extra [wandb]"]
    assert local["status"] == "FAIL" and code == 1  # the local backend needs it
    assert local["detail"] == (
        "older than retrain runs with: torch 2.6.0+cu124 (retrain needs >= 2.11); "
        "needed by [backend] backend = local"
    )
    assert local["fix"] == "pip install -U 'retrain[local]'"
    assert wandb["status"] == "WARN" and "wandb 0.18.7 (retrain needs >= 0.19)" in wandb["detail"]
    have["torch"] = "2.13.0+cpu"
    code, out, _ = run(["doctor", str(cfg), "--json", "--no-network"], capsys)
    assert checks_by_name(out)["extra [local]"]["status"] == "OK"


@pytest.mark.parametrize(
    "version, floor, old",
    [
        ("2.13.0+cpu", "2.11", False),
        ("2.11.0", "2.11", False),
        ("2.10.1", "2.11", True),
        ("2.9", "2.11", True),
        ("5.0.0rc1", "5.17", True),
        ("0.21.2", "0.21", False),
        ("10.0", "9.99", False),  # numbers, not strings
    ],
)
def test_older(version, floor, old):
    assert doctor.older(version, floor) is old


def test_torch_check_reports_cuda_state(env):
    pytest.importorskip("torch")
    checks = doctor.check_torch(None)
    assert checks[0].name == "torch" and checks[0].status == "OK"
    assert checks[1].name == "cuda"


def test_a_gpu_torch_cannot_use_is_explained(env, monkeypatch):
    """nvidia-smi shows a GPU (stood in) that torch does not see: a CPU build of torch
    (this machine's, faked where it is not) is named with the install that fixes it."""
    torch = pytest.importorskip("torch")
    from retrain.config import config_from_dict

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr("retrain.hardware.cuda_device_count", lambda **kw: 1)
    check = {c.name: c for c in doctor.check_torch(config_from_dict({}))}["cuda"]
    assert check.status == "FAIL"
    assert check.detail.endswith(
        f"(the run refuses it): nvidia-smi shows 1 GPU(s), but the installed torch "
        f"({torch.__version__}) is built without CUDA"
    )
    assert check.fix.startswith("install torch's CUDA build (on Linux, PyPI's: pip install")
    # a CUDA build, with CUDA_VISIBLE_DEVICES hiding the GPU: the variable is named
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr("retrain.hardware.cuda_device_count", lambda **kw: 0)
    monkeypatch.setattr("retrain.hardware.hidden_gpus", lambda **kw: "CUDA_VISIBLE_DEVICES = ''")
    check = {c.name: c for c in doctor.check_torch(config_from_dict({}))}["cuda"]
    assert check.detail.endswith("(the run refuses it): CUDA_VISIBLE_DEVICES = ''")
    assert check.fix == "list it in CUDA_VISIBLE_DEVICES (or unset it), or ask for a GPU CUDA sees"


def test_gpu_lines_with_a_faked_cuda(env, monkeypatch):
    """The CUDA branch, on a machine without a GPU: torch.cuda answers are faked."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from retrain.config import config_from_dict

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(name=f"Fake GPU {i}", total_memory=(80 if i == 0 else 8) * 2**30),
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (40 * 2**30, 80 * 2**30))
    config = config_from_dict({"backend": {"devices": "gpu:0,gpu:3"}})
    checks = {c.name: c for c in doctor.check_torch(config)}
    assert checks["cuda"].status == "OK" and "2 device(s)" in checks["cuda"].detail
    assert checks["gpu:0"].status == "OK" and "80.0 GiB (40.0 GiB free)" in checks["gpu:0"].detail
    assert checks["gpu:1"].status == "WARN" and checks["gpu:1"].fix
    assert checks["devices"].status == "FAIL" and "gpu:3" in checks["devices"].detail


def test_a_config_that_cannot_run_never_passes(env, capsys):
    """Each of these loads, but the run would refuse it before its first step."""
    (env / "data.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    good = write_config(env / "good.toml", "org/x")
    code, out, _ = run(["doctor", str(good), "--json", "--no-network"], capsys)
    assert checks_by_name(out)["run checks"]["status"] == "OK"

    (env / "data.jsonl").unlink()
    code, out, _ = run(["doctor", str(good), "--no-network"], capsys)
    assert code == 1 and "All checks passed" not in out
    line = next(line for line in out.splitlines() if line.split()[1:2] == ["config"])
    assert line.startswith("FAIL") and f"[data] path ({good}:8): JSONL file 'data.jsonl'" in line
    assert f"fix: edit {good}; retrain explain {good} says the same" in out

    # a file that is there but that the run's start would refuse: its line, as the run says it
    (env / "data.jsonl").write_text('{"question": "1+1", "answer": "2"}\n{"question": "2"}\n')
    code, out, _ = run(["doctor", str(good), "--no-network"], capsys)
    line = next(line for line in out.splitlines() if line.split()[1:3] == ["run", "checks"])
    assert code == 1 and line.startswith("FAIL")
    assert f"[data] path ({good}:8): data.jsonl:2: missing field 'answer'" in line

    (env / "data.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    bad_reward = env / "reward.toml"
    bad_reward.write_text(
        good.read_text() + '[reward]\ntype = "custom"\ncustom_module = "gone.py"\n'
    )
    code, out, _ = run(["doctor", str(bad_reward), "--json", "--no-network"], capsys)
    fails = [c["detail"] for c in json.loads(out)["checks"] if c["status"] == "FAIL"]
    assert code == 1
    assert any(
        f.startswith(f"{bad_reward}: [reward] custom_module ({bad_reward}:11)") for f in fails
    )

    bad_resume = env / "resume.toml"
    bad_resume.write_text(good.read_text() + '[resume]\nfrom = "logs/old"\n')
    code, out, _ = run(["doctor", str(bad_resume), "--json", "--no-network"], capsys)
    fails = [c["detail"] for c in json.loads(out)["checks"] if c["name"] == "run checks"]
    assert code == 1 and len(fails) == 1
    assert fails[0].startswith(f"[resume] from ({bad_resume}:10): 'logs/old' is not a directory")
