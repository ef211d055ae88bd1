"""The Tinker backend: sampling and LoRA training on a Tinker service through the official
`tinker` SDK (`pip install 'retrain[tinker]'`). The tokenizer, data, rewards and advantages
stay local; only sampling and gradient updates run remotely.

One step, as the trainer drives it:

1. `sample`: publish the current weights (`save_weights_and_get_sampling_client`, only when
   they changed since the last publish), fire one sampling request per prompt at once, then
   collect token ids + per-token sampler logprobs.
2. `train_step`: one Tinker `Datum` per completion and one `forward_backward(...,
   loss_fn="importance_sampling")` (or `loss_fn="ppo"` / `"cispo"` with
   `clip_low_threshold = 1 - clip_eps`, `clip_high_threshold = 1 + clip_eps_high` for
   `policy_loss = "ppo_clip"` / `"cispo"`), then `optim_step(AdamParams(...))`.

Datum layout (Tinker's next-token convention): the model reads `tokens[:-1]` and is scored on
`target_tokens = tokens[1:]`, with `tokens = prompt + completion`. The completion's targets
sit at positions `P-1 .. P+C-2`; `logprobs` and `advantages` are 0 on the prompt positions.
Advantages are sent divided by N, the step's completion-token count: the service's loss is
a sum over tokens, so its value is then exactly the local backend's per-token mean
`-(1/N) sum_t A_t exp(logp_t - logp_sampler_t)`, and `lr` / `max_grad_norm` mean the same
on both backends. The other aggregations (`loss_agg`) divide by their own per-completion
factor instead (retrain.loss.token_scales), and `adv_clip_max` clips the advantages
before they are scaled: the three losses are linear in A token by token (PPO's min
commutes with a positive factor; CISPO's detached weight does not involve A), so every
option listed in the registry's `loss_options` for Tinker is exact. Dual clip, the KL
penalty, the off-policy correction, sequence-level ratios and the other objectives have
no service loss and are refused when the config loads.

Robustness: every remote call is retried (bounded, `max_retries` attempts, exponential
backoff from `retry_backoff_s`) on 5xx, 408/429, timeouts and connection errors; other
errors fail at once. Every call holds a slot of the campaign's file-based throttle when
one is configured. A heartbeat thread keeps the session alive while the trainer scores
and computes advantages locally (it does not take a throttle slot: a heartbeat stuck behind
the throttle would let the session expire, which is what it exists to prevent).

The SDK changed shape between releases (0.16 returns clients directly, newer releases
return futures of clients; sample responses moved from pydantic models to dataclasses;
`optim_step` gained keyword forms). Everything version-dependent is feature-detected here.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrain.errors import BackendError, CheckpointError
from retrain.loss import cispo_clipped, ppo_clipped, token_scales
from retrain.registry import BACKENDS
from retrain.settings import TinkerSettings
from retrain.threads import Overran, call_within
from retrain.types import (
    CheckpointInfo,
    Datum,
    Sample,
    SamplingParams,
    TrainHyper,
    TrainResult,
)

log = logging.getLogger("retrain.backends.tinker")

LOSS_FN = "importance_sampling"
# SDK releases the whole flow was run with against a real Tinker-compatible server (docs/tinker.md).
TESTED_SDK_VERSIONS = ("0.16.1", "0.24.1")
MAX_BACKOFF_S = 60.0
_NAME_OK = re.compile(r"[^A-Za-z0-9_-]+")
_SECRET = re.compile(r"tml-[A-Za-z0-9_\-]{4,}")
_RETRYABLE_STATUS = {408, 429}
_RETRYABLE_NAMES = {
    "APIConnectionError",
    "APITimeoutError",
    "TransportError",  # httpx
    "TimeoutException",  # httpx
    "RemoteProtocolError",  # httpx
}


def import_tinker():
    """The `tinker` SDK module, or a BackendError that names the extra to install."""
    try:
        import tinker
    except ImportError as exc:
        raise BackendError(
            '[backend] backend = "tinker" needs the Tinker SDK, which is not installed '
            f"({exc}). Fix: pip install 'retrain[tinker]'"
        ) from exc
    return tinker


def sdk_version(module: Any = None) -> str:
    if module is None:
        try:
            import tinker as module
        except ImportError:
            return "not installed"
    return str(getattr(module, "__version__", "unknown"))


def redact(text: str) -> str:
    """Error text with anything that looks like a Tinker API key masked."""
    return _SECRET.sub("tml-***", text)


def describe(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(exc, TimeoutError) and not first:
        first = "timed out"
    return redact(f"{type(exc).__name__}: {first[:300]}" if first else type(exc).__name__)


# ------------------------------------------------------------------ retries


def is_retryable(exc: BaseException, _depth: int = 0) -> bool:
    """Transient: 5xx, 408, 429, timeouts, connection errors (also when wrapped by the SDK)."""
    if isinstance(exc, (TimeoutError, ConnectionError)):  # incl. concurrent.futures.TimeoutError
        return True
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and not isinstance(status, bool):
        return status >= 500 or status in _RETRYABLE_STATUS
    if any(cls.__name__ in _RETRYABLE_NAMES for cls in type(exc).__mro__):
        return True
    category = getattr(exc, "category", None)  # tinker.RequestFailedError
    if category is not None:
        return str(getattr(category, "value", category)).lower() in ("server", "unknown")
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc and _depth < 5:
        return is_retryable(cause, _depth + 1)
    return False


def backoff_delay(attempt: int, base_s: float, cap_s: float = MAX_BACKOFF_S) -> float:
    """Delay after failed attempt `attempt` (1-based): base, 2 base, 4 base, ... capped."""
    return min(cap_s, base_s * 2 ** (attempt - 1))


def call_with_retries(
    fn: Callable[[], Any],
    what: str,
    *,
    attempts: int,
    backoff_s: float,
    throttle: Any = None,
    sleep: Callable[[float], None] = time.sleep,
    warn: Callable[[str], None] | None = None,
) -> Any:
    """Run `fn` (one remote call) with up to `attempts` tries.

    Each try holds a throttle slot when `throttle` is given (released while backing off).
    Transient failures are retried; anything else, or the last transient failure, becomes
    a BackendError that says what failed. BackendError from `fn` passes through as is."""
    attempts = max(1, int(attempts))
    last: BaseException | None = None
    for attempt in range(1, attempts + 1):
        try:
            if throttle is None:
                return fn()
            with throttle.slot():
                return fn()
        except BackendError:
            raise
        except Exception as exc:
            if not is_retryable(exc):
                raise BackendError(f"Tinker {what} failed: {describe(exc)}") from exc
            last = exc
            if attempt == attempts:
                break
            delay = backoff_delay(attempt, backoff_s)
            message = (
                f"Tinker {what} failed ({describe(exc)}); "
                f"retry {attempt}/{attempts - 1} in {delay:.1f}s"
            )
            (warn or log.warning)(message)
            sleep(delay)
    raise BackendError(
        f"Tinker {what} failed after {attempts} attempts: {describe(last)}. "
        "The service looks unavailable: check [model] base_url (the service's address) "
        "and the service's status"
    ) from last


# ------------------------------------------------------------------ keepalive


class KeepAlive:
    """A daemon thread that calls `beat()` every `period_s` seconds until `stop()`.
    Failures are counted and logged, never raised: a missed beat is not fatal by itself."""

    def __init__(self, beat: Callable[[], Any], period_s: float, *, name: str = "tinker"):
        self.beat = beat
        self.period_s = float(period_s)
        self.beats = 0
        self.failures = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"retrain-{name}-keepalive", daemon=True
        )

    def start(self) -> KeepAlive:
        if self.period_s > 0:
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.beat()
                self.beats += 1
            except Exception as exc:  # keep beating; the next call will report real trouble
                self.failures += 1
                self.last_error = describe(exc)
                if self.failures in (1, 10) or self.failures % 100 == 0:
                    log.warning(
                        "Tinker keepalive failed (%d so far): %s", self.failures, self.last_error
                    )

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


def session_heartbeat(service_client: Any, timeout_s: float = 10.0) -> Callable[[], None] | None:
    """A function that sends one session heartbeat through the SDK's own client (the call
    the SDK's internal heartbeat loop makes), or None when this SDK has no such hook."""
    holder = getattr(service_client, "holder", None)
    try:
        from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

        session_id = holder.get_session_id()
        pool = ClientConnectionPoolType.SESSION
        aclient = holder.aclient
        submit = holder.run_coroutine_threadsafe
    except Exception:
        return None
    if not session_id:
        return None

    async def _one() -> None:
        with aclient(pool) as client:
            await client.service.session_heartbeat(
                session_id=session_id, max_retries=0, timeout=timeout_s
            )

    def beat() -> None:
        submit(_one()).result(timeout_s + 5.0)

    return beat


