"""verifiers environments as data + reward, built locally (the hub cannot be reached).

- v1 API: a real verifiers (0.4.x) Taskset/Task package written to a temp folder.
- classic API (verifiers <= 0.3.x): a package exposing `load_environment()` with the
  classic Environment shape (dataset rows with a chat `prompt` and `answer`, an async
  rubric). verifiers 0.4 (the dev environment's) no longer ships the classic classes, so
  the test against a real `vf.SingleTurnEnv` runs under an interpreter that has them
  (tests/unit/classic_verifiers.py: `scripts/verifiers03_venv.sh` builds it; CI does).
"""

from __future__ import annotations

import os
import stat
import sys
import textwrap
import uuid
from pathlib import Path

import classic_verifiers
import pytest
from builders import data_source

from retrain.data.prompts import PromptRenderer
from retrain.data.verifiers import module_name
from retrain.errors import DataError


@pytest.fixture
def env_dir(tmp_path):
    """A folder for environment packages, removed from sys.path/sys.modules afterwards."""
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        mod = sys.modules.get(name)
        if str(tmp_path) in str(getattr(mod, "__file__", "") or ""):
            del sys.modules[name]
    while str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def _unique(prefix):
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def test_module_name():
    assert module_name("primeintellect/gsm8k") == "gsm8k"
    assert module_name("owner/my-env@0.2.1") == "my_env"
    assert module_name("wordle") == "wordle"


# -- v1 -------------------------------------------------------------------------------

V1_ENV = textwrap.dedent(
    """
    import verifiers.v1 as vf


    class SumData(vf.TaskData):
        answer: str = ""


    class SumTask(vf.Task[SumData]):
        @vf.reward
        async def correct(self, task, trace) -> float:
            got = vf.extract_boxed_answer(trace.last_reply)
            return 1.0 if got == task.answer else 0.0

        @vf.reward(weight=0.5)
        async def mentions_plus(self, trace) -> float:
            # reads the trace's messages, not just the reply
            user = [m for m in trace.messages if m.role == "user"][-1]
            return 1.0 if "+" in user.content and "+" in trace.last_reply else 0.0


    class SumConfig(vf.TasksetConfig):
        n: int = 4
        offset: int = 0


    class SumTaskset(vf.Taskset[SumTask, SumConfig]):
        def load(self):
            for i in range(self.config.n):
                a = i + self.config.offset
                yield SumTask(
                    SumData(prompt=f"What is {a} + 1?", answer=str(a + 1),
                            system_prompt="Box the answer."),
                    self.config.task,
                )


    class EmptyTaskset(vf.Taskset[SumTask, SumConfig]):
        def load(self):
            return iter(())


    class EndlessTaskset(vf.Taskset[SumTask, SumConfig]):
        INFINITE = True

        def load(self):
            i = 0
            while True:
                yield SumTask(SumData(prompt=f"What is {i} + 1?", answer=str(i + 1)),
                              self.config.task)
                i += 1


    __all__ = ["SumTaskset"]
    """
)


@pytest.fixture
def v1_env(env_dir):
    pytest.importorskip("verifiers.v1")
    name = _unique("sum_env")
    (env_dir / f"{name}.py").write_text(V1_ENV)
    return env_dir, name


def test_v1_taskset_gives_examples_and_reward(v1_env):
    folder, name = v1_env
    src = data_source(
        "math",
        environment={
            "provider": "verifiers",
            "id": f"someone/{name.replace('_', '-')}",
            "args": {"n": 5, "offset": 10},
        },
        search_paths=[str(folder)],
        shuffle=False,
    )
    assert src.api == "v1" and src.reward_hint == "verifiers"
    assert len(src) == 5
    ex = src.examples[0]
    assert (ex.prompt, ex.reference) == ("What is 10 + 1?", "11")
    assert ex.meta["system_prompt"] == "Box the answer."

    batch = src.next_batch(3)
    out = src.reward.score_batch(["10 + 1 = \\boxed{11}", "\\boxed{11}", "no idea"], batch)
    # correct (1.0) + 0.5 * mentions_plus; the second is wrong for example 2 (answer 12)
    assert out.rewards == [1.5, 0.0, 0.0]
    assert out.answers == ["11", "11", None]
    assert out.errors == 0
    # the taskset scores its own format: no \boxed{} no-answer rate is reported for it
    assert "no_answer_rate" not in out.counters()
    src.close()


