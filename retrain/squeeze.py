"""LoRA-Squeeze: how much rank does a trained LoRA adapter really use, and a smaller copy.

Train at a generous rank, then ask each layer's update ``delta = B @ A`` (B: out x r,
A: r x in) how its energy spreads over singular directions. The spectrum comes from small
factors only: ``B = Q_B R_B`` and ``A^T = Q_A R_A`` (reduced QR), so
``B @ A = Q_B (R_B R_A^T) Q_A^T`` and the singular values of ``delta`` are those of the r x r
core ``R_B R_A^T``. The full out x in product is never formed.

Retained variance at rank k: ``V(k) = sum(s[:k]^2) / sum(s^2)``. The analysis reports the
mean / min / max of V(k) over layers for a list of target ranks and recommends the smallest
rank whose mean V(k) reaches ``min_variance_retention``.

Conventions:
* A layer whose update is exactly zero (e.g. a freshly initialised LoRA, where B = 0) has no
  spectrum: it is left out of the mean, min and max, which it would otherwise pull up (as
  V = 1) or down (as V = 0). Its count is reported (``zero_layers``); an adapter that is
  zero throughout retains everything (V = 1).
* A layer whose own rank is below k (``rank_pattern``) retains everything at k: V(k) = 1.
* Default target ranks: powers of two below the source rank, plus the source rank. The
  source rank is always part of the table (V = 1 there), so a recommendation always exists.
* Compression to rank k writes ``B' = Q_B U_k sqrt(S_k)`` and
  ``A' = sqrt(S_k) V_k^T Q_A^T``, so ``B' A'`` is the best rank-k approximation of ``B A``
  (Eckart-Young): the squared Frobenius error is the discarded energy ``sum(s[k:]^2)``
  (times the scale squared). The new config has ``r = k`` and
  ``lora_alpha = lora_alpha * k / r`` (``* sqrt(k / r)`` with rsLoRA), so PEFT's scale
  ``lora_alpha / r`` (``/ sqrt(r)``) is unchanged. ``rank_pattern`` and ``alpha_pattern``
  are cleared; a layer whose old scale differed from the new uniform one (because of those
  patterns) gets the ratio folded into its factors, and layers with fewer than k singular
  directions are padded with zero rows/columns. The delta of every layer is thus exactly the
  truncated delta.

torch and safetensors are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.checkpoint import TRAINING_STATE
from retrain.errors import RetrainError
from retrain.hardware import cuda_device_count
from retrain.logs.rundir import cannot_write_in, run_dir_holding

__all__ = [
    "LayerSpectrum",
    "RankRow",
    "SqueezeError",
    "SqueezeResult",
    "analyze_adapter",
    "compress_adapter",
    "config_problems",
    "default_target_ranks",
    "squeeze_from_options",
]

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"

# (suffix of the A key, suffix of the B key)
_PAIRS = (
    ("lora_A.weight", "lora_B.weight"),
    ("lora_embedding_A", "lora_embedding_B"),
)


# lora_alpha where adapter_config.json has none: PEFT's LoraConfig default
PEFT_DEFAULT_ALPHA = 8.0


class SqueezeError(RetrainError):
    """The adapter cannot be analysed or compressed (missing files, bad ranks, ...): a
    problem with what was asked, found before anything is written (exit 2, as a config
    error; a service that fails to answer is a BackendError, exit 1)."""

    exit_code = 2


# ------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class RankRow:
    """Retained variance at one rank, over all layers."""

    rank: int
    mean_variance: float
    min_variance: float
    max_variance: float


@dataclass(frozen=True)
class LayerSpectrum:
    """Singular values of one layer's ``B @ A`` (unscaled, descending)."""

    name: str
    rank: int
    singular_values: tuple[float, ...]

    @property
    def energy(self) -> float:
        return math.fsum(s * s for s in self.singular_values)

    def variance_at(self, k: int) -> float:
        """V(k) = sum(s[:k]^2) / sum(s^2); 1.0 for a zero update or k >= its rank."""
        total = self.energy
        if total <= 0.0 or k >= len(self.singular_values):
            return 1.0
        kept = math.fsum(s * s for s in self.singular_values[:k])
        return min(1.0, max(0.0, kept / total))


