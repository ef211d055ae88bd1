"""benchmarks/gpu_lease.sh, the prepared plan for a GPU lease: every script, option, test
selection and benchmark kind it names exists (a rename would otherwise surface only on a
rare, short lease), and with no time left every item is skipped and said so, nothing run."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEASE = ROOT / "benchmarks" / "gpu_lease.sh"
MEASURED = [
    "models",
    "headline",
    "quickstart",
    "trl",
    "variants",
    "quickstart-variants",
    "profile-quickstart",
    "profile",
]


def plan() -> dict[str, list[str]]:
    out = subprocess.run(
        ["bash", str(LEASE), "plan"], capture_output=True, text=True, check=True
    ).stdout
    items = {}
    for line in out.splitlines():
        if not line.startswith("#"):
            name, command = line.split(": ", 1)
            items[name.split(" (")[0]] = shlex.split(command)
    return items


def test_the_plan_lists_setups_tests_then_the_measurements_in_order():
    assert list(plan()) == ["gpu-tests", "attention", *MEASURED]


def test_every_script_and_option_the_plan_names_exists(tmp_path):
    for name, argv in plan().items():
        script = next((a for a in argv if a.endswith((".py", ".sh"))), None)
        assert script is not None, name
        if script.startswith(".gpu/"):  # the bundle's (../shared/gpu), carried by the call
            assert (ROOT.parent / "shared" / "gpu" / Path(script).name).is_file(), name
            continue
        source = (ROOT / script).read_text()
        own = argv[argv.index(script) + 1 :]
        own = own[: own.index("--")] if "--" in own else own  # then retrain's config flags
        for flag in (a for a in own if a.startswith("--")):
            assert f'"{flag}"' in source, f"{name}: {script} takes no {flag}"
        if "--" in argv:  # retrain's flags, as the CLI reads them (--backend-opt is the
            import retrain.compat  # noqa: F401  original's: its dialect, installed on import)
            from retrain.cli.init import templates
            from retrain.config import load_config

            path = tmp_path / "retrain.toml"
            path.write_text(templates()["quickstart"])
            load_config(path, argv[argv.index("--") + 1 :])


def test_the_test_selections_and_benchmark_kinds_exist():
    source = (ROOT / "tests" / "integration" / "test_gpu.py").read_text()
    tests = re.findall(r"^def (test_\w+)", source, re.MULTILINE)
    items = plan()
    setup = items["gpu-tests"][items["gpu-tests"].index("-k") + 1]
    assert setup == "not quickstart and not headline"
    picked = [t for t in tests if "quickstart" not in t and "headline" not in t]
    assert len(picked) == len(tests) - 2  # all but the two that need the model files
    gpu = (ROOT / "benchmarks" / "gpu.py").read_text()
    for name in ("headline", "quickstart", "variants", "quickstart-variants", "trl"):
        what = items[name][items[name].index("--what") + 1]
        assert f'what == "{what}"' in gpu, f"{name}: benchmarks/gpu.py has no setup {what}"
        kinds = items[name][items[name].index("--only") + 1].split(",")
        for kind in kinds:
            assert f'"{kind}"' in gpu, f"{name}: benchmarks/gpu.py has no {kind}"


def measure(out: Path, site: Path) -> subprocess.CompletedProcess:
    """`gpu_lease.sh measure 0` writing to `out`, with `site` as setup's install folder."""
    env = {**os.environ, "OUT": str(out), "LEASE_SITE": str(site)}
    return subprocess.run(
        ["bash", str(LEASE), "measure", "0"], capture_output=True, text=True, env=env
    )


def test_measure_without_setup_says_so_and_runs_nothing(tmp_path):
    done = measure(tmp_path / "out", tmp_path / "forgotten")
    assert done.returncode == 3
    assert "holds no retrain" in done.stdout and "run setup again" in done.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["lease.log"]


def test_with_no_time_left_every_item_is_skipped_and_said(tmp_path):
    site, out = tmp_path / "site", tmp_path / "out"
    (site / "retrain").mkdir(parents=True)  # what setup installs
    done = measure(out, site)
    assert done.returncode == 0, done.stderr
    log = (out / "lease.log").read_text().splitlines()
    items = [line for line in log if line.startswith("== ")]
    assert [line.split(":")[0].removeprefix("== ") for line in items] == MEASURED
    assert all("skipped, 0s left" in line for line in items)
    assert sorted(p.name for p in out.iterdir()) == ["lease.log"]  # nothing ran
    # then the report, every target unmeasured, also at the end of what the call returns
    targets = [line for line in log if line.startswith("| ") and "goal" not in line]
    assert len(targets) == 6 and all(line.endswith("| not run |") for line in targets)
    assert done.stdout.rstrip().endswith("| not run |")


