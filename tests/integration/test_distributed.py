"""One run on two processes (torchrun, gloo on the CPU) against the same run on one, on
the tiny model: the same adapter and metrics, a resume on two ranks, a rank that raises,
and the config errors a world of N refuses before any model loads."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_helpers import QuietConsole

from retrain.config import config_from_dict
from retrain.config.toml_writer import config_to_toml
from retrain.logs.jsonl import read_jsonl
from retrain.trainer import train

ROOT = Path(__file__).resolve().parents[2]
# Rows that measure time, or the gather that only a run on several ranks has.
TIMED = ("time_", "step_time_s", "elapsed", "wall", "tokens_per_s", "completions_per_s", "threads")


def two_rank_raw(raw: dict, tmp_path: Path, name: str) -> dict:
    raw = copy.deepcopy(raw)
    raw["training"].update(batch_size=4, max_steps=3, save_every=2)
    raw["logging"]["log_dir"] = str(tmp_path / name / "logs")
    raw["backend"]["adapter_path"] = str(tmp_path / name / "adapter")
    raw["backend"]["options"]["collective_timeout_s"] = 60
    return raw


def torchrun(
    raw: dict, tmp_path: Path, *flags: str, nproc: int = 2, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m retrain run.toml FLAGS` as the user types it (one
    CPU thread per rank: the box has two cores)."""
    path = tmp_path / f"run-{time.monotonic_ns()}.toml"
    path.write_text(config_to_toml(config_from_dict(raw)))
    full_env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "TMPDIR": str(tmp_path),  # torch's elastic agent leaves a folder there per run
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", "retrain", str(path), *flags]
    return subprocess.run(
        cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=400
    )


def torchrun_job(raw: dict, tmp_path: Path, env: dict) -> subprocess.Popen:
    """The same command, left running in its own process group (to be killed)."""
    path = tmp_path / "job.toml"
    path.write_text(config_to_toml(config_from_dict(raw)))
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    full_env["TMPDIR"] = str(tmp_path)  # as `torchrun`'s: the killed agent's folder stays
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node=2", "-m", "retrain", str(path)]
    return subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_job(job: subprocess.Popen, config: Path) -> None:
    """SIGKILL torchrun and its ranks. The ranks run in sessions of their own (torch's
    elastic agent starts them so), so killing torchrun's group alone leaves them blocked;
    they are found by the config path on their command line."""
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    killed = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(config).encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
                killed.append(cmdline.parent)
        except (OSError, ValueError):
            pass  # gone meanwhile
    # the next run starts once they are gone (or zombies: dead, not yet reaped)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in killed):
        time.sleep(0.05)


def _alive(proc: Path) -> bool:
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def said(done: subprocess.CompletedProcess) -> str:
    """What a failed torchrun printed: the ranks' own lines come before torchrun's long
    failure report, so stderr's head matters as much as its tail."""
    err = done.stderr
    if len(err) > 8000:
        err = f"{err[:5000]}\n[...]\n{err[-3000:]}"
    return f"stdout (tail):\n{done.stdout[-3000:]}\nstderr:\n{err}"


def one_process(raw: dict) -> int:
    return train(config_from_dict(raw), console=QuietConsole())


def adapter(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def max_diff(a: Path, b: Path) -> float:
    x, y = adapter(a), adapter(b)
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def rows(log_dir: Path) -> list[dict]:
    found, _ = read_jsonl(log_dir / "metrics.jsonl")
    return [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in found]


def assert_same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], float) and isinstance(y[key], float):
                assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6, nan_ok=True), key
            else:
                assert x[key] == y[key], key


# The parity reward, plus three ways for a rank to stop mid-run, chosen by environment
# variables the test hands torchrun: return a string on rank 1 from its 9th completion on
# (step 2), block once the step-2 checkpoint is written (to be killed there), or abort the
# process as a crash in native code would.
REWARD = """
import os, time
from pathlib import Path

calls = 0


def score(response, reference):
    global calls
    calls += 1
    if os.environ.get("ABORT_RANK", "-") == os.environ.get("RANK"):
        os.abort()
    if os.environ.get("BREAK_RANK", "-") == os.environ.get("RANK") and calls > 8:
        return "rank one breaks on purpose"
    pause = os.environ.get("PAUSE_AFTER")
    if pause and Path(pause).exists():
        time.sleep(600)
    return float(sum(map(ord, response)) % 2)
"""


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir) -> tuple[dict, subprocess.CompletedProcess]:
    """A 3-step run on two ranks, batch 4 (2 prompts per rank)."""
    tmp = tmp_path_factory.mktemp("straight")
    raw = selecting(two_rank_raw(base_raw(tmp, tiny_model_dir), tmp, "double"))
    return raw, torchrun(raw, tmp)


