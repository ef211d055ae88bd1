"""The PRIME-RL backend: retrain is the orchestrator of a running prime-rl stack.

retrain keeps its data, rewards, advantages, logging and checkpoints; a prime-rl trainer
(launched separately, on GPUs) does the optimisation and a prime-rl inference server (vLLM
with prime-rl's extra routes) does the sampling. This module speaks prime-rl's own formats
as they are at the pinned commit below; nothing of prime-rl is imported (it is not on PyPI).

The run is `[backend] adapter_path`, a `run_*` directory under the prime-rl trainer's
output_dir: before the first sample or batch the backend writes the run's orchestrator
config there (`control/orch.toml`, by which the trainer finds the run; on resume it names
the next batch step) and removes it at close; what the trainer writes back when it evicts
the run or refuses that config (`control/evicted.txt`, `control/config_validation_error.txt`)
stops the run with its reason.

One step, as the trainer drives it:

1. `sample`: first, once per batch step, the weight sync: after `k` batches were sent, the
   prime-rl trainer publishes the weights trained on them as `{adapter_path}/broadcasts/
   step_k/` and marks them complete with an empty `STABLE` file. The backend polls for that
   marker (`sync_poll_s`, at most `sync_wait_s` seconds), then points the inference server
   at the directory (`POST {url}/update_weights {"weight_dir": ...}`; a LoRA trainer's
   adapter: `POST {url}/load_lora_adapter` under the run's name, which sampling then asks
   for as its model). When step_k does not
   appear in time, the newest newer stable step is loaded instead (or none), and the
   console says the step samples with older weights. Then one
   `POST {url}/v1/chat/completions/tokens` per prompt (token ids in `tokens`, `n`
   completions, `logprobs` and `return_token_ids` on), sent concurrently.
2. `train_step`: one prime-rl `TrainingSample` per datum (prompt/completion ids and masks,
   the sampler's completion logprobs, the sampling temperature per token, one scalar
   advantage), all of them as one `TrainingBatch(step=k)` through the transport:
   - filesystem: msgpack bytes written to `{adapter_path}/rollouts/step_k/rollouts.bin.tmp`
     and renamed to `rollouts.bin` (the trainer only ever sees whole files);
   - zmq: a PUSH socket connected to `tcp://{zmq_host}:{zmq_port}` (the trainer binds the
     PULL end), one two-part message `[sender_id, payload]` per batch, where sender_id is
     the name (`Path.stem`) of `adapter_path`.
   lr, weight decay and the optimiser are the prime-rl trainer's: the loss returned here is
   a placeholder 0.0 (capability reports_sync_loss = false).
3. `save_checkpoint` writes `prime_rl_backend_state.json` (batches sent, broadcast step
   loaded into the inference server) into the checkpoint directory; `load_checkpoint`
   restores the counters and re-points the inference server at the loaded broadcast.

Batch steps are counted by this backend (0, 1, 2, ... per batch sent), not taken from the
trainer's step: a step whose groups were all uninformative sends nothing, and prime-rl's
trainer, which reads `rollouts/step_{its step}`, still gets contiguous steps.

Advantages: a `TrainingSample` carries one scalar advantage. A datum whose advantages vary
within its completion is refused (`strict_advantages`, which cannot be turned off); config
loading and the run preflight already refuse token-varying flows for this backend
(capability preserves_token_advantages = false).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

from retrain.errors import BackendError, CheckpointError
from retrain.registry import BACKENDS
from retrain.settings import RUN_DIR_PREFIX, PrimeRLSettings, prime_rl_run_dir_problem
from retrain.types import CheckpointInfo, Datum, Sample, SamplingParams, TrainHyper, TrainResult

# The prime-rl commit (on its main branch, 2026-03-03) whose formats this module writes and
# reads, every one of them read at that commit: the TrainingSample/TrainingBatch layout
# (src/prime_rl/transport/types.py); file names, atomic rename, ZMQ socket type and framing
# (src/prime_rl/transport/{filesystem,zmq}.py); how the trainer finds a run
# (src/prime_rl/trainer/runs.py: `run_*` directories with control/orch.toml, evicted.txt);
# the broadcast layout and STABLE marker (src/prime_rl/trainer/rl/broadcast/filesystem.py,
# src/prime_rl/utils/pathing.py); the inference server's routes
# (src/prime_rl/inference/vllm/server.py). See docs/prime_rl.md.
PRIME_RL_COMMIT = "9104df43c627db01c8ed974ddb71c664992ac54a"

ROLLOUTS_DIR = "rollouts"
BROADCASTS_DIR = "broadcasts"
CHECKPOINTS_DIR = "checkpoints"
BATCH_FILE_NAME = "rollouts.bin"
BATCH_TMP_NAME = "rollouts.bin.tmp"
STABLE_MARKER = "STABLE"
# The trainer trains only the `run_*` directories under its output_dir (RUN_DIR_PREFIX)
# that hold the run's orchestrator config; it writes why it refused one beside it.
CONTROL_DIR = "control"
RUN_CONFIG_FILE = "orch.toml"
EVICTED_FILE = "evicted.txt"  # the trainer stopped training the run (a bad sample)
CONFIG_ERROR_FILE = "config_validation_error.txt"  # it could not use orch.toml
STATE_FILE = "prime_rl_backend_state.json"
STATE_VERSION = 1
ADVANTAGE_TOLERANCE = 1e-6  # how far a completion's token advantages may spread

# prime-rl's msgspec Structs, field by field in wire order. array_like=True: a struct is a
# msgpack array of all its fields, defaults included (msgspec writes every field of an
# array-like struct; omit_defaults only matters for map-encoded structs). msgspec's typed
# decoder fills missing trailing fields with their defaults and skips extra trailing ones,
# so prime-rl versions that only append optional fields read these bytes too; a version
# that inserts or reorders fields (e.g. a required `env_name` after the temperatures, or
# the flat token_ids/mask layout) does not: see docs/prime_rl.md.
TRAINING_SAMPLE_FIELDS: tuple[tuple[str, str], ...] = (
    ("prompt_ids", "list[int]"),
    ("prompt_mask", "list[bool]"),
    ("completion_ids", "list[int]"),
    ("completion_mask", "list[bool]"),
    ("completion_logprobs", "list[float]"),
    ("completion_temperatures", "list[float]"),
    ("teacher_logprobs", "list[float] | None = None"),
    ("advantage", "float | None = None"),
    ("reward", "float | None = None"),
    ("pixel_values", "bytes | None = None"),
    ("pixel_values_shape", "list[int] | None = None"),
    ("image_grid_thw", "list[list[int]] | None = None"),
    ("routed_experts", "list[list[list[int]]] | None = None"),
)
TRAINING_BATCH_FIELDS: tuple[tuple[str, str], ...] = (
    ("examples", "list[TrainingSample]"),
    ("step", "int"),
    ("run_idx", "int | None = None"),
)


# ---------------------------------------------------------------- wire format


def _import_msgspec():
    try:
        import msgspec
    except ImportError as exc:
        raise BackendError(
            '[backend] backend = "prime_rl" needs msgspec to write prime-rl\'s msgpack batches '
            f"({exc}). Fix: pip install 'retrain[prime_rl]'"
        ) from exc
    return msgspec


@functools.cache
def wire_types() -> tuple[type, type]:
    """(TrainingSample, TrainingBatch) as msgspec Structs with prime-rl's layout."""
    msgspec = _import_msgspec()

    none = None
    TrainingSample = msgspec.defstruct(
        "TrainingSample",
        [
            ("prompt_ids", list[int]),
            ("prompt_mask", list[bool]),
            ("completion_ids", list[int]),
            ("completion_mask", list[bool]),
            ("completion_logprobs", list[float]),
            ("completion_temperatures", list[float]),
            ("teacher_logprobs", list[float] | None, none),
            ("advantage", float | None, none),
            ("reward", float | None, none),
            ("pixel_values", bytes | None, none),
            ("pixel_values_shape", list[int] | None, none),
            ("image_grid_thw", list[list[int]] | None, none),
            ("routed_experts", list[list[list[int]]] | None, none),
        ],
        array_like=True,
        gc=False,
        omit_defaults=True,
    )
    TrainingBatch = msgspec.defstruct(
        "TrainingBatch",
        [("examples", list[TrainingSample]), ("step", int), ("run_idx", int | None, none)],
        array_like=True,
        gc=False,
        omit_defaults=True,
    )
    declared = tuple(TrainingSample.__struct_fields__), tuple(TrainingBatch.__struct_fields__)
    assert declared == (
        tuple(n for n, _ in TRAINING_SAMPLE_FIELDS),
        tuple(n for n, _ in TRAINING_BATCH_FIELDS),
    )
    return TrainingSample, TrainingBatch


