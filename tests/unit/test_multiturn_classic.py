"""The classic verifiers API (0.1 - 0.3.x): a real `vf.MultiTurnEnv` driven turn by turn
by retrain's multi-turn rollout (the environment's own rollout loop, env_response and
stop conditions run unchanged; retrain is its client).

verifiers 0.4 (the project's) no longer ships the classic classes, so this runs where
verifiers 0.3 is importable, or re-runs itself under an interpreter that has it
(tests/unit/classic_verifiers.py; `scripts/verifiers03_venv.sh` builds one, and CI does).

That environment has no torch, so the model's turns come from a scripted sampler that
returns fixed replies as token ids (the part under test is the classic environment path:
the turn loop, the token masks and the rubric's scores; the real-model path is tested with
the v1 API in tests/integration/test_multiturn_run.py).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import classic_verifiers
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLASSIC_ENV = textwrap.dedent(
    """
    import re

    import verifiers as vf
    from datasets import Dataset


    def _text(m):
        return m["content"] if isinstance(m, dict) else m.content


    class GuessEnv(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            found = re.findall(r"\\[(\\d+)\\]", _text(messages[-1]) or "")
            secret = int(state["answer"])
            if not found:
                return [{"role": "user", "content": "Reply like [3]."}]
            guess = int(found[0])
            if guess == secret:
                state["final_env_response"] = [{"role": "user", "content": "Correct!"}]
                return state["final_env_response"]
            side = "higher" if secret > guess else "lower"
            return [{"role": "user", "content": f"{guess} is wrong: {side}."}]


    def load_environment(n: int = 2, max_turns: int = 5):
        ds = Dataset.from_list(
            [{"question": "Guess my number from 1 to 9, like [3].", "answer": str(2 + i)}
             for i in range(n)]
        )

        def solved(completion, answer, **kwargs):
            said = [_text(m) for m in completion if getattr(m, "role", None) == "assistant"
                    or (isinstance(m, dict) and m.get("role") == "assistant")]
            return 1.0 if any(f"[{answer}]" in (s or "") for s in said) else 0.0

        return GuessEnv(dataset=ds, rubric=vf.Rubric(funcs=[solved]), max_turns=max_turns)
    """
)


CLASSES = ("MultiTurnEnv", "Rubric")  # the classic API's classes this test needs


class ScriptedSampler:
    """Replies "[k]" on its k-th call (k = 1, 2, ...) to every prompt, as token ids of
    the tests' character tokenizer, ended by the end-of-turn token; keeps the prompts."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def sample(self, prompts, n, params):
        from retrain.types import Sample

        self.calls.append([list(p) for p in prompts])
        ids = self.tok(f"[{len(self.calls)}]", add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tok.eos_token_id]
        return [[Sample(ids, [-0.5] * len(ids), "eos")] for _ in prompts]


def test_classic_multi_turn_env(tmp_path):
    if not classic_verifiers.runs_here(__file__, "test_classic_multi_turn_env", *CLASSES):
        return  # it ran, and passed, under the classic interpreter
    from tiny_model import build_tokenizer

    from retrain.build import build_rollout
    from retrain.config import config_from_dict
    from retrain.config.schema import DataConfig, EnvironmentConfig
    from retrain.data import build_data_source
    from retrain.data.prompts import PromptRenderer
    from retrain.logs.timer import PhaseTimer
    from retrain.types import SamplingParams

    (tmp_path / "classic_guess.py").write_text(CLASSIC_ENV)
    src = build_data_source(
        DataConfig(source="math", shuffle=False),
        environment=EnvironmentConfig(provider="verifiers", id="classic-guess", args={"n": 2}),
        max_examples=0,
        shuffle_seed=None,
        search_paths=[str(tmp_path)],
    )
    assert src.api == "classic" and src.turn_environment is not None
    tok = build_tokenizer()
    sampler = ScriptedSampler(tok)
    rollout = build_rollout(config_from_dict({}), src, sampler, src.reward, PromptRenderer(tok))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    groups, counters = rollout(src.examples, 2, params, PhaseTimer())
    # secrets 2 and 3: guesses [1], [2] solve game 1 in two turns; [3] solves game 2 in three
    assert [g.rewards for g in groups] == [[1.0, 1.0], [1.0, 1.0]]
    assert [len(c) for c in sampler.calls] == [4, 4, 2]  # one batched call per round
    assert counters["turns_max"] == 3 and counters["env_errors"] == 0
    second = tok.decode(sampler.calls[1][0])
    assert "1 is wrong: higher." in second  # turn 2 was sampled on the environment's reply
    s = groups[0].samples[0]
    end = tok.eos_token_id
    # [1]<end> | \n<start>user\n1 is wrong: higher.<end>\n<start>assistant\n | [2]<end>
    text = tok.decode(s.token_ids[~s.loss_mask])
    assert text == "\n<|im_start|>user\n1 is wrong: higher.<|im_end|>\n<|im_start|>assistant\n"
    model = s.token_ids[s.loss_mask].tolist()
    assert tok.decode(model) == "[1]<|im_end|>[2]<|im_end|>" and model.count(end) == 2
    assert np.all(s.logprobs[~s.loss_mask] == 0.0)
    roles = [(m["role"], m["content"]) for m in groups[1].transcripts[0]]
    assert roles[:2] == [("assistant", "[1]"), ("user", "1 is wrong: higher.")]
    src.close()