def test_the_items_lease_skip_names_are_skipped_and_said(tmp_path):
    """`LEASE_SKIP="variants quickstart-variants"` (setup's -m gpu run showed the compiled
    step failing): those items are said skipped and not run, the others run."""
    log = tmp_path / "lease.log"
    script = (
        f'phase=measure; deadline=$((SECONDS + 60)); log="{log}"; touch "$log"; '
        f'source <(sed -n "/^item()/,/^}}/p" "{LEASE}"); '
        "item variants 10 1 echo compiled; item quickstart 10 1 echo ran; "
        "item quickstart-variants 10 1 echo compiled"
    )
    env = {**os.environ, "LEASE_SKIP": "variants quickstart-variants"}
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "== variants: skipped (LEASE_SKIP)"
    assert lines[-1] == "== quickstart-variants: skipped (LEASE_SKIP)"
    assert "ran" in done.stdout and "compiled" not in done.stdout


def test_an_item_past_its_cap_is_stopped_and_the_next_gets_what_is_left(tmp_path):
    """The script's own `item` runner, with a 10-second deadline: a command past its 1 s
    cap is interrupted (exit 124) and the lease goes on; the next item is limited to the
    seconds left; one whose minimum no longer fits is skipped without running."""
    log = tmp_path / "lease.log"
    script = (
        f'phase=measure; deadline=$((SECONDS + 10)); log="{log}"; touch "$log"; '
        f'source <(sed -n "/^item()/,/^}}/p" "{LEASE}"); '
        "item slow 1 1 sleep 30; item next 60 1 echo ran; item late 60 60 echo never"
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    assert lines[0].startswith("== slow: up to 1s")
    assert re.fullmatch(r"== slow: exit 124 after \d+s", lines[1])  # interrupted, went on
    left = int(re.match(r"== next: up to (\d+)s", lines[2]).group(1))
    assert 1 <= left < 10  # what the deadline left, not the 60 s cap
    assert lines[3] == "ran" and re.fullmatch(r"== next: exit 0 after \d+s", lines[4])
    assert re.fullmatch(r"== late: skipped, \d+s left \(needs 60s\)", lines[5])
    assert "never" not in done.stdout


def keep(folder: str, results: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RESULTS": str(results)}
    return subprocess.run(
        ["bash", str(LEASE), "keep", folder], capture_output=True, text=True, env=env, cwd=cwd
    )


def test_keep_files_what_came_back_under_the_cited_names(tmp_path):
    """What a measure call brought back lands in benchmarks/results/ as gpu_*.json, with the
    log and the report's table; a file that did not come back is named, the rest kept. The
    folder is read relative to where the command was run, not the repository."""
    back = tmp_path / "files_at"
    back.mkdir()
    step = {"step_s": 9.0, "sampling_s": 4.0, "training_s": 4.5, "sampling_tokens_per_s": 8e3}
    (back / "headline.json").write_text(
        json.dumps({"summary": {"headline/retrain": {**step, "peak_gpu_gb": 40.0}}, "runs": {}})
    )
    (back / "lease.log").write_text("== headline: exit 0 after 100s\n")
    results = tmp_path / "results"
    done = keep("files_at", results, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in results.iterdir()) == [
        "gpu_headline.json",
        "gpu_lease.log",
        "gpu_lease_report.md",
    ]
    assert (results / "gpu_headline.json").read_text() == (back / "headline.json").read_text()
    for missing in ("quickstart", "profile", "variants", "memory_fit", "trl"):
        assert f"not back: {missing}.json" in done.stdout
    report = (results / "gpu_lease_report.md").read_text()
    assert "| training s at the headline | at most 4 | 4.50 | no |" in report


def test_keep_without_results_fails_and_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    done = keep(str(tmp_path / "empty"), tmp_path / "results", cwd=ROOT)
    assert done.returncode == 1 and "no result in" in done.stderr
    missing = keep(str(tmp_path / "nowhere"), tmp_path / "results", cwd=ROOT)
    assert missing.returncode == 2 and "no folder" in missing.stderr
    usage = subprocess.run(["bash", str(LEASE), "keep"], capture_output=True, text=True)
    assert usage.returncode == 2 and "keep FOLDER" in usage.stderr