def selecting(raw: dict) -> dict:
    """Clip-Cov cutting out a random 30% of each step's tokens (a band that holds them
    all): a selection over the whole step, from every rank's logprobs, with one draw."""
    raw["training"].update(
        policy_loss="clip_cov", clip_cov_fraction=0.3, clip_cov_lb=-1e9, clip_cov_ub=1e9
    )
    return raw


def base_raw(tmp: Path, model: Path) -> dict:
    (tmp / "parity_reward.py").write_text(REWARD)
    return {
        "backend": {
            "backend": "local",
            "devices": "cpu",
            "options": {"threads": 1, "dtype": "fp32"},
        },
        "model": {"model": str(model), "lora_rank": 4},
        "algorithm": {"advantage_mode": "reinforce_pp", "transform_mode": "gtpo_sepa"},
        "training": {
            "seed": 3,
            "batch_size": 4,
            "group_size": 4,
            "max_tokens": 6,
            "temperature": 1.0,
            "lr": 5e-3,
        },
        "data": {
            "source": "reasoning_gym",
            "task": "basic_arithmetic",
            "size": 50,
            "args": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        },
        "reward": {"type": "custom", "custom_module": str(tmp / "parity_reward.py")},
        "logging": {"group_lines": 1},
        "plugins": {"search_paths": [str(tmp)]},
    }


def test_two_ranks_train_the_adapter_one_process_trains(straight, tmp_path, tiny_model_dir):
    """reinforce_pp (batch-normalised advantages) with SEPA (pooled statistics), and
    Clip-Cov's selection over the step: the statistics and the selection span the whole
    batch on both ranks."""
    double, done = straight
    assert done.returncode == 0, said(done)
    single = selecting(two_rank_raw(base_raw(tmp_path, tiny_model_dir), tmp_path, "single"))
    assert one_process(single) == 0
    diff = max_diff(
        Path(single["backend"]["adapter_path"]) / "final",
        Path(double["backend"]["adapter_path"]) / "final",
    )
    print(f"max |adapter diff| 2 ranks vs 1: {diff:.3g}")
    assert diff < 1e-5
    a, b = rows(Path(single["logging"]["log_dir"])), rows(Path(double["logging"]["log_dir"]))
    assert_same_rows(a, b)
    # rank 0 alone wrote: one metrics row per step, rank 0's pid in run.json
    state = json.loads((Path(double["logging"]["log_dir"]) / "trainer_state.json").read_text())
    assert len(state["rng"]["ranks"]) == 2
    assert "Done: 3 steps" in done.stdout and done.stdout.count("Done: 3 steps") == 1


def test_a_two_rank_run_killed_after_a_checkpoint_resumes_on_two_ranks(straight, tmp_path):
    """Both ranks block in step 2 once the step-2 checkpoint is written; the whole job is
    killed (SIGKILL), then resumed on two ranks: the straight run's adapter and rows."""
    raw = copy.deepcopy(straight[0])
    raw["logging"]["log_dir"] = str(tmp_path / "logs")
    raw["backend"]["adapter_path"] = str(tmp_path / "adapter")
    state = tmp_path / "logs" / "trainer_state.json"
    job = torchrun_job(raw, tmp_path, env={"PAUSE_AFTER": str(state)})
    try:
        deadline = time.monotonic() + 300
        while not state.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert state.exists(), job.communicate()[1][-3000:]
    finally:
        kill_job(job, tmp_path / "job.toml")
    assert json.loads(state.read_text())["step"] == 2
    done = torchrun(raw, tmp_path, "--resume", str(tmp_path / "logs"))
    assert done.returncode == 0, said(done)
    assert "Resumed from" in done.stdout
    diff = max_diff(
        Path(straight[0]["backend"]["adapter_path"]) / "final", tmp_path / "adapter" / "final"
    )
    print(f"max |adapter diff| resumed vs straight (2 ranks): {diff:.3g}")
    assert diff == 0.0
    assert_same_rows(rows(Path(straight[0]["logging"]["log_dir"])), rows(tmp_path / "logs"))


