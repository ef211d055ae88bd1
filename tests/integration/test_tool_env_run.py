"""A 2-step run, the real CLI as a process, on a tiny model with a tool-call chat template
against a real verifiers ToolEnv (tests/fixtures/tool_envs/add_tool.py): the tool is
actually called (the environment logs each call) and the results are `tool` messages in
the transcript.

Which tool environment, and why: verifiers 0.4 (the project's) has no ToolEnv (its v1
toolsets run as MCP servers in a sandbox runtime, which retrain does not drive), so this
is the classic ToolEnv of verifiers 0.3, the one Prime Hub tool environments use. It runs
under the classic interpreter (tests/unit/classic_verifiers.py), which has no torch: the
project's site-packages are appended behind its own (torch from there, verifiers 0.3 from
the classic one).

A random tiny model never writes a well-formed tool call, so the test first teaches it one
(a few hundred supervised steps on the task's own prompt): this shows the wiring, not
learning. The rewards stay 0 (the taught model calls the tool again instead of answering).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

import classic_verifiers  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOOL_ENVS = REPO / "tests" / "fixtures" / "tool_envs"
SITE = "RETRAIN_PROJECT_SITE"  # the project's site-packages, for torch under the classic one
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 0, "b": 3}}\n</tool_call>'


# Under the classic interpreter: torch (for the fixtures' tiny model too) from the project.
# As a site directory: in an overlay venv its .pth file chains to the base's packages.
if SITE in os.environ and os.environ[SITE] not in sys.path:
    site.addsitedir(os.environ[SITE])


def taught_model(directory: Path, env_args: dict) -> Path:
    """The tiny model with the tool template, taught to answer the task's prompt (as the
    run renders it, tools included) with CALL."""
    import torch
    from tiny_model import TOOL_CHAT_TEMPLATE, make_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retrain.config.schema import DataConfig, EnvironmentConfig
    from retrain.data import build_data_source
    from retrain.data.prompts import PromptRenderer
    from retrain.data.verifiers import _classic_tool_schemas
    from retrain.multiturn import ChatTokens

    make_tiny_model(directory, template=TOOL_CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(directory)
    src = build_data_source(
        DataConfig(source="math", shuffle=False),
        environment=EnvironmentConfig(provider="verifiers", id="add_tool", args=env_args),
        max_examples=0,
        shuffle_seed=None,
        search_paths=[str(TOOL_ENVS)],
    )
    chat, renderer = ChatTokens(tok), PromptRenderer(tok)
    tools = _classic_tool_schemas(src.env.tool_defs)
    prompt = chat.encode(chat.render(renderer.messages(src.examples[0]), True, tools))
    src.close()
    target = [*chat.encode(CALL), tok.eos_token_id]
    ids = torch.tensor([prompt + target])
    labels = torch.tensor([[-100] * len(prompt) + target])
    model = AutoModelForCausalLM.from_pretrained(directory)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(300):  # until it writes CALL (loss < 0.01), a few dozen steps
        loss = model(input_ids=ids, labels=labels).loss
        if loss.item() < 0.01:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.01, loss.item()
    model.save_pretrained(directory)
    return directory


@pytest.mark.slow  # a long CLI-process test; in process: tests/unit/test_multiturn_tools.py
def test_a_run_against_a_tool_env_calls_the_tool(tiny_raw, tmp_path):
    if SITE not in os.environ:  # where torch is: the project's site-packages, or its base's
        torch_init = importlib.util.find_spec("torch").origin  # in an overlay venv
        os.environ[SITE] = str(Path(torch_init).parents[1])
    if not classic_verifiers.runs_here(
        __file__, "test_a_run_against_a_tool_env", "ToolEnv", marker="slow"
    ):
        return  # it ran, and passed, under the classic interpreter
    log = tmp_path / "calls.jsonl"
    env_args = {"log": str(log), "n": 1}
    model = taught_model(tmp_path / "tool_model", env_args)
    log.unlink(missing_ok=True)
    raw = copy.deepcopy(tiny_raw)
    raw.pop("reward")
    raw["model"]["model"] = str(model)
    raw["data"] = {"size": 1}
    raw["environment"] = {"provider": "verifiers", "id": "add_tool", "args": env_args}
    raw["environment"]["max_turns"] = 2
    raw["plugins"]["search_paths"].append(str(TOOL_ENVS))
    raw["training"].update(
        max_steps=2, max_tokens=96, group_size=2, batch_size=1, temperature=0.3, save_every=0
    )
    config = tmp_path / "run.toml"
    config.write_text(tomlkit.dumps(raw))
    boot = "import site, sys; site.addsitedir(sys.argv.pop(1)); from retrain.cli.main import main; "
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            boot + "sys.exit(main(sys.argv[1:]))",
            os.environ[SITE],
            str(config),
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Tool calls: hermes format" in out
    logs = tmp_path / "logs"
    rows = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2, rows
    got = [(r.get("env_errors"), r.get("tool_calls")) for r in rows]
    assert all(e == 0 and n >= 2 for e, n in got), (got, sorted(rows[0]))
    # the environment ran the tool: at least once per conversation (2 steps x 2)
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(calls) >= 4 and calls[0] == {"a": 0, "b": 3}
    gens = [
        json.loads(x) for x in (logs / "emergence" / "generations.jsonl").read_text().splitlines()
    ]
    transcript = gens[0]["transcript"]
    assert transcript[0]["tool_calls"][0]["function"]["name"] == "add"
    assert transcript[1]["role"] == "tool" and transcript[1]["content"] == "3"