# ------------------------------------------------------------------ SDK data


def _resolve(value: Any, tinker: Any, timeout: float | None) -> Any:
    """Newer SDKs return a future of a client where older ones returned the client."""
    future_type = getattr(tinker, "APIFuture", None)
    if future_type is not None and isinstance(value, future_type):
        return value.result(timeout)
    if isinstance(value, concurrent.futures.Future):
        return value.result(timeout)
    return value


def _bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """`fn()` waited on for `timeout_s` (`threads.call_within`): some SDK calls block
    (retrying inside) where others return a future, and an unreachable service (a wrong
    [model] base_url) would hold the run there without a word. Its TimeoutError is
    retried as any timeout is."""
    try:
        return call_within(fn, timeout_s, "retrain-tinker-call")
    except Overran:
        raise TimeoutError(f"Tinker {what} did not answer within {timeout_s:g} s") from None


def _to_list(value: Any) -> list:
    if value is None:
        return []
    if hasattr(value, "tolist"):
        return list(value.tolist())
    if hasattr(value, "data"):
        return list(value.data)
    return list(value)


def _tensor(tinker: Any, values: Sequence[float | int], dtype: str) -> Any:
    return tinker.TensorData(data=list(values), dtype=dtype, shape=[len(values)])


def build_tinker_datum(
    tinker: Any, datum: Datum, advantage_scale: float = 1.0, adv_clip_max: float = 0.0
) -> Any:
    """One retrain Datum as a Tinker Datum for the importance-sampling (or ppo) loss; its
    advantages clipped to [-adv_clip_max, adv_clip_max] (when > 0), then scaled."""
    # (a Datum's per-token arrays have equal lengths by construction)
    prompt, completion = list(datum.prompt_ids), datum.completion_ids.tolist()
    n_p, n_c = len(prompt), len(completion)
    if n_p < 1 or n_c < 1:
        raise BackendError(
            f"cannot train on a datum with {n_p} prompt and {n_c} completion tokens "
            "(Tinker needs at least one of each)"
        )
    tokens = prompt + completion
    pad = [0.0] * (n_p - 1)
    logprobs = pad + datum.sampler_logprobs.tolist()
    adv = datum.advantages
    if adv_clip_max > 0:
        adv = np.clip(adv, -adv_clip_max, adv_clip_max)
    advantages = pad + (adv * advantage_scale).tolist()
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": _tensor(tinker, tokens[1:], "int64"),
            "logprobs": _tensor(tinker, logprobs, "float32"),
            "advantages": _tensor(tinker, advantages, "float32"),
        },
    )


