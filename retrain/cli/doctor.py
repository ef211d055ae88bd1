"""`retrain doctor [CONFIG] [--json] [--no-network]`: check the installation and environment.

Each check prints one line, OK / WARN / FAIL, and a fix when it is not OK; the exit
status is 1 when any check FAILs. Checks: Python, retrain and its extras, torch + CUDA
(GPU memory), each device's memory read without torch (nvidia-smi, /proc/meminfo) with a
local run's estimated peak beside its training device, the config, its backend's dependencies, whether the configured model is
on disk or reachable, what the run checks before its first step (the same checks as
`retrain explain`: the devices, reasoning-gym tasks, the custom reward, the advantage
flow as the run's preflight builds it, the tinker API key, a resume directory), the
retrain cache, free disk space for logs, and the wandb login.

Secrets are never printed: for API keys and tokens doctor says only whether they are set.
torch is imported inside its check only.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from retrain.models import HubAsk

OK, WARN, FAIL = "OK", "WARN", "FAIL"

# Fallback when retrain's own metadata is unavailable (running from a source tree).
EXTRAS_FALLBACK = {
    "local": ["torch", "transformers", "peft", "safetensors", "gguf"],
    "gym": ["reasoning-gym"],
    "math": ["math-verify"],
    "data": ["datasets"],
    "tinker": ["tinker"],
    "verifiers": ["verifiers"],
    "wandb": ["wandb"],
    "ray": ["ray"],
    "semantic": ["sentence-transformers"],
    "plots": ["matplotlib", "scipy"],
    "judge": ["httpx"],
    "prime_rl": ["msgspec", "pyzmq", "httpx"],
}
EXTRA_PURPOSE = {
    "local": "the local backend (PyTorch/PEFT training and sampling)",
    "gym": "[data] source = reasoning_gym and [reward] type = gym",
    "math": "[reward] type = math",
    "data": "[data] source = math (Hugging Face datasets)",
    "tinker": "[backend] backend = tinker",
    "verifiers": "[environment] provider = verifiers",
    "wandb": "[logging] wandb_project",
    "ray": "[campaign] executor = ray",
    "semantic": "[planning] detector = semantic",
    "plots": "retrain compare (statistics and plots)",
    "judge": "[reward] type = judge",
    "prime_rl": "[backend] backend = prime_rl",
}
SKIP_EXTRAS = {"dev"}
MIN_FREE_GB = 5.0


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


# ----------------------------------------------------------------------------- helpers


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _requirements() -> list[tuple[str, str | None, str | None]] | None:
    """(distribution, the extra that asks for it or None, its `>=` floor or None) for each
    of retrain's requirements, from its metadata; None where that is not installed."""
    try:
        requires = md.requires("retrain") or []
    except md.PackageNotFoundError:
        return None
    out = []
    for req in requires:
        spec, _, marker = req.partition(";")
        name = re.match(r"\s*([A-Za-z0-9_.\-]+)", spec)
        if not name or name.group(1) == "retrain":
            continue
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        floor = re.search(r">=\s*([0-9.]+)", spec)
        out.append(
            (
                name.group(1),
                extra.group(1) if extra else None,
                floor.group(1).rstrip(".") if floor else None,
            )
        )
    return out


def extras() -> dict[str, list[str]]:
    """Extra name -> distributions it installs, from retrain's metadata."""
    out: dict[str, list[str]] = {}
    for name, extra, _ in _requirements() or []:
        if extra and extra not in SKIP_EXTRAS:
            out.setdefault(extra, []).append(name)
    return out or dict(EXTRAS_FALLBACK)


def floors() -> dict[str, str]:
    """Distribution -> the oldest version retrain's requirements accept (`>=` in its
    metadata); {} where the metadata is not installed."""
    return {name: floor for name, _, floor in _requirements() or [] if floor}


def older(version: str, floor: str) -> bool:
    """Whether `version` (as a distribution reports it: "2.13.0+cpu", "5.0.0rc1") is
    older than `floor` ("2.11"), on their release numbers."""

    def release(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])

    have, want = release(version), release(floor)
    width = max(len(have), len(want))
    return have + (0,) * (width - len(have)) < want + (0,) * (width - len(want))


_EXTRA = re.compile(r"retrain\[(\w+)\]")


