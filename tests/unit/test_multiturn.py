"""Multi-turn trajectories, token by token: the environment's tokens are context (mask
False, logprob 0, advantage 0) and the advantage pipeline sees the model's tokens only.

The tokenizer is the tests' character-level one (tests/tiny_model.py: one token per
character, `<|im_start|>` / `<|im_end|>` special), so every expected id list is worked
out by hand from the chat template
`<|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_model import build_tokenizer  # noqa: E402

from retrain.errors import DataError  # noqa: E402
from retrain.multiturn import (  # noqa: E402
    ChatTokens,
    MalformedMessages,
    Reply,
    Trajectory,
    check_messages,
)
from retrain.rollout import build_datums, scatter_model_tokens, token_groups  # noqa: E402
from retrain.types import Datum, Example, GroupRollout, Sample  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(tok, text: str) -> list[int]:
    """Character ids of plain text (no special tokens in it)."""
    return [tok.convert_tokens_to_ids(c) for c in text]


def test_env_delta_after_an_eos_ended_turn(tok):
    chat = ChatTokens(tok)
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    history = [{"role": "user", "content": "Guess"}]
    prompt = [
        start,
        *ids(tok, "user\nGuess"),
        end,
        *ids(tok, "\n"),
        start,
        *ids(tok, "assistant\n"),
    ]
    assert chat.encode(chat.render(history, generation_prompt=True)) == prompt
    model = [*ids(tok, "[3]"), end]  # the model's turn, ended by its end-of-turn token
    delta = chat.env_delta(
        prompt,
        model,
        history + [{"role": "assistant", "content": "[3]"}],
        [{"role": "user", "content": "higher"}],
    )
    # the template's newline after the turn, the user's message, the next generation prompt
    assert delta == [
        *ids(tok, "\n"),
        start,
        *ids(tok, "user\nhigher"),
        end,
        *ids(tok, "\n"),
        start,
        *ids(tok, "assistant\n"),
    ]


def answered_no(tok, sampled: str, content: str) -> list[int]:
    """env_delta after a model turn that sampled `sampled` (rendered as `content`) to the
    question "Q", when the user answers "no"."""
    chat = ChatTokens(tok)
    history = [{"role": "user", "content": "Q"}]
    prompt = chat.encode(chat.render(history, generation_prompt=True))
    turn = [{"role": "assistant", "content": content}]
    return chat.env_delta(
        prompt, ids(tok, sampled), history + turn, [{"role": "user", "content": "no"}]
    )


def closed_then_no(tok) -> list[int]:
    """What follows a model turn without its end-of-turn token when the user answers
    "no": the end-of-turn token, the template's newline, the message, the next prompt."""
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    return [end, *ids(tok, "\n"), start, *ids(tok, "user\nno"), end, *ids(tok, "\n")] + [
        start,
        *ids(tok, "assistant\n"),
    ]


def test_env_delta_closes_a_turn_cut_by_length(tok):
    # no end-of-turn token: max_tokens cut it
    assert answered_no(tok, "abc", "abc") == closed_then_no(tok)


def test_env_delta_of_a_turn_that_does_not_render_back_keeps_the_templates_text(tok):
    """The model's text is not what the template renders (its reply is stripped of the
    trailing space it sampled): the turn is closed with the end-of-turn token and the
    newline the template writes after it, as the rendered conversation has it."""
    assert answered_no(tok, "ab ", "ab") == closed_then_no(tok)


REWRITING_TEMPLATE = (
    # drops the content of every assistant turn but the last (as reasoning templates do)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}-{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = build_tokenizer()
    tok.chat_template = REWRITING_TEMPLATE
    chat = ChatTokens(tok)
    history = [{"role": "user", "content": "Q"}]
    prompt = chat.encode(chat.render(history, generation_prompt=True))
    with pytest.raises(DataError, match="prefix-consistent"):
        chat.env_delta(
            prompt,
            ids(tok, "xyz"),
            history + [{"role": "assistant", "content": "xyz"}],
            [{"role": "user", "content": "no"}],
        )


def test_no_chat_template_is_refused():
    tok = build_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="chat template"):
        ChatTokens(tok)