def parse_sample_response(
    response: Any, n: int, eos_ids: Sequence[int] = (), max_tokens: int | None = None
) -> list[Sample]:
    """A Tinker SampleResponse (any SDK shape) as retrain Samples."""
    sequences = list(getattr(response, "sequences", None) or [])
    if len(sequences) != n:
        raise BackendError(f"the Tinker sampler returned {len(sequences)} sequences, expected {n}")
    eos = set(eos_ids)
    out = []
    for seq in sequences:
        tokens = [int(t) for t in _to_list(seq.tokens)]
        raw = seq.logprobs
        if raw is None:
            raise BackendError(
                "the Tinker sampler returned no per-token logprobs; the importance-sampling "
                "loss needs them (server or SDK too old?)"
            )
        logprobs = [float(x) for x in _to_list(raw)]
        if len(logprobs) != len(tokens):
            raise BackendError(
                f"the Tinker sampler returned {len(tokens)} tokens but {len(logprobs)} logprobs"
            )
        if max_tokens is not None and len(tokens) > max_tokens:
            tokens, logprobs = tokens[:max_tokens], logprobs[:max_tokens]
        reason = str(getattr(seq.stop_reason, "value", seq.stop_reason) or "").lower()
        if tokens and tokens[-1] in eos:
            stop = "eos"
        elif reason.endswith("length"):
            stop = "length"
        else:
            stop = "eos" if reason.endswith("stop") else "length"
        out.append(Sample(token_ids=tokens, logprobs=logprobs, stop_reason=stop))
    return out