def _entry(kind: str, name: str) -> Any:
    """The registry entry behind a configured name (None: a dotted-path plugin)."""
    from retrain import registry

    return registry.ALL_REGISTRIES[kind].entry(name)


def _named_extras(config: Any) -> dict[str, str]:
    """Extras named by the install hints of the configured built-in entries."""
    from retrain.cli.startup_checks import configured_entries

    need: dict[str, str] = {}
    for kind, key, value in configured_entries(config, engine=False):
        entry = _entry(kind, value)
        match = _EXTRA.search(entry.install) if entry is not None else None
        if match:
            need.setdefault(match.group(1), f"{key} = {value}")
    return need


def needed_extras(config: Any) -> dict[str, str]:
    """Extras the config needs -> why."""
    if config is None:
        return {}
    need = _named_extras(config)
    if config.environment.provider == "verifiers":
        need["verifiers"] = "[environment] provider = verifiers"
    elif config.data.source == "math" and not config.data.path:
        need["data"] = "[data] source = math"
    if config.logging.wandb_project:
        need["wandb"] = "[logging] wandb_project"
    if config.campaign is not None and config.campaign.executor == "ray":
        need["ray"] = "[campaign] executor = ray"
    return need


def _uses_torch_here(config: Any) -> bool:
    """Whether the configured backend runs torch on this machine (a built-in that needs
    it; a plugin may or may not)."""
    entry = _entry("backend", config.backend.backend)
    return entry is not None and "torch" in entry.requires


def _loads_weights_remotely(config: Any) -> bool:
    """A built-in backend that ignores `[backend] devices` runs the model elsewhere."""
    entry = _entry("backend", config.backend.backend)
    return entry is not None and "[backend] devices" in entry.ignores


# ----------------------------------------------------------------------------- checks


def check_python() -> Check:
    v = sys.version_info
    text = f"{v.major}.{v.minor}.{v.micro} ({sys.executable})"
    if (v.major, v.minor) < (3, 11):
        return Check("python", FAIL, text, "retrain needs Python 3.11 or newer")
    return Check("python", OK, text)


def check_retrain() -> Check:
    from retrain import __version__

    return Check("retrain", OK, f"{__version__} ({Path(__file__).resolve().parents[1]})")


def check_extras(config: Any) -> list[Check]:
    out = []
    need, least = needed_extras(config), floors()
    for extra, dists in extras().items():
        versions = {d: _version(d) for d in dists}
        have = [f"{d} {v}" for d, v in versions.items() if v]
        missing = [d for d, v in versions.items() if not v]
        fix = f"pip install 'retrain[{extra}]'"
        name = f"extra [{extra}]"
        old = [
            f"{d} {v} (retrain needs >= {least[d]})"
            for d, v in versions.items()
            if v and d in least and older(v, least[d])
        ]
        if old and not missing:  # what retrain was not built against: it may not run
            status = FAIL if extra in need else WARN
            why = f"; needed by {need[extra]}" if extra in need else ""
            out.append(
                Check(
                    name,
                    status,
                    f"older than retrain runs with: {', '.join(old)}{why}",
                    f"pip install -U 'retrain[{extra}]'",
                )
            )
        elif not missing:
            out.append(Check(name, OK, ", ".join(have)))
        elif extra in need:
            out.append(
                Check(name, FAIL, f"missing {', '.join(missing)}; needed by {need[extra]}", fix)
            )
        elif have:
            out.append(
                Check(
                    name,
                    WARN,
                    f"partly installed ({', '.join(have)}); missing {', '.join(missing)}",
                    fix,
                )
            )
        else:
            out.append(
                Check(name, OK, f"not installed (optional: for {EXTRA_PURPOSE.get(extra, extra)})")
            )
    return out


def _no_cuda(torch, config: Any, wants_gpu: bool) -> Check:
    """The CUDA check where torch sees none: fine for a CPU run; a GPU run is refused (it
    never moves to the CPU by itself), and the cause named where nvidia-smi shows GPUs
    (torch's build, the driver, or CUDA_VISIBLE_DEVICES). `config`: None without one (a warning then)."""
    from retrain.hardware import TorchBuild, torch_lacks_gpus

    status, detail, fix = OK, 'CUDA not available: local runs use devices = "cpu"', ""
    if wants_gpu:
        asked = config.backend.devices if config is not None else "gpu:0"
        unseen = torch_lacks_gpus(TorchBuild.of(torch), 0)
        why = unseen[0] if unseen else "this machine has no CUDA device"
        detail = (
            f"CUDA not available, but [backend] devices = {asked!r} (the run refuses it): {why}"
        )
        status = FAIL if config is not None else WARN
        fix = unseen[1] if unseen else 'devices = "cpu" in [backend]'
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        detail += '; Apple MPS is available ([backend] devices = "mps")'
    return Check("cuda", status, detail, fix)


