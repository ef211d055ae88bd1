"""The tinker backend without a server: Datum building, response parsing with the real SDK
types, retries, keepalive, checkpoints and the glue, against fake clients that return real
SDK objects. The end-to-end run against a real server is the opt-in
tests/integration/test_tinker_server.py."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

tinker = pytest.importorskip(
    "tinker", reason="the tinker SDK is not installed (pip install 'retrain[tinker]')"
)
httpx = pytest.importorskip("httpx", reason="httpx comes with the tinker SDK")

from retrain.backends import tinker as tb  # noqa: E402
from retrain.backends.base import backend_info  # noqa: E402
from retrain.build import tinker_settings  # noqa: E402
from retrain.config import config_from_dict  # noqa: E402
from retrain.errors import BackendError, CheckpointError  # noqa: E402
from retrain.registry import BACKENDS  # noqa: E402
from retrain.types import CheckpointInfo, Datum, SamplingParams, TrainHyper  # noqa: E402

EOS = 2


# ---------------------------------------------------------------- real SDK objects


def make_sequence(tokens, logprobs, stop_reason="stop", index=0):
    """A SampledSequence in whichever shape this SDK has (pydantic model or dataclass)."""
    cls = tinker.types.SampledSequence
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {
            "stop_reason": stop_reason,
            "tokens_np": np.asarray(tokens, dtype=np.int32),
            "logprobs_np": None if logprobs is None else np.asarray(logprobs, dtype=np.float32),
        }
        if "sequence_id" in names:
            kwargs["sequence_id"] = f"seq-{index}"
        return cls(**kwargs)
    return cls(stop_reason=stop_reason, tokens=list(tokens), logprobs=logprobs)


def make_response(seqs):
    return tinker.types.SampleResponse(sequences=seqs)


def tensor(values, dtype="float32"):
    return tinker.TensorData(data=list(values), dtype=dtype, shape=[len(values)])


def fb_output(outputs, metrics=None):
    return tinker.types.ForwardBackwardOutput(
        loss_fn_output_type="scalar", loss_fn_outputs=outputs, metrics=metrics or {}
    )


def status_error(code: int):
    request = httpx.Request("POST", "http://127.0.0.1:1/api/v1/x")
    response = httpx.Response(code, request=request)
    cls = {500: tinker.InternalServerError, 400: tinker.BadRequestError}.get(
        code, tinker.APIStatusError
    )
    return cls(f"Error code: {code}", response=response, body=None)


# ---------------------------------------------------------------- capabilities


def test_capabilities_and_metadata():
    caps = tb.TinkerBackend.capabilities
    assert caps is BACKENDS.entry("tinker").capabilities
    assert caps.reports_sync_loss and caps.preserves_token_advantages
    assert caps.supports_checkpoint_resume and caps.resume_runtime_dependent
    info = backend_info("tinker")
    assert info.source == "builtin" and set(info.options) >= {
        "max_retries",
        "retry_backoff_s",
        "timeout_s",
        "keepalive_s",
    }
    assert "[inference]" in BACKENDS.entry("tinker").ignores


def test_missing_sdk_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tinker", None)
    with pytest.raises(BackendError, match=r"retrain\[tinker\]"):
        tb.import_tinker()


# ---------------------------------------------------------------- Datum building


def test_datum_layout_follows_tinkers_next_token_convention():
    d = Datum(
        prompt_ids=[10, 11, 12],
        completion_ids=[20, 21, EOS],
        sampler_logprobs=[-0.5, -1.0, -0.25],
        advantages=[1.0, 2.0, -1.0],
    )
    out = tb.build_tinker_datum(tinker, d, advantage_scale=0.5)
    assert isinstance(out, tinker.Datum)
    assert out.model_input.to_ints() == [10, 11, 12, 20, 21]
    inputs = out.loss_fn_inputs
    assert inputs["target_tokens"].tolist() == [11, 12, 20, 21, EOS]
    assert inputs["target_tokens"].dtype == "int64"
    # Prompt positions (predicting 11 and 12) carry nothing; completion positions carry the
    # sampler logprob and the scaled advantage of the token they predict.
    assert inputs["logprobs"].tolist() == pytest.approx([0, 0, -0.5, -1.0, -0.25])
    assert inputs["advantages"].tolist() == pytest.approx([0, 0, 0.5, 1.0, -0.5])
    assert set(inputs) == {"target_tokens", "logprobs", "advantages"}


def test_single_token_prompt_and_bad_datums():
    out = tb.build_tinker_datum(
        tinker, Datum([5], [6, EOS], [-1.0, -2.0], [1.0, 1.0]), advantage_scale=1.0
    )
    assert out.model_input.to_ints() == [5, 6]
    assert out.loss_fn_inputs["logprobs"].tolist() == pytest.approx([-1.0, -2.0])
    with pytest.raises(ValueError, match="2 tokens, 1 logprobs"):
        Datum([1, 2], [3, 4], [-1.0], [1.0, 1.0])  # the record refuses ragged fields
    with pytest.raises(BackendError, match="completion tokens"):
        tb.build_tinker_datum(tinker, Datum([1, 2], [], [], []))


def test_adam_params_carry_the_optimizer_table():
    p = tb.adam_params(
        tinker,
        TrainHyper(lr=2e-4, weight_decay=0.01, beta1=0.9, beta2=0.99, eps=1e-8, max_grad_norm=1.0),
    )
    assert isinstance(p, tinker.AdamParams)
    assert (p.learning_rate, p.beta1, p.beta2, p.eps) == (2e-4, 0.9, 0.99, 1e-8)
    assert p.weight_decay == 0.01 and p.grad_clip_norm == 1.0


# ---------------------------------------------------------------- response parsing


def test_parse_sample_response_with_sdk_types():
    response = make_response(
        [
            make_sequence([7, 8, EOS], [-0.1, -0.2, -0.3], "stop", 0),
            make_sequence([7, 9, 9], [-0.1, -2.0, -0.5], "length", 1),
        ]
    )
    samples = tb.parse_sample_response(response, 2, [EOS], max_tokens=3)
    assert [s.token_ids.tolist() for s in samples] == [[7, 8, EOS], [7, 9, 9]]
    assert samples[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert [s.stop_reason for s in samples] == ["eos", "length"]
    assert all(s.token_ids.dtype == np.int64 and s.logprobs.dtype == np.float64 for s in samples)
    assert all(isinstance(x, float) for s in samples for x in s.logprobs)


def response_from_the_wire(tokens, logprobs, stop_reason):
    """A SampleResponse decoded by the SDK from what a server sends: JSON for the pydantic
    SDKs, protobuf bytes (decoded by the SDK's own response_conv) for the dataclass ones
    (0.38 and later)."""
    cls = tinker.types.SampleResponse
    if hasattr(cls, "model_validate"):
        wire = {
            "type": "sample",
            "sequences": [{"stop_reason": stop_reason, "tokens": tokens, "logprobs": logprobs}],
            "prompt_logprobs": None,
        }
        return cls.model_validate(wire)
    pb = pytest.importorskip("tinker.proto.tinker_public_pb2")
    conv = pytest.importorskip("tinker.proto.response_conv")
    message = pb.SampleResponse()
    seq = message.sequences.add()
    seq.stop_reason = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}[stop_reason]
    seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
    seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    return conv.deserialize_proto_response(message.SerializeToString(), cls)


def test_parse_sample_response_from_what_a_server_sends():
    response = response_from_the_wire([198, EOS], [-0.06, -1.5], "stop")
    assert isinstance(response, tinker.types.SampleResponse)
    samples = tb.parse_sample_response(response, 1, [EOS])
    assert samples[0].token_ids.tolist() == [198, EOS] and samples[0].stop_reason == "eos"
    assert samples[0].logprobs == pytest.approx([-0.06, -1.5], abs=1e-6)
    cut = tb.parse_sample_response(response_from_the_wire([7, 8], [-1.0, -2.0], "length"), 1, [EOS])
    assert cut[0].stop_reason == "length" and cut[0].token_ids.tolist() == [7, 8]


def test_parse_sample_response_rejects_what_training_cannot_use():
    with pytest.raises(BackendError, match="no per-token logprobs"):
        tb.parse_sample_response(make_response([make_sequence([1, 2], None)]), 1, [EOS])
    with pytest.raises(BackendError, match="returned 1 sequences, expected 2"):
        tb.parse_sample_response(make_response([make_sequence([1], [-1.0])]), 2, [EOS])


def test_summarize_forward_backward_from_elementwise_loss_and_logprobs():
    datums = [
        Datum([1, 2], [3, EOS], [-1.0, -2.0], [0.5, 0.5]),
        Datum([1, 2], [4], [-3.0], [-1.0]),
    ]
    outputs = [
        {
            "elementwise_loss": tensor([0.0, -0.25, -0.25]),
            "logprobs": tensor([-9.0, -1.1, -1.9]),
        },
        {"elementwise_loss": tensor([0.0, 0.5]), "logprobs": tensor([-9.0, -3.0])},
    ]
    loss, mean, max_abs, extra = tb.summarize_forward_backward(fb_output(outputs), datums)
    assert loss == pytest.approx(0.0)
    # completion log ratios: -1.1+1, -1.9+2, -3+3 -> -0.1, 0.1, 0
    assert mean == pytest.approx(0.0, abs=1e-6) and max_abs == pytest.approx(0.1, abs=1e-6)
    assert extra == {}


def test_summarize_forward_backward_prefers_the_service_loss_metric():
    datums = [Datum([1], [2], [-1.0], [1.0])]
    out = fb_output([{"logprobs": tensor([-1.0])}], {"loss:sum": -0.75, "clip:frac": 0.0})
    loss, mean, _, extra = tb.summarize_forward_backward(out, datums)
    assert loss == -0.75 and mean == 0.0
    assert extra == {"tinker_loss_sum": -0.75, "tinker_clip_frac": 0.0}
    with pytest.raises(BackendError, match="carries no loss"):
        tb.summarize_forward_backward(fb_output([{}]), datums)


def test_ratio_and_clip_metrics_count_the_models_tokens_only():
    """A multi-turn datum: completion = model [10, 11], environment [90, 91], model [12].
    The environment's tokens carry no sampler logprob (0), so a trainer logprob there is
    no off-policy gap: on-policy model tokens give ratio 0 and nothing clipped."""
    mask = [True, True, False, False, True]
    multi = Datum([1, 2], [10, 11, 90, 91, 12], [-0.1, -0.2, 0, 0, -0.3], [0.5] * 5, mask)
    single = Datum([1, 2], [20, EOS], [-1.0, -2.0], [-0.5, -0.5])
    # the trainer's logprobs (position 0 predicts the prompt's 2nd token): equal to the
    # sampler's on the model's tokens, -3 on the environment's
    on_policy = [-9.0, -0.1, -0.2, -3.0, -3.0, -0.3]
    outputs = [{"logprobs": tensor(on_policy)}, {"logprobs": tensor([-9.0, -1.0, -2.0])}]
    out = fb_output(outputs, {"loss:sum": 0.0})
    _, mean, max_abs, _ = tb.summarize_forward_backward(out, [multi, single])
    assert mean == pytest.approx(0.0, abs=1e-6) and max_abs == pytest.approx(0.0, abs=1e-6)
    hyper = TrainHyper(1e-5, 0.0, 0.9, 0.999, 1e-8, policy_loss="cispo")
    assert tb.clip_fraction(out, [multi, single], hyper) == 0.0
    # one model token 0.5 nats off: the mean over the 5 model tokens, 1 of 5 clipped
    outputs[0] = {"logprobs": tensor([-9.0, -0.6, -0.2, -3.0, -3.0, -0.3])}
    out = fb_output(outputs, {"loss:sum": 0.0})
    _, mean, max_abs, _ = tb.summarize_forward_backward(out, [multi, single])
    assert mean == pytest.approx(-0.1, abs=1e-6) and max_abs == pytest.approx(0.5, abs=1e-6)
    assert tb.clip_fraction(out, [multi, single], hyper) == pytest.approx(1 / 5)


# ---------------------------------------------------------------- retries


def test_retryable_errors():
    assert tb.is_retryable(status_error(500))
    assert tb.is_retryable(status_error(503))
    assert tb.is_retryable(status_error(429))
    assert not tb.is_retryable(status_error(400))
    assert not tb.is_retryable(status_error(404))
    request = httpx.Request("POST", "http://127.0.0.1:1/x")
    assert tb.is_retryable(tinker.APITimeoutError(request=request))
    assert tb.is_retryable(tinker.APIConnectionError(request=request))
    assert tb.is_retryable(TimeoutError())
    assert not tb.is_retryable(ValueError("bad input"))
    # The SDK wraps a failed future's HTTP error in a ValueError: the cause decides.
    for code, expected in ((502, True), (400, False)):
        try:
            try:
                raise status_error(code)
            except Exception as inner:
                raise ValueError("Error retrieving result") from inner
        except ValueError as wrapped:
            assert tb.is_retryable(wrapped) is expected
    category = tinker.types.RequestErrorCategory
    assert tb.is_retryable(tinker.RequestFailedError("x", "1", category.Server))
    assert not tb.is_retryable(tinker.RequestFailedError("x", "1", category.User))


class FlakyCall:
    def __init__(self, failures):
        self.failures = list(failures)
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "ok"


def test_retries_back_off_exponentially_then_succeed():
    sleeps, warnings = [], []
    fn = FlakyCall([status_error(503), TimeoutError()])
    result = tb.call_with_retries(
        fn, "sampling", attempts=5, backoff_s=2.0, sleep=sleeps.append, warn=warnings.append
    )
    assert result == "ok" and fn.calls == 3
    assert sleeps == [2.0, 4.0]
    assert "retry 1/4 in 2.0s" in warnings[0] and "Tinker sampling failed" in warnings[0]


def test_retries_are_bounded_and_end_in_a_clear_error():
    sleeps = []
    fn = FlakyCall([status_error(500)] * 10)
    with pytest.raises(BackendError) as info:
        tb.call_with_retries(
            fn, "optim_step", attempts=3, backoff_s=1.0, sleep=sleeps.append, warn=lambda m: None
        )
    assert fn.calls == 3 and sleeps == [1.0, 2.0]
    message = str(info.value)
    assert "optim_step failed after 3 attempts" in message
    assert "InternalServerError" in message and "check [model] base_url" in message
    assert tb.backoff_delay(10, 2.0) == tb.MAX_BACKOFF_S


def test_non_transient_errors_fail_at_once():
    sleeps = []
    fn = FlakyCall([status_error(400)])
    with pytest.raises(BackendError, match="forward_backward failed: BadRequestError"):
        tb.call_with_retries(fn, "forward_backward", attempts=5, backoff_s=1.0, sleep=sleeps.append)
    assert fn.calls == 1 and sleeps == []


def test_each_attempt_holds_a_throttle_slot_released_while_backing_off(tmp_path):
    from retrain.throttle import Throttle

    throttle = Throttle(tmp_path / "throttle", 1)
    seen = []

    def fn():
        seen.append(throttle.in_use())
        if len(seen) < 2:
            raise status_error(503)
        return "ok"

    def sleep(_):
        seen.append(("sleeping", throttle.in_use()))

    assert tb.call_with_retries(fn, "x", attempts=3, backoff_s=0.1, throttle=throttle, sleep=sleep)
    assert seen == [1, ("sleeping", 0), 1]
    assert throttle.in_use() == 0


def test_secrets_never_reach_messages():
    fn = FlakyCall([ValueError("auth failed for key tml-abcdef123456")])
    with pytest.raises(BackendError) as info:
        tb.call_with_retries(fn, "connection", attempts=1, backoff_s=1.0)
    assert "abcdef123456" not in str(info.value) and "tml-***" in str(info.value)


# ---------------------------------------------------------------- keepalive


def test_keepalive_beats_until_stopped_and_survives_failures():
    beats = []

    def beat():
        beats.append(time.monotonic())
        if len(beats) == 2:
            raise ConnectionError("blip")

    keep = tb.KeepAlive(beat, 0.01).start()
    deadline = time.monotonic() + 5
    while len(beats) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    keep.stop()
    assert not keep.running
    assert len(beats) >= 4 and keep.failures >= 1 and "blip" in keep.last_error
    count = len(beats)
    time.sleep(0.05)
    assert len(beats) == count
    assert not tb.KeepAlive(beat, 0).start().running  # 0 = off


def test_session_heartbeat_hook_needs_the_sdk_holder():
    assert tb.session_heartbeat(SimpleNamespace()) is None


# ---------------------------------------------------------------- the backend with fake clients


class Future:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error

    def result(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.value


class FakeSampler:
    def __init__(self, version):
        self.version = version
        self.calls = []

    def sample(self, prompt, num_samples, sampling_params):
        self.calls.append((prompt.to_ints(), num_samples, sampling_params))
        base = prompt.to_ints()[-1]
        seqs = [
            make_sequence([base + 1 + i, EOS], [-0.5 - i, -0.1], "stop", i)
            for i in range(num_samples)
        ]
        return Future(make_response(seqs))


class FakeTraining:
    model_id = "model_fake"

    def __init__(self, *, with_load=True, with_optimizer_load=True):
        self.calls = []
        self.samplers = []
        if not with_load:
            self.load_state = None
        if not with_optimizer_load:
            self.load_state_with_optimizer = None

    def save_weights_and_get_sampling_client(self):
        self.calls.append("publish")
        self.samplers.append(FakeSampler(len(self.samplers)))
        return self.samplers[-1]

    def forward_backward(self, data, loss_fn):
        self.calls.append(("forward_backward", loss_fn, len(data)))
        self.last_data = data
        outputs = []
        for d in data:
            lp = d.loss_fn_inputs["logprobs"].tolist()
            adv = d.loss_fn_inputs["advantages"].tolist()
            outputs.append(
                {
                    "logprobs": tensor([x + 0.01 if a else -5.0 for x, a in zip(lp, adv)]),
                    "elementwise_loss": tensor([-a for a in adv]),
                }
            )
        return Future(fb_output(outputs))

    def optim_step(self, params):
        self.calls.append(("optim_step", params))
        return Future(tinker.types.OptimStepResponse(metrics={"grad_norm": 0.5}))

    def save_state(self, name):
        self.calls.append(("save_state", name))
        return Future(SimpleNamespace(path=f"tinker://{self.model_id}/weights/{name}"))

    def save_weights_for_sampler(self, name):
        self.calls.append(("save_weights_for_sampler", name))
        return Future(SimpleNamespace(path=f"tinker://{self.model_id}/sampler_weights/{name}"))

    def load_state_with_optimizer(self, path):
        self.calls.append(("load_state_with_optimizer", path))
        return Future(SimpleNamespace(path=path))

    def load_state(self, path):
        self.calls.append(("load_state", path))
        return Future(SimpleNamespace(path=path))


class FakeService:
    def __init__(self, training):
        self.training = training
        self.created = []

    def create_lora_training_client(self, base_model, rank, seed=None):
        self.created.append((base_model, rank, seed))
        return self.training


def make_config(**overrides):
    raw = {
        "backend": {
            "backend": "tinker",
            "options": {"keepalive_s": 0.0, "max_retries": 3, "retry_backoff_s": 0.5},
        },
        "model": {"model": "org/model", "lora_rank": 8, "base_url": "http://127.0.0.1:9"},
        "training": {"seed": 3, "temperature": 1.0},
    }
    for table, values in overrides.items():
        raw.setdefault(table, {}).update(values)
    return config_from_dict(raw)


def make_backend(training=None, config=None):
    training = training or FakeTraining()
    lines = []
    sleeps = []
    backend = tb.TinkerBackend(
        tinker_settings(config or make_config()),
        SimpleNamespace(eos_token_id=EOS),
        say=lines.append,
        service_client=FakeService(training),
        sleep=sleeps.append,
    )
    return backend, training, lines, sleeps


def test_startup_lines_and_notices():
    backend, _, lines, _ = make_backend()
    assert lines == [
        "Connecting to Tinker...",
        "Creating LoRA training client (model=org/model, rank=8)...",
        "Training client ready.",
    ]
    assert backend.service.created == [("org/model", 8, 3)]
    _, _, lines, _ = make_backend(
        config=make_config(
            inference={"prefix_caching": False},
            backend={"devices": "cpu"},
            training={"temperature": 0.7},
        )
    )
    notes = [line for line in lines if line.startswith("Note:")]
    assert len(notes) == 2
    assert "ignores [inference] prefix_caching; [backend] devices" in notes[0]
    assert "temperature = 0.7" in notes[1]


def test_sample_publishes_weights_once_per_version_and_fires_every_prompt():
    backend, training, _, _ = make_backend()
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=100)
    groups = backend.sample([[1, 10], [1, 20], [1, 30]], 2, params)
    assert training.calls == ["publish"]
    assert [[s.token_ids.tolist() for s in g] for g in groups] == [
        [[11, EOS], [12, EOS]],
        [[21, EOS], [22, EOS]],
        [[31, EOS], [32, EOS]],
    ]
    sent = training.samplers[0].calls
    assert [c[1] for c in sent] == [2, 2, 2]
    assert [c[2].seed for c in sent] == [100, 102, 104]  # prompts spaced n seeds apart
    assert sent[0][2].stop == [EOS] and sent[0][2].max_tokens == 4
    backend.sample([[1, 10]], 2, params)
    assert training.calls == ["publish"]  # weights unchanged: same sampler


def test_sampling_retries_only_the_prompts_that_failed():
    backend, training, lines, sleeps = make_backend()
    backend._sampling_client()
    sampler = training.samplers[0]
    original = sampler.sample

    failures = [status_error(503)]

    def flaky(prompt, num_samples, sampling_params):
        if prompt.to_ints() == [1, 20] and failures:
            sampler.calls.append((prompt.to_ints(), num_samples, sampling_params))
            return Future(error=failures.pop())
        return original(prompt, num_samples, sampling_params)

    sampler.sample = flaky  # the second prompt fails once with a 503
    groups = backend.sample([[1, 10], [1, 20]], 2, SamplingParams(4, 1.0, seed=None))
    assert [g[0].token_ids.tolist() for g in groups] == [[11, EOS], [21, EOS]]
    assert [c[0] for c in sampler.calls] == [[1, 10], [1, 20], [1, 20]]
    assert sleeps == [0.5] and any("retry 1/2" in line for line in lines)


def test_train_step_sends_is_datums_and_adam_params():
    backend, training, _, _ = make_backend()
    datums = [
        Datum([1, 2], [3, EOS], [-1.0, -2.0], [1.0, 1.0]),
        Datum([1, 2], [4, 5, EOS], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]),
    ]
    hyper = TrainHyper(lr=1e-4, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8)
    result = backend.train_step(datums, hyper)
    assert training.calls[0] == ("forward_backward", "importance_sampling", 2)
    assert training.calls[1][0] == "optim_step" and training.calls[1][1].learning_rate == 1e-4
    # advantages are sent with their Datum's sign, divided by the step's 5 completion
    # tokens: Tinker's importance_sampling loss is -sum(advantages * ratio) per datum,
    # so the service's loss is the local backend's -(1/N) sum(A * ratio)
    sent = [d.loss_fn_inputs["advantages"].tolist() for d in training.last_data]
    assert sent[0] == pytest.approx([0.0, 0.2, 0.2])
    assert sent[1] == pytest.approx([0.0, -0.2, -0.2, -0.2])
    for d, adv in zip(datums, sent, strict=True):
        completion = np.asarray(adv[len(d.prompt_ids) - 1 :])
        assert np.array_equal(np.sign(completion), np.sign(d.advantages))
        assert completion == pytest.approx(d.advantages / 5)
    # service loss = -sum(advantages sent) = -(0.4 - 0.6)
    assert result.loss == pytest.approx(0.2) and result.num_tokens == 5
    assert result.grad_norm == 0.5
    assert result.log_ratio_mean == pytest.approx(0.01, abs=1e-6)
    assert backend.train_step([], hyper).num_tokens == 0
    backend.sample([[1, 2]], 2, SamplingParams(4, 1.0))
    assert training.calls.count("publish") == 1  # published after the update, not before


def test_checkpoint_save_and_resume():
    backend, training, lines, _ = make_backend()
    info = backend.save_checkpoint(Path("/tmp/adapters/checkpoint_step_20"))
    assert info.backend == "tinker"
    assert info.state == "tinker://model_fake/weights/checkpoint_step_20"
    assert info.adapter == "tinker://model_fake/sampler_weights/checkpoint_step_20"
    assert info.extra["sdk_version"] == tb.sdk_version(tinker) and info.extra["lora_rank"] == 8
    assert CheckpointInfo.from_dict(json.loads(json.dumps(info.as_dict()))) == info
    assert not Path("/tmp/adapters/checkpoint_step_20").exists()  # nothing written locally
    fresh, training2, lines2, _ = make_backend()
    fresh.load_checkpoint(info)
    assert ("load_state_with_optimizer", info.state) in training2.calls
    assert f"Loaded Tinker checkpoint {info.state}" in lines2
    fresh.sample([[1, 2]], 2, SamplingParams(4, 1.0))
    assert training2.calls[-1] == "publish"


def test_resume_falls_back_to_weights_only_load_state():
    backend, training, lines, _ = make_backend(FakeTraining(with_optimizer_load=False))
    backend.load_checkpoint(CheckpointInfo("tinker", state="tinker://run/weights/final"))
    assert ("load_state", "tinker://run/weights/final") in training.calls
    assert "weights only" in lines[-1]


def test_resume_without_load_state_names_the_sdk_version():
    backend, _, _, _ = make_backend(FakeTraining(with_load=False, with_optimizer_load=False))
    with pytest.raises(CheckpointError) as info:
        backend.load_checkpoint(CheckpointInfo("tinker", state="tinker://run/weights/final"))
    message = str(info.value)
    assert f"tinker SDK {tb.sdk_version(tinker)}" in message and "load_state" in message
    with pytest.raises(CheckpointError, match="not a Tinker checkpoint"):
        backend.load_checkpoint(CheckpointInfo.from_dict({"adapter": "/tmp/adapters/final"}))


class ClosingService(FakeService):
    """A service with the newer SDKs' `close(status)`, recording each call."""

    def __init__(self, training, error=None):
        super().__init__(training)
        self.closed = []
        self.error = error

    def close(self, status):
        self.closed.append(status)
        if self.error is not None:
            raise self.error
        return Future(None)


def _backend_on(service, **options):
    return tb.TinkerBackend(
        tinker_settings(make_config(backend={"options": {"keepalive_s": 0.0, **options}})),
        SimpleNamespace(eos_token_id=EOS),
        say=lambda line: None,
        service_client=service,
        sleep=lambda s: None,
    )


def test_close_releases_the_session_once():
    service = ClosingService(FakeTraining())
    backend = _backend_on(service)
    backend.close()
    backend.close()
    assert service.closed == ["success"]  # idempotent: the session is ended once


def test_close_after_a_failed_call_reports_errored():
    training = FakeTraining()
    training.optim_step = lambda params: Future(error=status_error(400))
    service = ClosingService(training)
    backend = _backend_on(service)
    hyper = TrainHyper(lr=1e-4, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8)
    with pytest.raises(BackendError, match="optim_step failed"):
        backend.train_step([Datum([1, 2], [3], [-1.0], [1.0])], hyper)
    backend.close()
    assert service.closed == ["errored"]


def test_close_is_quiet_when_the_service_fails(caplog):
    service = ClosingService(FakeTraining(), error=ConnectionError("gone tml-abcdef123456"))
    backend = _backend_on(service)
    with caplog.at_level("INFO", logger="retrain.backends.tinker"):
        backend.close()  # the run's own result matters more: logged, not raised
    assert service.closed == ["success"]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "releasing the Tinker session failed" in messages and "ConnectionError" in messages
    assert "abcdef123456" not in messages


def test_keepalive_runs_through_the_sdk_holder_and_stops_on_close():
    calls = []

    class Holder:
        def get_session_id(self):
            return "session_1"

        def aclient(self, pool):
            calls.append(pool.name)

            class Ctx:
                def __enter__(self_inner):
                    async def heartbeat(**kw):
                        calls.append(kw["session_id"])

                    return SimpleNamespace(service=SimpleNamespace(session_heartbeat=heartbeat))

                def __exit__(self_inner, *a):
                    return False

            return Ctx()

        def run_coroutine_threadsafe(self, coro):
            import asyncio

            result = asyncio.run(coro)
            return Future(result)

    service = FakeService(FakeTraining())
    service.holder = Holder()
    backend = tb.TinkerBackend(
        tinker_settings(make_config(backend={"options": {"keepalive_s": 0.01}})),
        SimpleNamespace(eos_token_id=EOS),
        say=lambda line: None,
        service_client=service,
    )
    deadline = time.monotonic() + 5
    while backend.keepalive.beats < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.keepalive.beats >= 2 and "session_1" in calls and "SESSION" in calls
    backend.close()
    assert not backend.keepalive.running
    assert not any(t.name.endswith("keepalive") and t.is_alive() for t in threading.enumerate())


# ---------------------------------------------------------------- tinker:// adapters


def test_checkpoint_paths():
    assert tb.parse_checkpoint_path("tinker://run/weights/final") == ("run", "final")
    assert tb.parse_checkpoint_path("tinker://run/sampler_weights/s1") == ("run", "s1")
    assert tb.parse_checkpoint_path("tinker://run/s1") == ("run", "s1")
    with pytest.raises(BackendError):
        tb.parse_checkpoint_path("tinker://run/other/x/y")
    assert tb.checkpoint_name("/x/adapters/checkpoint_step_3") == "checkpoint_step_3"
    assert tb.checkpoint_name("weird name!") == "weird_name"


def _archive(tmp_path: Path, adapter_dir: Path) -> Path:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for f in sorted(adapter_dir.iterdir()):
            tar.add(f, arcname=f.name)
    path = tmp_path / "archive.tar.gz"
    path.write_bytes(buffer.getvalue())
    return path


class FakeRest:
    """The SDK's archive call by tinker path 404s (like skyrl-tx); by id it works."""

    def __init__(self, url):
        self.url = url
        self.asked = []

    def get_checkpoint_archive_url_from_tinker_path(self, path):
        self.asked.append(("path", path))
        return Future(
            error=tinker.NotFoundError(
                "404",
                response=httpx.Response(404, request=httpx.Request("GET", "http://x")),
                body=None,
            )
        )

    def get_checkpoint_archive_url(self, run, name):
        self.asked.append(("id", run, name))
        return Future(SimpleNamespace(url=self.url))


def _peft_adapter(directory: Path, rank: int = 4) -> Path:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 32, "target_modules": ["q_proj"]})
    )
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for layer in range(2):
        stem = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        weights[f"{stem}.lora_A.weight"] = torch.randn(rank, 16, generator=gen)
        weights[f"{stem}.lora_B.weight"] = torch.randn(16, rank, generator=gen)
    save_file(weights, str(directory / "adapter_model.safetensors"))
    return directory


