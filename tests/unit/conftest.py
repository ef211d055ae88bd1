"""Fixtures shared by the unit tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hub_standin import HubStandIn  # noqa: E402

# Property tests draw the same examples on every run (a run that fails once fails always,
# and CI cannot fail on a new random draw), with no example database and no deadline.
settings.register_profile("retrain", derandomize=True, database=None, deadline=None)
settings.load_profile("retrain")


@pytest.fixture(autouse=True)
def _empty_cwd(tmp_path_factory, monkeypatch):
    """Every test starts in an empty directory of its own: a config's relative log and
    adapter directories (logs/quickstart, ...) must not find a developer's runs in the
    checkout, which a run, `explain` and `doctor` refuse as another run's files."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project directory as cwd; sys.path and the import finder caches restored after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    # a relative search path ("plugins") caches its finder per process: start afresh here
    monkeypatch.setattr(sys, "path_importer_cache", dict(sys.path_importer_cache))
    sys.path_importer_cache.pop("plugins", None)
    return tmp_path


@pytest.fixture
def import_counts(monkeypatch):
    """Records every registry import and every importlib.invalidate_caches call."""
    import importlib

    from retrain import registry

    counts = {"imports": [], "invalidations": []}
    real_import, real_invalidate = registry.import_object, importlib.invalidate_caches

    def counting_import(*args, **kw):
        counts["imports"].append(args[0])
        return real_import(*args, **kw)

    def counting_invalidate():
        counts["invalidations"].append(1)
        real_invalidate()

    monkeypatch.setattr(registry, "import_object", counting_import)
    monkeypatch.setattr(importlib, "invalidate_caches", counting_invalidate)
    return counts


@pytest.fixture(scope="session")
def hub_standin():
    hub = HubStandIn()
    yield hub
    hub.close()


@pytest.fixture(autouse=True)
def hub(hub_standin, monkeypatch):
    """The model check (`find_model`) asks this stand-in for the hub, never the real one,
    so every machine, connected or not, gets the same answers: every model exists unless
    a test adds it to `hub.missing`."""
    hub_standin.reset()
    monkeypatch.setenv("HF_ENDPOINT", hub_standin.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return hub_standin


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine where nvidia-smi counts one CUDA device (what a config with the default
    `[backend] devices = "gpu:0"` is written for), with torch's CUDA build."""
    from retrain.hardware import TorchBuild

    monkeypatch.setattr("retrain.hardware.cuda_device_count", lambda **kw: 1)
    monkeypatch.setattr("retrain.hardware.torch_build", lambda: TorchBuild("2.13.0", "12.8"))


def _addmm_takes_out_dtype_on_meta() -> bool:
    import torch

    meta = {"device": "meta", "dtype": torch.bfloat16}
    a, b = torch.empty(2, 2, **meta), torch.empty(2, 2, **meta)
    try:
        torch.addmm(a.float(), a, b, out_dtype=torch.float32)
    except TypeError:  # torch 2.11: its decomposition binds out_dtype to beta
        return False
    return True


@pytest.fixture
def meta_addmm(monkeypatch):
    """`torch.addmm(..., out_dtype=)` (and its `out=` form) on the meta device, for tests
    that trace CUDA's branch there. Torch 2.11 (the GPU image's) has no meta kernel for
    that overload, and the decomposition it falls back to takes out_dtype for beta
    (pytorch#179634; CUDA's kernel is right). There it becomes the product, then the add:
    the same result's shape and dtype."""
    import torch

    if _addmm_takes_out_dtype_on_meta():
        return
    real = torch.addmm

    def addmm(c, a, b, *, alpha=1, out_dtype=None, out=None, **kwargs):
        if out_dtype is None or c.device.type != "meta":
            return real(c, a, b, alpha=alpha, out=out, **kwargs)
        summed = torch.add(c, torch.mm(a, b, out_dtype=out_dtype), alpha=alpha)
        return summed if out is None else out.copy_(summed)

    monkeypatch.setattr(torch, "addmm", addmm)