def scalar_advantage(advantages: np.ndarray, *, strict: bool = True) -> float:
    """The one advantage of a completion whose token advantages are all equal (within
    ADVANTAGE_TOLERANCE); BackendError when they vary and `strict`."""
    if advantages.size == 0:
        return 0.0
    lo, hi = float(advantages.min()), float(advantages.max())
    if strict and hi - lo > ADVANTAGE_TOLERANCE * max(1.0, abs(lo), abs(hi)):
        raise BackendError(
            f"a datum's token advantages vary within its completion (from {lo:.6g} to {hi:.6g}), "
            "but a prime-rl TrainingSample carries one scalar advantage per completion: sending "
            "it would silently aggregate them. Fix: use a flow whose advantages are uniform per "
            'completion (transform_mode = "none"), or a backend that preserves token advantages '
            "(local, tinker)"
        )
    return float(advantages.mean())


def training_sample(datum: Datum, temperature: float, *, strict: bool = True) -> Any:
    """One retrain Datum as a prime-rl TrainingSample (the prompt is context, not trained)."""
    TrainingSample, _ = wire_types()
    n_prompt, n_completion = len(datum.prompt_ids), int(datum.completion_ids.size)
    if n_completion == 0:
        raise BackendError("cannot send a datum without completion tokens to prime-rl")
    return TrainingSample(
        prompt_ids=[int(t) for t in datum.prompt_ids],
        prompt_mask=[False] * n_prompt,
        completion_ids=datum.completion_ids.tolist(),
        # Environment tokens of a multi-turn trajectory are context, not trained.
        completion_mask=datum.trained_mask.tolist(),
        completion_logprobs=datum.sampler_logprobs.tolist(),
        completion_temperatures=[float(temperature)] * n_completion,
        advantage=scalar_advantage(datum.advantages[datum.trained_mask], strict=strict),
    )