@dataclass
class SqueezeResult:
    adapter_path: str
    source_rank: int
    num_layers: int
    min_variance_retention: float
    recommended_rank: int
    rows: list[RankRow]
    layers: list[LayerSpectrum] = field(default_factory=list, repr=False)
    zero_layers: int = 0
    compressed_path: str | None = None
    compressed_rank: int | None = None

    @property
    def mean_variance(self) -> dict[int, float]:
        """Mean retained variance by rank."""
        return {row.rank: row.mean_variance for row in self.rows}

    def row(self, rank: int) -> RankRow:
        for r in self.rows:
            if r.rank == rank:
                return r
        raise KeyError(rank)

    def format_table(self) -> str:
        """The variance table, recommended row marked."""
        head = (
            f"LoRA-Squeeze: {self.adapter_path}\n"
            f"source rank {self.source_rank}, {self.num_layers} layers"
            + (f" ({self.zero_layers} with a zero update)" if self.zero_layers else "")
            + f", target retention {self.min_variance_retention:.2%}\n"
        )
        lines = [f"{'rank':>6}  {'mean V(k)':>10}  {'min V(k)':>10}  {'max V(k)':>10}"]
        for r in self.rows:
            mark = "  <- recommended" if r.rank == self.recommended_rank else ""
            lines.append(
                f"{r.rank:>6}  {r.mean_variance:>10.4f}  {r.min_variance:>10.4f}  "
                f"{r.max_variance:>10.4f}{mark}"
            )
        tail = f"\nrecommended rank: {self.recommended_rank} (of {self.source_rank})"
        if self.compressed_path:
            tail += f"\ncompressed adapter (rank {self.compressed_rank}): {self.compressed_path}"
        return head + "\n".join(lines) + tail

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (what campaigns write into manifest.json)."""
        out: dict[str, Any] = {
            "recommended_rank": self.recommended_rank,
            "source_rank": self.source_rank,
            "num_layers": self.num_layers,
            "zero_layers": self.zero_layers,
            "min_variance_retention": self.min_variance_retention,
            "adapter_path": self.adapter_path,
            "ranks": [
                {
                    "rank": r.rank,
                    "mean_variance": r.mean_variance,
                    "min_variance": r.min_variance,
                    "max_variance": r.max_variance,
                }
                for r in self.rows
            ],
        }
        if self.compressed_path:
            out["compressed_path"] = self.compressed_path
            out["compressed_rank"] = self.compressed_rank
        return out


# ------------------------------------------------------------------------------------------
# Reading adapters


def _fetch_tinker(tinker_path: str) -> Path:
    """A `tinker://` checkpoint fetched through the Tinker SDK as a local PEFT adapter (the
    sampler weights of that checkpoint, cached under the retrain cache). The service is
    TINKER_BASE_URL (else the SDK default); the key is TINKER_API_KEY."""
    from retrain.backends.tinker import fetch_adapter
    from retrain.errors import BackendError

    try:
        return fetch_adapter(tinker_path)
    except BackendError as e:
        raise BackendError(f"cannot fetch the adapter {tinker_path}: {e}") from e


def saved_adapters_in(path: Path) -> list[Path]:
    """The saved adapters a directory holds, such as a run's [backend] adapter_path (its
    final/ and checkpoint_step_N/): the final one first, then the newest checkpoint."""

    def order(d: Path) -> tuple[bool, int, str]:
        step = re.fullmatch(r"checkpoint_step_(\d+)", d.name)
        return d.name != "final", -int(step.group(1)) if step else 0, d.name

    return sorted((d for d in path.iterdir() if (d / SAFETENSORS_NAME).is_file()), key=order)


def _adapter_problem(path: Path) -> str | None:
    """Why the local directory `path` is not a PEFT adapter to read, or None."""
    if not path.exists():
        return f"adapter directory not found: {path}"
    if not path.is_dir():
        return f"{path} is a file, not a directory (an adapter is a directory with {CONFIG_NAME})"
    if not (path / CONFIG_NAME).is_file():
        saved = saved_adapters_in(path)
        inside = f"; it holds the saved adapters {', '.join(map(str, saved[:4]))}" if saved else ""
        return f"{path} is not a PEFT adapter: {CONFIG_NAME} is missing{inside}"
    if not (path / SAFETENSORS_NAME).is_file() and not (path / BIN_NAME).is_file():
        return f"{path} holds neither {SAFETENSORS_NAME} nor {BIN_NAME}"
    return None


def _check_local(adapter_path: str | Path) -> Path:
    text = str(adapter_path)
    path = _fetch_tinker(text) if text.startswith("tinker://") else Path(text).expanduser()
    problem = _adapter_problem(path)
    if problem is not None:
        raise SqueezeError(problem)
    return path


def _read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SqueezeError(f"cannot read {path / CONFIG_NAME}: {e}") from e
    if not isinstance(cfg, dict):
        raise SqueezeError(f"{path / CONFIG_NAME} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise SqueezeError(f"{path} is a {peft_type} adapter; LoRA-Squeeze handles LORA only")
    if cfg.get("target_parameters"):
        # PEFT stacks one rank-r block per expert into each factor (r*E rows of lora_A):
        # read as one layer, its spectrum and a compression of it would both be wrong
        raise SqueezeError(
            f"{path} adapts parameters (target_parameters = {cfg['target_parameters']!r}, "
            "e.g. mixture-of-experts weights), whose LoRA factors stack one block per expert; "
            "LoRA-Squeeze handles adapters of target_modules only"
        )
    return cfg


def _read_weights(path: Path) -> dict[str, Any]:
    import torch

    try:
        if (path / SAFETENSORS_NAME).is_file():
            from safetensors.torch import load_file

            return dict(load_file(str(path / SAFETENSORS_NAME), device="cpu"))
        state = torch.load(str(path / BIN_NAME), map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or unreadable file
        raise SqueezeError(f"cannot read the adapter weights in {path}: {e}") from e
    if not isinstance(state, dict):
        raise SqueezeError(f"{path / BIN_NAME} does not hold a state dict")
    return dict(state)


@dataclass
class _Layer:
    name: str
    a_key: str
    b_key: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    rank: int


def _pair_layers(weights: dict[str, Any]) -> list[_Layer]:
    layers, used = [], set()
    for key in sorted(weights):
        for a_suffix, b_suffix in _PAIRS:
            if not key.endswith(a_suffix):
                continue
            stem = key[: -len(a_suffix)]
            b_key = stem + b_suffix
            if b_key not in weights:
                raise SqueezeError(f"adapter weight {key} has no matching {b_key}")
            a, b = weights[key], weights[b_key]
            if not (hasattr(a, "dim") and hasattr(b, "dim")):
                raise SqueezeError(f"{stem}: LoRA factors are not tensors")
            if a.dim() < 2 or b.dim() < 2:
                raise SqueezeError(f"{stem}: LoRA factors must be at least 2-D")
            r = int(a.shape[0])
            if int(b.shape[1]) != r or any(int(d) != 1 for d in b.shape[2:]):
                raise SqueezeError(
                    f"{stem}: factor shapes {tuple(b.shape)} x {tuple(a.shape)} do not chain"
                )
            layers.append(_Layer(stem.rstrip("."), key, b_key, tuple(a.shape), tuple(b.shape), r))
            used.update((key, b_key))
    orphans = [k for k in weights if k.endswith(tuple(b for _, b in _PAIRS)) and k not in used]
    if orphans:
        raise SqueezeError(f"adapter weight {orphans[0]} has no matching lora_A")
    if not layers:
        raise SqueezeError("the adapter holds no LoRA layers (no lora_A / lora_B weights)")
    return layers


def _detect_rank(cfg: dict[str, Any], layers: list[_Layer], path: Path) -> int:
    r = cfg.get("r")
    if isinstance(r, int) and not isinstance(r, bool) and r > 0:
        return r
    ranks = {layer.rank for layer in layers}
    if len(ranks) != 1:
        raise SqueezeError(f"{path}: config has no rank `r` and layer ranks differ: {ranks}")
    return ranks.pop()


def _resolve_source_rank(requested: int, detected: int, path: Path) -> int:
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise SqueezeError(f"source_rank must be an integer >= 0 (0 = detect), got {requested!r}")
    if requested and requested != detected:
        raise SqueezeError(
            f"[squeeze] source_rank = {requested}, but the adapter at {path} has rank "
            f"{detected}; set source_rank = 0 to detect it, or point at the right adapter"
        )
    return detected


def _torch_device(device: str):
    import torch

    try:  # [backend] devices' spelling: gpu:N is torch's cuda:N
        dev = torch.device(device.strip().replace("gpu:", "cuda:"))
        torch.zeros(1, device=dev)
    except Exception as e:
        raise SqueezeError(f"[squeeze] device = {device!r} is not usable here: {e}") from e
    return dev


def _factors(a, b, dev):
    """(B2, A2) as float64 2-D matrices on `dev`: B2 out x r, A2 r x in."""
    import torch

    r = a.shape[0]
    a2 = a.detach().to(device=dev, dtype=torch.float64).reshape(r, -1)
    b2 = b.detach().to(device=dev, dtype=torch.float64).reshape(b.shape[0], r)
    return b2, a2


def _core_svd(b2, a2):
    """Return (Q_B, U, S, Vh, Q_A) with B2 @ A2 == Q_B @ U @ diag(S) @ Vh @ Q_A^T."""
    import torch

    q_b, r_b = torch.linalg.qr(b2, mode="reduced")
    q_a, r_a = torch.linalg.qr(a2.T, mode="reduced")
    core = r_b @ r_a.T
    u, s, vh = torch.linalg.svd(core, full_matrices=False)
    return q_b, u, s, vh, q_a


# ------------------------------------------------------------------------------------------
# Checks before any weights load


def _output_problem(out: Path, adapter: Path | None, force: bool) -> str | None:
    """Why the compressed adapter cannot go to `out`, or None. Nothing saved is
    overwritten: another run's checkpoint (its training_state.pt would no longer match
    the weights beside it) and a run's log directory never, other files only with force."""
    if adapter is not None and out.resolve() == adapter.resolve():
        return "must differ from the adapter it compresses"
    if out.exists() and not out.is_dir():
        return f"{out} is a file, not a directory"
    if (out / TRAINING_STATE).exists():
        return f"{out} holds {TRAINING_STATE}: it is a run's checkpoint, which stays as saved"
    run = run_dir_holding(out)
    if run is not None:
        return f"{out} is inside the log directory of a run ({run}), which stays as saved"
    if out.is_dir() and any(out.iterdir()) and not force:
        return f"{out} is not empty; name a new directory (or pass --force to write into it)"
    return cannot_write_in(out)


