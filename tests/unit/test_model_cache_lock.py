"""Preparing a model's cached copy one process at a time (`retrain.models.one_at_a_time`):
parallel campaign workers, or benchmarks run side by side, on a fresh machine once all
extracted the embedded GGUF into the same `.part` file and one failed. A process that
finds the lock held says so, waits, and then uses what the holder left."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from retrain.models import one_at_a_time

ROOT = Path(__file__).resolve().parents[2]


def waiting(code: str) -> subprocess.Popen:
    """`code` in a process of its own, its first line read once it says it waits."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = proc.stdout.readline()
    assert first.startswith("Waiting for another process"), (first, proc.stderr.read())
    return proc


def test_a_conversion_waits_for_the_one_under_way_and_uses_its_result(tmp_path):
    """While this process holds the conversion's lock, another asked to convert waits;
    once the holder has written the model and let go, the other returns it without
    converting again (its GGUF does not even exist, so converting would fail)."""
    out = tmp_path / "safetensors"
    with one_at_a_time(tmp_path / "safetensors.lock", "converting"):
        proc = waiting(f"""
            from pathlib import Path
            from retrain.models import convert_gguf
            print(convert_gguf(Path({str(tmp_path / "missing.gguf")!r}), Path({str(out)!r})))
            """)
        out.mkdir()
        (out / "config.json").write_text("{}")
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert stdout.strip() == str(out)


def test_the_lock_is_exclusive_and_dropped_when_its_holder_dies(tmp_path):
    """A second holder gets in only after the first lets go; a holder killed while it
    holds the lock does not keep anyone out."""
    lock = tmp_path / "x.lock"
    log = tmp_path / "log"
    with one_at_a_time(lock, "testing"):
        proc = waiting(f"""
            from pathlib import Path
            from retrain.models import one_at_a_time
            with one_at_a_time(Path({str(lock)!r}), "testing"):
                Path({str(log)!r}).write_text("second")
            """)
        log.write_text("first")
        assert log.read_text() == "first"
    assert proc.wait(timeout=60) == 0
    assert log.read_text() == "second"

    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from pathlib import Path
            from retrain.models import one_at_a_time
            with one_at_a_time(Path({str(lock)!r}), "testing"):
                print("held", flush=True)
                time.sleep(60)
            """)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait(timeout=60)
    with one_at_a_time(lock, "testing"):  # would block forever if the dead still held it
        pass