def check_torch(config: Any) -> list[Check]:
    from retrain.config.validate import asked_gpus

    wants_gpu = config is None or bool(asked_gpus(config.backend.devices))
    local = config is None or _uses_torch_here(config)
    if importlib.util.find_spec("torch") is None:
        status = FAIL if (config is not None and local) else WARN
        return [
            Check(
                "torch",
                status,
                "not installed",
                "install a torch build for your machine first (CPU: pip install torch --index-url "
                "https://download.pytorch.org/whl/cpu), then pip install 'retrain[local]'",
            )
        ]
    try:
        import torch
    except Exception as exc:  # a broken install (missing CUDA libraries, ...)
        return [
            Check("torch", FAIL, f"import failed: {type(exc).__name__}: {exc}", "reinstall torch")
        ]
    out = [Check("torch", OK, f"{torch.__version__}")]
    try:
        cuda = torch.cuda.is_available()
    except Exception:
        cuda = False
    if not cuda:
        out.append(_no_cuda(torch, config if local and wants_gpu else None, wants_gpu and local))
        return out
    count = torch.cuda.device_count()
    out.append(Check("cuda", OK, f"CUDA {torch.version.cuda}, {count} device(s)"))
    for i in range(count):
        try:
            props = torch.cuda.get_device_properties(i)
            total = props.total_memory / 2**30
            detail = f"{props.name}, {total:.1f} GiB"
            try:
                free, _ = torch.cuda.mem_get_info(i)
                detail += f" ({free / 2**30:.1f} GiB free)"
            except Exception:
                pass
            status = OK if total >= 16 else WARN
            fix = (
                ""
                if status == OK
                else "under 16 GiB: use a small model, lower max_tokens/batch_size, or the tinker backend"
            )
            out.append(Check(f"gpu:{i}", status, detail, fix))
        except Exception as exc:
            out.append(Check(f"gpu:{i}", WARN, f"cannot query: {exc}"))
    if config is not None and local:
        for part in config.backend.devices.split(","):
            part = part.strip()
            if part.startswith(("gpu:", "cuda:")) and int(part.split(":")[1]) >= count:
                out.append(
                    Check(
                        "devices",
                        FAIL,
                        f"[backend] devices names {part}, but only {count} CUDA device(s) are visible",
                        "fix [backend] devices or CUDA_VISIBLE_DEVICES",
                    )
                )
    return out


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f}"


def check_memory(config: Any) -> list[Check]:
    """The memory each device has, read without torch (retrain/hardware.py: nvidia-smi
    for each CUDA device, /proc/meminfo for the CPU), and, for a local run, its estimated
    peak beside its training device's free memory (`retrain explain`'s estimate). An
    estimate over the free memory is already a `run checks` FAIL; near it, a WARN here."""
    from retrain.hardware import cuda_device_count, device_memory, gpu_name, gpu_order_unknown

    gpus = range(cuda_device_count())
    devices = [(f"gpu:{i}", device_memory("cuda", i), gpu_name(i)) for i in gpus]
    devices.append(("cpu", device_memory("cpu"), None))
    unordered = gpu_order_unknown() if gpus else None
    estimate = _local_estimate(config)
    out = []
    for name, found, model in devices:
        if found is None and name != "cpu" and unordered:
            fix = "export CUDA_DEVICE_ORDER=PCI_BUS_ID (torch then numbers them as nvidia-smi does)"
            out.append(Check(f"memory {name}", WARN, f"cannot read its memory: {unordered}", fix))
            continue
        if found is None:
            source = "/proc/meminfo" if name == "cpu" else "nvidia-smi"
            out.append(Check(f"memory {name}", WARN, f"cannot read its memory ({source})"))
            continue
        free, total = found
        detail = f"{_gib(free)} of {_gib(total)} GiB free" + (f" ({model})" if model else "")
        status, fix = OK, ""
        if estimate and estimate.get("device") in (name, name.replace("gpu:", "cuda:")):
            detail += f"; the run's estimated peak ~{estimate['peak_memory_gib']:g} GiB"
            problem = estimate.get("memory_problem")
            if problem:
                status, fix = WARN, problem["message"]
                detail += (
                    "; a completion of max_tokens would not fit a micro-batch"
                    if problem.get("what") == "completion"
                    else ", over it"
                    if problem["level"] == "error"
                    else ", close to it"
                )
        out.append(Check(f"memory {name}", status, detail, fix))
    return out