def test_trajectory_mask_logprobs_and_transcript_by_hand():
    t = Trajectory(Example("q", ""), 0, [1, 2])
    t.add_model_turn(Sample([10, 11, 2], [-0.5, -0.25, -0.125], "eos"), Reply("ab"))
    t.add_env_tokens([5, 6, 7, 8], [{"role": "user", "content": "higher"}])
    t.add_model_turn(Sample([12, 13], [-1.0, -2.0], "length"), Reply("cd"))
    s = t.sample(with_entropies=False)
    assert s.token_ids.tolist() == [10, 11, 2, 5, 6, 7, 8, 12, 13]
    assert s.loss_mask.tolist() == [True, True, True, False, False, False, False, True, True]
    assert s.logprobs.tolist() == [-0.5, -0.25, -0.125, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0]
    assert s.stop_reason == "length" and t.turns == 2
    assert [(m["role"], m["content"], m["turn"]) for m in t.transcript] == [
        ("assistant", "ab", 1),
        ("user", "higher", 1),
        ("assistant", "cd", 2),
    ]
    t.error = "timeout"  # a failed conversation is never trained on
    assert not t.sample(with_entropies=False).loss_mask.any()


def test_pipeline_sees_model_tokens_and_datums_get_zeros_at_env_tokens():
    mask = np.array([True, True, False, False, True])
    s1 = Sample([3, 4, 90, 91, 5], [-0.1, -0.2, 0.0, 0.0, -0.3], "eos", np.arange(5.0), mask)
    s2 = Sample([7, 8], [-1.0, -2.0], "eos", np.array([0.5, 0.25]))
    g = GroupRollout(
        Example("q", ""), [1], [s1, s2], ["a", "b"], [1.0, 0.0], [None, None], [True, False]
    )
    (tg,) = token_groups([g], [None], with_entropies=True)
    assert [x.tolist() for x in tg.logprobs_G_T] == [[-0.1, -0.2, -0.3], [-1.0, -2.0]]
    assert [x.tolist() for x in tg.entropies_G_T] == [[0.0, 1.0, 4.0], [0.5, 0.25]]
    adv = [np.array([1.0, 2.0, 3.0]), np.array([-1.0, -1.0])]
    d1, d2 = build_datums([g], [adv])
    assert d1.advantages.tolist() == [1.0, 2.0, 0.0, 0.0, 3.0]
    assert d1.loss_mask.tolist() == mask.tolist() and d1.num_trained_tokens == 3
    assert d2.loss_mask is None and d2.num_trained_tokens == 2
    assert d2.trained_mask.tolist() == [True, True]


def _group(rewards, failed):
    """A group of one-token completions, `failed` conversations with their mask cleared."""
    samples = [Sample([5], [-0.5], "eos", np.array([0.3]), np.array([not f])) for f in failed]
    n = len(rewards)
    correct = [r > 0.5 for r in rewards]
    return GroupRollout(
        Example("q", ""), [1], samples, ["a"] * n, rewards, [None] * n, correct, failed=failed
    )


@pytest.mark.parametrize(("advantage", "transform"), [("grpo", "none"), ("maxrl", "gtpo")])
def test_a_failed_conversation_is_in_no_groups_baseline(advantage, transform):
    """A conversation the environment failed scores 0 and gives no datum; its 0 also
    stays out of its group's statistics. Three conversations scoring 1.0 beside a failed
    one once made an update of +0.25 (GRPO) each; now the group is all correct and
    skipped. A group with a failed member gets the advantages its scored members get
    alone; a group whose every conversation failed is skipped as "all_failed"."""
    from retrain.advantages import AdvantagePipeline
    from retrain.rollout import pipeline_advantages

    pipeline = AdvantagePipeline(advantage_mode=advantage, transform_mode=transform)
    all_ok = _group([1.0, 1.0, 1.0, 0.0], [False, False, False, True])
    mixed = _group([1.0, 0.0, 1.0, 0.0], [False, False, False, True])
    dead = _group([0.0, 0.0], [True, True])
    groups = [all_ok, mixed, dead]
    adv = pipeline_advantages(pipeline, groups, [[np.zeros(1, bool)] * len(g) for g in groups])
    assert adv.skipped == ["all_correct", None, "all_failed"]
    assert adv.advantages[0] is None and adv.advantages[2] is None
    alone = _group([1.0, 0.0, 1.0], [False, False, False])  # the reference: no failure
    (want,) = pipeline_advantages(pipeline, [alone], [[np.zeros(1, bool)] * 3]).advantages
    got = adv.advantages[1]
    assert [x.tolist() for x in got[:3]] == [x.tolist() for x in want] and got[3].size == 0
    assert got[0][0] > 0 > got[1][0]
    assert len(build_datums(groups, adv.advantages)) == 3  # the mixed group's scored three