def test_v1_args_are_validated(v1_env):
    folder, name = v1_env
    with pytest.raises(DataError, match=r"\[environment\] args"):
        data_source(
            "math",
            environment={"provider": "verifiers", "id": name, "args": {"n": "many"}},
            search_paths=[str(folder)],
        )


def test_v1_args_as_json_string(v1_env):
    folder, name = v1_env
    src = data_source(
        "math",
        environment={"provider": "verifiers", "id": name, "args": '{"n": 2}'},
        search_paths=[str(folder)],
    )
    assert len(src) == 2


def test_v1_empty_taskset_is_eval_only(env_dir):
    pytest.importorskip("verifiers.v1")
    name = _unique("empty_env")
    (env_dir / f"{name}.py").write_text(V1_ENV.replace('["SumTaskset"]', '["EmptyTaskset"]'))
    with pytest.raises(DataError, match="evaluation-only.*yields no tasks"):
        data_source(
            "math",
            environment={"provider": "verifiers", "id": name},
            search_paths=[str(env_dir)],
        )


def _check_infinite_taskset_is_cut_at_data_size(env_dir):
    name = _unique("endless_env")
    (env_dir / f"{name}.py").write_text(V1_ENV.replace('["SumTaskset"]', '["EndlessTaskset"]'))
    src = data_source(
        "math",
        environment={"provider": "verifiers", "id": name},
        search_paths=[str(env_dir)],
        size=3,
        shuffle=False,
    )
    assert [e.reference for e in src.examples] == ["1", "2", "3"]


def test_v1_single_turn_tasksets_on_verifiers_0_3(v1_env, env_dir):
    """verifiers 0.3.1 ships the v1 API too, but says `INFINITE`/`head` where 0.4 says
    `bounded`/`take`: single-turn tasksets, infinite ones too, load and score on it."""
    test = "test_v1_single_turn_tasksets_on_verifiers_0_3"
    if not classic_verifiers.runs_here(__file__, test, "SingleTurnEnv"):
        return  # it ran, and passed, under verifiers 0.3
    test_v1_taskset_gives_examples_and_reward(v1_env)
    _check_infinite_taskset_is_cut_at_data_size(env_dir)


def test_v1_multi_turn_env_on_verifiers_0_3_is_refused_by_version():
    """retrain plays a v1 Env's seat with 0.4's Trace; 0.3.1's lacks its fields, so a
    multi-turn v1 Env is refused up front, naming the installed version."""
    test = "test_v1_multi_turn_env_on_verifiers_0_3_is_refused"
    if not classic_verifiers.runs_here(__file__, test, "SingleTurnEnv"):
        return  # it ran, and passed, under verifiers 0.3
    envs = Path(__file__).resolve().parents[1] / "fixtures" / "multiturn_envs"
    with pytest.raises(DataError, match=r"'opening_env'.*verifiers 0\.4 or later.*0\.3"):
        data_source(
            "math",
            environment={"provider": "verifiers", "id": "opening_env"},
            search_paths=[str(envs)],
        )


def test_v1_prompt_renders_with_the_tasks_system_prompt(v1_env):
    folder, name = v1_env
    src = data_source(
        "math",
        environment={"provider": "verifiers", "id": name, "args": {"n": 1}},
        search_paths=[str(folder)],
    )

    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    text = PromptRenderer(Tok(), system_prompt="ignored when the env has one").render(
        src.examples[0]
    )
    assert text == "system:Box the answer.|user:What is 0 + 1?|assistant:"


