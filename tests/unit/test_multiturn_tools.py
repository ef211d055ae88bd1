"""Tool calls through a real verifiers `ToolEnv` (the classic API, verifiers 0.3.x;
tests/fixtures/tool_envs/add_tool.py): the tools' schemas go into the prompt through the
chat template, the model's `<tool_call>` text is parsed into tool calls the environment
runs, and the results come back as `tool` messages rendered by the template, as
environment tokens (out of the loss).

verifiers 0.4 (the project's) has no ToolEnv, so this runs under the classic interpreter
(tests/unit/classic_verifiers.py). That one has no torch: the model's turns are scripted
token ids (the real-model run is tests/integration/test_tool_env_run.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import classic_verifiers
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOL_ENVS = Path(__file__).resolve().parents[1] / "fixtures" / "tool_envs"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 0, "b": 3}}\n</tool_call>'


class ScriptedSampler:
    """Turn 1: a call of `add(0, 3)` in the Hermes format; turn 2: "It is 3."."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def sample(self, prompts, n, params):
        from retrain.types import Sample

        self.calls.append([list(p) for p in prompts])
        text = CALL if len(self.calls) == 1 else "It is 3."
        ids = [*self.tok(text, add_special_tokens=False)["input_ids"], self.tok.eos_token_id]
        return [[Sample(ids, [-0.5] * len(ids), "eos")] for _ in prompts]


def test_a_tool_env_gets_tool_calls_and_its_results_are_masked(tmp_path):
    if not classic_verifiers.runs_here(__file__, "test_a_tool_env_gets", "ToolEnv"):
        return  # it ran, and passed, under the classic interpreter
    from tiny_model import TOOL_CHAT_TEMPLATE, build_tokenizer

    from retrain.build import build_rollout
    from retrain.config import config_from_dict
    from retrain.config.schema import DataConfig, EnvironmentConfig
    from retrain.data import build_data_source
    from retrain.data.env_probe import describe
    from retrain.data.prompts import PromptRenderer
    from retrain.logs.timer import PhaseTimer
    from retrain.types import SamplingParams

    log = tmp_path / "calls.jsonl"
    src = build_data_source(
        DataConfig(source="math", shuffle=False),
        environment=EnvironmentConfig(
            provider="verifiers", id="add_tool", args={"log": str(log), "n": 1}
        ),
        max_examples=0,
        shuffle_seed=None,
        search_paths=[str(TOOL_ENVS)],
    )
    assert describe(src).needs_tools and "needs tools" in describe(src).summary()
    tok = build_tokenizer(TOOL_CHAT_TEMPLATE)
    sampler = ScriptedSampler(tok)
    rollout = build_rollout(config_from_dict({}), src, sampler, src.reward, PromptRenderer(tok))
    groups, counters = rollout(
        src.examples, 2, SamplingParams(max_tokens=64, temperature=1.0, seed=0), PhaseTimer()
    )
    # the tool ran once per conversation, with the parsed arguments
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [{"a": 0, "b": 3}] * 2 and counters["tool_calls"] == 2
    assert groups[0].rewards == [1.0, 1.0] and counters["env_errors"] == 0
    first, second = (tok.decode(c[0]) for c in sampler.calls)
    assert '"name": "add"' in first and "# Tools" in first  # the schema, via the template
    assert second.endswith(
        "<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    s = groups[0].samples[0]
    env_text = tok.decode(s.token_ids[~s.loss_mask])
    assert env_text == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(s.token_ids[s.loss_mask]) == CALL + "<|im_end|>It is 3.<|im_end|>"
    assert np.all(s.logprobs[~s.loss_mask] == 0.0)
    roles = [m["role"] for m in groups[0].transcripts[0]]
    assert roles == ["assistant", "tool", "assistant"]
    call_turn, result = groups[0].transcripts[0][:2]
    assert call_turn["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 0, "b": 3}}
    assert result["content"] == "3" and result["tool_call_id"] == call_turn["tool_calls"][0]["id"]
    src.close()