def test_planning_masks_cover_model_tokens_only():
    from retrain.advantages import make_detector
    from retrain.rollout import VocabTable, planning_masks

    tok = build_tokenizer()
    vocab = VocabTable(tok)
    text_ids = lambda s: [tok.convert_tokens_to_ids(c) for c in s]  # noqa: E731
    env = text_ids(" let me think ")
    model = text_ids("ok")
    s = Sample(
        model + env + model,
        [0.0] * (2 * len(model) + len(env)),
        "eos",
        loss_mask=[True] * 2 + [False] * len(env) + [True] * 2,
    )
    (plan,) = planning_masks(make_detector("regex"), vocab, [s])
    assert plan.shape == (4,)  # one entry per model token, none from the env's words
    assert not plan.any()


def test_a_trajectory_without_model_tokens_gives_no_datum():
    s = Sample([1, 2], [0.0, 0.0], "eos", loss_mask=[False, False])
    g = GroupRollout(Example("q", ""), [1], [s], ["x"], [0.0], [None], [False])
    assert build_datums([g], [[np.zeros(0)]]) == []


def test_mask_shapes_are_checked():
    with pytest.raises(ValueError, match="loss mask"):
        Sample([1, 2], [0.0, 0.0], "eos", loss_mask=[True])
    with pytest.raises(ValueError, match="loss mask"):
        Datum([1], [1, 2], [0.0, 0.0], [0.0, 0.0], loss_mask=[True, False, True])
    assert scatter_model_tokens(np.array([1.0, 2.0]), None).tolist() == [1.0, 2.0]


def test_check_messages():
    assert check_messages([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) == [
        {"role": "user", "content": "hi"}
    ]
    for bad in ([], "hello", [{"speaker": "env", "text": 42}], [{"role": "user", "content": 3}]):
        with pytest.raises(MalformedMessages):
            check_messages(bad)


# A Llama-3-style tool template (the whole reply is the call) over the tests' tokenizer,
# whose stop token <|im_end|> is none of Llama's own end tokens the parser knows.
LLAMA_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    '{% endfor %}{% if tools %}<|python_tag|> "parameters": dictionary{% endif %}'
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_tool_reply_is_parsed_without_its_stop_token():
    """The sampled stop token would otherwise end the call's JSON ("{...}<|im_end|>"), and
    a Llama-3 reply with text after its calls is plain text, not a call."""
    from retrain.data.prompts import PromptRenderer
    from retrain.multiturn import MultiTurnRollout

    tok = build_tokenizer(LLAMA_TOOLS)
    rollout = MultiTurnRollout(None, None, PromptRenderer(tok), correct_above=0.5)
    assert rollout.tool_format.name == "llama3"
    t = Trajectory(Example("q", "a"), 0, [], tools=[{"name": "add"}])
    call = '{"name": "add", "parameters": {"a": 0, "b": 3}}'
    body = ids(tok, call)
    for stop in ([tok.eos_token_id], []):
        ids_ = body + stop
        reply = rollout._reply(Sample(ids_, [-0.5] * len(ids_), "eos"), t)
        assert [(c.name, c.arguments) for c in reply.tool_calls] == [("add", {"a": 0, "b": 3})]
        assert reply.text == "" and reply.malformed_calls == 0
    # the stop token is taken off the end only: one inside the reply leaves it plain text
    text = body + [tok.eos_token_id] + ids(tok, " and more")
    reply = rollout._reply(Sample(text, [-0.5] * len(text), "length"), t)
    assert reply.tool_calls == [] and reply.text == call + " and more"