# -- classic --------------------------------------------------------------------------

CLASSIC_ENV = textwrap.dedent(
    '''
    """A classic-API-shaped environment (verifiers <= 0.3): load_environment() returns an
    object with a training dataset of chat prompts and an async rubric."""
    import re

    class Rubric:
        async def score_rollout(self, state):
            text = state["completion"][-1]["content"]
            m = re.findall(r"\\\\boxed\\{([^}]*)\\}", text)
            if "CRASH" in text:
                raise RuntimeError("rubric crashed")
            state["reward"] = 1.0 if m and m[-1] == state["answer"] else 0.0

    class Env:
        message_type = "chat"
        max_turns = 1

        def __init__(self, rows, eval_rows=None):
            self.dataset = rows
            self.eval_dataset = eval_rows
            self.rubric = Rubric()

    def _rows(n):
        return [
            {
                "prompt": [
                    {"role": "system", "content": "Answer in \\\\boxed{}."},
                    {"role": "user", "content": f"What is {i} * 2?"},
                ],
                "answer": str(2 * i),
                "info": "{}",
                "example_id": i,
            }
            for i in range(n)
        ]

    def load_environment(n: int = 3, eval_only: bool = False):
        if eval_only:
            return Env(None, eval_rows=_rows(n))
        return Env(_rows(n))
    '''
)


@pytest.fixture
def classic_env(env_dir):
    name = _unique("classic_env")
    (env_dir / f"{name}.py").write_text(CLASSIC_ENV)
    return env_dir, name


def test_classic_environment(classic_env, caplog):
    folder, name = classic_env
    src = data_source(
        "math",
        environment={"provider": "verifiers", "id": f"owner/{name}", "args": {"n": 4}},
        search_paths=[str(folder)],
        shuffle=False,
    )
    assert src.api == "classic" and len(src) == 4
    ex = src.examples[2]
    assert (ex.prompt, ex.reference) == ("What is 2 * 2?", "4")
    assert ex.meta["messages"][0] == {"role": "system", "content": "Answer in \\boxed{}."}
    batch = src.examples[1:3] + src.examples[1:2]
    out = src.reward.score_batch(["\\boxed{2}", "\\boxed{5}", "CRASH \\boxed{2}"], batch)
    assert out.rewards == [1.0, 0.0, 0.0]
    assert out.errors == 1  # the crashing rubric call
    src.close()


def test_classic_eval_only_environment_fails_fast(classic_env):
    folder, name = classic_env
    with pytest.raises(DataError, match="evaluation-only.*only an eval_dataset"):
        data_source(
            "math",
            environment={"provider": "verifiers", "id": name, "args": {"eval_only": True}},
            search_paths=[str(folder)],
        )


def test_classic_bad_args(classic_env):
    folder, name = classic_env
    with pytest.raises(DataError, match=r"\[environment\] args.*colour"):
        data_source(
            "math",
            environment={"provider": "verifiers", "id": name, "args": {"colour": "red"}},
            search_paths=[str(folder)],
        )


# -- install / missing ----------------------------------------------------------------


def test_missing_environment_without_auto_install(tmp_path):
    with pytest.raises(DataError, match="not installed.*prime env install owner/nowhere-env"):
        data_source("math", environment={"provider": "verifiers", "id": "owner/nowhere-env"})


