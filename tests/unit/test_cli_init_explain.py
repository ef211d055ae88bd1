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
    for name in ("quickstart", "experiment", "campaign", "multiturn", "zoo"):
        line = next(line for line in out.splitlines() if line.startswith(name))
        assert len(line.split(None, 1)[1]) > 20  # a real one-line description


@pytest.mark.parametrize("name", ["quickstart", "experiment", "campaign", "multiturn", "zoo"])
def test_init_writes_valid_template_and_refuses_overwrite(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    out_path = tmp_path / f"{name}.toml"
    code, out, _ = run(["init", "--template", name, "--output", str(out_path)], capsys)
    assert code == 0 and out_path.exists() and "retrain explain" in out
    config = load_config(out_path)
    assert (config.campaign is not None) == (name in ("campaign", "zoo"))
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


def test_init_interactive_on_a_tty(tmp_path, capsys):
    """Answer the questions through a real pseudo-terminal: the defaults' model writes the
    quickstart with the answers set, a config that runs on this CPU as written."""
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
    # the quickstart's CPU settings kept, its run's directories not reused
    assert (config.backend.devices, config.training.seed, config.training.max_tokens) == (
        "cpu",
        0,
        24,
    )
    assert config.logging.log_dir == "logs/grpo_none"
    assert config.backend.adapter_path == "adapters/grpo_none"
    code, out, err = run(["explain", str(tmp_path / "retrain.toml")], capsys)
    assert code == 0 and "ERROR" not in out, out + err


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
    assert report["checkpoints"]["periodic"] == 2  # steps 10 and 20; 30 is the final one
    assert "linear" in report["sepa"]


def test_explain_campaign_matrix(capsys, one_gpu):
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
    # its runs are seeded by [campaign] seeds, so its unset [training] seed is no warning
    report = json.loads(out)
    assert not [w for w in report["warnings"] if "seed" in w]
    # the base config's condition is no run's: the lines name the conditions instead,
    # and SEPA's schedule the one condition that uses it
    assert report["condition"] is None and report["algorithm"] is None
    assert [c["sepa"].startswith("not used by") for c in camp["condition_details"]] == [
        True, True, True, True, False
    ]  # fmt: skip
    text = run(["explain", str(REPO / "retrain/config/templates/campaign.toml")], capsys)[1]
    assert "Condition:   one per run: grpo+none, maxrl+none, maxrl+gtpo, maxrl+gtpo_hicra, " in text
    assert "Algorithm:   " not in text and "seed per run ([campaign] seeds)" in text
    sepa = next(line for line in text.splitlines() if line.startswith("SEPA:"))
    assert sepa.endswith(
        "(sticky) (maxrl+gtpo_sepa); not used by grpo+none, maxrl+none, maxrl+gtpo, "
        "maxrl+gtpo_hicra"
    )


def test_explain_warns_about_an_unseeded_run(tmp_path, capsys, one_gpu):
    path = _write(tmp_path / "r.toml", "[training]\nmax_steps = 1\n")
    code, out, _ = run(["explain", str(path), "--json"], capsys)
    assert "[training] seed = -1: the run is not reproducible" in " ".join(
        json.loads(out)["warnings"]
    )


def test_explain_tinker_ignores_inference(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-test")
    path = tmp_path / "t.toml"
    path.write_text('[backend]\nbackend = "tinker"\n[training]\nseed = 1\n')
    code, out, _ = run(["explain", str(path)], capsys)
    assert code == 0 and "resume_runtime_dependent=true" in out
    assert "Ignored:" not in out  # nothing it ignores is set
    path.write_text(
        '[backend]\nbackend = "tinker"\n[inference]\ntimeout = 60.0\n[training]\nseed = 1\n'
    )
    code, out, _ = run(["explain", str(path)], capsys)
    assert code == 0
    assert "Ignored:     [inference] timeout (set, but not used by the tinker backend)" in out


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
    ("text", "needle"),
    [
        # nothing listens on port 9: the server is down
        (
            '[inference]\nengine = "vllm"\nurl = "http://127.0.0.1:9"\n',
            "scripts/vllm_server/start.sh",
        ),
        ('[inference]\nengine = "sglang"\nurl = "http://127.0.0.1:9"\n', "sglang.launch_server"),
    ],
)
def test_explain_fails_on_a_server_engine_whose_server_does_not_answer(
    tmp_path, capsys, text, needle
):
    path = tmp_path / "t.toml"
    path.write_text(text)
    code, out, _ = run(["explain", str(path)], capsys)
    assert code == 2 and "ERROR: [inference] url" in out and "http://127.0.0.1:9" in out
    assert needle in out and "Fix:" in out


def test_explain_openai_engine_needs_a_url(tmp_path, capsys):
    path = tmp_path / "t.toml"
    path.write_text('[inference]\nengine = "openai"\n')
    code, _, err = run(["explain", str(path)], capsys)
    assert code == 2 and "[inference] url" in err and "no default URL" in err


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


# ---------------------------------------------------------------- what the run checks at start


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_explain_shows_resolved_settings_and_cli_overrides(tmp_path, capsys):
    quick = REPO / "retrain/config/templates/quickstart.toml"
    args = ["explain", str(quick), "--json", "--lr", "3e-4", "--top-p", "0.9"]
    code, out, _ = run(args + ["--temperature", "0.8", "--lora-rank", "8"], capsys)
    s = json.loads(out)["settings"]
    assert code == 0
    assert (s["lr"], s["top_p"], s["temperature"]) == (3e-4, 0.9, 0.8)
    assert s["lr_schedule"] == "constant" and s["seed"] == 0
    assert s["optimizer"]["name"] == "AdamW" and s["optimizer"]["beta2"] == 0.99
    assert s["lora"]["rank"] == 8 and s["lora"]["alpha"] == 16
    assert s["loss"]["policy_loss"] == "is" and s["loss"]["loss_agg"] == "token_mean"
    assert s["inference"] == {
        "engine": "pytorch",
        "url": None,
        "decode": "dynamic (the cache grows, finished rows leave the batch)",
    }
    assert s["devices"] == "cpu"
    code, text, _ = run(["explain", str(quick), "--lr", "3e-4", "--top-p", "0.9"], capsys)
    assert "Training:    lr 0.0003 (constant)" in text and "top_p 0.9" in text
    assert "Optimizer:   AdamW betas (0.9, 0.99)" in text and "LoRA:        rank 16" in text
    assert "Sampling:    pytorch on cpu" in text


def test_explain_tinker_settings_name_the_service(tmp_path, capsys):
    path = _write(
        tmp_path / "t.toml",
        '[backend]\nbackend = "tinker"\n[model]\nbase_url = "http://127.0.0.1:8000"\n'
        "[training]\nseed = 1\n",
    )
    report = json.loads(run(["explain", str(path), "--json"], capsys)[1])
    assert report["settings"]["inference"]["url"] == "http://127.0.0.1:8000"
    assert "tinker" in report["settings"]["inference"]["engine"]
    assert report["settings"]["devices"] is None
    est = report["estimates"]
    assert est["peak_memory_gib"] is None and "service" in est["memory_note"]


def _tiny_model(tmp_path: Path) -> Path:
    """A model directory with only a config.json: the estimate reads its shape."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 100,
                "tie_word_embeddings": False,
            }
        )
    )
    return model


def test_explain_reads_the_jsonl_files_as_the_run_would(tmp_path, capsys):
    """The example count of [data] path; a line the run's start would refuse, in either
    file, is an error naming the key, the config line and the file's line; [data] keys
    the source does not read are a warning."""
    (tmp_path / "d.jsonl").write_text(
        '{"question": "1+1", "answer": "2"}\n\n{"question": "2+3", "answer": 5}\n'
    )
    (tmp_path / "h.jsonl").write_text('{"question": "1+2", "answer": "3"}\nnot json\n')
    text = (
        f'[data]\nsource = "jsonl"\npath = "{tmp_path / "d.jsonl"}"\ntask = "chain_sum"\n'
        f'[eval]\nevery = 0\npath = "{tmp_path / "h.jsonl"}"\n'
        f'[logging]\nlog_dir = "{tmp_path / "logs"}"\n[backend]\ndevices = "cpu"\n'
    )
    path = _write(tmp_path / "r.toml", text)
    code, out, _ = run(["explain", str(path), "--json"], capsys)
    report = json.loads(out)
    assert code == 0 and report["errors"] == []
    assert report["data"].endswith("; 2 examples")
    (warning,) = [w for w in report["warnings"] if w.startswith("[data]")]
    assert warning.startswith("[data] task is read by source reasoning_gym only; source 'jsonl'")

    path.write_text(text.replace("every = 0", "every = 5").replace('task = "chain_sum"\n', ""))
    code, out, _ = run(["explain", str(path)], capsys)
    assert code == 2 and "WARNING: [data]" not in out
    assert f"ERROR: [eval] path ({path}:6): {tmp_path / 'h.jsonl'}:2: malformed JSON" in out
    (tmp_path / "d.jsonl").write_text('{"question": "1+1"}\n')
    code, out, _ = run(["explain", str(path)], capsys)
    assert f"ERROR: [data] path ({path}:3): {tmp_path / 'd.jsonl'}:1: missing field 'answer'" in out


def test_explain_says_what_the_reward_asks_or_calls(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    path = _write(tmp_path / "r.toml", f'[logging]\nlog_dir = "{tmp_path / "logs"}"\n')
    judge = ["--reward-type", "judge", "--reward-judge-model", "j"]
    flags = [*judge, "--reward-judge-base-url", "http://127.0.0.1:9/v1"]
    report = json.loads(run(["explain", str(path), "--json", *flags], capsys)[1])
    assert report["reward"] == "judge: j at http://127.0.0.1:9/v1"
    report = json.loads(run(["explain", str(path), "--json", *judge], capsys)[1])
    assert report["reward"] == "judge: j at https://api.openai.com/v1 (the OpenAI API)"
    (tmp_path / "mine.py").write_text("def grade(response, reference):\n    return 1.0\n")
    custom = ["--reward-type", "custom", "--reward-custom-module", str(tmp_path / "mine.py")]
    report = json.loads(
        run(["explain", str(path), "--json", *custom, "--reward-custom-function", "grade"], capsys)[
            1
        ]
    )
    assert report["reward"] == f"custom: grade() of {tmp_path / 'mine.py'}"


def test_explain_estimates_memory_and_step_time(tmp_path, capsys):
    model = _tiny_model(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    path = _write(
        tmp_path / "r.toml",
        f'[model]\nmodel = "{model}"\nlora_rank = 4\n[backend]\ndevices = "cpu"\n'
        f'[data]\nsource = "jsonl"\npath = "{tmp_path / "d.jsonl"}"\n'
        f'[eval]\nevery = 0\n[logging]\nlog_dir = "{tmp_path / "logs"}"\n'
        "[training]\nseed = 1\nbatch_size = 2\ngroup_size = 4\nmax_tokens = 10\n",
    )
    est = json.loads(run(["explain", str(path), "--json"], capsys)[1])["estimates"]
    # attention 64*64*2 + 64*32*2, MLP 3*64*128, per layer; norms (2*2+1)*64; untied
    # embeddings 2*100*64
    assert est["model_params"] == 2 * (8192 + 4096 + 24576) + 320 + 12800
    assert est["sampled_tokens_per_step"] == 2 * 4 * 10
    assert 0 < est["peak_memory_gib"] < 1
    assert est["recent_run"] is None and "parameters x tokens" in est["step_time_source"]
    # 2 x params per sampled token at the CPU's sampling rate, 6 x params at its training
    # rate (2 x 4 completions x 10 tokens)
    want = 2 * est["model_params"] * 80 / 9e10 + 6 * est["model_params"] * 80 / 4.9e11
    assert est["step_time_s"] == pytest.approx(want, abs=0.01)

    # a run already logged in log_dir: its measured median wins
    logs = tmp_path / "logs"
    logs.mkdir()
    rows = [
        {"step": i, "step_time_s": t, "tokens_generated": 400, "time_sampling_s": s}
        for i, (t, s) in enumerate([(3.0, 1.0), (5.0, 2.0), (4.0, 4.0)])
    ]
    (logs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = run(["explain", str(path), "--json"], capsys)
    est = json.loads(out)["estimates"]
    assert est["step_time_s"] == 4.0 and est["recent_run"]["steps"] == 3
    assert est["recent_run"]["sampled_tokens_per_s"] == 200.0
    text = run(["explain", str(path)], capsys)[1]
    assert f"~4 s/step (median of 3 steps logged in {logs})" in text
    assert "sampling 200 tokens/s" in text and "Memory:      " in text

    # ... when that run recorded this setup; another setup's steps are not this one's
    resolved = path.read_text().replace("group_size = 4", "group_size = 8")
    (logs / "config.resolved.toml").write_text(resolved.replace("lora_rank = 4", "lora_rank = 2"))
    est = json.loads(run(["explain", str(path), "--json"], capsys)[1])["estimates"]
    assert est["step_time_s"] == pytest.approx(want, abs=0.01)
    assert est["step_time_source"].endswith(
        f"; the 3 steps logged in {logs} ran another setup ([model] lora_rank = 2 (here 4), "
        "[training] group_size = 8 (here 4)), so their median is not this one's"
    )
    assert "tokens/s" not in run(["explain", str(path)], capsys)[1].split("Step time:")[1]
    (logs / "config.resolved.toml").write_text(path.read_text())
    assert (
        json.loads(run(["explain", str(path), "--json"], capsys)[1])["estimates"]["step_time_s"]
        == 4.0
    )


@pytest.mark.parametrize(
    ("environment", "says"),
    [
        ("", None),
        ('provider = "openenv"\nid = "g.Game"\nmax_turns = 1\n', None),
        ('provider = "openenv"\nid = "g.Game"\nmax_turns = 3\n', "takes up to 3 turns"),
        (
            'provider = "openenv"\nid = "g.Game"\n',
            "takes as many turns as the environment allows (8 where",
        ),
    ],
)
def test_estimates_say_a_conversation_is_longer_than_one_turn(tmp_path, environment, says):
    """The estimates count one model turn of max_tokens per completion; with a multi-turn
    environment the memory and step-time notes say a conversation can take more."""
    from retrain.backends.base import backend_info
    from retrain.cli.estimates import estimates

    text = f'[model]\nmodel = "{_tiny_model(tmp_path)}"\n[backend]\ndevices = "cpu"\n'
    config = load_config(_write(tmp_path / "r.toml", text + f"[environment]\n{environment}"))
    est = estimates(config, backend_info("local"))
    notes = est["memory_note"], est["step_time_source"]
    if says is None:
        assert not any("model turn" in note for note in notes), notes
    else:
        assert all(
            f"one model turn per completion: an environment's conversation {says}" in note
            for note in notes
        ), notes


def test_explain_step_time_reproduces_the_measured_gpu_steps(tmp_path, capsys, monkeypatch):
    """Without a logged run, explain's GPU estimate gives back what was measured on an
    H100: the headline shape's 3.39 s sampling + 2.78 s training (one group a
    micro-batch), and the quickstart's 0.53 s floor for a model whose FLOPs take far
    less. Another GPU's by its peak figures against the H100's; one retrain has no
    figures for as the H100, saying so."""
    shapes = {
        "model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 9728, "vocab_size": 151936, "tie_word_embeddings": True,
    }  # fmt: skip
    big = tmp_path / "qwen3-4b-shapes"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(shapes))
    path = _write(
        tmp_path / "r.toml",
        f'[model]\nmodel = "{big}"\nlora_rank = 32\n[backend]\ndevices = "gpu:0"\n'
        f'[eval]\nevery = 0\n[logging]\nlog_dir = "{tmp_path / "logs"}"\n'
        "[training]\nbatch_size = 8\ngroup_size = 16\nmax_tokens = 256\n",
    )
    est = json.loads(run(["explain", str(path), "--json"], capsys)[1])["estimates"]
    assert est["model_params"] == pytest.approx(4.02e9, rel=0.01)
    assert est["step_time_s"] == pytest.approx(6.2, abs=0.1)
    assert "sampling ~3.4 s + training ~2.8 s" in est["step_time_source"]
    assert "then to the" not in est["step_time_source"]  # no nvidia-smi here
    h100 = est["step_time_s"]
    for name, want in (
        ("NVIDIA H100 80GB HBM3", h100),
        # sampling x 3.35 / 1.008 TB/s, training x 989 / 165 TFLOPS: 11.2 s + 16.9 s
        ("NVIDIA GeForce RTX 4090", 28.1),
        ("NVIDIA A10G", h100),
    ):
        monkeypatch.setattr("retrain.cli.estimates.gpu_name", lambda index, n=name: n)
        est = json.loads(run(["explain", str(path), "--json"], capsys)[1])["estimates"]
        assert est["step_time_s"] == pytest.approx(want, abs=0.1), name
        source = est["step_time_source"]
        assert ("then to the NVIDIA GeForce RTX 4090" in source) == ("4090" in name)
        assert ("no peak figures for the NVIDIA A10G: taken as an H100" in source) == (
            "A10G" in name
        )
    monkeypatch.setattr("retrain.cli.estimates.gpu_name", lambda index: None)
    small = _tiny_model(tmp_path)
    est = json.loads(run(["explain", str(path), "--json", "--model", str(small)], capsys)[1])[
        "estimates"
    ]
    assert est["step_time_s"] == 0.53 and "at least the 0.53 s" in est["step_time_source"]
    mps = run(["explain", str(path), "--json", "--devices", "mps"], capsys)[1]
    est = json.loads(mps)["estimates"]
    assert est["step_time_s"] is None and "no rate measured on mps" in est["step_time_source"]


def test_explain_memory_does_not_grow_with_the_group(tmp_path, capsys):
    model = _tiny_model(tmp_path)
    path = _write(
        tmp_path / "r.toml",
        f'[model]\nmodel = "{model}"\nlora_rank = 4\n[backend]\ndevices = "cpu"\n'
        "[eval]\nevery = 0\n[training]\nbatch_size = 4\nmax_tokens = 10\n",
    )

    def estimate(*flags):
        report = json.loads(run(["explain", str(path), "--json", *flags], capsys)[1])
        return report["estimates"]

    by_group = [estimate("--training-group-size", str(g)) for g in (8, 64, 256, 1024)]
    peaks = [e["peak_memory_gib"] for e in by_group]
    assert peaks[0] <= peaks[1] == peaks[2] == peaks[3]
    assert all("does not grow with the group size" in e["memory_note"] for e in by_group)
    # whole prompts decoded together: sampling memory grows with the group again
    fixed = [
        estimate("--training-group-size", str(g), "--backend-opt", "prompt_batch=2")
        for g in (256, 1024)
    ]
    assert fixed[0]["peak_memory_gib"] < fixed[1]["peak_memory_gib"]
    assert "does not grow" not in fixed[1]["memory_note"]


@pytest.mark.parametrize(
    "toml, key, message",
    [
        (
            '[data]\nsource = "reasoning_gym"\n\ntask = "basic_arithmetik"\n',
            "[data] task",
            "unknown reasoning-gym task 'basic_arithmetik' (did you mean 'basic_arithmetic'",
        ),
        (
            '[model]\n\n\nmodel = "./no-such-model"\n',
            "[model] model",
            "'./no-such-model' not found",
        ),
        ('[resume]\n\n\nfrom = "logs/never"\n', "[resume] from", "'logs/never' is not a directory"),
    ],
)
def test_explain_reports_what_the_run_would_refuse_at_start(
    tmp_path, capsys, monkeypatch, one_gpu, toml, key, message
):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path / "c.toml", toml + "[training]\nseed = 1\n")
    code, out, _ = run(["explain", str(path), "--json"], capsys)
    errors = json.loads(out)["errors"]
    assert code == 2
    assert any(e.startswith(f"{key} ({path}:4): ") and message in e for e in errors), errors


@pytest.mark.parametrize(
    "toml, key, message",
    [
        ('[data]\nsource = "jsonl"\npath = "nope.jsonl"\n', "[data] path", "not found"),
        (
            '[reward]\ntype = "custom"\ncustom_module = "missing_reward.py"\n',
            "[reward] custom_module",
            "not found",
        ),
    ],
)
def test_explain_reports_files_the_config_names_when_it_loads(
    tmp_path, capsys, monkeypatch, toml, key, message
):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path / "c.toml", toml + "[training]\nseed = 1\n")
    code, out, _ = run(["explain", str(path), "--json"], capsys)
    errors = json.loads(out)["errors"]
    assert code == 2
    assert any(e.startswith(f"{key} ({path}:3): ") and message in e for e in errors), errors


def test_explain_custom_reward_without_its_function(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_reward.py").write_text("def reward(response, reference):\n    return 1.0\n")
    path = _write(
        tmp_path / "c.toml",
        '[reward]\ntype = "custom"\ncustom_module = "my_reward.py"\n[training]\nseed = 1\n',
    )
    code, out, _ = run(["explain", str(path)], capsys)
    assert code == 2
    assert "ERROR: [reward] custom_function:" in out and "callables there: reward" in out


def test_explain_reports_missing_modules_of_configured_entries(
    tmp_path, capsys, monkeypatch, one_gpu
):
    from retrain.cli import startup_checks

    real = startup_checks.missing_modules
    monkeypatch.setattr(
        startup_checks,
        "missing_modules",
        lambda mods: [m for m in mods if m in ("reasoning_gym", "math_verify")] or real(mods),
    )
    path = _write(
        tmp_path / "c.toml",
        '[data]\nsource = "reasoning_gym"\ntask = "basic_arithmetic"\n[reward]\ntype = "math"\n'
        "[training]\nseed = 1\n",
    )
    code, out, _ = run(["explain", str(path), "--json"], capsys)
    errors = json.loads(out)["errors"]
    assert code == 2
    assert any(e.startswith(f"[data] source ({path}:2): reasoning_gym needs") for e in errors)
    assert any(e.startswith(f"[reward] type ({path}:5): math needs math_verify") for e in errors)
    assert all("retrain[" in e for e in errors)  # each names its install