def _local_estimate(config: Any) -> dict[str, Any] | None:
    """explain's memory estimate of a local run's step, or None (no config, another
    backend, or no estimate)."""
    if config is None or config.backend.backend != "local":
        return None
    from retrain.cli.estimates import memory_estimate

    try:
        estimate = memory_estimate(config)
    except Exception:  # a check must not take doctor down; run checks reports the config
        return None
    return estimate if estimate.get("peak_memory_gib") is not None else None


def check_config(path: str | None, flags: list[str] | None = None) -> tuple[list[Check], Any]:
    """The config's checks (one FAIL per problem, so a name that is not built in this
    version is named with its key, line and fix) and the loaded config, or None."""
    from retrain.config import load_config
    from retrain.errors import ConfigError

    p = Path(path or "retrain.toml")
    if not p.exists():
        if path:
            return [
                Check("config", FAIL, f"{p} not found", "pass the path of an existing TOML")
            ], None
        if flags:  # the run's rule (cli/run.py `config_path`): the defaults plus the flags
            return _defaults_with(flags)
        return [
            Check(
                "config",
                WARN,
                "no retrain.toml in this directory; the model/backend checks use the defaults",
                "retrain init --template quickstart (or pass a config: retrain doctor my.toml)",
            )
        ], None
    try:
        config = load_config(p, flags or [])
    except ConfigError as exc:
        problems = exc.problems or [str(exc)]
        fix = f"edit {p}; retrain explain {p} says the same"
        return [Check("config", FAIL, f"{p}: {problem}", fix) for problem in problems], None
    what = config.condition
    if config.campaign is not None:  # the base config's condition is no run's
        from retrain.campaign.conditions import campaign_conditions

        labels = [c.label for c in campaign_conditions(config)]
        what = f"a campaign of {', '.join(labels)} x {len(config.campaign.seeds)} seeds"
    detail = f"{p} is valid ({what}, backend {config.backend.backend})"
    from retrain.cli.run import is_standalone_squeeze

    if is_standalone_squeeze(config):
        detail = f"{p} is valid (a standalone LoRA-Squeeze of {config.squeeze.adapter_path})"
    return [Check("config", OK, detail)], config


def _defaults_with(flags: list[str]) -> tuple[list[Check], Any]:
    """The built-in defaults plus `flags`, as the run takes flags without ./retrain.toml."""
    from retrain.config import load_config
    from retrain.errors import ConfigError

    try:
        config = load_config(None, flags)
    except ConfigError as exc:
        fix = "fix the flag; retrain explain with the same flags says the same"
        return [Check("config", FAIL, problem, fix) for problem in exc.problems], None
    detail = (
        "no retrain.toml: the built-in defaults plus the flags given are valid "
        f"({config.condition}, backend {config.backend.backend})"
    )
    return [Check("config", OK, detail)], config


def check_backend(config: Any) -> Check:
    from retrain.backends.base import backend_info
    from retrain.errors import RetrainError

    name = config.backend.backend if config is not None else "local"
    search = tuple(config.plugins.search_paths) if config is not None else ()
    try:
        info = backend_info(name, search)
    except RetrainError as exc:
        return Check(
            "backend", FAIL, f"{name}: {exc}", "check [backend] backend and [plugins] search_paths"
        )
    caps = info.capabilities
    flags = ", ".join(
        f"{k}={'yes' if v else 'no'}" for k, v in caps.as_dict().items() if isinstance(v, bool)
    )
    detail = f"{info.name} (source={info.source}): {flags}"
    if info.source == "plugin/default":
        return Check(
            "backend",
            WARN,
            detail + "; no capability hooks, conservative defaults",
            "define retrain_backend_capabilities on the backend class or module (retrain backends)",
        )
    return Check("backend", OK, detail)


