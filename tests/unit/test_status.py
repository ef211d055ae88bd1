"""`retrain status` on a tree of runs and a campaign, with a torn line and a stale run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retrain.cli.main import main as cli_main
from retrain.cli.status import main as status_main
from retrain.cli.status import watch
from retrain.errors import UsageError
from retrain.logs.ownership import process_alive
from retrain.logs.rundir import run_dir_name
from retrain.logs.status import (
    collect,
    discover,
    read_campaign,
    read_run,
    render,
)

NOW = 1_700_000_000.0  # fixed and in the past: runs read as stale on the real clock


def write_run(
    d: Path,
    *,
    rates,
    status=None,
    heartbeat=None,
    max_steps=10,
    step_time=2.0,
    finished=False,
    condition="grpo+none",
    torn=False,
    pid=1,
    host=None,
    started_at=NOW - 1000,
):
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    done = 0
    for i, rate in enumerate(rates):
        done += rate
        rows.append(
            {
                "step": i,
                "condition": condition,
                "correct_rate": rate,
                "running_correct_rate": done / (i + 1),
                "mean_reward": rate,
                "step_time_s": step_time + i,  # median = step_time + (n-1)/2
            }
        )
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if torn:
        text += '{"step": 99, "correct_r'
    (d / "metrics.jsonl").write_text(text)
    if status is not None:
        (d / "run.json").write_text(
            json.dumps(
                {
                    "status": status,
                    "pid": pid,
                    "condition": condition,
                    "max_steps": max_steps,
                    "started_at": started_at,
                    "heartbeat": NOW - 10 if heartbeat is None else heartbeat,
                    "step": len(rates),
                    **({"host": host} if host else {}),
                }
            )
        )
    if finished or status == "running":
        (d / "trainer_state.json").write_text(
            json.dumps({"step": len(rates), "finished": finished, "condition": condition})
        )


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "logs"
    write_run(root / "done", rates=[0.0, 0.5, 1.0], status="finished", finished=True, max_steps=3)
    write_run(root / "live", rates=[0.25, 0.5, 0.5, 0.75], status="running", max_steps=10)
    write_run(root / "ghost", rates=[0.5], status="running", heartbeat=NOW - 3600)
    write_run(root / "torn", rates=[0.5, 0.25], status="failed", torn=True)
    # a campaign: 2 conditions x 2 seeds, one still pending
    camp = root / "campaign_20250101_000000"
    entries = []
    for cond, seed, final in (("grpo+none", 1, 0.5), ("grpo+none", 2, 0.7), ("maxrl+gtpo", 1, 0.4)):
        name = f"{cond}_s{seed}"
        write_run(
            camp / "runs" / name,
            rates=[0.1, final],
            status="finished",
            finished=True,
            max_steps=2,
            condition=cond,
        )
        entries.append(
            {
                "name": name,
                "condition": cond,
                "seed": seed,
                "status": "finished",
                "exit_code": 0,
                "log_dir": str(camp / "runs" / name),
            }
        )
    entries.append(
        {
            "name": "maxrl+gtpo_s2",
            "condition": "maxrl+gtpo",
            "seed": 2,
            "status": "pending",
            "log_dir": str(camp / "runs" / "maxrl+gtpo_s2"),
        }
    )
    (camp / "manifest.json").write_text(
        json.dumps(
            {
                "status": "running",
                "max_steps": 2,
                "runs": entries,
                "squeeze": {"recommended_rank": 4, "source_rank": 16, "run": "grpo+none_s1"},
            }
        )
    )
    return root


def test_discover_finds_runs_and_campaigns_not_campaign_internals(tree):
    runs, campaigns = discover(tree)
    assert [p.name for p in runs] == ["done", "ghost", "live", "torn"]
    assert [p.name for p in campaigns] == ["campaign_20250101_000000"]


def test_run_states_rates_and_eta(tree):
    done = read_run(tree / "done", now=NOW)
    assert done.state == "finished" and done.steps_done == 3 and done.max_steps == 3
    assert done.last_correct_rate == 1.0 and done.running_correct_rate == pytest.approx(0.5)
    assert done.mean_reward == pytest.approx(0.5) and done.eta_s == 0.0

    live = read_run(tree / "live", now=NOW)
    assert live.state == "running" and live.steps_done == 4 and live.max_steps == 10
    assert live.median_step_s == pytest.approx(3.5)  # 2, 3, 4, 5
    assert live.eta_s == pytest.approx(3.5 * 6)
    assert live.heartbeat_age_s == pytest.approx(10)

    ghost = read_run(tree / "ghost", now=NOW)
    assert ghost.state == "stale" and ghost.eta_s is None
    # an explicit threshold wins over the default (>= 300 s)
    assert read_run(tree / "live", now=NOW, stale_after=5).state == "stale"
    assert read_run(tree / "ghost", now=NOW, stale_after=7200).state == "running"


def test_default_stale_threshold_follows_step_time(tmp_path):
    slow = tmp_path / "slow"
    write_run(slow, rates=[0.5], status="running", heartbeat=NOW - 500, step_time=200.0)
    assert read_run(slow, now=NOW).state == "running"  # 500 s < 3 x 200 s
    write_run(slow, rates=[0.5], status="running", heartbeat=NOW - 700, step_time=200.0)
    assert read_run(slow, now=NOW).state == "stale"


def test_torn_last_line_is_skipped_and_reported(tree):
    torn = read_run(tree / "torn", now=NOW)
    assert torn.state == "failed" and torn.steps_done == 2
    assert torn.last_correct_rate == 0.25
    assert torn.corrupt_lines == {str(tree / "torn" / "metrics.jsonl"): [3]}
    assert "skipped 1 corrupt line(s)" in torn.warnings[0]


def test_partial_and_unreadable_files(tmp_path):
    only_metrics = tmp_path / "m"
    write_run(only_metrics, rates=[0.5, 0.5])  # no run.json: heartbeat from the file time
    st = read_run(only_metrics)
    assert st.state == "running" and st.steps_done == 2 and st.max_steps is None
    assert read_run(only_metrics, now=time.time() + 10_000).state == "stale"

    broken = tmp_path / "b"
    broken.mkdir()
    (broken / "run.json").write_text('{"status": "runn')
    (broken / "metrics.jsonl").write_text("not json\n")
    st = read_run(broken, now=NOW)
    assert st.steps_done == 0 and st.corrupt_lines
    assert any("cannot read" in w for w in st.warnings)


def test_campaign_grouped_by_condition(tree):
    c = read_campaign(tree / "campaign_20250101_000000", now=NOW)
    assert [r.name for r in c.runs] == [
        "grpo+none_s1",
        "grpo+none_s2",
        "maxrl+gtpo_s1",
        "maxrl+gtpo_s2",
    ]
    assert c.runs[-1].state == "pending" and c.runs[0].seed == 1
    by = {s.condition: s for s in c.conditions}
    assert by["grpo+none"].mean == pytest.approx(0.6)
    assert by["grpo+none"].std == pytest.approx(0.1414213, rel=1e-5)
    assert by["grpo+none"].finished == 2
    assert by["maxrl+gtpo"].mean == pytest.approx(0.4) and by["maxrl+gtpo"].std == 0.0
    assert by["maxrl+gtpo"].runs == 2 and by["maxrl+gtpo"].finished == 1
    assert c.squeeze["recommended_rank"] == 4


def test_render_table(tree):
    text = render(collect(tree, now=NOW))
    assert "Runs under" in text and "Campaign campaign_20250101_000000" in text
    for part in (
        "finished",
        "running",
        "stale (1h00m ago)",
        "failed",
        "4/10",
        "25.0%",
        "grpo+none: 2/2 finished, final correct 60.0% +- 14.1% (n=2)",
        "squeeze: recommended rank 4",
        "skipped 1 corrupt line(s)",
    ):
        assert part in text, part
    (tree.parent / "empty").mkdir()
    assert render(collect(tree.parent / "empty")).startswith("No runs or campaigns")


def test_cli_json_and_text(tree, capsys):
    assert status_main([str(tree), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    states = {Path(r["path"]).name: r["state"] for r in data["runs"]}
    # on the real clock the fixture's heartbeats are years old: running runs read as stale
    assert states["done"] == "finished" and states["torn"] == "failed"
    assert states["ghost"] == "stale"
    assert data["campaigns"][0]["conditions"][0]["condition"] == "grpo+none"
    assert any("corrupt" in w for w in data["warnings"])
    assert cli_main(["status", str(tree), "--stale-after", "1e12"]) == 0
    out = capsys.readouterr().out
    assert "ghost" in out and "stale" not in out.split("Campaign")[0]


def test_cli_errors(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        status_main([str(tmp_path / "missing")])
    with pytest.raises(UsageError, match="stale-after"):
        status_main([str(tmp_path), "--stale-after", "0"])
    with pytest.raises(UsageError):
        status_main(["--bogus"])


def test_conditions_that_differ_only_by_overrides_are_separate_groups(tmp_path):
    """Rows written by a trainer that records only `adv+tx` still group by the manifest's
    full label, so `lr` variants of one condition never merge."""
    camp = tmp_path / "campaign_20250101_000000"
    entries = []
    labels = ("maxrl+gtpo", "maxrl+gtpo~lr=0.0001", "maxrl+gtpo~model=Qwen/Qwen3-0.6B")
    for i, label in enumerate(labels):
        for seed in (1, 2):
            name = run_dir_name(label, seed)
            final = 0.2 * (i + 1) + 0.01 * seed
            write_run(
                camp / "runs" / name,
                rates=[0.1, final],
                status="finished",
                finished=True,
                max_steps=2,
                condition="maxrl+gtpo",  # what the rows say without the full label
            )
            entries.append({"name": name, "condition": label, "seed": seed, "status": "finished"})
    (camp / "manifest.json").write_text(json.dumps({"status": "finished", "runs": entries}))
    c = read_campaign(camp, now=NOW)
    assert [s.condition for s in c.conditions] == list(labels)
    by = {s.condition: s for s in c.conditions}
    assert by["maxrl+gtpo~lr=0.0001"].runs == 2
    assert by["maxrl+gtpo~lr=0.0001"].mean == pytest.approx(0.415)
    text = render(collect(tmp_path, now=NOW))
    assert "  maxrl+gtpo~lr=0.0001: 2/2 finished" in text
    assert "  maxrl+gtpo~model=Qwen/Qwen3-0.6B: 2/2 finished" in text


# ------------------------------------------------------------------ killed runs


def dead_pid() -> int:
    """The id of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not process_alive(proc.pid)
    return proc.pid