def test_auto_install_without_prime_cli(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `prime` here
    with pytest.raises(DataError, match="auto_install needs the `prime` CLI"):
        data_source(
            "math",
            environment={"provider": "verifiers", "id": "owner/nowhere-env", "auto_install": True},
        )


def test_auto_install_runs_prime(monkeypatch, env_dir):
    # A real executable named `prime` on PATH that "installs" the environment by writing
    # its module into a folder on sys.path (what `prime env install` does via pip).
    name = _unique("installed_env")
    bin_dir = env_dir / "bin"
    site = env_dir / "site"
    bin_dir.mkdir()
    site.mkdir()
    src_file = env_dir / "payload.py"
    src_file.write_text(CLASSIC_ENV)
    prime = bin_dir / "prime"
    prime.write_text(
        f'#!/bin/sh\necho "$@" > "{env_dir}/prime_args.txt"\ncp "{src_file}" "{site}/{name}.py"\n'
    )
    prime.chmod(prime.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    sys.path.insert(0, str(site))
    try:
        src = data_source(
            "math",
            environment={"provider": "verifiers", "id": f"owner/{name}", "auto_install": True},
        )
    finally:
        sys.path.remove(str(site))
    assert (env_dir / "prime_args.txt").read_text().split() == ["env", "install", f"owner/{name}"]
    assert src.api == "classic" and len(src) == 3


def test_not_an_environment(env_dir):
    name = _unique("plain_mod")
    (env_dir / f"{name}.py").write_text("x = 1\n")
    with pytest.raises(DataError, match="is not a verifiers environment"):
        data_source(
            "math",
            environment={"provider": "verifiers", "id": name},
            search_paths=[str(env_dir)],
        )


# -- against real classic verifiers, when installed -----------------------------------


def test_real_classic_single_turn_env(env_dir):
    test = "test_real_classic_single_turn_env"
    if not classic_verifiers.runs_here(__file__, test, "SingleTurnEnv", "Rubric"):
        return  # it ran, and passed, under the classic interpreter
    name = _unique("real_classic")
    (env_dir / f"{name}.py").write_text(
        textwrap.dedent(
            """
            import verifiers as vf
            from datasets import Dataset

            def load_environment(n: int = 3):
                ds = Dataset.from_list(
                    [{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(n)]
                )
                parser = vf.Parser(extract_fn=vf.extract_boxed_answer)

                def correct(completion, answer, parser, **kwargs):
                    return 1.0 if parser.parse_answer(completion) == answer else 0.0

                rubric = vf.Rubric(funcs=[correct], parser=parser)
                return vf.SingleTurnEnv(dataset=ds, system_prompt="Box it.", parser=parser,
                                        rubric=rubric)
            """
        )
    )
    src = data_source(
        "math",
        environment={"provider": "verifiers", "id": name, "args": {"n": 3}},
        search_paths=[str(env_dir)],
        shuffle=False,
    )
    out = src.reward.score_batch(["\\boxed{1}", "\\boxed{3}"], src.examples[:2])
    assert out.rewards == [1.0, 0.0]


GENERATIONS = Path(__file__).resolve().parents[1] / "fixtures" / "api_generations"


def test_an_id_resolves_to_verifiers_bundled_taskset_before_an_installed_library():
    """`id = "textarena"` with a library of that name installed: verifiers' own order
    picks its bundled taskset, as `vf-eval textarena` would."""
    from retrain.data.verifiers import import_environment

    # verifiers' taskset is the one imported (it then asks for its own extras, nltk and
    # the real textarena, which this machine lacks): never the library on the path
    with pytest.raises(DataError, match=r"module 'verifiers\.v1\.tasksets\.textarena'"):
        import_environment("textarena", [str(GENERATIONS)])
    # [environment] module picks any module: here the library, which is refused by name
    with pytest.raises(DataError, match=r"is not a verifiers environment.*classic.*interim.*v1"):
        data_source(
            "math",
            environment={"provider": "verifiers", "id": "textarena", "module": "textarena"},
            search_paths=[str(GENERATIONS)],
        )


def test_the_interim_api_is_refused_naming_the_three_generations():
    with pytest.raises(DataError) as err:
        data_source(
            "math",
            environment={"provider": "verifiers", "id": "interim-env"},
            search_paths=[str(GENERATIONS)],
        )
    text = str(err.value)
    assert "interim verifiers API (its load_environment(config))" in text
    assert "classic (verifiers 0.1 - 0.3.x" in text and "v1 (verifiers.v1" in text
