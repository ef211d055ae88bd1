"""Scoring classic verifiers environments (verifiers 0.3.x) as verifiers itself does:
reward functions get every dataset column by name and verifiers' message objects, a
reward function that raises is a reward error (verifiers' Rubric would score it 0 and
go on), the rubric's cleanup runs after scoring, and a conversation that ends on its own
on the last allowed turn is not counted as cut by max_turns.

verifiers 0.4 (the project's) has no classic classes, so each test runs its body under
the classic interpreter (tests/unit/classic_verifiers.py). That one has no torch: the
model's turns are scripted token ids.
"""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import classic_verifiers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOL_ENVS = Path(__file__).resolve().parents[1] / "fixtures" / "tool_envs"

SINGLE_TURN = textwrap.dedent(
    """
    import verifiers as vf
    from datasets import Dataset

    CLEANED = []  # one entry per state the rubric's cleanup saw


    class CleaningRubric(vf.Rubric):
        @vf.cleanup
        async def release(self, state):
            CLEANED.append(state["answer"])


    def load_environment():
        ds = Dataset.from_list(
            [
                {"question": "What is 2+2?", "answer": "4", "difficulty": "easy"},
                {"question": "What is 3+3?", "answer": "6", "difficulty": "hard"},
            ]
        )

        # verifiers 0.3 hands reward functions message objects (`m.content`), and
        # every column of the row by name (`question`, the custom `difficulty`)
        def said_it(completion, answer):
            return 1.0 if answer in completion[-1].content else 0.0

        def asked_by_user(prompt):
            return 1.0 if prompt[-1].role == "user" else 0.0

        def reads_question(question, answer):
            return 1.0 if question.endswith(f"{int(answer) // 2}?") else 0.0

        def reads_column(difficulty):
            return 1.0 if difficulty in ("easy", "hard") else 0.0

        def crashes(completion):
            if "CRASH" in completion[-1].content:
                raise RuntimeError("the scorer fell over")
            return 0.0

        rubric = CleaningRubric(
            funcs=[said_it, asked_by_user, reads_question, reads_column, crashes],
            weights=[1.0, 2.0, 4.0, 8.0, 1.0],
        )
        return vf.SingleTurnEnv(dataset=ds, system_prompt="Be brief.", rubric=rubric)
    """
)


def _single_turn(tmp_path):
    from builders import data_source

    name = f"classic_st_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(SINGLE_TURN)
    src = data_source(
        "math",
        environment={"provider": "verifiers", "id": name},
        search_paths=[str(tmp_path)],
        shuffle=False,
    )
    return src, sys.modules[name]


def test_single_turn_reward_functions_get_every_column_and_message_objects(tmp_path):
    test = "test_single_turn_reward_functions_get_every_column"
    if not classic_verifiers.runs_here(__file__, test, "SingleTurnEnv", "Rubric"):
        return  # it ran, and passed, under the classic interpreter
    src, _ = _single_turn(tmp_path)
    out = src.reward.score_batch(
        ["It is 4.", "It is 5.", "It is 6."], src.examples[:1] * 2 + src.examples[1:]
    )
    # said_it (1) + asked_by_user (2) + reads_question (4) + reads_column (8)
    assert out.rewards == [15.0, 14.0, 15.0]
    assert out.errors == 0
    src.close()


def test_a_reward_function_that_raises_is_a_reward_error(tmp_path):
    test = "test_a_reward_function_that_raises_is_a_reward_error"
    if not classic_verifiers.runs_here(__file__, test, "SingleTurnEnv", "Rubric"):
        return  # it ran, and passed, under the classic interpreter
    src, _ = _single_turn(tmp_path)
    batch = src.examples[:1] * 2 + src.examples[1:]
    out = src.reward.score_batch(["It is 4.", "CRASH", "It is 6."], batch)
    # the crash fails its example's group (both completions); the other group scores
    assert out.rewards == [0.0, 0.0, 15.0]
    assert out.errors == 2
    src.close()


def test_the_rubric_cleanup_runs_after_scoring(tmp_path):
    test = "test_the_rubric_cleanup_runs_after_scoring"
    if not classic_verifiers.runs_here(__file__, test, "SingleTurnEnv", "Rubric"):
        return  # it ran, and passed, under the classic interpreter
    src, module = _single_turn(tmp_path)
    src.reward.score_batch(
        ["It is 4.", "It is 4.", "It is 6."], src.examples[:1] * 2 + src.examples[1:]
    )
    assert sorted(module.CLEANED) == ["4", "4", "6"]
    src.close()


MULTI_TURN = textwrap.dedent(
    """
    import verifiers as vf
    from datasets import Dataset

    CLEANED = []


    class CleaningRubric(vf.Rubric):
        @vf.cleanup
        async def release(self, state):
            CLEANED.append(len(state["trajectory"]))


    class EchoLevelEnv(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            # env code reads the row's own columns from state["task"], as in verifiers
            return [vf.UserMessage(content=f"level {state['task'].get('level', 'MISSING')}")]


    def load_environment(crash: bool = False):
        ds = Dataset.from_list([{"question": "Talk to me.", "answer": "x", "level": "hard"}])

        def level_ok(level):
            return 1.0 if level == "hard" else 0.0

        def crashes(completion):
            if crash:
                raise RuntimeError("the scorer fell over")
            return 0.0

        def cut_short(state):  # a turn stopped at max_tokens makes the state truncated
            return 1.0 if state["is_truncated"] else 0.0

        rubric = CleaningRubric(funcs=[level_ok, crashes, cut_short], weights=[1.0, 1.0, 10.0])
        return EchoLevelEnv(dataset=ds, rubric=rubric, max_turns=2)
    """
)


