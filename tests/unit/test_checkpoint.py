"""trainer_state.json: the typed checkpoint record, old formats, and resume checks."""

from __future__ import annotations

import json

import pytest

from retrain.checkpoint import TrainerState, check_compatible, load_state, save_state
from retrain.errors import CheckpointError
from retrain.types import CheckpointInfo


def state(info: CheckpointInfo) -> TrainerState:
    return TrainerState(
        step=3,
        model="m",
        lora_rank=8,
        condition="maxrl+gtpo_sepa",
        batch_size=4,
        group_size=8,
        data={"position": 12},
        counters={"correct": 1.0},
        sepa={},
        checkpoint=info,
    )


def test_state_round_trips_with_a_typed_checkpoint(tmp_path):
    info = CheckpointInfo("tinker", "tinker://r/sampler/s3", "tinker://r/weights/s3", {"a": 1})
    save_state(tmp_path, state(info))
    back = load_state(tmp_path)
    assert back.checkpoint == info and back.step == 3


@pytest.mark.parametrize(
    "raw, expected",
    [
        (
            {"adapter": "/a/checkpoint_step_2"},
            CheckpointInfo("local", "/a/checkpoint_step_2", "/a/checkpoint_step_2"),
        ),
        (
            {
                "backend": "tinker",
                "path": "tinker://r/w",
                "sampler_path": "tinker://r/s",
                "name": "final",
            },
            CheckpointInfo("tinker", "tinker://r/s", "tinker://r/w", {"name": "final"}),
        ),
    ],
)
def test_untyped_checkpoints_of_earlier_versions_still_load(tmp_path, raw, expected):
    save_state(tmp_path, state(CheckpointInfo("x")))
    data = json.loads((tmp_path / "trainer_state.json").read_text())
    data["checkpoint"] = raw
    (tmp_path / "trainer_state.json").write_text(json.dumps(data))
    assert load_state(tmp_path).checkpoint == expected


def test_resume_into_another_backend_is_refused_naming_both():
    saved = state(CheckpointInfo("tinker", state="tinker://r/weights/s3"))
    with pytest.raises(CheckpointError) as err:
        check_compatible(saved, "local", "m", 8, "logs/run")
    message = str(err.value)
    assert "'tinker' backend" in message and "'local'" in message and "[backend] backend" in message
    check_compatible(saved, "tinker", "m", 8, "logs/run")  # the same backend resumes


def test_resume_names_model_and_rank_differences():
    saved = state(CheckpointInfo("local", "/a", "/a"))
    with pytest.raises(CheckpointError, match=r"\[model\] lora_rank: checkpoint 8, config 16"):
        check_compatible(saved, "local", "m", 16, "logs/run")