def _local_rank(path: Path) -> tuple[int | None, str | None]:
    """(the rank `r` in the adapter's config or None, why the config is unusable or None),
    read without torch."""
    try:
        cfg = _read_config(path)
    except SqueezeError as exc:
        return None, str(exc)
    r = cfg.get("r")
    return (r if isinstance(r, int) and not isinstance(r, bool) and r > 0 else None), None


def _device_problem(device: str, count_cuda: Callable[[], int]) -> str | None:
    kind, _, index = device.strip().partition(":")
    if kind not in ("gpu", "cuda"):
        return None
    n = int(index or 0) if (index or "0").isdigit() else 0
    present = count_cuda()
    if n < present:
        return None
    has = f"{present} CUDA device(s)" if present else "no CUDA device (nvidia-smi finds none)"
    return f"{device!r} asks for CUDA device {n}, but this machine has {has}. Fix: cpu"


def config_problems(
    adapter_path: str | Path,
    *,
    target_ranks: Iterable[int] | None = None,
    source_rank: int = 0,
    output_path: str | Path | None = "",
    compress_to: int = 0,
    device: str = "cpu",
    force: bool = False,
    count_cuda: Callable[[], int] = cuda_device_count,
) -> list[tuple[str, str]]:
    """What would make a squeeze fail or do other than asked, as ("[squeeze] KEY",
    problem) pairs, found before any weights load and without torch: the adapter (a
    PEFT directory; its rank from adapter_config.json), the ranks against that rank,
    the output directory (`force`: a non-empty one may be written into), the device.
    A `tinker://` adapter is fetched only by the run, so its rank is not known here."""
    problems: list[tuple[str, str]] = []
    text = str(adapter_path or "").strip()
    local = None if text.startswith("tinker://") else Path(text).expanduser()
    rank = None
    if not text:
        problems.append(("[squeeze] adapter_path", "is empty: set it to a PEFT adapter directory"))
    elif local is not None:
        problem = _adapter_problem(local)
        if problem is None:
            rank, problem = _local_rank(local)
        if problem is not None:
            problems.append(("[squeeze] adapter_path", problem))
    if source_rank and rank is not None and source_rank != rank:
        problems.append(
            (
                "[squeeze] source_rank",
                f"{source_rank}, but the adapter at {local} has rank {rank}; "
                "0 detects it, or point at the right adapter",
            )
        )
    ranks = list(target_ranks or ())
    twice = sorted({k for k in ranks if ranks.count(k) > 1})
    if twice:
        problems.append(("[squeeze] target_ranks", f"{ranks} lists {twice} more than once"))
    above = [k for k in ranks if rank is not None and k > rank]
    if above:
        problems.append(
            ("[squeeze] target_ranks", f"{above} above the adapter's rank {rank} ({local})")
        )
    if compress_to and not output_path:
        problems.append(
            (
                "[squeeze] compress_to",
                f"{compress_to} needs an output directory for the compressed adapter "
                "([squeeze] output_path, or --output DIR); without one it is only analysed",
            )
        )
    if compress_to and rank is not None and compress_to > rank:
        problems.append(
            ("[squeeze] compress_to", f"{compress_to} is above the adapter's rank {rank} ({local})")
        )
    if output_path:
        problem = _output_problem(Path(str(output_path)).expanduser(), local, force)
        if problem is not None:
            problems.append(("[squeeze] output_path", problem))
    problem = _device_problem(device, count_cuda)
    if problem is not None:
        problems.append(("[squeeze] device", problem))
    return problems