def test_a_killed_run_on_this_host_is_dead_with_its_resume_command(tmp_path):
    here = socket.gethostname()
    run = tmp_path / "killed"
    # heartbeat 10 s old: fresh by the clock, but the process is gone
    write_run(run, rates=[0.5, 0.25, 0.5], status="running", pid=dead_pid(), host=here)
    (run / "config.resolved.toml").write_text("[training]\nmax_steps = 10\n")
    st = read_run(run, now=NOW)
    assert st.state == "dead" and st.eta_s is None
    assert st.last_step == 2 and st.checkpoint_step == 3
    assert st.resume_command == f"retrain {run / 'config.resolved.toml'} --resume {run}"
    text = render(collect(tmp_path, now=NOW))
    assert f"dead (pid {st.pid} gone)" in text
    assert "killed is dead: last step 2, checkpoint at step 3" in text
    assert f"resume: retrain {run / 'config.resolved.toml'} --resume {run}" in text

    # the same record with a live pid is running; the fresh heartbeat keeps it so (the
    # run started after its process did, as a run.json is written)
    write_run(
        run, rates=[0.5], status="running", pid=os.getpid(), host=here, started_at=time.time()
    )
    alive = read_run(run, now=NOW)
    assert alive.state == "running" and alive.resume_command is None
    # a live pid born after the run started is another process's (the pid was reused)
    write_run(run, rates=[0.5], status="running", pid=os.getpid(), host=here)
    assert read_run(run, now=NOW).state == "dead"


