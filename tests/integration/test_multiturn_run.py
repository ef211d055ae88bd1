"""Multi-turn verifiers environments, end to end on the tiny random model (CPU).

The environments are real verifiers (0.4, v1 API) packages under
tests/fixtures/multiturn_envs, written with verifiers' own Taskset/Task/Env classes:
`guess_number` (the environment answers "higher"/"lower", so the model's second turn is
sampled on the environment's reply) and `flaky_env` (raises, hangs, malformed replies).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from retrain.build import build_backend, build_rollout
from retrain.config import config_from_dict
from retrain.config.schema import DataConfig, EnvironmentConfig
from retrain.data import build_data_source
from retrain.data.prompts import PromptRenderer
from retrain.logs.timer import PhaseTimer
from retrain.trainer import train
from retrain.types import Datum, SamplingParams, TrainHyper

pytest.importorskip("verifiers.v1")

ENVS = Path(__file__).resolve().parents[1] / "fixtures" / "multiturn_envs"


def env_raw(tiny_raw: dict, env_id: str, args: dict, **environment) -> dict:
    raw = copy.deepcopy(tiny_raw)
    raw.pop("data")
    raw.pop("reward")
    raw["environment"] = {"provider": "verifiers", "id": env_id, "args": args, **environment}
    raw["plugins"]["search_paths"].append(str(ENVS))
    raw["training"].update(max_tokens=5, group_size=2, batch_size=2)
    return raw


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dir):
    """A tokenizer and a local backend on the tiny model, shared by the rollout tests."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("mt")
    raw = {
        "backend": {
            "backend": "local",
            "devices": "cpu",
            "adapter_path": str(tmp / "a"),
            "options": {"threads": 1, "dtype": "fp32"},  # as tiny_raw: machine-independent
        },
        "model": {"model": str(tiny_model_dir), "lora_rank": 4},
        "training": {"max_tokens": 5, "temperature": 1.0},
    }
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = build_backend(config_from_dict(raw), tok, say=lambda s: None)
    yield tok, backend
    backend.close()