def encode_batch(samples: Sequence[Any], step: int) -> bytes:
    """A TrainingBatch's msgpack bytes, as prime-rl's `msgspec.msgpack.Encoder()` writes them."""
    _, TrainingBatch = wire_types()
    return _import_msgspec().msgpack.encode(TrainingBatch(examples=list(samples), step=int(step)))


def decode_batch(payload: bytes) -> Any:
    """The TrainingBatch in `payload` (as prime-rl's typed Decoder reads it)."""
    _, TrainingBatch = wire_types()
    return _import_msgspec().msgpack.decode(payload, type=TrainingBatch)


# ---------------------------------------------------------------- transports


def rollout_path(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / ROLLOUTS_DIR / f"step_{int(step)}" / BATCH_FILE_NAME


class FileSystemSender:
    """prime-rl's filesystem transport: one file per batch step, written under a temporary
    name and renamed, so a reader never sees a partial batch."""

    def __init__(self, output_dir: Path):
        self.output_dir = Path(output_dir)

    @property
    def where(self) -> str:
        return str(self.output_dir / ROLLOUTS_DIR)

    def send(self, step: int, payload: bytes) -> Path:
        target = rollout_path(self.output_dir, step)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(BATCH_TMP_NAME)
        with open(tmp, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        return target

    def close(self) -> None:
        pass


class ZMQSender:
    """prime-rl's ZMQ transport: a PUSH socket connected to the trainer's PULL socket; each
    batch is one multipart message [sender_id, payload]."""

    def __init__(self, output_dir: Path, host: str, port: int, hwm: int, timeout_s: float):
        try:
            import zmq
        except ImportError as exc:
            raise BackendError(
                f"transport = \"zmq\" needs pyzmq ({exc}). Fix: pip install 'retrain[prime_rl]'"
            ) from exc
        self.zmq = zmq
        self.endpoint = f"tcp://{host}:{int(port)}"
        self.sender_id = Path(output_dir).stem.encode("utf-8")
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, int(hwm))
        self.socket.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        self.socket.connect(self.endpoint)
        self.linger_ms = max(1, int(timeout_s * 1000))

    @property
    def where(self) -> str:
        return f"{self.endpoint} as {self.sender_id.decode()!r}"

    def send(self, step: int, payload: bytes) -> None:
        try:
            self.socket.send_multipart([self.sender_id, payload])
        except self.zmq.Again as exc:
            raise BackendError(
                f"the prime-rl trainer did not take batch step {step} on {self.endpoint} in time "
                f"(its queue is full or nothing listens there). Fix: start the prime-rl trainer "
                "with the zmq transport on this host/port, or check zmq_host/zmq_port"
            ) from exc

    def close(self) -> None:
        # Linger so a batch still queued reaches the trainer before the socket goes.
        self.socket.close(linger=self.linger_ms)


# ---------------------------------------------------------------- weight broadcasts


def stable_steps(output_dir: Path) -> list[int]:
    """Broadcast steps whose `STABLE` marker is written, ascending."""
    root = Path(output_dir) / BROADCASTS_DIR
    steps = []
    if root.is_dir():
        for entry in root.glob("step_*"):
            suffix = entry.name[len("step_") :]
            if suffix.isdigit() and (entry / STABLE_MARKER).exists():
                steps.append(int(suffix))
    return sorted(steps)


def weight_dir(output_dir: Path, step: int) -> Path | None:
    """Where the weights of `step` are: the broadcast, else a trainer checkpoint's weights."""
    broadcast = Path(output_dir) / BROADCASTS_DIR / f"step_{step}"
    if (broadcast / STABLE_MARKER).exists():
        return broadcast
    ckpt = Path(output_dir) / CHECKPOINTS_DIR / f"step_{step}"
    if (ckpt / "weight").is_dir() and (ckpt / STABLE_MARKER).exists():
        return ckpt / "weight"
    return None


def is_adapter(where: Path) -> bool:
    """A LoRA trainer broadcasts an adapter (adapter_config.json beside its weights),
    which the inference server loads as a named LoRA, not as the model's weights."""
    return (Path(where) / "adapter_config.json").is_file()


# ---------------------------------------------------------------- the run directory


def lora_name(output_dir: Path) -> str:
    """The name the inference server serves this run's LoRA under: the run's directory."""
    return Path(output_dir).name


def run_config_toml(output_dir: Path, model: str, resume_step: int = 0) -> str:
    """The run's orchestrator config (`control/orch.toml`), by which prime-rl's trainer
    finds the run: where it is, the model, the LoRA's name (a LoRA trainer needs the table;
    rank and alpha left out are the trainer's own) and, on resume, the batch step to read
    next. Every other key keeps prime-rl's default, as an orchestrator writing it would."""
    import tomlkit

    config: dict[str, Any] = {
        "output_dir": str(output_dir),
        "model": {"name": model, "lora": {"name": lora_name(output_dir)}},
    }
    if resume_step > 0:
        config["ckpt"] = {"resume_step": int(resume_step)}
    return tomlkit.dumps(config)


def trainer_refusal(output_dir: Path) -> str | None:
    """What the trainer wrote when it stopped or refused training this run, or None."""
    control = Path(output_dir) / CONTROL_DIR
    for name, what in (
        (EVICTED_FILE, "evicted this run"),
        (CONFIG_ERROR_FILE, f"refused this run's {CONTROL_DIR}/{RUN_CONFIG_FILE}"),
    ):
        path = control / name
        if path.is_file():
            reason = path.read_text(errors="replace").strip() or "(no reason given)"
            return f"the prime-rl trainer {what} ({path}): {reason}"
    return None


# ---------------------------------------------------------------- inference responses


def _token_id(text: Any) -> int | None:
    """vLLM writes tokens as `token_id:N` when asked to return token ids as tokens."""
    if isinstance(text, str) and text.startswith("token_id:") and text[9:].lstrip("-").isdigit():
        return int(text[9:])
    return None


def parse_choice(
    choice: Mapping[str, Any], eos_ids: Iterable[int] = (), max_tokens: int | None = None
) -> Sample:
    """One choice of a /v1/chat/completions/tokens response as a Sample: token ids from
    `token_ids` (vLLM's return_token_ids), logprobs from `logprobs.content[*].logprob`."""
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice, Mapping) else None
    if not isinstance(content, list):
        raise BackendError(
            "the prime-rl inference server returned no per-token logprobs (logprobs.content); "
            "is the URL prime-rl's inference server and does it accept logprobs=true?"
        )
    logprobs = [float(item.get("logprob")) for item in content]
    ids = choice.get("token_ids")
    if ids is None:
        ids = [_token_id(item.get("token")) for item in content]
        if any(i is None for i in ids):
            raise BackendError(
                "the prime-rl inference server returned no completion token ids (token_ids); "
                "it must accept return_token_ids=true (prime-rl's vLLM server does)"
            )
    ids = [int(i) for i in ids]
    if len(ids) != len(logprobs):
        raise BackendError(
            f"the prime-rl inference server returned {len(ids)} token ids but {len(logprobs)} logprobs"
        )
    if max_tokens is not None and len(ids) > max_tokens:
        ids, logprobs = ids[:max_tokens], logprobs[:max_tokens]
    reason = str(choice.get("finish_reason") or "")
    if ids and ids[-1] in set(eos_ids):
        stop = "eos"
    elif reason == "length":
        stop = "length"
    else:
        stop = "eos" if reason == "stop" else "length"
    return Sample(token_ids=ids, logprobs=logprobs, stop_reason=stop)


