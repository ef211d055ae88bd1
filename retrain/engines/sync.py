"""The live-adapter folder: where the local backend publishes each optimizer step's LoRA
adapter for a server engine to load.

Every version goes to a new folder, `{adapter_path}/_live_adapter/v000012/`, written to a
temporary sibling and renamed into place, so a server never reads a half-written adapter.
A new folder per version matters: vLLM reloading an adapter in place from the *same*
folder reuses cached work of the old weights (measured: logprobs off by 0.024). The last
`keep` folders stay (the server may still be reading the previous one while it loads the
new one); older ones are removed. Versions continue after the highest folder already
there, so a resumed run never reuses a folder name the server has seen.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

LIVE_DIR = "_live_adapter"
_VERSION = re.compile(r"^v(\d{6,})$")


class LiveAdapterDir:
    """Versioned adapter folders under `root` (`{adapter_path}/_live_adapter`)."""

    def __init__(self, root: str | Path, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.version = max(self.versions(), default=0)

    def versions(self) -> list[int]:
        """The versions present, oldest first."""
        if not self.root.is_dir():
            return []
        found = (_VERSION.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def publish(self, save: Callable[[Path], None]) -> tuple[int, Path]:
        """Write the next version with `save(tmp_dir)`, rename it into place atomically,
        prune all but the last `keep`, and return (version, folder)."""
        self.root.mkdir(parents=True, exist_ok=True)
        version = self.version + 1
        target = self.path(version)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version:06d}.tmp-", dir=self.root))
        try:
            save(tmp)
            for f in tmp.iterdir():  # on disk before the server is told to read it
                if f.is_file():
                    with open(f, "rb") as fh:
                        os.fsync(fh.fileno())
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.version = version
        self.prune()
        return version, target

    def prune(self) -> None:
        for old in self.versions()[: -self.keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)
