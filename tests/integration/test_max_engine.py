"""The max engine against a real Modular MAX server on CPU (opt-in: `-m max`).

`max serve` (modular 26.7.0) serves SmolLM2-135M-Instruct in float32 on 127.0.0.1. The test
samples through retrain's `max` engine (token-id prompts, `n`, `seed`, logprobs,
`return_token_ids`) and checks the returned ids and logprobs against the trainer's own
(HF fp32) logprobs of the same tokens at the same temperature. MAX serves LoRA on GPUs only,
so on a CPU retrain must refuse to *train* against it before step 0 (the adapter could not
follow the optimizer): `explain` fails naming `[inference] engine` and why.

    scripts/max_server/setup_venv.sh        # ~/.cache/retrain/servers/max-venv (2 GB)
    .venv/bin/python -m pytest -m max tests/integration/test_max_engine.py -s

RETRAIN_MAX_URL points the test at a running server instead of starting one (the first
start compiles for ~2 min).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_server import CACHE, MODEL_DIR, served

pytestmark = [pytest.mark.max, pytest.mark.timeout(1800)]

VENV = Path(os.environ.get("MAX_VENV", CACHE / "servers" / "max-venv"))
# MAX 26.7 returns logprobs at temperature 1 whatever the sampling temperature (measured:
# 1e-4 from HF at T = 1, up to 1.3 off at T = 0.7), so it is sampled at T = 1 and retrain
# refuses T != 1 on it.
TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if os.environ.get("RETRAIN_MAX_URL"):
        yield os.environ["RETRAIN_MAX_URL"].rstrip("/")
        return
    if not (VENV / "bin" / "max").exists():
        pytest.skip(f"no MAX venv at {VENV}. Build it with: scripts/max_server/setup_venv.sh")
    if not (MODEL_DIR / "config.json").exists():
        pytest.skip(f"no SmolLM2 safetensors copy at {MODEL_DIR}: run the quickstart once")
    yield from served(
        "max", "MAX", tmp_path_factory.mktemp("max"), venv=VENV, model=MODEL_DIR, timeout=1200
    )


def _prompts(tok) -> list[list[int]]:
    prompts = []
    for q in ("Calculate 3 + 4.", "Calculate 8 + 5."):
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def _check_against_trainer(engine, tok, label: str) -> None:
    """Sample 2 x 4 through `engine`; the ids and logprobs must match HF fp32's."""
    import torch
    from transformers import AutoModelForCausalLM

    from retrain.types import SamplingParams

    engine.connect(needs_lora=False)  # sampling only: no LoRA on a CPU
    prompts = _prompts(tok)
    params = SamplingParams(max_tokens=16, temperature=TEMPERATURE, seed=3)
    start = time.perf_counter()
    groups = engine.sample(prompts, 4, params)
    seconds = time.perf_counter() - start
    assert [len(g) for g in groups] == [4, 4]
    assert engine.metrics()["engine_token_prompt_fallbacks"] == 0  # token-id prompts taken
    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    worst, tokens = 0.0, 0
    for prompt, group in zip(prompts, groups, strict=True):
        for sample in group:
            assert len(sample) > 0 and (sample.logprobs <= 1e-6).all()
            ids = torch.tensor([prompt + sample.token_ids.tolist()])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
            hf = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
            worst = max(worst, float((hf - torch.from_numpy(sample.logprobs)).abs().max()))
            tokens += len(sample)
    print(
        f"{label}: {tokens} tokens in {seconds:.1f}s; logprobs vs HF at T={TEMPERATURE}: {worst:.2e}"
    )
    assert worst < 2e-3
    assert engine.raw_logprobs  # found at connect: the logprobs ignore the temperature
    with pytest.raises(Exception, match=r"temperature = 1.0"):
        engine.sample(prompts, 2, SamplingParams(max_tokens=4, temperature=0.7, seed=1))