@pytest.mark.parametrize("listed", ["failed", "interrupted"])
def test_a_campaign_run_its_manifest_saw_end_is_what_the_manifest_says(tmp_path, listed):
    """The campaign recorded how its run ended, but the run's own run.json still says
    running (the process was killed before updating it): status says what the
    manifest saw (compare's unfinished-run warning reads the same rule)."""
    camp = tmp_path / "campaign_20250101_000000"
    run = camp / "runs" / "grpo+none_s1"
    write_run(run, rates=[0.5, 0.25], status="running", pid=dead_pid(), host=socket.gethostname())
    entry = {"name": run.name, "condition": "grpo+none", "seed": 1, "status": listed}
    (camp / "manifest.json").write_text(json.dumps({"status": listed, "runs": [entry]}))
    (st,) = read_campaign(camp, now=NOW).runs
    assert st.state == listed and st.resume_command is None
    assert read_run(run, now=NOW).state == "dead"  # the run's own files alone


def test_pid_is_only_checked_on_the_host_that_wrote_it(tmp_path):
    run = tmp_path / "remote"
    gone = dead_pid()
    write_run(run, rates=[0.5], status="running", pid=gone, host="another-host.example")
    assert read_run(run, now=NOW).state == "running"  # the heartbeat decides
    write_run(
        run,
        rates=[0.5],
        status="running",
        pid=gone,
        host="another-host.example",
        heartbeat=NOW - 3600,
    )
    stale = read_run(run, now=NOW)
    assert stale.state == "stale" and stale.last_step == 0
    assert stale.resume_command is not None and "--resume" in stale.resume_command
    # no host at all (a run.json from an older retrain): no pid check either
    write_run(run, rates=[0.5], status="running", pid=gone)
    assert read_run(run, now=NOW).state == "running"