# ------------------------------------------------------------------------------------------
# Analysis


def default_target_ranks(source_rank: int) -> list[int]:
    """Powers of two below `source_rank`, then `source_rank` itself."""
    ranks, k = [], 1
    while k < source_rank:
        ranks.append(k)
        k *= 2
    ranks.append(source_rank)
    return ranks


def _target_ranks(target_ranks: Iterable[int] | None, source_rank: int) -> list[int]:
    if not target_ranks:
        return default_target_ranks(source_rank)
    ranks = set()
    for k in target_ranks:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= source_rank:
            raise SqueezeError(
                f"[squeeze] target_ranks: {k!r} is not an integer in [1, {source_rank}] "
                "(the adapter's rank)"
            )
        ranks.add(k)
    ranks.add(source_rank)
    return sorted(ranks)


def analyze_adapter(
    adapter_path: str | Path,
    min_variance_retention: float = 0.95,
    target_ranks: Iterable[int] | None = None,
    source_rank: int = 0,
    device: str = "cpu",
) -> SqueezeResult:
    """Singular-value analysis of every LoRA layer of a PEFT adapter directory."""
    thr = min_variance_retention
    if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0.0 < thr <= 1.0:
        raise SqueezeError(
            f"[squeeze] min_variance_retention must be in (0, 1], got {min_variance_retention!r}"
        )
    path = _check_local(adapter_path)
    cfg = _read_config(path)
    weights = _read_weights(path)
    layers = _pair_layers(weights)
    src = _resolve_source_rank(source_rank, _detect_rank(cfg, layers, path), path)
    ranks = _target_ranks(target_ranks, src)
    dev = _torch_device(device)

    spectra: list[LayerSpectrum] = []
    for layer in layers:
        b2, a2 = _factors(weights[layer.a_key], weights[layer.b_key], dev)
        if not (bool(b2.isfinite().all()) and bool(a2.isfinite().all())):
            raise SqueezeError(f"{layer.name}: the adapter holds NaN or infinite values")
        s = _core_svd(b2, a2)[2]
        spectra.append(LayerSpectrum(layer.name, layer.rank, tuple(s.cpu().tolist())))

    rows = []
    for k in ranks:
        vs = [sp.variance_at(k) for sp in spectra if sp.energy > 0.0] or [1.0]
        rows.append(RankRow(k, math.fsum(vs) / len(vs), min(vs), max(vs)))
    # Tolerance so a mean that is 1 up to rounding still counts as reaching thr = 1.0.
    recommended = next(
        (row.rank for row in rows if row.mean_variance >= thr - 1e-12), rows[-1].rank
    )
    return SqueezeResult(
        adapter_path=str(path),
        source_rank=src,
        num_layers=len(spectra),
        min_variance_retention=float(thr),
        recommended_rank=recommended,
        rows=rows,
        layers=spectra,
        zero_layers=sum(1 for sp in spectra if sp.energy <= 0.0),
    )