class ScriptedSampler:
    """Replies with `texts[k]` on its k-th call (the last one from then on), as token ids
    of the tests' character tokenizer, ended by the end-of-turn token."""

    def __init__(self, tok, texts, stop="eos"):
        self.tok, self.texts, self.calls, self.stop = tok, texts, 0, stop

    def sample(self, prompts, n, params):
        from retrain.types import Sample

        text = self.texts[min(self.calls, len(self.texts) - 1)]
        self.calls += 1
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tok.eos_token_id] if self.stop == "eos" else ids  # else: max_tokens
        return [[Sample(ids, [-0.5] * len(ids), self.stop)] for _ in prompts]


def _multi_turn(tmp_path, env_id, args, texts, template=None, search_path=None, stop="eos"):
    from builders import data_source
    from tiny_model import build_tokenizer

    from retrain.build import build_rollout
    from retrain.config import config_from_dict
    from retrain.data.prompts import PromptRenderer
    from retrain.logs.timer import PhaseTimer
    from retrain.types import SamplingParams

    src = data_source(
        "math",
        environment={"provider": "verifiers", "id": env_id, "args": args},
        search_paths=[str(search_path or tmp_path)],
        shuffle=False,
    )
    tok = build_tokenizer(template) if template else build_tokenizer()
    sampler = ScriptedSampler(tok, texts, stop)
    rollout = build_rollout(config_from_dict({}), src, sampler, src.reward, PromptRenderer(tok))
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=0)
    groups, counters = rollout(src.examples, 2, params, PhaseTimer())
    src.close()
    return groups, counters


def test_multi_turn_env_and_rubric_see_the_whole_row_and_cleanup_runs(tmp_path):
    test = "test_multi_turn_env_and_rubric_see_the_whole_row"
    if not classic_verifiers.runs_here(__file__, test, "MultiTurnEnv", "Rubric"):
        return  # it ran, and passed, under the classic interpreter
    name = f"classic_mt_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(MULTI_TURN)
    groups, counters = _multi_turn(tmp_path, name, {}, ["hi"])
    assert groups[0].rewards == [1.0, 1.0] and counters["reward_errors"] == 0
    said = [m["content"] for m in groups[0].transcripts[0] if m["role"] == "user"]
    assert said == ["level hard"]
    # two turns each, cut by max_turns = 2 (the environment never ends it)
    assert counters["truncated_max_turns_rate"] == 1.0
    assert sys.modules[name].CLEANED == [2, 2]
    # turns that stop at max_tokens reach the environment as verifiers reports them
    groups, _ = _multi_turn(tmp_path, name, {}, ["hi"], stop="length")
    assert groups[0].rewards == [11.0, 11.0]


def test_multi_turn_reward_function_that_raises_is_a_reward_error(tmp_path):
    test = "test_multi_turn_reward_function_that_raises"
    if not classic_verifiers.runs_here(__file__, test, "MultiTurnEnv", "Rubric"):
        return  # it ran, and passed, under the classic interpreter
    name = f"classic_mt_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(MULTI_TURN)
    groups, counters = _multi_turn(tmp_path, name, {"crash": True}, ["hi"])
    assert groups[0].rewards == [0.0, 0.0] and groups[0].failed == [True, True]
    assert counters["reward_errors"] == 2 and counters["env_errors"] == 0


def test_a_tool_env_answering_on_its_last_turn_is_not_truncated(tmp_path):
    test = "test_a_tool_env_answering_on_its_last_turn"
    if not classic_verifiers.runs_here(__file__, test, "ToolEnv"):
        return  # it ran, and passed, under the classic interpreter
    from tiny_model import TOOL_CHAT_TEMPLATE

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 0, "b": 3}}\n</tool_call>'
    args = {"log": str(tmp_path / "calls.jsonl"), "n": 1}
    # max_turns = 2: a call, then the answer; both `max_turns_reached` and the ToolEnv's
    # `no_tools_called` fire, and verifiers records the first by name
    groups, counters = _multi_turn(
        tmp_path, "add_tool", args, [call, "It is 3."], TOOL_CHAT_TEMPLATE, TOOL_ENVS
    )
    assert groups[0].rewards == [1.0, 1.0] and counters["turns_max"] == 2
    assert counters["truncated_max_turns_rate"] == 0.0
    # still calling tools when the turns run out: cut
    groups, counters = _multi_turn(
        tmp_path, "add_tool", args, [call], TOOL_CHAT_TEMPLATE, TOOL_ENVS
    )
    assert counters["truncated_max_turns_rate"] == 1.0