class RecordingBackend:
    """The real backend, with every sampler call's prompts kept (a spy, not a stand-in)."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def sample(self, prompts, n, params):
        self.calls.append([list(p) for p in prompts])
        return self.backend.sample(prompts, n, params)


def rollout_for(built, env_id, args, max_turns=-1, turn_timeout_s=60.0):
    tok, backend = built
    src = build_data_source(
        DataConfig(source="math", shuffle=False),
        environment=EnvironmentConfig(
            provider="verifiers", id=env_id, args=args, max_turns=max_turns
        ),
        max_examples=0,
        shuffle_seed=None,
        search_paths=[str(ENVS)],
    )
    raw = {"environment": {"turn_timeout_s": turn_timeout_s}}
    spy = RecordingBackend(backend)
    rollout = build_rollout(config_from_dict(raw), src, spy, src.reward, PromptRenderer(tok))
    return src, spy, rollout


def test_turn_two_is_sampled_on_the_environments_reply(built):
    tok, _ = built
    src, spy, rollout = rollout_for(built, "guess-number", {"n": 2}, max_turns=3)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=1)
    groups, counters = rollout(src.examples[:2], 2, params, PhaseTimer())
    # one batched sampler call per round, across the conversations still running (a
    # random model's reply sometimes holds the secret digit, which ends its game)
    turns = [max(m["turn"] for m in t) for g in groups for t in g.transcripts]
    assert len(spy.calls) == counters["turns_max"] == 3
    assert [len(c) for c in spy.calls] == [sum(k > r for k in turns) for r in range(3)]
    assert turns[0] == 3  # with this seed the first conversation plays every turn
    assert counters["turns_mean"] == pytest.approx(np.mean(turns))
    g = groups[0]
    s = g.samples[0]
    first, second = spy.calls[0][0], spy.calls[1][0]
    assert first == g.prompt_ids
    n1 = int(np.argmin(s.loss_mask)) if not s.loss_mask.all() else len(s)
    # turn 2's prompt = the prompt + the model's turn 1 + the environment's reply
    assert second[: len(first) + n1] == first + s.token_ids[:n1].tolist()
    env_text = tok.decode(second[len(first) + n1 :])
    reply = g.transcripts[0][1]
    assert reply["role"] == "user" and reply["content"] in env_text
    assert (
        "higher" in reply["content"] or "lower" in reply["content"] or "number" in reply["content"]
    )
    # the whole trajectory is the last prompt's continuation: mask True exactly at the
    # tokens the sampler returned
    last = spy.calls[2][0]
    assert last == g.prompt_ids + s.token_ids[: len(last) - len(g.prompt_ids)].tolist()
    model_positions = np.flatnonzero(s.loss_mask)
    assert len(model_positions) == int(s.loss_mask.sum()) > 0
    assert np.all(s.logprobs[~s.loss_mask] == 0.0) and np.all(s.logprobs[s.loss_mask] < 0)
    assert counters["truncated_max_turns_rate"] > 0
    assert [m["turn"] for m in g.transcripts[0] if m["role"] == "assistant"] == [1, 2, 3]
    assert counters["env_errors"] == counters["env_timeouts"] == 0
    src.close()


def test_failures_are_isolated_counted_and_logged_once(built, caplog):
    src, spy, rollout = rollout_for(
        built,
        "flaky-env",
        {"modes": ["ok", "raise", "hang", "malformed"], "n": 4},
        turn_timeout_s=1.0,
    )
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=2)
    with caplog.at_level(logging.WARNING, logger="retrain.multiturn"):
        groups, counters = rollout(src.examples, 2, params, PhaseTimer())
    assert [g.example.meta["task"].data.mode for g in groups] == [
        "ok",
        "raise",
        "hang",
        "malformed",
    ]
    assert counters["env_errors"] == 2 and counters["env_timeouts"] == 2
    assert counters["env_malformed"] == 2
    ok, *bad = groups
    assert ok.rewards == [1.0, 1.0] and all(s.loss_mask.any() for s in ok.samples)
    for g in bad:  # reward 0, never trained on, the failure in the transcript
        assert g.rewards == [0.0, 0.0]
        assert not any(s.loss_mask.any() for s in g.samples)
        assert all(t[-1]["role"] == "error" for t in g.transcripts)
    tracebacks = [r for r in caplog.records if "Traceback" in r.getMessage()]
    assert len(tracebacks) == 1
    src.close()


def _update(backend, datums):
    """Loss, gradient norm and parameter update of one step, undone afterwards."""
    backend.optimizer.zero_grad()
    snapshot = [p.detach().clone() for p in backend.params]
    hyper = TrainHyper(lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8)
    result = backend.train_step(datums, hyper)
    moved = [p.detach() - s for p, s in zip(backend.params, snapshot, strict=True)]
    with torch.no_grad():
        for p, s in zip(backend.params, snapshot, strict=True):
            p.copy_(s)
    backend.optimizer.state.clear()
    return result, moved


def test_environment_tokens_get_no_gradient(built):
    _, backend = built
    prompt = [5, 6, 7, 8]
    ids = [20, 21, 22, 2, 30, 31, 32, 33, 23, 24]
    mask = [True] * 4 + [False] * 4 + [True] * 2
    model_adv = np.array([0.5, -0.25, 1.0, 0.75, 0.0, 0.0, 0.0, 0.0, -0.5, 0.25])
    lp = np.where(mask, -1.5, 0.0)

    def datum(env_adv, env_lp):
        adv = np.where(mask, model_adv, env_adv)
        return Datum(prompt, ids, np.where(mask, lp, env_lp), adv, loss_mask=mask)

    base, upd_base = _update(backend, [datum(0.0, 0.0)])
    other, upd_other = _update(backend, [datum(7.0, -3.0)])
    assert base.num_tokens == other.num_tokens == 6  # only the model's tokens are trained
    assert base.loss == pytest.approx(other.loss, abs=1e-7)
    assert base.grad_norm == pytest.approx(other.grad_norm, rel=1e-6)
    for a, b in zip(upd_base, upd_other, strict=True):
        assert torch.allclose(a, b, atol=1e-8)
    # the same change at a MODEL token does move the loss (the check above can fail)
    moved = Datum(prompt, ids, lp, np.where(mask, model_adv + 1.0, 0.0), loss_mask=mask)
    changed, _ = _update(backend, [moved])
    assert changed.loss != pytest.approx(base.loss, abs=1e-4)


def test_a_multi_turn_run_trains_and_logs_transcripts(tiny_raw):
    raw = env_raw(tiny_raw, "guess-number", {"n": 4}, max_turns=3)
    raw["training"].update(max_steps=2, save_every=0)
    assert train(config_from_dict(raw)) == 0
    logs = Path(raw["logging"]["log_dir"])
    rows = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["turns_max"] <= 3 and row["turns_mean"] >= 1
        assert row["time_environment_s"] >= 0 and row["time_sampling_s"] > 0
        assert {"truncated_max_turns_rate", "env_errors", "env_timeouts"} <= set(row)
    gens = [
        json.loads(x) for x in (logs / "emergence" / "generations.jsonl").read_text().splitlines()
    ]
    for g in gens:
        roles = [m["role"] for m in g["transcript"]]
        assert g["turns"] == roles.count("assistant") >= 1 and roles[0] == "assistant"
    # most games are lost by a random model: several turns, the environment's replies between
    many = [g for g in gens if g["turns"] >= 2]
    assert many and all("user" in [m["role"] for m in g["transcript"]] for g in many)


def test_the_multiturn_template_builds_a_turn_environment(tmp_path):
    from retrain.cli.init import templates
    from retrain.config import load_config

    cfg = tmp_path / "retrain.toml"
    cfg.write_text(templates()["multiturn"])
    config = load_config(cfg)
    src = build_data_source(
        config.data,
        environment=config.environment,
        max_examples=0,
        shuffle_seed=None,
        search_paths=[],
    )
    assert src.api == "v1" and len(src) == 64
    assert src.turn_environment.max_turns == config.environment.max_turns == 4
    src.close()


def test_an_environment_that_speaks_first_opens_the_conversation(built):
    """A v1 Env whose tasks have no prompt says its opening at turn 0: the first
    sampled prompt is that message rendered, and the conversation trains."""
    tok, _ = built
    src, spy, rollout = rollout_for(built, "opening_env", {"n": 2})
    assert src.examples[0].prompt == ""
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    groups, counters = rollout(src.examples[:2], 2, params, PhaseTimer())
    assert counters["env_errors"] == counters["env_malformed"] == 0
    first = spy.calls[0][0]
    assert "Welcome, traveller. Name a colour." in tok.decode(first)
    g = groups[0]
    assert g.prompt_ids == first  # the group shares the opening as its prompt
    assert g.transcripts[0][0] == {
        "role": "user",
        "content": "Welcome, traveller. Name a colour.",
        "turn": 0,
    }
    assert all(s.loss_mask.any() for s in g.samples)
    src.close()
