"""Config schema, validation, CLI overrides and the TOML round trip."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retrain.cli.main import main
from retrain.config import (
    TABLES,
    Config,
    ConfigError,
    all_fields,
    config_from_dict,
    flag_table,
    load_config,
    load_dotenv,
)

REPO = Path(__file__).resolve().parents[2]

# (TOML text, text the error must contain). Each is one bad input.
BAD_INPUTS = [
    ("[trainig]\nlr = 1e-4\n", "[trainig]"),
    ("[trainig]\nlr = 1e-4\n", "did you mean 'training'"),
    ("[training]\nlearning_rate = 1e-4\n", "[training] learning_rate"),
    ("[training]\nlearning_rate = 1e-4\n", "Fix: lr = 0.0001 under [training]"),
    ("[training]\nnum_generations = 8\n", "Fix: group_size = 8 under [training]"),
    ("[lora]\nr = 16\n", "Fix: lora_rank = 16 under [model]"),
    ("[training]\ngrop_size = 4\n", "did you mean 'group_size'"),
    ("[training]\nlr = -1e-4\n", "[training] lr"),
    ("[training]\nlr = 0\n", "[training] lr"),
    ('[training]\nlr = "fast"\n', "[training] lr"),
    ("[training]\nbatch_size = 0\n", "[training] batch_size"),
    ("[training]\nbatch_size = 2.5\n", "[training] batch_size"),
    ("[training]\ngroup_size = 1\n", "[training] group_size"),
    ("[training]\ntemperature = 0\n", "[training] temperature"),
    ("[training]\nmax_tokens = 0\n", "[training] max_tokens"),
    ("[training]\nsave_every = -1\n", "[training] save_every"),
    ("[training]\nmax_steps = 0\n", "[training] max_steps"),
    ("[training]\nseed = -2\n", "[training] seed"),
    ("[training]\nseed = true\n", "[training] seed"),
    ("[training]\nmax_examples = -5\n", "[training] max_examples"),
    ('[data]\nshuffle = "false"\n', "[data] shuffle"),
    ('[inference]\nprefix_caching = "false"\n', "[inference] prefix_caching"),
    ("[backpressure]\nenabled = 1\n", "[backpressure] enabled"),
    ('[backend]\ndevices = "gpu0"\n', "[backend] devices"),
    ('[backend]\ndevices = "gpu:0,gpu:0"\n', "[backend] devices"),
    ('[backend]\ndevices = "gpu:0,tpu:1"\n', "[backend] devices"),
    ('[backend]\ndevices = ""\n', "[backend] devices"),
    ('[backend]\nbackend = "tinkr"\n', "[backend] backend"),
    ('[algorithm]\nadvantage_mode = "grpp"\n', "[algorithm] advantage_mode"),
    ('[algorithm]\ntransform_mode = "sepa"\n', "[algorithm] transform_mode"),
    ('[algorithm]\nuncertainty_kind = "varentropy"\n', "[algorithm] uncertainty_kind"),
    ('[inference]\nengine = "vllmm"\n', "[inference] engine"),
    ('[inference]\ndtype = "fp16"\n', "[inference] dtype"),
    ('[reward]\ntype = "exact"\n', "[reward] type"),
    ('[sepa]\nschedule = "cosine"\n', "[sepa] schedule"),
    ('[planning]\ndetector = "neural"\n', "[planning] detector"),
    ("[sepa]\ncorrect_rate_gate = 1.5\n", "[sepa] correct_rate_gate"),
    ("[squeeze]\nmin_variance_retention = 0\n", "[squeeze] min_variance_retention"),
    ("[backpressure]\nthrottle_margin = 1.2\n", "[backpressure] throttle_margin"),
    ("[backpressure]\nmin_batch_size = 8\nmax_batch_size = 4\n", "[backpressure] min_batch_size"),
    ("[lora]\ndropout = 1.5\n", "[lora] dropout"),
    ("[gtpo]\nbeta = -0.1\n", "[gtpo] beta"),
    ("[hicra]\nalpha = -1\n", "[hicra] alpha"),
    ("[hicra]\nalpha = 1.5\n", "[hicra] alpha"),
    ("[hicra]\nalpha = 1.5\n", "so above 1 a negative advantage would flip sign"),
    ("[sepa]\nema_decay = 1.0\n", "bad.toml:2): must be < 1, got 1.0"),
    ("[backpressure]\nema_decay = 1.0\n", "[backpressure] ema_decay"),
    ("[model]\nlora_rank = 0\n", "[model] lora_rank"),
    ("[optimizer]\neps = 0\n", "[optimizer] eps"),
    ('[reward]\ntype = "custom"\n', "[reward] custom_module"),
    ('[data]\nsource = "jsonl"\n', "[data] path"),
    ('[data]\nsource = "reasoning_gym"\n', "[data] task"),
    ('[environment]\nprovider = "verifiers"\n', "[environment] id"),
    ('[environment]\nprovider = "gym"\n', "[environment] provider"),
    ('[environment]\nargs = "{not json"\n', "[environment] args"),
    ('[inference]\nengine = "openai"\n', "[inference] url"),
    # keys nothing would read: a forgotten provider, a URL for the in-process engine
    (
        '[environment]\nid = "primeintellect/gsm8k"\nmax_turns = 4\n',
        "bad.toml:2): is set but [environment] provider is empty: id, "
        "max_turns would be ignored and the run would train on [data] source = 'math'",
    ),
    (
        '[inference]\nurl = "http://127.0.0.1:8000"\n',
        "bad.toml:2): is set, but engine 'pytorch' samples in-process",
    ),
    (
        '[environment]\nprovider = "verifiers"\nid = "x"\nmax_turns = 0\n',
        "bad.toml:4): must be -1 (the environment's cap) or >= 1, got 0",
    ),
    (
        "[logging]\nstrategic_grams = '[\"let me'\n",
        "bad.toml:2): looks like a JSON array but does not parse",
    ),
    # the spec's engine-tuning values that no engine applies in this version
    (
        '[inference]\nattention_kernel = "flash"\n',
        "valid: 'default'. Fix: the spec's flash, triton, tk and cutlass are not applied",
    ),
    ('[inference]\nkv_cache_dtype = "fp8"\n', "bad.toml:2)"),
    ('[inference]\ndtype = "fp8"\n', "Fix: the spec's fp8 and fp4 are not applied"),
    (
        '[inference]\nengine = "vllm"\ndtype = "bf16"\n',
        "bad.toml:3): is not applied by engine 'vllm'",
    ),
    (
        '[inference]\nengine = "vllm"\nprefix_caching = false\n',
        "bad.toml:3): is not applied by engine 'vllm'",
    ),
    ("[campaign]\nseeds = [1, 1]\n", "[campaign] seeds"),
    ('[campaign]\nseeds = ["a"]\n', "[campaign] seeds"),
    (
        '[[campaign.conditions]]\nadvantage_mode = "grpo"\ntransform_mode = "gtpx"\n',
        "[campaign] conditions",
    ),
    ('[[data.few_shot]]\nuser = "hi"\n', "[data] few_shot"),
    ("[squeeze]\ntarget_ranks = [0, 4]\n", "[squeeze] target_ranks"),
    (
        '[squeeze]\ndevice = "gpu"\n',
        "bad.toml:2): malformed device 'gpu': use e.g. 'cpu' or 'gpu:0'",
    ),
    # prime_rl takes one advantage per completion: the default gtpo_sepa is refused
    ('[backend]\nbackend = "prime_rl"\n', "[algorithm] transform_mode"),
    (
        '[backend]\nbackend = "tinker"\n[algorithm]\nuncertainty_kind = "shannon_entropy"\n',
        "[algorithm] uncertainty_kind",
    ),
    (
        '[backend]\noptions = { micro_batch_tokens = "big" }\n',
        "[backend.options] micro_batch_tokens (",
    ),
    (
        "[backend]\noptions = { micro_batch_size = 4 }\n",
        "bad.toml:2): unknown option 'micro_batch_size'",
    ),
    # a key of another place: the option of a table, and a table's key among the options
    (
        '[inference]\ndecode = "graphs"\n',
        "(it is an option of the local backend: did you mean [backend.options] decode?)",
    ),
    (
        "[backend]\nmicro_batch_tokens = 4096\n",
        "did you mean [backend.options] micro_batch_tokens?",
    ),
    (
        "[backend.options]\nprefix_caching = false\n",
        "(it belongs to [inference]: did you mean [inference] prefix_caching?)",
    ),
    (
        '[backend.options]\ndtype = "bf16"\ncheckpointing = "maybe"\n',
        "bad.toml:3): expects bool or \"auto\", got 'maybe'",
    ),
    ("lr = 1e-4\n", "did you mean [training] lr"),
    ("[training]\ntemperature = inf\n", "[training] temperature"),
    ('[logging]\nlog_dir = ""\n', "[logging] log_dir"),
]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("text", "expected"), BAD_INPUTS, ids=[f"bad{i}" for i in range(len(BAD_INPUTS))]
)
def test_bad_input_exits_2_naming_the_key(tmp_path, capsys, text, expected):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    code, _, err = run_cli(["explain", str(path)], capsys)
    assert code == 2
    assert expected in err
    assert "Traceback" not in err
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert isinstance(info.value, ValueError)
    assert any(expected in p for p in info.value.problems) or expected in str(info.value)


def test_at_least_thirty_bad_inputs():
    assert len({text for text, _ in BAD_INPUTS}) >= 30


def test_errors_name_file_and_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nmodel = "x"\n\n[training]\nbatch_size = 4\nlr = -1\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}:6" in str(info.value)


def test_all_problems_reported_together(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[training]\nlr = -1\nbatch_size = 0\n[trainig]\n[sepa]\nschedule = "x"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 4


def test_unknown_key_in_wrong_table_points_to_owner():
    with pytest.raises(ConfigError, match=r"did you mean \[training\] lr"):
        config_from_dict({"model": {"lr": 1e-4}})


def test_missing_file_suggests_init(tmp_path, capsys):
    code, _, err = run_cli(["explain", str(tmp_path / "nope.toml")], capsys)
    assert code == 2
    assert "nope.toml" in err and "retrain init" in err


def test_toml_syntax_error_names_line(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nlr = = 3\n")
    code, _, err = run_cli(["explain", str(path)], capsys)
    assert code == 2 and "line 2" in err


def test_defaults_match_spec():
    c = Config()
    assert (c.backend.backend, c.backend.devices, c.backend.adapter_path) == (
        "local",
        "gpu:0",
        "/tmp/retrain_adapter",
    )
    assert (c.model.model, c.model.base_url, c.model.lora_rank) == (
        "Qwen/Qwen3-4B-Instruct-2507",
        "",
        32,
    )
    assert (c.algorithm.advantage_mode, c.algorithm.transform_mode) == ("maxrl", "gtpo_sepa")
    t = c.training
    assert (t.seed, t.max_steps, t.batch_size, t.group_size, t.max_tokens) == (-1, 500, 8, 16, 2048)
    assert (t.temperature, t.lr, t.weight_decay, t.max_examples, t.save_every) == (
        0.7,
        4e-5,
        0.0,
        0,
        20,
    )
    assert (c.optimizer.beta1, c.optimizer.beta2, c.optimizer.eps) == (0.9, 0.95, 1e-8)
    assert (c.lora.alpha, c.lora.dropout) == (0, 0.0)
    assert c.data.source == "math"
    e = c.environment
    assert (e.provider, e.id, e.args, e.max_turns, e.auto_install) == ("", "", {}, -1, False)
    assert (c.planning.detector, c.planning.model, c.planning.threshold) == (
        "regex",
        "all-MiniLM-L6-v2",
        0.02,
    )
    assert (c.gtpo.beta, c.hicra.alpha) == (0.1, 0.2)
    s = c.sepa
    assert (s.steps, s.schedule, s.delay_steps, s.correct_rate_gate) == (500, "linear", 50, 0.1)
    i = c.inference
    assert (i.engine, i.url, i.attention_kernel, i.dtype, i.kv_cache_dtype, i.prefix_caching) == (
        "pytorch",
        "",
        "default",
        "auto",
        "auto",
        True,
    )
    r = c.reward
    assert (r.type, r.judge_model, r.custom_module, r.custom_function) == ("match", "", "", "score")
    b = c.backpressure
    assert (b.enabled, b.warmup_steps, b.ema_decay, b.throttle_margin, b.increase_margin) == (
        False,
        10,
        0.9,
        0.85,
        0.5,
    )
    assert (b.min_batch_size, b.max_batch_size, b.peak_gflops, b.peak_bw_gb_s) == (1, 64, 0.0, 0.0)
    assert c.resume.from_ == ""
    lg = c.logging
    assert (
        lg.log_dir,
        lg.wandb_project,
        lg.wandb_run_name,
        lg.wandb_entity,
        lg.wandb_group,
        lg.wandb_tags,
        lg.strategic_grams,
    ) == ("logs/train", "", "", "", "", "", "")
    assert c.backend.max_concurrent == 4
    assert c.plugins.search_paths == ["plugins"] and c.plugins.strict is True
    assert c.squeeze is None and c.campaign is None
    sq = config_from_dict({"squeeze": {}}).squeeze
    assert (
        sq.min_variance_retention,
        sq.adapter_path,
        sq.source_rank,
        sq.target_ranks,
        sq.output_path,
        sq.compress_to,
        sq.device,
    ) == (0.95, "", 0, [], "", 0, "cpu")
    camp = config_from_dict({"campaign": {}}).campaign
    assert camp.seeds == [42, 101, 202, 303, 404, 505, 606, 707] and camp.max_steps == 500
    assert (camp.parallel, camp.max_workers, camp.stagger_seconds) == (False, 0, 0.0)


def test_tables_cover_config():
    assert [f.name for f in dataclasses.fields(Config)] == list(TABLES)


def test_precedence_defaults_toml_cli(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nlr = 1e-3\nbatch_size = 2\n")
    c = load_config(path)
    assert c.training.lr == 1e-3 and c.training.batch_size == 2 and c.training.group_size == 16
    c = load_config(path, ["--lr", "5e-5", "--group-size=4"])
    assert c.training.lr == 5e-5 and c.training.batch_size == 2 and c.training.group_size == 4


def test_every_field_has_a_flag_and_flags_parse(tmp_path):
    flags = flag_table()
    covered = {(s.table, s.key) for s in flags.values()}
    assert covered == {(s.table, s.key) for s in all_fields()}
    for spec in all_fields():
        assert f"--{spec.table}-{spec.key}".replace("_", "-") in flags


def test_spec_short_flags(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("")
    c = load_config(
        path,
        [
            "--advantage-mode",
            "grpo",
            "--transform-mode",
            "none",
            "--seed",
            "7",
            "--lr",
            "1e-4",
            "--batch-size",
            "3",
            "--group-size",
            "5",
            "--max-steps",
            "9",
            "--lora-rank",
            "8",
            "--log-dir",
            "x",
            "--wandb-project",
            "p",
            "--wandb-entity",
            "e",
            "--wandb-group",
            "g",
            "--wandb-tags",
            "a,b",
            "--wandb-run-name",
            "n",
            "--resume",
            "logs/old",
        ],
    )
    assert c.condition == "grpo+none" and c.training.seed == 7 and c.training.max_steps == 9
    assert c.model.lora_rank == 8 and c.logging.log_dir == "x" and c.logging.wandb_tags == "a,b"
    assert c.resume.from_ == "logs/old"


def test_cli_values_are_type_checked(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("")
    with pytest.raises(ConfigError, match=r"--batch-size"):
        load_config(path, ["--batch-size", "many"])
    with pytest.raises(ConfigError, match=r"\[data\] shuffle"):
        load_config(path, ["--data-shuffle", "maybe"])
    c = load_config(
        path,
        ["--data-shuffle", "false", "--campaign-seeds", "1,2", "--data-args", "{min_terms = 3}"],
    )
    assert (
        c.data.shuffle is False and c.campaign.seeds == [1, 2] and c.data.args == {"min_terms": 3}
    )


def test_unknown_flag_did_you_mean(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text("")
    code, _, err = run_cli([str(path), "--learning-rat", "1"], capsys)
    assert code == 2 and "--learning-rat" in err
    code, _, err = run_cli([str(path), "--bach-size", "1"], capsys)
    assert code == 2 and "--batch-size" in err


def test_dotenv_never_overrides(tmp_path, monkeypatch):
    env = tmp_path / ".env"
    env.write_text(
        "# comment\nRETRAIN_T_A=1\nexport RETRAIN_T_B='two words'\nRETRAIN_T_C=keep\nnot a line\n"
    )
    monkeypatch.setenv("RETRAIN_T_C", "original")
    monkeypatch.delenv("RETRAIN_T_A", raising=False)
    monkeypatch.delenv("RETRAIN_T_B", raising=False)
    loaded = load_dotenv(env)
    assert sorted(loaded) == ["RETRAIN_T_A", "RETRAIN_T_B"]
    assert os.environ["RETRAIN_T_A"] == "1" and os.environ["RETRAIN_T_B"] == "two words"
    assert os.environ["RETRAIN_T_C"] == "original"


def test_environment_args_json_string():
    c = config_from_dict(
        {"environment": {"provider": "verifiers", "id": "x/y", "args": '{"split": "train"}'}}
    )
    assert c.environment.args == {"split": "train"}


def test_dotted_plugin_paths_accepted_syntactically():
    c = config_from_dict(
        {"algorithm": {"advantage_mode": "my_pkg.adv.fn", "transform_mode": "my_pkg.tr:make"}}
    )
    assert c.condition == "my_pkg.adv.fn+my_pkg.tr:make"


def test_explain_and_help_do_not_import_torch(tmp_path):
    code = (
        "import sys; from retrain.cli.main import main; "
        "main(['--help']); main(['--version']); main(['init', '--list']); "
        f"main(['explain', {str(REPO / 'retrain/config/templates/quickstart.toml')!r}]); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr


def test_config_error_exit_code_and_no_traceback_in_subprocess(tmp_path):
    path = tmp_path / "retrain.toml"
    path.write_text('[training]\nlr = "x"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", "explain"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "[training] lr" in proc.stderr and "Traceback" not in proc.stderr