def check_backend_probe(config: Any) -> list[Check]:
    """The configured backend's own probe (servers, transport directory or socket), run
    before any model load; nothing for backends without one."""
    if config is None:
        return []
    from retrain.startup import backend_problems, engine_problems, probes

    entry = _entry("backend", config.backend.backend)
    if entry is None or not probes(config):
        return []
    problems = engine_problems(config) + backend_problems(config)
    if not problems:
        return [Check("backend probe", OK, f"{entry.name}: servers and transport answer")]
    return [
        Check(
            "backend probe",
            FAIL,
            f"{key}: {problem.split(' Fix: ')[0]}",
            problem.partition(" Fix: ")[2],
        )
        for key, problem in problems
    ]


def check_run(config: Any, path: str | None, launch: Any = None) -> list[Check]:
    """What the run itself would refuse before its first step, found the way `retrain
    explain` finds it (the same report, no model load): the advantage flow against the
    backend, campaign runs, the reasoning-gym task, the custom reward, the devices against
    this machine, a resume directory, modules of the configured entries. A config that
    loads but cannot run is a FAIL here, so doctor never passes it. (The model and the
    extras have their own lines.)"""
    if config is None:
        return []
    from retrain.cli.explain import build_report

    try:  # the model has its own line, which asks the hub once
        report = build_report(config, path, launch, ask=None)
    except Exception as exc:  # a check must not take doctor down
        return [Check("run checks", FAIL, f"{type(exc).__name__}: {exc}", "retrain explain")]
    errors = [
        e
        for e in report.get("errors", [])
        if not e.startswith("[model] model") and "retrain[" not in e
    ]
    env = [Check("environment", OK, report["environment"])] if report.get("environment") else []
    if not errors:
        return env + [Check("run checks", OK, "what the run checks before its first step passes")]
    fix = f"retrain explain {path or '(with the same flags)'} says the same"
    return [Check("run checks", FAIL, e, fix) for e in errors]


def check_model(config: Any, network: bool, ask: HubAsk | None = None) -> Check:
    """Whether the configured model can be had, decided as the run's start decides it
    (retrain/models.py's `find_model`: on disk, in a cache, or one metadata request to the
    hub; `ask` replaces that request). Without the network the hub is not asked."""
    from retrain.models import ask_hub, find_model
    from retrain.startup import source_problems

    model = config.model.model if config is not None else "Qwen/Qwen3-4B-Instruct-2507"
    found = find_model(model, (ask or ask_hub) if network else None)
    if found.unchecked:
        return Check("model", WARN, f"{model}: {found.where} (--no-network)")
    if not found.problem:
        remote = config is not None and _loads_weights_remotely(config)
        service = f"; weights load on the {config.backend.backend} service" if remote else ""
        return Check("model", OK, f"{model}: {found.where}{service}")
    problems = source_problems(config, found) if config is not None else []
    key, problem = problems[0] if problems else ("[model] model", found.problem)
    detail, _, fix = problem.partition(" Fix: ")
    return Check("model", FAIL, f"{key}: {detail}", fix)


def check_cache() -> Check:
    from retrain.models import cache_dir

    root = cache_dir()
    probe_dir = root
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if not os.access(probe_dir, os.W_OK):
        return Check(
            "cache", FAIL, f"{root} is not writable", "set RETRAIN_CACHE to a writable directory"
        )
    size = ""
    models = root / "models"
    if models.is_dir():
        names = sorted(p.name for p in models.iterdir() if p.is_dir())
        size = f"; models: {', '.join(names)}" if names else ""
    state = "exists" if root.exists() else "created on first use"
    return Check("cache", OK, f"{root} ({state}{size}; RETRAIN_CACHE overrides)")


def check_disk(config: Any) -> Check:
    log_dir = Path(config.logging.log_dir if config is not None else "logs")
    probe = log_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free / 2**30
    except OSError as exc:
        return Check("disk", WARN, f"cannot read free space at {probe}: {exc}")
    if free < MIN_FREE_GB:
        return Check(
            "disk", WARN, f"{free:.1f} GiB free at {probe}", "free space for checkpoints and logs"
        )
    return Check("disk", OK, f"{free:.0f} GiB free for {log_dir}")