def test_max_samples_token_ids_and_logprobs_that_match_the_trainer(server):
    from transformers import AutoTokenizer

    from retrain.engines.http import HTTPEngine
    from retrain.settings import EngineSettings

    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    engine = HTTPEngine(EngineSettings("max", url=server), tok, {tok.eos_token_id})
    _check_against_trainer(engine, tok, "MAX")
    engine.close()


def _max_venv_entry() -> str:
    """The `max` console script of the MAX venv, as retrain finds it in its own env."""
    if not (VENV / "bin" / "python").exists():
        pytest.skip(f"no MAX venv at {VENV}. Build it with: scripts/max_server/setup_venv.sh")
    code = (
        "from importlib.metadata import entry_points as e; "
        "print(next(iter(e(group='console_scripts', name='max'))).value)"
    )
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_retrain_starts_samples_from_and_stops_its_own_max_serve():
    """No url: retrain runs `max serve` from the environment that has the `max` package
    (here the MAX venv's interpreter), on a free port, and stops it on close."""
    from transformers import AutoTokenizer

    from retrain.engines.http import HTTPEngine
    from retrain.engines.max_serve import ManagedMax
    from retrain.settings import EngineSettings

    python = str(VENV / "bin" / "python")
    managed = ManagedMax(str(MODEL_DIR), python=python, entry=_max_venv_entry(), ready_s=1500)
    start = time.time()
    try:
        url = managed.start(gpu=False)
        print(f"managed max serve ready on {url} in {time.time() - start:.0f}s")
        pid = managed.process.pid
        tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
        engine = HTTPEngine(EngineSettings("max", url=url), tok, {tok.eos_token_id})
        engine.owned = managed
        _check_against_trainer(engine, tok, "MAX (started by retrain)")
        engine.close()  # stops the server it owns
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert managed.process is None
    finally:
        managed.close()


def _overlay_python(tmp: Path) -> str:
    """A throwaway venv that sees the project's packages and then the MAX venv's: retrain
    with `max` importable, without installing modular into the project venv."""
    import sysconfig

    _max_venv_entry()  # skips without the MAX venv
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True)
    ours = sysconfig.get_paths()["purelib"]
    theirs = next((VENV / "lib").glob("python3*/site-packages"))
    site = next((tmp / "lib").glob("python3*/site-packages"))
    (site / "zz_overlay.pth").write_text(
        f"import site; site.addsitedir({ours!r}); site.addsitedir({str(theirs)!r})\n"
    )
    return str(tmp / "bin" / "python")


def test_max_without_url_is_explained_before_any_model_load(tmp_path):
    """No url and no `max` package: the fix names pip install modular and the url
    alternative. With `max` installed on this CPU: refused (MAX LoRA is GPU-only)."""
    config = tmp_path / "max.toml"
    config.write_text('[inference]\nengine = "max"\n')
    cmd = ["-m", "retrain.cli.main", "explain", str(config)]
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=300)
    if out.returncode == 2 and "pip install modular" not in out.stdout:
        pytest.skip("the max package is installed in the project venv")
    assert out.returncode == 2 and "ERROR: [inference] engine" in out.stdout
    assert 'url = "http://127.0.0.1:8000"' in out.stdout
    python = _overlay_python(tmp_path / "overlay")
    out = subprocess.run([python, *cmd], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "ERROR: [inference] engine" in out.stdout, out.stdout
    assert "GPUs only" in out.stdout and "stale" in out.stdout


def test_training_against_max_on_a_cpu_is_refused_before_step_0(server, tmp_path):
    from retrain.engines.dialects import DIALECTS
    from retrain.engines.probe import server_problems

    problems, model = server_problems(DIALECTS["max"], server, needs_lora=True, timeout=30)
    assert model and problems and problems[0][0] == "[inference] engine"
    assert "GPUs only" in problems[0][1] and "stale" in problems[0][1]
    config = tmp_path / "max.toml"
    config.write_text(f'[inference]\nengine = "max"\nurl = "{server}"\n')
    out = subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", "explain", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "ERROR: [inference] engine" in out.stdout
