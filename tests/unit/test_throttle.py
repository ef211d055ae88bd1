"""The file-based counting semaphore that limits concurrent Tinker calls across workers."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from retrain.errors import RetrainError
from retrain.throttle import (
    ENV_DIR,
    ENV_MAX,
    Throttle,
    ThrottleTimeout,
    maybe_slot,
    throttle_for,
)

CTX = multiprocessing.get_context("fork")


def test_slots_are_counted_and_released(tmp_path):
    t = Throttle(tmp_path / "th", 2)
    assert t.in_use() == 0
    a = t.try_acquire()
    b = t.try_acquire()
    assert a is not None and b is not None and {a.index, b.index} == {0, 1}
    assert t.try_acquire() is None and t.in_use() == 2
    a.release()
    a.release()  # idempotent
    assert t.in_use() == 1
    with t.slot() as index:
        assert index == a.index and t.in_use() == 2
    assert t.in_use() == 1
    b.release()
    assert t.in_use() == 0
    assert sorted(p.name for p in (tmp_path / "th").iterdir()) == ["slot_0.lock", "slot_1.lock"]


def test_timeout_when_every_slot_is_held(tmp_path):
    t = Throttle(tmp_path, 1)
    with t.slot():
        start = time.monotonic()
        with pytest.raises(ThrottleTimeout, match="no Tinker throttle slot"):
            t.acquire(timeout=0.2)
        assert time.monotonic() - start < 10  # gave up (it would otherwise wait forever)


def test_threads_of_one_process_are_limited_too(tmp_path):
    t = Throttle(tmp_path, 2)
    lock = threading.Lock()
    current, peak = [0], [0]

    def work():
        with t.slot():
            with lock:
                current[0] += 1
                peak[0] = max(peak[0], current[0])
            time.sleep(0.05)
            with lock:
                current[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert peak[0] == 2


def _hold_and_log(directory, limit, log_path, hold_s):
    t = Throttle(directory, limit)
    with t.slot():
        with open(log_path, "a") as fh:
            fh.write(f"start {time.time()}\n")
        time.sleep(hold_s)
        with open(log_path, "a") as fh:
            fh.write(f"end {time.time()}\n")


def test_processes_never_exceed_max_concurrent(tmp_path):
    log = tmp_path / "events.log"
    procs = [
        CTX.Process(target=_hold_and_log, args=(tmp_path / "th", 2, log, 0.3)) for _ in range(5)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    events = sorted(
        (float(ts), kind) for kind, ts in (line.split() for line in log.read_text().splitlines())
    )
    assert len(events) == 10
    running = peak = 0
    for _, kind in events:  # at equal times an end sorts before a start
        running += 1 if kind == "start" else -1
        peak = max(peak, running)
    assert peak == 2


def _hold_forever(directory, ready):
    t = Throttle(directory, 1)
    t.acquire()
    ready.set()
    time.sleep(600)


def test_a_killed_holder_releases_its_slot(tmp_path):
    t = Throttle(tmp_path, 1)
    ready = CTX.Event()
    p = CTX.Process(target=_hold_forever, args=(tmp_path, ready))
    p.start()
    try:
        assert ready.wait(30)
        assert t.in_use() == 1
        with pytest.raises(ThrottleTimeout):
            t.acquire(timeout=0.2)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
        with t.slot(timeout=5) as index:  # the kernel dropped the dead holder's lock
            assert index == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def test_async_slot_waits_without_blocking_the_loop(tmp_path):
    t = Throttle(tmp_path, 1)
    order = []

    async def user(name, hold):
        async with t.async_slot():
            order.append(f"{name}+")
            await asyncio.sleep(hold)
            order.append(f"{name}-")

    async def main():
        await asyncio.gather(user("a", 0.1), user("b", 0.0))

    asyncio.run(main())
    assert order in (["a+", "a-", "b+", "b-"], ["b+", "b-", "a+", "a-"])

    async def blocked():
        async with t.async_slot(timeout=0.1):
            pass

    held = t.acquire()
    try:
        with pytest.raises(ThrottleTimeout):
            asyncio.run(blocked())
    finally:
        held.release()


def test_from_env_config_and_helpers(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_DIR, raising=False)
    monkeypatch.delenv(ENV_MAX, raising=False)
    assert Throttle.from_env() is None
    assert throttle_for(SimpleNamespace(throttle_dir="", max_concurrent=4)) is None
    with maybe_slot(None):
        pass

    env_t = Throttle.from_env({ENV_DIR: str(tmp_path / "e")})
    assert env_t is not None and env_t.max_concurrent == 4
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "e"))
    monkeypatch.setenv(ENV_MAX, "3")
    t = throttle_for(None)
    assert t is not None and t.max_concurrent == 3 and t.directory == tmp_path / "e"
    cfg_t = throttle_for(SimpleNamespace(throttle_dir=str(tmp_path / "c"), max_concurrent=2))
    assert cfg_t is not None and cfg_t.directory == tmp_path / "c" and cfg_t.max_concurrent == 2
    with maybe_slot(cfg_t):
        assert cfg_t.in_use() == 1

    with pytest.raises(RetrainError, match="not an integer"):
        Throttle.from_env({ENV_DIR: str(tmp_path), ENV_MAX: "many"})
    with pytest.raises(RetrainError, match=">= 1"):
        Throttle(tmp_path, 0)