def test_a_run_without_a_checkpoint_starts_over(tmp_path):
    run = tmp_path / "early"
    write_run(run, rates=[], status="running", pid=dead_pid(), host=socket.gethostname())
    (run / "trainer_state.json").unlink()
    (run / "run.json").write_text(
        json.dumps({**json.loads((run / "run.json").read_text()), "config": "my run.toml"})
    )
    st = read_run(run, now=NOW)
    assert st.state == "dead" and st.last_step is None and st.checkpoint_step is None
    assert st.resume_command == "retrain 'my run.toml'"
    assert "no step logged, no checkpoint: it starts over" in render(collect(tmp_path, now=NOW))


def test_runlog_records_pid_and_host(tmp_path):
    from retrain.config import config_from_dict
    from retrain.logs.runlog import RunLog

    log = RunLog(config_from_dict({}), tmp_path, "retrain.toml", say=lambda s: None)
    log.write_status("running", step=1)
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    assert read_run(tmp_path).state == "running"  # this very process
    info["pid"] = dead_pid()
    (tmp_path / "run.json").write_text(json.dumps(info))
    assert read_run(tmp_path).state == "dead"


def test_a_start_that_fails_before_its_first_row_puts_back_what_it_found(tmp_path):
    """RunLog.reserve holds the directory while the model loads; release undoes it."""
    from retrain.config import config_from_dict
    from retrain.logs.runlog import RunLog

    def log_in(path):
        return RunLog(config_from_dict({}), path, None, say=said.append)

    said: list[str] = []
    fresh = log_in(tmp_path / "a" / "b" / "logs")
    fresh.reserve(0)
    assert json.loads((tmp_path / "a/b/logs/run.json").read_text())["status"] == "running"
    fresh.release()
    assert list(tmp_path.iterdir()) == []  # every directory it made, and only those
    # a resumed run: the previous run.json comes back byte for byte, the rest untouched
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    previous = b'{"status": "interrupted", "step": 7}'
    (resumed / "run.json").write_bytes(previous)
    (resumed / "metrics.jsonl").write_text('{"step": 6}\n')
    log = log_in(resumed)
    log.reserve(7)
    assert json.loads((resumed / "run.json").read_text())["step"] == 7
    log.release()
    assert (resumed / "run.json").read_bytes() == previous
    assert sorted(p.name for p in resumed.iterdir()) == ["metrics.jsonl", "run.json"]
    # a directory something else wrote into meanwhile stays, with what is in it
    shared = log_in(tmp_path / "shared" / "logs")
    shared.reserve(0)
    (tmp_path / "shared" / "other").mkdir()
    shared.release()
    assert [p.name for p in (tmp_path / "shared").iterdir()] == ["other"] and said == []