def failing_run(raw: dict, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The straight run at batch 2 in `tmp_path`, a rank set to fail by `env`: it exits
    non-zero."""
    raw = copy.deepcopy(raw)
    raw["training"]["batch_size"] = 2
    raw["logging"]["log_dir"] = str(tmp_path / "logs")
    raw["backend"]["adapter_path"] = str(tmp_path / "adapter")
    raw["backend"]["options"]["collective_timeout_s"] = 20
    done = torchrun(raw, tmp_path, env=env)
    assert done.returncode != 0, said(done)
    return done


def test_a_rank_that_raises_stops_every_rank_with_its_message(straight, tmp_path):
    """Rank 1's reward returns a string in step 2 (a RewardError there): rank 0, waiting
    for it in the gather, stops at once with rank 1's message; both exit non-zero and the
    step-2 checkpoint stays whole."""
    done = failing_run(straight[0], tmp_path, BREAK_RANK="1")
    err = done.stderr
    assert "returned str 'rank one breaks on purpose'" in err, said(done)
    assert "rank 1 of 2 failed: custom reward" in err, said(done)  # rank 0's own error
    assert "rank      : 1 (local_rank: 1)" in err and "exitcode  : 1" in err  # torchrun's
    state = json.loads((tmp_path / "logs" / "trainer_state.json").read_text())
    assert state["step"] == 2
    assert (tmp_path / "adapter" / "checkpoint_step_2" / "adapter_model.safetensors").exists()


@pytest.mark.slow  # a long CLI-process test; a rank that raises runs by default
def test_a_rank_that_dies_in_native_code_leaves_its_python_stack(straight, tmp_path):
    """Rank 1 aborts (SIGABRT, as gloo or a CUDA library would) while scoring step 1:
    its stderr holds the Python stack it died in."""
    done = failing_run(straight[0], tmp_path, ABORT_RANK="1")
    err = done.stderr
    assert "Fatal Python error: Aborted" in err, said(done)
    assert 'parity_reward.py", line' in err and " in score" in err, said(done)
    assert "exitcode  : -6" in err  # torchrun's report of rank 1


def test_a_batch_that_does_not_divide_over_the_ranks_is_a_config_error(straight, tmp_path):
    """`retrain explain` (WORLD_SIZE from torchrun's environment, or --world-size) and the
    run's own start refuse batch_size 3 on 2 ranks (and back pressure's bounds 1 and 7):
    exit 2, the key, file:line, the fix; explain shows the ranks and each one's share."""
    raw = copy.deepcopy(straight[0])
    raw["training"]["batch_size"] = 3
    raw["backpressure"] = {"enabled": True, "min_batch_size": 1, "max_batch_size": 7}
    raw["logging"]["log_dir"] = str(tmp_path / "logs")
    path = tmp_path / "run.toml"
    path.write_text(config_to_toml(config_from_dict(raw)))
    line = next(
        i
        for i, text in enumerate(path.read_text().splitlines(), 1)
        if text.startswith("batch_size")
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "retrain"]
    explain = subprocess.run(
        [*cli, "explain", "--world-size", "2", "run.toml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert explain.returncode == 2
    assert (
        f"ERROR: [training] batch_size (run.toml:{line}): 3 prompts do not divide over 2 ranks"
        in explain.stdout
    )
    assert "Fix: batch_size = 2 or 4" in explain.stdout
    # back pressure's bounds too: each batch size it picks must divide over the ranks
    assert "[backpressure] min_batch_size (run.toml:" in explain.stdout
    assert "1 prompt does not divide over 2 ranks" in explain.stdout
    assert "Fix: min_batch_size = 2\n" in explain.stdout
    assert "Fix: max_batch_size = 6 or 8" in explain.stdout
    assert "Ranks:       2 processes (torchrun), 1.5 prompts" in explain.stdout
    start = subprocess.run(
        [*cli, "run.toml"],
        cwd=tmp_path,
        env={**env, "WORLD_SIZE": "2", "RANK": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert start.returncode == 2
    assert "the run cannot start on 2 ranks" in start.stderr
    assert "[training] batch_size: 3 prompts do not divide over 2 ranks" in start.stderr
    assert "Traceback" not in start.stderr
    assert not (tmp_path / "logs").exists()


def test_a_sharded_base_on_two_ranks_trains_the_adapter_the_all_reduce_trains(
    tmp_path, tiny_model_dir
):
    """`[backend.options] shard = true` (FSDP2: the blocks split over the ranks, gathered
    whole for sampling) against the same 2-rank run unsharded (LoRA grads all-reduced),
    both with micro-batches of at most 86 positions: the same adapter after 3 steps and
    the same rows. That budget packs step 2's groups into 4 micro-batches on one rank and
    2 on the other, so the short rank runs zero-weight padding passes; the step-2
    checkpoint is saved from the sharded model."""
    runs = {}
    for name, shard in (("ddp", False), ("fsdp", True)):
        raw = two_rank_raw(base_raw(tmp_path, tiny_model_dir), tmp_path, name)
        raw["backend"]["options"].update(shard=shard, micro_batch_tokens=86)
        runs[name] = done = torchrun(raw, tmp_path)
        assert done.returncode == 0, said(done)
    assert "transformer blocks over 2 ranks (FSDP2)" in runs["fsdp"].stdout
    diff = max_diff(tmp_path / "ddp" / "adapter" / "final", tmp_path / "fsdp" / "adapter" / "final")
    print(f"max |adapter diff| FSDP2 shard vs all-reduce (2 ranks): {diff:.3g}")
    assert diff < 1e-6
    a, b = rows(tmp_path / "ddp" / "logs"), rows(tmp_path / "fsdp" / "logs")
    assert sum(r.pop("shard_padding_passes") for r in b) > 0
    assert_same_rows(a, b)
    checkpoint = tmp_path / "fsdp" / "adapter" / "checkpoint_step_2"
    assert (checkpoint / "adapter_model.safetensors").exists()


def test_shard_alone_or_with_a_bf16_sampler_is_a_config_error(tmp_path, tiny_model_dir):
    """`shard = true` on one process (nothing to shard over) and, on 2 ranks, with a bf16
    sampler (a merged copy of weights no rank holds whole): `retrain explain` exits 2 with
    the key, its file:line and the fix."""
    raw = two_rank_raw(base_raw(tmp_path, tiny_model_dir), tmp_path, "cfg")
    del raw["backend"]["options"]

    def with_shard(raw: dict) -> str:  # [backend.options] as a table: keys get lines
        text = config_to_toml(config_from_dict(raw)).replace("options = {}\n", "", 1)
        return text + "\n[backend.options]\nthreads = 1\nshard = true\n"

    text = with_shard(raw)
    (tmp_path / "run.toml").write_text(text)
    line = text.splitlines().index("shard = true") + 1
    (tmp_path / "bf16.toml").write_text(with_shard({**raw, "inference": {"dtype": "bf16"}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def explain(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "retrain", "explain", *args]
        return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)

    alone = explain("run.toml")
    assert alone.returncode == 2
    assert (
        f"ERROR: [backend.options] shard (run.toml:{line}): true needs several ranks"
        in alone.stdout
    )
    assert "Fix: start with torchrun --nproc-per-node N, or shard = false" in alone.stdout
    two = explain("--world-size", "2", "run.toml")
    assert two.returncode == 0, two.stdout
    assert "shard = true: training holds" in two.stdout
    assert "of which the sampler's copy" not in two.stdout  # it reads the gathered blocks
    bf16 = explain("--world-size", "2", "bf16.toml")
    assert bf16.returncode == 2
    assert "[inference] dtype (bf16.toml:" in bf16.stdout
    assert 'no rank holds. Fix: dtype = "auto" (or shard = false)' in bf16.stdout
    # CUDA graphs would replay the addresses of blocks gathered anew every step
    graphs = with_shard({**raw, "backend": {**raw["backend"], "devices": "gpu:0"}})
    (tmp_path / "graphs.toml").write_text(graphs + 'decode = "graphs"\n')
    refused = explain("--world-size", "2", "graphs.toml")
    assert refused.returncode == 2
    assert "[backend.options] decode (graphs.toml:" in refused.stdout
    assert 'Fix: decode = "auto" (static there)' in refused.stdout


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (one NCCL rank per GPU)",
)
def test_two_ranks_on_two_gpus_train_what_one_gpu_trains(tiny_raw, tmp_path, tiny_model_dir):
    """The opt-in CUDA variant (`pytest -m gpu`): NCCL between two GPUs, against one GPU.
    CUDA's generator need not skip rows exactly as one draw, so completions may differ: the run
    must finish with one adapter and rows for every step, and the adapter stays near."""
    raw = two_rank_raw(base_raw(tmp_path, tiny_model_dir), tmp_path, "gpu2")
    raw["backend"]["devices"] = "gpu:0"
    done = torchrun(raw, tmp_path)
    assert done.returncode == 0, said(done)
    found = rows(Path(raw["logging"]["log_dir"]))
    assert [r["step"] for r in found] == [0, 1, 2]
    assert (Path(raw["backend"]["adapter_path"]) / "final" / "adapter_model.safetensors").exists()