# ------------------------------------------------------------------------------------------
# Compression


def _module_name(layer_name: str) -> str:
    """`base_model.model.model.layers.0.q_proj` -> `model.layers.0.q_proj` (PEFT's name)."""
    return layer_name.removeprefix("base_model.model.")


def _pattern_value(patterns: dict[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's rule: a pattern key applies to a module whose name ends with it (a regex,
    grouped: `q_proj|v_proj` matches both)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _scale(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def compress_adapter(
    adapter_path: str | Path,
    output_path: str | Path,
    target_rank: int,
    *,
    source_rank: int = 0,
    device: str = "cpu",
    force: bool = False,
) -> Path:
    """Write a rank-`target_rank` PEFT adapter whose deltas are the truncated SVD of the
    original ones (into a new or empty directory; a non-empty one only with `force`).
    Returns the output directory."""
    import torch

    path = _check_local(adapter_path)
    out = Path(output_path).expanduser()
    problem = _output_problem(out, path, force)
    if problem is not None:
        raise SqueezeError(f"[squeeze] output_path: {problem}")
    cfg = _read_config(path)
    if cfg.get("use_dora"):
        raise SqueezeError(
            f"{path} is a DoRA adapter; truncating its direction would change the learned "
            "magnitudes, so LoRA-Squeeze does not compress it"
        )
    weights = _read_weights(path)
    layers = _pair_layers(weights)
    src = _resolve_source_rank(source_rank, _detect_rank(cfg, layers, path), path)
    k = target_rank
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= src:
        raise SqueezeError(
            f"target rank must be an integer in [1, {src}] (the adapter's rank), got {k!r}"
        )
    dev = _torch_device(device)

    alpha = float(cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA))
    rslora = bool(cfg.get("use_rslora", False))
    new_alpha = alpha * (math.sqrt(k / src) if rslora else k / src)
    new_scale = _scale(new_alpha, k, rslora)

    new_weights = dict(weights)
    for layer in layers:
        a, b = weights[layer.a_key], weights[layer.b_key]
        module = _module_name(layer.name)
        old_alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, alpha))
        ratio = _scale(old_alpha, layer.rank, rslora) / new_scale
        if not (math.isfinite(ratio) and ratio > 0):
            raise SqueezeError(f"{layer.name}: lora_alpha must be positive to compress")
        b2, a2 = _factors(a, b, dev)
        q_b, u, s, vh, q_a = _core_svd(b2, a2)
        kk = min(k, s.shape[0])
        root = torch.sqrt(s[:kk] * ratio)
        b_new = torch.zeros(b2.shape[0], k, dtype=torch.float64, device=dev)
        a_new = torch.zeros(k, a2.shape[1], dtype=torch.float64, device=dev)
        b_new[:, :kk] = (q_b @ u[:, :kk]) * root
        a_new[:kk, :] = root[:, None] * (vh[:kk, :] @ q_a.T)
        new_weights[layer.b_key] = (
            b_new.reshape((b.shape[0], k, *b.shape[2:])).to(device="cpu", dtype=b.dtype)
        ).contiguous()
        new_weights[layer.a_key] = (
            a_new.reshape((k, *a.shape[1:])).to(device="cpu", dtype=a.dtype)
        ).contiguous()
        bias = layer.b_key.removesuffix("weight") + "bias"  # lora_bias: scaled like B A
        if bias in weights:
            new_weights[bias] = (weights[bias] * ratio).to(dtype=weights[bias].dtype)

    new_cfg = dict(cfg)
    new_cfg["r"] = k
    new_cfg["lora_alpha"] = int(new_alpha) if float(new_alpha).is_integer() else new_alpha
    new_cfg["rank_pattern"] = {}
    new_cfg["alpha_pattern"] = {}
    _write_adapter(path, out, new_weights, new_cfg)
    return out