def check_wandb(config: Any) -> Check:
    wanted = bool(config is not None and config.logging.wandb_project)
    if _version("wandb") is None:
        if wanted:
            return Check(
                "wandb",
                FAIL,
                "[logging] wandb_project is set but wandb is not installed",
                "pip install 'retrain[wandb]'",
            )
        return Check("wandb", OK, "not installed (only needed with [logging] wandb_project)")
    from retrain.logs.wandb import LOGIN_FIX, login, not_logged_in

    logged_in, how = login()
    if logged_in:
        return Check("wandb", OK, how)
    status = WARN
    detail = (
        not_logged_in(config.logging.wandb_project)
        if wanted
        else "not logged in (wandb is off unless [logging] wandb_project is set)"
    )
    if not wanted:
        status = OK
    return Check(
        "wandb",
        status,
        detail,
        LOGIN_FIX if wanted else "",
    )


def check_secrets() -> Check:
    known = ("HF_TOKEN", "WANDB_API_KEY", "OPENAI_API_KEY", "TINKER_API_KEY")
    names = [n for n in known if os.environ.get(n)]
    return Check(
        "secrets",
        OK,
        f"set: {', '.join(names)}"
        if names
        else f"none of {', '.join(known)} is set (values are never shown)",
    )


def run_checks(
    config_path: str | None = None,
    *,
    network: bool = True,
    torch: bool = True,
    flags: list[str] | None = None,
    overwrite: bool = False,
) -> list[Check]:
    """`flags` and `overwrite`: the run's command line, checked as the run would take it."""
    from retrain.cli.run import is_standalone_squeeze
    from retrain.config import load_dotenv
    from retrain.logs.ownership import launch_for

    load_dotenv()
    checks = [check_python(), check_retrain()]
    config_checks, config = check_config(config_path, flags)
    checks += config_checks
    # the file the config came from: None where it is the defaults plus flags
    path = config_path or ("retrain.toml" if Path("retrain.toml").is_file() else None)
    launch = launch_for(path, flags or [], overwrite=overwrite)
    if config is not None and is_standalone_squeeze(config):
        # a squeeze reads one adapter on [squeeze] device: no model, backend or training
        # device to check (its own checks are explain's, in `run checks`)
        return [
            *checks,
            *(c for c in (check_torch(None) if torch else []) if c.name == "torch"),
            *check_run(config, path, launch),
        ]
    checks += check_extras(config)
    if torch:
        checks += check_torch(config)
    checks += check_memory(config)
    checks.append(check_backend(config))
    checks += check_run(config, path, launch)
    if network:
        checks += check_backend_probe(config)
    if config is None and any(c.name == "config" and c.status == FAIL for c in config_checks):
        # the defaults' model is not the one the file names: no FAIL for a model not asked for
        checks.append(Check("model", WARN, "not checked: the config does not load", "fix it first"))
    else:
        checks.append(check_model(config, network))
    checks.append(check_cache())
    checks.append(check_disk(config))
    checks.append(check_wandb(config))
    checks.append(check_secrets())
    return checks


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name.ljust(width)}  {c.detail}")
        if c.fix and c.status != OK:
            lines.append(f"{'':<4}  {''.ljust(width)}  fix: {c.fix}")
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    lines.append("")
    lines.append(
        f"{fails} failure(s), {warns} warning(s)" if fails or warns else "All checks passed."
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from retrain.cli.args import split_config_args

    p = argparse.ArgumentParser(
        prog="retrain doctor",
        usage="retrain doctor [CONFIG] [--flag value ...] [--json] [--no-network] [--overwrite]",
        description="Check Python, extras, torch/CUDA, the model, the cache and wandb. Exits 1 "
        "on a FAIL. CONFIG (default ./retrain.toml if present) and config flags are taken as "
        "the run takes them.",
        allow_abbrev=False,
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--no-network", action="store_true", help="skip the hub reachability probe")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="as the run's --overwrite: directories holding another run are moved aside",
    )
    args, rest = p.parse_known_args(argv)
    path, flags = split_config_args(rest)
    checks = run_checks(path, network=not args.no_network, flags=flags, overwrite=args.overwrite)
    failed = any(c.status == FAIL for c in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render(checks))
    return 1 if failed else 0
