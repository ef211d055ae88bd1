"""A backend whose capabilities say it cannot resume (supports_checkpoint_resume = false,
which a plugin without capability hooks gets) is refused `--resume` before anything
loads, by the run's start and by `retrain explain`; a plugin that claims it but has no
load_checkpoint stops the resume with an error naming it, not an AttributeError."""

from __future__ import annotations

import pytest
from cli_run import run_retrain

from retrain.checkpoint import TrainerState, save_state
from retrain.config import config_from_dict
from retrain.errors import CheckpointError
from retrain.registry import import_object
from retrain.startup import resume_problems
from retrain.trainer import Trainer
from retrain.types import CheckpointInfo

PLUGIN = """
class Plain:  # no capability hooks: conservative defaults
    def __init__(self, config, tokenizer, say=print):
        pass


class Claims:  # says it resumes, but has no load_checkpoint
    RETRAIN_BACKEND_CAPABILITIES = {"supports_checkpoint_resume": True}

    def __init__(self, config, tokenizer, say=print):
        pass
"""


def small_state(step: int, checkpoint: CheckpointInfo) -> TrainerState:
    """A trainer state of a run of model "m", LoRA rank 4 (tests/unit/test_resume_paths.py
    too)."""
    return TrainerState(
        step=step,
        model="m",
        lora_rank=4,
        condition="grpo+none",
        batch_size=1,
        group_size=2,
        data={},
        counters={},
        sepa={},
        checkpoint=checkpoint,
    )


def a_state(log_dir, backend: str) -> None:
    save_state(log_dir, small_state(1, CheckpointInfo(backend, extra={"carried": True})))


def config(backend: str, project):
    return config_from_dict(
        {
            "backend": {"backend": backend, "devices": "cpu"},
            "model": {"model": "m", "lora_rank": 4},
            "resume": {"from": str(project / "logs")},
            "plugins": {"search_paths": [str(project)]},
        }
    )


def test_a_backend_that_cannot_resume_is_refused_naming_it(project):
    (project / "fake_backends.py").write_text(PLUGIN)
    a_state(project / "logs", "fake_backends.Plain")
    ((key, problem),) = resume_problems(config("fake_backends.Plain", project))
    assert key == "[resume] from"
    assert problem.startswith(
        "the 'fake_backends.Plain' backend cannot resume from a checkpoint: its capabilities "
        "say supports_checkpoint_resume = false (it has no capability hooks, so retrain "
        "assumes it cannot)"
    )
    assert "Fix: drop --resume / [resume] from and start a new run" in problem
    a_state(project / "logs", "fake_backends.Claims")
    assert resume_problems(config("fake_backends.Claims", project)) == []


def test_explain_refuses_the_resume(project):
    (project / "fake_backends.py").write_text(PLUGIN)
    (project / "model").mkdir()
    (project / "model" / "config.json").write_text("{}")
    (project / "c.toml").write_text(
        '[backend]\nbackend = "fake_backends.Plain"\ndevices = "cpu"\n\n'
        '[model]\nmodel = "model"\n\n[algorithm]\ntransform_mode = "none"\n\n'
        '[plugins]\nsearch_paths = ["."]\n'
    )
    a_state(project / "logs", "fake_backends.Plain")
    explained = run_retrain(["explain", "c.toml", "--resume", "logs"], project)
    assert explained.returncode == 2, explained.stdout + explained.stderr
    assert (
        "ERROR: [resume] from (from --resume): the 'fake_backends.Plain' backend cannot "
        "resume from a checkpoint"
    ) in explained.stdout


def test_a_backend_without_load_checkpoint_is_named_on_restore(project):
    (project / "fake_backends.py").write_text(PLUGIN)
    a_state(project / "logs", "fake_backends.Claims")
    cfg = config("fake_backends.Claims", project)
    trainer = Trainer(cfg)
    claims = import_object("fake_backends.Claims", [str(project)])
    trainer.parts = type("Parts", (), {"backend": claims(cfg, None)})()
    with pytest.raises(CheckpointError) as caught:
        trainer.restore(str(project / "logs"))
    assert str(caught.value).startswith(
        "[resume] from: the 'fake_backends.Claims' backend (Claims) has no load_checkpoint "
        "method, though its capabilities say supports_checkpoint_resume = true. Fix:"
    )
