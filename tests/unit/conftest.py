"""Fixtures shared by the unit tests."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project directory as cwd; sys.path and the import finder caches restored after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    # a relative search path ("plugins") caches its finder per process: start afresh here
    monkeypatch.setattr(sys, "path_importer_cache", dict(sys.path_importer_cache))
    sys.path_importer_cache.pop("plugins", None)
    return tmp_path