# ------------------------------------------------------------------ --watch


def test_watch_refreshes_a_bounded_number_of_times(tree):
    out, sleeps = [], []
    assert (
        watch(tree, interval=0.5, count=3, write=out.append, sleep=sleeps.append, clear=False) == 0
    )
    text = "".join(out)
    assert text.count(f"retrain status {tree} at ") == 3 and text.count("Runs under") == 3
    assert sleeps == [0.5, 0.5]  # none after the last report


def test_watch_sees_a_run_change_between_refreshes(tmp_path):
    run = tmp_path / "r"
    write_run(
        run,
        rates=[0.5],
        status="running",
        pid=os.getpid(),
        host=socket.gethostname(),
        heartbeat=time.time(),
        started_at=time.time(),
    )
    out = []

    def kill_it(_):  # between two reports the process dies
        write_run(
            run,
            rates=[0.5, 0.5],
            status="running",
            pid=dead_pid(),
            host=socket.gethostname(),
            heartbeat=time.time(),
        )

    watch(tmp_path, interval=1, count=2, as_json=True, write=out.append, sleep=kill_it)
    states = [json.loads(line)["runs"][0]["state"] for line in "".join(out).splitlines()]
    assert states == ["running", "dead"]


def test_watch_ends_cleanly_on_ctrl_c(tree):
    out = []

    def interrupt(_):
        raise KeyboardInterrupt

    assert watch(tree, interval=1, count=None, write=out.append, sleep=interrupt, clear=False) == 0
    assert "".join(out).count("Runs under") == 1


def test_cli_watch(tree, capsys):
    assert status_main([str(tree), "--watch", "--interval", "0.01", "--count", "2"]) == 0
    assert capsys.readouterr().out.count("Runs under") == 2
    assert status_main([str(tree), "--watch", "--interval", "0.01", "--count", "2", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(json.loads(line)["root"] == str(tree) for line in lines)
    for bad in (["--count", "2"], ["--watch", "--interval", "0"], ["--watch", "--count", "0"]):
        with pytest.raises(UsageError):
            status_main([str(tree), *bad])


def test_a_run_without_a_checkpoint_but_with_rows_starts_over_with_overwrite(tmp_path):
    # its rows are in the way: a run never writes into another run's files
    run = tmp_path / "early"
    write_run(run, rates=[0.5], status="running", pid=dead_pid(), host=socket.gethostname())
    (run / "trainer_state.json").unlink()
    (run / "config.resolved.toml").write_text("[training]\nmax_steps = 10\n")
    st = read_run(run, now=NOW)
    assert st.resume_command == f"retrain {run / 'config.resolved.toml'} --overwrite"


def test_status_explains_its_columns_and_states(tmp_path):
    """A user reading `retrain status` for the first time: what the columns and a dead run
    mean, under the table and in --help (issue 28)."""
    write_run(
        tmp_path / "killed",
        rates=[0.5],
        status="running",
        pid=dead_pid(),
        host=socket.gethostname(),
    )
    write_run(tmp_path / "done", rates=[0.5, 0.75], status="finished", finished=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", "status", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    legend = proc.stdout.split("\nColumns: ", 1)[1]
    for column in (
        "STEPS steps done / max_steps",
        "CORRECT correct rate of the last step",
        "RUNNING correct rate over all the steps",
        "EVAL last held-out correct rate",
        "ETA time left",
    ):
        assert column in " ".join(legend.split()), column
    assert "  dead: run.json says running, but its process on this host is gone" in legend
    assert "  finished: " in legend and "  stale: " not in legend  # the states shown only
    proc = subprocess.run(
        [sys.executable, "-m", "retrain.cli.main", "status", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0
    for state in (
        "running",
        "finished",
        "interrupted",
        "failed",
        "dead",
        "stale",
        "pending",
        "unknown",
    ):
        assert f"\n  {state}: " in proc.stdout, state
    assert "Columns: RUN the run's directory" in proc.stdout