def parse_response(
    data: Any, n: int, eos_ids: Iterable[int] = (), max_tokens: int | None = None
) -> list[Sample]:
    choices = data.get("choices") if isinstance(data, Mapping) else None
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else "no"
        raise BackendError(f"the prime-rl inference server returned {got} choices, expected {n}")
    eos = list(eos_ids)
    ordered = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, Mapping) else 0)
    return [parse_choice(c, eos, max_tokens) for c in ordered]


# ---------------------------------------------------------------- probe (explain, doctor)


def _tcp_open(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _url_host_port(url: str) -> tuple[str | None, int]:
    parsed = urlparse(url if "://" in url else f"http://{url}")
    return parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)


def _writable_dir(path: Path) -> str | None:
    """None when `path` is (or can be created as) a writable directory, else why not."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None


def probe(settings: PrimeRLSettings, timeout: float = 2.0) -> list[tuple[str, str]]:
    """What stands between these settings and a run, found without loading anything: the
    inference URL must answer, the transport's directory must be writable or its ZMQ
    endpoint must be listening, and the wire libraries must be installed. Returns
    (`[table] key`, problem with a fix) pairs; `retrain explain` and `retrain doctor` call it
    through the registry entry's `probe`."""
    problems: list[tuple[str, str]] = []
    options = settings.options
    url = settings.url.strip()
    if not url:
        problems.append(
            (
                "[inference] url",
                "is empty; the prime_rl backend samples from prime-rl's inference server. "
                'Fix: url = "http://HOST:8000" (where `uv run inference` listens)',
            )
        )
    else:
        host, port = _url_host_port(url)
        if not host or not _tcp_open(host, port, timeout):
            problems.append(
                (
                    "[inference] url",
                    f"{url}: nothing answers on {host}:{port}. Fix: start prime-rl's inference "
                    "server there, or point url at it",
                )
            )
    try:
        import msgspec  # noqa: F401
    except ImportError:
        problems.append(
            ("[backend] backend", "prime_rl needs msgspec. Fix: pip install 'retrain[prime_rl]'")
        )
    output_dir = Path(settings.output_dir).expanduser()
    if options.transport == "zmq":
        try:
            import zmq  # noqa: F401
        except ImportError:
            problems.append(
                (
                    "[backend.options] transport",
                    "zmq needs pyzmq. Fix: pip install 'retrain[prime_rl]'",
                )
            )
        host, port = options.zmq_host, int(options.zmq_port)
        if not _tcp_open(host, port, timeout):
            problems.append(
                (
                    "[backend.options] zmq_port",
                    f"nothing listens on tcp://{host}:{port}. Fix: start the prime-rl trainer "
                    "with the zmq transport (it binds the receiving end), or fix zmq_host/zmq_port",
                )
            )
    why = _writable_dir(output_dir)
    if why:
        problems.append(
            (
                "[backend] adapter_path",
                f"{why}: the prime_rl backend writes its batches (filesystem transport) and "
                "checkpoint state there and reads the trainer's broadcasts from it. Fix: set it "
                "to the prime-rl output directory of this run",
            )
        )
    return problems


