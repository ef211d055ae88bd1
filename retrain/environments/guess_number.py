"""A multi-turn verifiers (v1) environment: guess the number (`id = "guess-number"`).

Written with verifiers' own classes: a Taskset of seeded games, a Task whose reward
reads the trace, and an Env whose `run()` is the game master. The model guesses, the
environment answers "higher" / "lower" (so the model's next turn depends on that reply),
and the game ends when the guess is right or the agent's turns run out.
"""

import re

import verifiers.v1 as vf

RULES = (
    "I am thinking of a whole number from 1 to {hi}. Guess it. Reply with one number "
    "in square brackets, like [3]. I will say higher or lower."
)


class GuessData(vf.TaskData):
    secret: int
    hi: int = 8


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=0.1)
    async def well_formed(self, trace) -> float:
        # every model turn gave exactly one bracketed guess
        replies = [m.content or "" for m in trace.assistant_messages]
        ok = [len(re.findall(r"\[\s*\d+\s*\]", r)) == 1 for r in replies]
        return float(sum(ok)) / max(1, len(ok))


class GuessConfig(vf.TasksetConfig):
    n: int = 8
    hi: int = 8


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        for i in range(self.config.n):
            secret = 1 + (i * 5 + 3) % self.config.hi
            yield GuessTask(
                GuessData(
                    prompt=RULES.format(hi=self.config.hi),
                    secret=secret,
                    hi=self.config.hi,
                    system_prompt="You play a guessing game.",
                ),
                self.config.task,
            )


def guess_of(reply: str) -> int | None:
    found = re.findall(r"\[\s*(\d+)\s*\]", reply) or re.findall(r"\d+", reply)
    return int(found[0]) if found else None


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=4)


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        secret = task.data.secret
        solved = 0.0
        async with agents.player.interaction(task) as game:
            segment = await game.turn()  # the task's prompt opens: the model guesses first
            while not segment.terminated:
                guess = guess_of(segment.last_reply)
                if guess == secret:
                    solved = 1.0
                    break
                if guess is None:
                    feedback = "I did not see a number. Reply like [3]."
                else:
                    feedback = (
                        f"{guess} is wrong: my number is {'higher' if secret > guess else 'lower'}."
                    )
                segment = await game.turn(feedback)
        game.trace.record_reward("solved", solved, 1.0)


__all__ = ["GuessTaskset", "GuessEnv"]