def _write_adapter(source: Path, out: Path, weights: dict, cfg: dict) -> None:
    """The compressed adapter beside copies of the source's other files (README,
    tokenizer files, ...; not its training state); the weights are written to a
    temporary name first."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    not_copied = (CONFIG_NAME, SAFETENSORS_NAME, BIN_NAME, TRAINING_STATE)
    for item in source.iterdir():
        if item.is_file() and item.name not in not_copied:
            shutil.copy2(item, out / item.name)
    stale = out / BIN_NAME
    if stale.exists():
        stale.unlink()
    tmp = out / (SAFETENSORS_NAME + ".tmp")
    save_file(
        {key: t.contiguous() for key, t in weights.items()}, str(tmp), metadata={"format": "pt"}
    )
    tmp.replace(out / SAFETENSORS_NAME)
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------------------
# One call for the CLI and campaigns


def squeeze_from_options(
    adapter_path: str | Path,
    min_variance_retention: float = 0.95,
    target_ranks: Iterable[int] | None = None,
    source_rank: int = 0,
    output_path: str | Path | None = "",
    compress_to: int = 0,
    device: str = "cpu",
    print_fn: Callable[[str], Any] | None = print,
    *,
    force: bool = False,
    where: Callable[[str], str] = lambda key: key,
) -> SqueezeResult:
    """Analyse the adapter, print the table, and compress it when `output_path` is set
    (to `compress_to`, or to the recommended rank when that is 0). Every problem
    `config_problems` finds is raised first, each named by `where(key)` (how the caller
    set it: a flag, or the key with its file and line)."""
    if not str(adapter_path or "").strip():
        raise SqueezeError("[squeeze] adapter_path is empty: set it to a PEFT adapter directory")
    problems = config_problems(
        adapter_path,
        target_ranks=target_ranks,
        source_rank=source_rank,
        output_path=output_path,
        compress_to=compress_to,
        device=device,
        force=force,
    )
    if problems:
        lines = [f"{where(key)}: {problem}" for key, problem in problems]
        raise SqueezeError(
            lines[0] if len(lines) == 1 else "\n  ".join(["cannot squeeze:", *lines])
        )
    result = analyze_adapter(
        adapter_path,
        min_variance_retention=min_variance_retention,
        target_ranks=target_ranks,
        source_rank=source_rank,
        device=device,
    )
    if output_path:
        if isinstance(compress_to, bool) or not isinstance(compress_to, int) or compress_to < 0:
            raise SqueezeError(
                f"[squeeze] compress_to must be an integer >= 0, got {compress_to!r}"
            )
        rank = compress_to or result.recommended_rank
        out = compress_adapter(
            adapter_path, output_path, rank, source_rank=source_rank, device=device, force=force
        )
        result.compressed_path = str(out)
        result.compressed_rank = rank
    if print_fn is not None:
        print_fn(result.format_table())
    return result