def summarize_forward_backward(
    output: Any, datums: Sequence[Datum]
) -> tuple[float, float | None, float | None, dict[str, float]]:
    """(loss, log-ratio mean, log-ratio max |.|, extra metrics) of a ForwardBackwardOutput.

    The loss is the service's `loss:sum` metric when it reports one, else the sum of the
    per-token `elementwise_loss` outputs. Log ratios compare the trainer's logprobs of the
    completion tokens (`logprobs` outputs) with the sampler's."""
    metrics = {
        str(k): float(v)
        for k, v in (getattr(output, "metrics", None) or {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    outputs = list(getattr(output, "loss_fn_outputs", None) or [])
    loss = metrics.get("loss:sum")
    if loss is None:
        parts = [o.get("elementwise_loss") for o in outputs if isinstance(o, dict)]
        if parts and all(p is not None for p in parts):
            loss = math.fsum(float(x) for p in parts for x in _to_list(p))
    if loss is None:
        raise BackendError(
            "the Tinker forward_backward result carries no loss (no 'loss:sum' metric and no "
            "'elementwise_loss' outputs)"
        )
    ratio_sum, ratio_max, count = 0.0, 0.0, 0
    if len(outputs) == len(datums):
        for out, d in zip(outputs, datums):
            train_lp = out.get("logprobs") if isinstance(out, dict) else None
            if train_lp is None:
                count = 0
                break
            values = _to_list(train_lp)
            start = len(d.prompt_ids) - 1
            mine = values[start : start + len(d.completion_ids)]
            if len(mine) != len(d.sampler_logprobs):
                count = 0
                break
            # the model's tokens only: an environment's tokens (multi-turn) have no
            # sampler logprob (0 there), so their "ratio" would be the trainer's logprob
            gap = (np.asarray(mine, dtype=float) - d.sampler_logprobs)[d.trained_mask]
            if gap.size:
                ratio_sum += float(gap.sum())
                ratio_max = max(ratio_max, float(np.abs(gap).max()))
                count += int(gap.size)
    extra = {f"tinker_{_NAME_OK.sub('_', k)}": v for k, v in metrics.items()}
    if count:
        return float(loss), ratio_sum / count, ratio_max, extra
    return float(loss), None, None, extra


# retrain's policy_loss -> the service's loss_fn taking (clip_low, clip_high) thresholds
SERVICE_CLIPPED_LOSSES = {"ppo_clip": "ppo", "cispo": "cispo"}


def loss_request(hyper: TrainHyper) -> tuple[str, dict[str, float] | None]:
    """(loss_fn, loss_fn_config) of the service for the configured objective."""
    unsupported = [
        key
        for key, on in (
            ("kl_coef", hyper.kl_coef > 0),
            ("clip_ratio_c", hyper.clip_ratio_c > 0),
            ("tis_cap", hyper.tis_cap > 0),
            ("is_correction", hyper.is_correction != "none"),
            ("ratio_level", hyper.ratio_level != "token"),
        )
        if on
    ]
    if unsupported or hyper.policy_loss not in ("is", *SERVICE_CLIPPED_LOSSES):
        what = ", ".join(unsupported) or f"policy_loss = {hyper.policy_loss!r}"
        raise BackendError(
            f"the Tinker service has no loss for {what}. Fix: the importance_sampling, ppo "
            "or cispo loss without them, or the local backend"
        )
    if hyper.policy_loss in SERVICE_CLIPPED_LOSSES:
        return SERVICE_CLIPPED_LOSSES[hyper.policy_loss], {
            "clip_low_threshold": 1.0 - hyper.clip_eps,
            "clip_high_threshold": 1.0 + hyper.clip_eps_high,
        }
    return LOSS_FN, None


def advantage_scales(datums: Sequence[Datum], hyper: TrainHyper) -> np.ndarray:
    """w_i / denominator per datum under `[training] loss_agg` (the service sums)."""
    return token_scales(
        [d.num_trained_tokens for d in datums],
        hyper.loss_agg,
        max_tokens=hyper.max_tokens,
        batch_size=hyper.bnpo_batch_size,
    )


def clip_fraction(output: Any, datums: Sequence[Datum], hyper: TrainHyper) -> float | None:
    """The share of completion tokens whose PPO loss was clipped (cispo: whose weight was
    clamped), from the service's logprobs of this forward pass (None when it returned
    none)."""
    outputs = list(getattr(output, "loss_fn_outputs", None) or [])
    if len(outputs) != len(datums):
        return None
    clipped = tokens = 0
    for out, d in zip(outputs, datums):
        train_lp = out.get("logprobs") if isinstance(out, dict) else None
        if train_lp is None:
            return None
        start = len(d.prompt_ids) - 1
        mine = np.asarray(_to_list(train_lp)[start : start + len(d.completion_ids)], dtype=float)
        if mine.size != d.sampler_logprobs.size:
            return None
        log_ratio = mine - d.sampler_logprobs
        if hyper.policy_loss == "cispo":
            cut = cispo_clipped(log_ratio, hyper.clip_eps, hyper.clip_eps_high)
        else:
            cut = ppo_clipped(log_ratio, d.advantages, hyper.clip_eps, hyper.clip_eps_high)
        clipped += int(cut[d.trained_mask].sum())  # the model's tokens only, as above
        tokens += d.num_trained_tokens
    return clipped / tokens if tokens else 0.0


def adam_params(tinker: Any, hyper: TrainHyper) -> Any:
    kwargs: dict[str, Any] = {
        "learning_rate": hyper.lr,
        "beta1": hyper.beta1,
        "beta2": hyper.beta2,
        "eps": hyper.eps,
    }
    fields = set(getattr(tinker.AdamParams, "model_fields", {}) or {})
    if not fields or "weight_decay" in fields:
        kwargs["weight_decay"] = hyper.weight_decay
    if not fields or "grad_clip_norm" in fields:
        kwargs["grad_clip_norm"] = hyper.max_grad_norm
    elif hyper.max_grad_norm > 0:
        raise BackendError(
            f"[optimizer] max_grad_norm = {hyper.max_grad_norm}: tinker SDK {sdk_version(tinker)} "
            "has no gradient clipping (AdamParams.grad_clip_norm). Fix: max_grad_norm = 0 or a newer SDK"
        )
    return tinker.AdamParams(**kwargs)


def checkpoint_name(directory: str | Path) -> str:
    """`.../checkpoint_step_20` -> `checkpoint_step_20` (Tinker names: [A-Za-z0-9_-])."""
    name = _NAME_OK.sub("_", Path(str(directory)).name).strip("_")
    return name or "checkpoint"


# ------------------------------------------------------------------ the backend


class TinkerBackend:
    capabilities = BACKENDS.entry("tinker").capabilities

    def __init__(
        self,
        settings: TinkerSettings,
        tokenizer,
        *,
        say: Callable[[str], None] = print,
        service_client: Any = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        from retrain.throttle import throttle_for

        self.tinker = import_tinker()
        self.version = sdk_version(self.tinker)
        self.tokenizer = tokenizer
        self.say = say
        self._sleep = sleep
        self.options = settings.options
        self.timeout_s = float(self.options.timeout_s)
        self.base_url = settings.base_url.strip()
        self.model = settings.model
        self.rank = settings.lora_rank
        self.failed = False
        self._closed = False
        self._weights_version = 0
        self._sampler_version = -1
        self._sampler: Any = None
        self.keepalive: KeepAlive | None = None
        # `[backend] throttle_dir` when set, else the one a campaign gives its workers
        self.throttle = throttle_for(settings)
        if settings.ignored:
            say(
                f"Note: the tinker backend ignores {'; '.join(settings.ignored)} "
                "(the service runs inference, fixes the LoRA layout and stores checkpoints)"
            )
        if settings.temperature != 1.0:
            say(
                f"Note: [training] temperature = {settings.temperature}: Tinker's trainer scores "
                "tokens at temperature 1, so the importance ratio carries the temperature mismatch "
                "(see log_ratio_mean); temperature = 1.0 avoids it"
            )
        self.eos_ids = self._stop_tokens(tokenizer, self.model)

        say("Connecting to Tinker...")
        kwargs = {"base_url": self.base_url} if self.base_url else {}
        self.service = service_client or self._call(
            lambda: self.tinker.ServiceClient(**kwargs), "connection"
        )
        say(f"Creating LoRA training client (model={self.model}, rank={self.rank})...")
        seed = settings.seed if settings.seed >= 0 else None
        try:
            self.training = self._call(
                lambda: _bounded(
                    lambda: _resolve(
                        self.service.create_lora_training_client(
                            base_model=self.model, rank=self.rank, seed=seed
                        ),
                        self.tinker,
                        self.timeout_s,
                    ),
                    self.timeout_s,
                    "training-client creation",
                ),
                "training-client creation",
            )
        except BaseException:
            close_service(self.service, status="errored", timeout=min(30.0, self.timeout_s))
            raise
        say("Training client ready.")
        self._start_keepalive()

    # ------------------------------------------------------------ plumbing

    @staticmethod
    def _stop_tokens(tokenizer, model: str = "") -> list[int]:
        """The tokenizer's eos, plus the model's generation_config eos ids when the model is
        a local directory (chat models often end turns with a token other than eos)."""
        eos = getattr(tokenizer, "eos_token_id", None)
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        gen = Path(model).expanduser() / "generation_config.json" if model else None
        if gen is not None and gen.is_file():
            import json

            try:
                extra = json.loads(gen.read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                extra = None
            ids += extra if isinstance(extra, list) else [extra] if extra is not None else []
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
        if not ids:
            raise BackendError(
                "the tokenizer defines no eos token; Tinker completions could never stop"
            )
        return sorted({int(i) for i in ids})

    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return call_with_retries(
                fn,
                what,
                attempts=self.options.max_retries,
                backoff_s=self.options.retry_backoff_s,
                throttle=self.throttle,
                sleep=self._sleep,
                warn=self.say,
            )
        except BackendError as exc:
            self.failed = True
            if getattr(exc.__cause__, "status_code", None) == 404:
                raise BackendError(
                    f"{exc} (tinker SDK {self.version}: a 404 usually means the server does not "
                    "implement this SDK version's API; see the tested pairs in docs/tinker.md)"
                ) from exc.__cause__
            raise

    def _start_keepalive(self) -> None:
        period = float(self.options.keepalive_s)
        if period <= 0:
            return
        beat = session_heartbeat(self.service, timeout_s=min(30.0, self.timeout_s))
        if beat is None:
            log.info(
                "tinker SDK %s offers no session heartbeat hook; relying on its own", self.version
            )
            return
        self.keepalive = KeepAlive(beat, period).start()

    # ------------------------------------------------------------ sampling

    def _sampling_client(self) -> Any:
        """A sampling client for the current weights (published once per weight version)."""
        if self._sampler is not None and self._sampler_version == self._weights_version:
            return self._sampler
        training = self.training
        if hasattr(training, "save_weights_and_get_sampling_client"):

            def publish():
                return _resolve(
                    training.save_weights_and_get_sampling_client(), self.tinker, self.timeout_s
                )
        else:  # very old SDKs: a named sampler checkpoint, then a client on it

            def publish():
                name = f"retrain_sampler_{self._weights_version}"
                path = training.save_weights_for_sampler(name).result(self.timeout_s).path
                return _resolve(training.create_sampling_client(path), self.tinker, self.timeout_s)

        self._sampler = self._call(publish, "weight publish for sampling")
        self._sampler_version = self._weights_version
        return self._sampler

    def sample(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        if not prompts_B:
            return []
        tinker = self.tinker
        sampler = self._sampling_client()

        def sampling_params(i: int) -> Any:
            # The service derives sample j's seed as seed + j: space the prompts n apart.
            seed = None if params.seed is None else (params.seed + i * n) % 2**31
            return tinker.SamplingParams(
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                seed=seed,
                stop=list(self.eos_ids),
                top_k=-1,
                top_p=params.top_p,
            )

        inputs = [tinker.ModelInput.from_ints(list(p)) for p in prompts_B]
        results: list[Any] = [None] * len(prompts_B)

        def fire_and_collect() -> list[Any]:
            # Only the prompts a previous attempt did not finish are (re)sent.
            pending = {
                i: sampler.sample(inputs[i], n, sampling_params(i))
                for i in range(len(inputs))
                if results[i] is None
            }
            deadline = time.monotonic() + self.timeout_s
            first_error: BaseException | None = None
            for i, future in pending.items():
                try:
                    results[i] = future.result(max(0.0, deadline - time.monotonic()))
                except Exception as exc:
                    first_error = first_error or exc
            if first_error is not None:
                raise first_error
            return results

        responses = self._call(fire_and_collect, f"sampling ({len(inputs)} prompts x {n})")
        return [parse_sample_response(r, n, self.eos_ids, params.max_tokens) for r in responses]

    # ------------------------------------------------------------ training

    def train_step(self, datums: list[Datum], hyper: TrainHyper) -> TrainResult:
        if not datums:
            return TrainResult(loss=0.0, num_tokens=0)
        # Environment tokens of multi-turn trajectories carry advantage 0 (no gradient
        # under Tinker's per-token losses) and are not counted as trained tokens.
        total = sum(d.num_trained_tokens for d in datums)
        scales = advantage_scales(datums, hyper)
        data = [
            build_tinker_datum(self.tinker, d, float(s), hyper.adv_clip_max)
            for d, s in zip(datums, scales)
        ]
        params = adam_params(self.tinker, hyper)
        training = self.training
        loss_fn, loss_config = loss_request(hyper)
        if loss_config is None:
            submit = lambda: training.forward_backward(data, loss_fn)  # noqa: E731
        elif "loss_fn_config" not in inspect.signature(training.forward_backward).parameters:
            raise BackendError(
                f"[training] policy_loss = {hyper.policy_loss!r}: tinker SDK {self.version} cannot "
                f"pass the {loss_fn} clip thresholds (forward_backward has no loss_fn_config). "
                'Fix: a newer SDK, or policy_loss = "is"'
            )
        else:
            submit = lambda: training.forward_backward(data, loss_fn, loss_fn_config=loss_config)  # noqa: E731
        output = self._call(
            lambda: submit().result(self.timeout_s),
            f"forward_backward ({len(data)} datums, loss_fn={loss_fn})",
        )
        loss, ratio_mean, ratio_max, extra = summarize_forward_backward(output, datums)
        if hyper.policy_loss in SERVICE_CLIPPED_LOSSES:
            fraction = clip_fraction(output, datums, hyper)
            if fraction is not None:
                extra["clip_fraction"] = fraction
        else:
            extra["clip_fraction"] = 0.0
        step = self._call(lambda: training.optim_step(params).result(self.timeout_s), "optim_step")
        self._weights_version += 1
        step_metrics = getattr(step, "metrics", None) or {}
        grad_norm = None
        for key in ("grad_norm", "grad_norm:mean", "grad_norm:sum"):
            value = step_metrics.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                grad_norm = float(value)
                break
        return TrainResult(
            loss=loss,
            num_tokens=total,
            grad_norm=grad_norm,
            log_ratio_mean=ratio_mean,
            log_ratio_max_abs=ratio_max,
            extra=extra,
        )

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        """Save the training state (weights + optimizer) on the service under the name of
        `directory` (`checkpoint_step_N`, `final`), plus sampler weights under the same name
        (a PEFT adapter that `retrain squeeze` can fetch). Nothing is written locally."""
        name = checkpoint_name(directory)
        training = self.training
        state = self._call(
            lambda: training.save_state(name).result(self.timeout_s), f"save_state({name})"
        )
        sampler_path = ""
        if hasattr(training, "save_weights_for_sampler"):
            sampler = self._call(
                lambda: training.save_weights_for_sampler(name).result(self.timeout_s),
                f"save_weights_for_sampler({name})",
            )
            sampler_path = str(sampler.path)
        return CheckpointInfo(
            "tinker",
            adapter=sampler_path,
            state=str(state.path),
            extra={
                "name": name,
                "model": self.model,
                "lora_rank": self.rank,
                "base_url": self.base_url,
                "sdk_version": self.version,
            },
        )

    def load_checkpoint(self, info: CheckpointInfo) -> None:
        path = info.state
        if not path.startswith("tinker://"):
            raise CheckpointError(
                f"the checkpoint {path or info!r} is not a Tinker checkpoint (no tinker:// path): it "
                f"was saved by the {info.backend or 'another'} backend; resume it with that backend"
            )
        saved_url = str(info.extra.get("base_url") or "")
        if saved_url != self.base_url:
            self.say(
                f"Note: the checkpoint was saved on {saved_url or 'the SDK default service'}; "
                f"loading it from {self.base_url or 'the SDK default service'}"
            )
        training = self.training
        loader = getattr(training, "load_state_with_optimizer", None)
        with_optimizer = loader is not None
        if loader is None:
            loader = getattr(training, "load_state", None)
        if loader is None:
            raise CheckpointError(
                f"cannot resume: tinker SDK {self.version} has no TrainingClient.load_state, so it "
                f"cannot load {path}. Fix: install an SDK that has it (tested: "
                f"{', '.join(TESTED_SDK_VERSIONS)}), e.g. pip install 'tinker==0.24.1'"
            )
        self._call(lambda: loader(path).result(self.timeout_s), "load_state")
        self._weights_version += 1
        self.say(
            f"Loaded Tinker checkpoint {path}"
            + ("" if with_optimizer else " (weights only: this SDK does not restore Adam moments)")
        )

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the heartbeat and release the service-side model and session (best effort)."""
        if self._closed:
            return
        self._closed = True
        if self.keepalive is not None:
            self.keepalive.stop()
        service = getattr(self, "service", None)
        if service is not None:
            training = getattr(self, "training", None)
            close_service(
                service,
                status="errored" if self.failed else "success",
                model_id=getattr(training, "model_id", None),
                timeout=min(60.0, self.timeout_s),
            )


def close_service(
    service: Any, *, status: str = "success", model_id: str | None = None, timeout: float = 30.0
) -> None:
    """End a ServiceClient's session, best effort (errors are logged, never raised).

    Newer SDKs have `ServiceClient.close(status)`, which finishes the session and frees its
    models. Older ones have no public close: the model is unloaded through the SDK's REST
    client (so the service frees its adapter slot now, not when the session expires) and the
    client's heartbeat is stopped."""
    import inspect

    try:
        close = getattr(service, "close", None)
        takes_status = False
        if callable(close):
            try:
                takes_status = "status" in inspect.signature(close).parameters
            except (TypeError, ValueError):
                takes_status = False
        if takes_status:  # the call itself may block on an unreachable service
            result = _bounded(lambda: close(status), timeout, "session close")
            if hasattr(result, "result"):
                result.result(timeout)
            return
        holder = getattr(service, "holder", None)
        if holder is None:
            return
        if model_id:
            _unload_model(holder, model_id, timeout)
        if callable(getattr(holder, "close", None)):
            holder.close()
    except Exception as exc:  # the run's own result matters more
        log.info("releasing the Tinker session failed: %s", describe(exc))


def _unload_model(holder: Any, model_id: str, timeout: float) -> None:
    try:
        import tinker
        from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

        request = tinker.types.UnloadModelRequest(model_id=model_id)
    except Exception:
        return

    async def _unload() -> Any:
        with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            return await client.models.unload(request=request)

    holder.run_coroutine_threadsafe(_unload()).result(timeout)


# ------------------------------------------------------------------ adapters (squeeze)


def parse_checkpoint_path(path: str) -> tuple[str, str]:
    """`tinker://RUN/weights/NAME`, `tinker://RUN/sampler_weights/NAME` or `tinker://RUN/NAME`
    (what some servers return for sampler weights) -> (RUN, NAME)."""
    text = str(path)
    parts = text[len("tinker://") :].strip("/").split("/") if text.startswith("tinker://") else []
    if len(parts) == 2 and all(parts):
        return parts[0], parts[1]
    if len(parts) == 3 and parts[1] in ("weights", "sampler_weights") and parts[0] and parts[2]:
        return parts[0], parts[2]
    raise BackendError(
        f"{text!r} is not a Tinker checkpoint path (expected tinker://RUN/sampler_weights/NAME)"
    )


def _archive_url(rest: Any, run: str, name: str, timeout: float) -> str:
    """The download URL of a sampler checkpoint's archive. SDKs ask for it by full tinker
    path; some servers only route the bare checkpoint id, so that form is tried second."""
    canonical = f"tinker://{run}/sampler_weights/{name}"
    errors = []
    ways = []
    if hasattr(rest, "get_checkpoint_archive_url_from_tinker_path"):
        ways.append(
            ("by path", lambda: rest.get_checkpoint_archive_url_from_tinker_path(canonical))
        )
    if hasattr(rest, "get_checkpoint_archive_url"):
        ways.append(("by id", lambda: rest.get_checkpoint_archive_url(run, name)))
    for how, ask in ways:
        try:
            return str(ask().result(timeout).url)
        except Exception as exc:
            if is_retryable(exc):
                raise
            errors.append(f"{how}: {describe(exc)}")
    raise BackendError(
        f"the service offers no download of {canonical} ({'; '.join(errors) or 'no archive API in this SDK'})"
    )


def _safe_members(tar: Any) -> list:
    import tarfile

    members = []
    for m in tar.getmembers():
        name = Path(m.name)
        if name.is_absolute() or ".." in name.parts:
            raise BackendError(f"unsafe path {m.name!r} in the checkpoint archive")
        if m.isdir() or m.isfile():
            members.append(m)
        elif (
            m.issym() or m.islnk() or m.type in (tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE)
        ):
            raise BackendError(f"link or device {m.name!r} in the checkpoint archive")
    return members


def _standalone_rest_client(tinker: Any) -> bool:
    """Whether this SDK's RestClient is built from a base_url (newer) or a holder (older)."""
    import inspect

    cls = getattr(tinker, "RestClient", None)
    try:
        return cls is not None and "base_url" in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def fetch_adapter(
    tinker_path: str,
    target_dir: str | Path | None = None,
    *,
    rest_client: Any = None,
    base_url: str = "",
    timeout_s: float = 600.0,
    attempts: int = 3,
) -> Path:
    """Download the sampler weights behind a tinker:// checkpoint path as a PEFT adapter
    directory (adapter_config.json + adapter weights) and return it. A state path
    (`.../weights/NAME`) maps to the sampler weights of the same name, which the tinker
    backend saves next to every checkpoint. Cached: a second call for the same path reads
    the copy in `target_dir` (default: the retrain cache, `tinker_adapters/RUN__NAME`)."""
    import os
    import shutil
    import tarfile
    import tempfile
    import urllib.request

    run, name = parse_checkpoint_path(tinker_path)
    if target_dir is None:
        from retrain.models import cache_dir

        target_dir = cache_dir() / "tinker_adapters" / f"{run}__{name}"
    target = Path(target_dir)
    if (target / "adapter_config.json").is_file():
        return target
    service = None
    if rest_client is None:
        tinker = import_tinker()
        url = base_url or os.environ.get("TINKER_BASE_URL", "")
        kwargs = {"base_url": url} if url else {}
        try:
            if _standalone_rest_client(tinker):
                rest_client = tinker.RestClient(**kwargs)  # newer SDKs: no session needed
            else:
                service = tinker.ServiceClient(**kwargs)
                rest_client = service.create_rest_client()
        except Exception as exc:
            raise BackendError(f"cannot connect to Tinker: {describe(exc)}") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:

        def download() -> Path:
            url = _archive_url(rest_client, run, name, timeout_s)
            archive = work / "archive"
            with (
                urllib.request.urlopen(url, timeout=timeout_s) as response,
                open(archive, "wb") as fh,
            ):
                shutil.copyfileobj(response, fh, 1 << 20)
            return archive

        archive = call_with_retries(
            download, f"download of {tinker_path}", attempts=attempts, backoff_s=2.0
        )
        extracted = work / "extracted"
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(extracted, members=_safe_members(tar))
        except tarfile.TarError as exc:
            raise BackendError(f"the archive of {tinker_path} is not a tar file: {exc}") from exc
        found = sorted(extracted.rglob("adapter_config.json"), key=lambda p: len(p.parts))
        if not found:
            raise BackendError(
                f"the archive of {tinker_path} holds no PEFT adapter (no adapter_config.json)"
            )
        if target.exists():
            shutil.rmtree(target)
        os.replace(found[0].parent, target)
        return target
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if service is not None:
            close_service(service)


def credential_problems() -> list[tuple[str, str]]:
    """The service's credential, which the run needs only when it connects (after the
    data loads), found as the tinker SDK finds it (`resolve_auth_provider`): a
    TINKER_API_KEY (environment or .env) that starts with tml- (or is a JWT), else
    TINKER_CREDENTIAL_CMD, else a key stored by `tinker auth login`. Mirrored rather than
    asked, so that the run's start and explain check it without importing the SDK.
    retrain has no config key for it."""
    key, command = os.environ.get("TINKER_API_KEY", ""), os.environ.get("TINKER_CREDENTIAL_CMD")
    stored = Path("~/.tinker/credentials.json").expanduser().is_file()
    if key.startswith(("tml-", "eyJ")) or command or (stored and not key):
        return []
    why = (
        "TINKER_API_KEY is set but the tinker SDK refuses it (a key starts with 'tml-')"
        if key
        else "TINKER_API_KEY is not set (in the environment or .env), nor "
        "TINKER_CREDENTIAL_CMD, and no key is stored by `tinker auth login`"
    )
    return [
        (
            "[backend] backend",
            f"tinker needs a Tinker API key: {why}; the run would stop when it connects. "
            "Fix: TINKER_API_KEY=tml-... in the environment, or in .env in the directory "
            "retrain runs in",
        )
    ]