def test_fetch_adapter_downloads_extracts_and_caches(tmp_path):
    pytest.importorskip("safetensors")
    source = _peft_adapter(tmp_path / "src")
    url = _archive(tmp_path, source).as_uri()
    rest = FakeRest(url)
    target = tmp_path / "cache" / "run__final"
    got = tb.fetch_adapter("tinker://run/weights/final", target, rest_client=rest)
    assert got == target and (got / "adapter_config.json").is_file()
    assert rest.asked == [("path", "tinker://run/sampler_weights/final"), ("id", "run", "final")]
    again = tb.fetch_adapter("tinker://run/weights/final", target, rest_client=FakeRest("bad"))
    assert again == target  # cached


def test_squeeze_reads_a_tinker_adapter(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from retrain import squeeze

    source = _peft_adapter(tmp_path / "src")
    url = _archive(tmp_path, source).as_uri()
    monkeypatch.setenv("RETRAIN_CACHE", str(tmp_path / "cache"))
    real = tb.fetch_adapter
    monkeypatch.setattr(tb, "fetch_adapter", lambda path: real(path, rest_client=FakeRest(url)))
    result = squeeze.analyze_adapter("tinker://run/sampler_weights/final")
    assert result.source_rank == 4 and result.num_layers == 2
    assert Path(result.adapter_path) == tmp_path / "cache" / "tinker_adapters" / "run__final"


def test_unsafe_archives_are_refused(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    archive = tmp_path / "bad.tar"
    archive.write_bytes(buffer.getvalue())
    with pytest.raises(BackendError, match="unsafe path"):
        tb.fetch_adapter(
            "tinker://run/final", tmp_path / "out", rest_client=FakeRest(archive.as_uri())
        )
    assert not (tmp_path / "escape.txt").exists()


def test_stop_tokens_include_a_local_models_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, EOS]}))
    tok = SimpleNamespace(eos_token_id=EOS)
    assert tb.TinkerBackend._stop_tokens(tok, str(tmp_path)) == [EOS, 7]
    assert tb.TinkerBackend._stop_tokens(tok, "org/hub-model") == [EOS]
    with pytest.raises(BackendError, match="no eos"):
        tb.TinkerBackend._stop_tokens(SimpleNamespace(eos_token_id=None))


def test_a_failed_training_client_creation_ends_the_session():
    closed = []

    class Service(FakeService):
        def create_lora_training_client(self, base_model, rank, seed=None):
            raise status_error(400)

        def close(self, status):
            closed.append(status)
            return Future(None)

    with pytest.raises(BackendError, match="training-client creation failed: BadRequestError"):
        tb.TinkerBackend(
            tinker_settings(make_config()),
            SimpleNamespace(eos_token_id=EOS),
            say=lambda line: None,
            service_client=Service(FakeTraining()),
        )
    assert closed == ["errored"]