# ---------------------------------------------------------------- the backend


def _eos_ids(tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return sorted({int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool)})


class PrimeRLBackend:
    capabilities = BACKENDS.entry("prime_rl").capabilities

    def __init__(
        self,
        settings: PrimeRLSettings,
        tokenizer: Any,
        *,
        say: Callable[[str], None] = print,
        sleep: Callable[[float], None] = time.sleep,
        http_client: Any = None,
    ):
        self.say = say
        self._sleep = sleep
        self.options = options = settings.options
        if not options.strict_advantages:
            raise BackendError(
                "[backend.options] strict_advantages = false is not supported: prime-rl takes "
                "one advantage per completion, and aggregating token advantages silently is refused"
            )
        self.strict = True
        self.model = settings.model
        self.output_dir = Path(settings.output_dir).expanduser()
        why = prime_rl_run_dir_problem(self.output_dir)
        if why:
            raise BackendError(f"[backend] adapter_path {why}")
        url = settings.url.strip().rstrip("/")
        if not url:
            raise BackendError(
                '[inference] url is empty: set it to prime-rl\'s inference server, e.g. "http://localhost:8000"'
            )
        self.base_url = url[:-3] if url.endswith("/v1") else url
        self.sample_url = f"{self.base_url}/v1/chat/completions/tokens"
        self.update_url = f"{self.base_url}/update_weights"
        self.lora_url = f"{self.base_url}/load_lora_adapter"
        self.served_model = self.model  # the LoRA's name once the server loaded one
        self.sync_wait_s = max(0, int(options.sync_wait_s))
        self.sync_poll_s = max(0.01, float(options.sync_poll_s))
        self.timeout_s = float(options.timeout_s)
        self.eos_ids = _eos_ids(tokenizer)
        wire_types()  # msgspec is needed from the first batch on: fail now, not after sampling

        self.batches_sent = 0  # the next TrainingBatch's step
        self.loaded_step = -1  # broadcast step in the inference server (-1: its start weights)
        self._synced_for = 0  # the batch count the last weight sync was done for
        self._closed = False

        if settings.ignored:
            say(
                f"Note: the prime_rl backend ignores {'; '.join(settings.ignored)} (prime-rl's "
                "trainer owns the optimiser and the LoRA layout; its inference server samples)"
            )
        self.output_dir.mkdir(parents=True, exist_ok=True)
        refused = trainer_refusal(self.output_dir)
        if refused and (self.output_dir / CONTROL_DIR / EVICTED_FILE).is_file():
            raise BackendError(
                f"{refused}. It does not train an evicted run again. Fix: a new "
                f"{RUN_DIR_PREFIX}* directory as adapter_path (or remove {EVICTED_FILE} once "
                "the cause is fixed)"
            )
        self._resumed = False
        self._started = False  # the run config written (at the first sample or batch)
        if options.transport == "zmq":
            self.sender: Any = ZMQSender(
                self.output_dir,
                options.zmq_host,
                options.zmq_port,
                options.zmq_hwm,
                self.timeout_s,
            )
        else:
            self.sender = FileSystemSender(self.output_dir)
        if http_client is None:
            from retrain.http import sync_client

            http_client = sync_client(timeout=self.timeout_s, max_connections=16)
        self.http = http_client
        say(
            f"PRIME-RL backend ready (transport={options.transport} -> {self.sender.where}, "
            f"inference={self.base_url}, prime-rl formats of {PRIME_RL_COMMIT[:12]})."
        )

    # ------------------------------------------------------------ plumbing

    def _start(self) -> None:
        """Once, before the first sample or batch (after a checkpoint was loaded, if one
        is): write control/orch.toml, by which the trainer finds this run, with the batch
        step to read next, so a trainer started afresh does not read earlier batches
        again. An error the trainer wrote about an earlier orch.toml goes with it. It is
        removed at close: a trainer restarted meanwhile waits for the run to be driven again."""
        if self._started:
            return
        if not self._resumed:
            self._refuse_earlier_run()
        control = self.output_dir / CONTROL_DIR
        control.mkdir(parents=True, exist_ok=True)
        tmp = control / f".{RUN_CONFIG_FILE}.tmp"
        tmp.write_text(run_config_toml(self.output_dir, self.model, self.batches_sent))
        os.replace(tmp, control / RUN_CONFIG_FILE)
        (control / CONFIG_ERROR_FILE).unlink(missing_ok=True)
        self._started = True

    def _check_trainer(self) -> None:
        """Stop with the trainer's own words once it evicted or refused this run: batches
        sent after that would never be trained, and no broadcast would come."""
        refused = trainer_refusal(self.output_dir)
        if refused:
            raise BackendError(f"{refused}. Nothing sent from now on would be trained")

    def _refuse_earlier_run(self) -> None:
        """A fresh run (no checkpoint loaded) must not start in a run directory that holds
        another run's batches or broadcasts: the trainer's step there is not 0, and a stale
        broadcast would be loaded as this run's weights."""
        found = [
            d for d in (ROLLOUTS_DIR, BROADCASTS_DIR) if any((self.output_dir / d).glob("step_*"))
        ]
        if found:
            raise BackendError(
                f"[backend] adapter_path {self.output_dir} holds an earlier run's "
                f"{' and '.join(found)} (step_* directories): a fresh run would be mixed with "
                f"it. Fix: a new {RUN_DIR_PREFIX}* directory under the trainer's output_dir, or "
                "--resume the run that wrote them"
            )

    def _post(self, url: str, payload: dict[str, Any], what: str) -> Any:
        from retrain.http import HTTPRequestError, RetryPolicy, request

        try:
            return request(
                self.http,
                "POST",
                url,
                json=payload,
                retry=RetryPolicy(max_retries=2),
                source="[inference] url",
            )
        except HTTPRequestError as exc:
            raise BackendError(f"prime-rl {what} failed: {exc}") from exc

    def _load_weights(self, step: int) -> None:
        where = weight_dir(self.output_dir, step)
        if where is None:
            raise BackendError(
                f"no prime-rl weights for step {step} under {self.output_dir} (no "
                f"{BROADCASTS_DIR}/step_{step}/{STABLE_MARKER}): is [backend] adapter_path the "
                "directory the prime-rl trainer broadcasts into?"
            )
        what = f"weight update to step {step}"
        if is_adapter(where):  # a LoRA trainer's broadcast: loaded (in place) by name
            name = lora_name(self.output_dir)
            self._post(self.lora_url, {"lora_name": name, "lora_path": str(where)}, what)
            self.served_model = name
        else:
            self._post(self.update_url, {"weight_dir": str(where)}, what)
        self.loaded_step = step

    def sync_weights(self) -> None:
        """Point the inference server at the weights trained on every batch sent so far
        (broadcast step = batches sent), waiting up to sync_wait_s for them; once per step."""
        target = self.batches_sent
        if target <= self.loaded_step or target == self._synced_for:
            return
        self._synced_for = target
        deadline = time.monotonic() + self.sync_wait_s
        while True:
            self._check_trainer()
            newer = [s for s in stable_steps(self.output_dir) if self.loaded_step < s <= target]
            if newer and newer[-1] == target:
                self._load_weights(target)
                return
            if time.monotonic() >= deadline:
                break
            self._sleep(self.sync_poll_s)
        if newer:
            self._load_weights(newer[-1])
        behind = target - max(self.loaded_step, 0)
        self.say(
            f"Note: prime-rl has not broadcast step {target} within {self.sync_wait_s}s; sampling "
            f"with the weights of step {max(self.loaded_step, 0)} ({behind} step(s) behind)"
        )

    # ------------------------------------------------------------ sampling

    def sample(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        if not prompts_B:
            return []
        self._start()
        self._check_trainer()
        self.sync_weights()

        def payload(i: int, prompt: list[int]) -> dict[str, Any]:
            body: dict[str, Any] = {
                "model": self.served_model,
                "messages": [{"role": "user", "content": ""}],
                "tokens": [int(t) for t in prompt],
                "n": int(n),
                "max_tokens": int(params.max_tokens),
                "temperature": max(float(params.temperature), 1e-7),
                "top_p": float(params.top_p),
                "logprobs": True,
                "return_token_ids": True,
                "skip_special_tokens": False,
                "top_k": -1,
                "min_p": 0.0,
            }
            if params.seed is not None:
                body["seed"] = int((params.seed + i * n) % 2**31)
            return body

        def one(i: int) -> list[Sample]:
            data = self._post(
                self.sample_url, payload(i, prompts_B[i]), f"sampling (prompt {i + 1})"
            )
            return parse_response(data, n, self.eos_ids, params.max_tokens)

        workers = min(16, len(prompts_B))
        with concurrent.futures.ThreadPoolExecutor(workers, "retrain-prime-rl") as pool:
            return list(pool.map(one, range(len(prompts_B))))

    # ------------------------------------------------------------ training

    def train_step(self, datums: list[Datum], hyper: TrainHyper) -> TrainResult:
        """Send the datums as the next TrainingBatch; the loss is a placeholder (prime-rl
        optimises asynchronously, with its own lr and weight decay)."""
        if not datums:
            return TrainResult(loss=0.0, num_tokens=0)
        # the temperature the step sampled at: prime-rl's trainer scores tokens at it
        samples = [training_sample(d, hyper.temperature, strict=self.strict) for d in datums]
        self._start()
        self._check_trainer()
        step = self.batches_sent
        self.sender.send(step, encode_batch(samples, step))
        self.batches_sent += 1
        return TrainResult(
            loss=0.0,
            num_tokens=sum(d.num_trained_tokens for d in datums),  # not env tokens
            extra={
                "prime_rl_batch_step": float(step),
                "prime_rl_loaded_step": float(self.loaded_step),
            },
        )

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "backend": "prime_rl",
            "prime_rl_commit": PRIME_RL_COMMIT,
            "output_dir": str(self.output_dir),
            "inference_url": self.base_url,
            "transport": self.options.transport,
            "batches_sent": self.batches_sent,
            "loaded_step": self.loaded_step,
        }

    def save_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        """The backend's counters as `prime_rl_backend_state.json` in `directory`; the
        weights themselves are prime-rl's (its broadcasts and checkpoints). First waits (up
        to sync_wait_s) for the broadcast of every batch sent, so the checkpoint names the
        weights trained on all of them."""
        self.sync_weights()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        tmp = directory / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, directory / STATE_FILE)
        weights = weight_dir(self.output_dir, self.loaded_step) if self.loaded_step >= 0 else None
        return CheckpointInfo(
            "prime_rl", adapter=str(weights or ""), state=str(directory), extra=state
        )

    def load_checkpoint(self, info: CheckpointInfo) -> None:
        if info.backend != "prime_rl":
            raise CheckpointError(
                f"the checkpoint {info.state or info.adapter!r} was saved by the "
                f"{info.backend or 'another'} backend; resume it with that backend"
            )
        path = Path(info.state) / STATE_FILE
        if path.is_file():
            state = json.loads(path.read_text())
        elif "batches_sent" in info.extra:
            state = dict(info.extra)
        else:
            raise CheckpointError(
                f"cannot resume: {path} is missing (the prime_rl backend's counters are kept there)"
            )
        self.batches_sent = int(state["batches_sent"])
        self._resumed = True  # (the run config, written next, names this step)
        self.loaded_step = -1
        self._synced_for = -1  # the next sample() syncs to the newest broadcast again
        saved_dir = str(state.get("output_dir") or "")
        if saved_dir and Path(saved_dir) != self.output_dir:
            self.say(
                f"Note: the checkpoint was written for {saved_dir}; continuing in {self.output_dir}"
            )
        loaded = int(state.get("loaded_step", -1))
        if loaded >= 0:  # the inference server may have restarted since: point it again
            self._load_weights(loaded)
        self.say(
            f"Loaded PRIME-RL backend state {path} (next batch step {self.batches_sent}, "
            f"inference weights of step {max(loaded, 0)})"
        )

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started:
            (self.output_dir / CONTROL_DIR / RUN_CONFIG_FILE).unlink(missing_ok=True)
        try:
            self.sender.close()
        finally:
            close = getattr(self.http, "close", None)
            if callable(close):
                close()
