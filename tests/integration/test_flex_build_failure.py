"""FlexAttention's kernels not building on the GPU (`flex.build_failed`: triton finding no
block size that fits a consumer card's shared memory, which inductor reports as
InductorError "No valid triton configs"). `attention = "flex"` stops the step with the
option named and the weights as they were; "auto" says so, takes the dense mask for the
rest of the run, and the step it redoes is the dense step to the bit. On this CPU
FlexAttention runs eager and forward only, so the failure is injected into `flex._flex`:
in the forward, where its compile runs, or in the backward, where the compiled
backward's kernels build."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from grad_recorder import step_gradients
from test_memory_sizing import HYPER, datums_of, make_backend, trained_adapter
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import InductorError

from retrain.errors import BackendError
from retrain.kernels import flex

SHARED_MEMORY = (
    "No valid triton configs. OutOfResources: out of resource: shared memory, Required: "
    "131074, Hardware limit: 101376. Reducing block sizes or `num_stages` may help."
)


def _build_error() -> InductorError:
    return InductorError(RuntimeError(SHARED_MEMORY), None)


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, out):
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        raise _build_error()


def _failing(where: str, calls: list[str]):
    """A `flex._flex` whose kernels do not build: at the call (`forward`), or in the
    backward of what it returns (`backward`, its forward computed by the eager one)."""
    eager = flex._flex

    def attend(query, key, value, mask, scale):
        calls.append(where)
        if where == "forward":
            raise _build_error()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager FlexAttention warns it is not compiled
            out = eager(query.detach(), key.detach(), value.detach(), mask, scale)
        return _FailsInBackward.apply(query, out)

    return attend


@pytest.fixture
def backend(tiny_raw, tiny_model_dir):
    said: list[str] = []
    b = trained_adapter(make_backend(tiny_raw, tiny_model_dir, said))
    b.said = said
    flex.use_flex(b.model.get_base_model())  # retrain's attention, as on CUDA
    return b


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_auto_takes_the_dense_mask_and_redoes_the_step(backend, monkeypatch, where):
    datums = datums_of(backend)
    dense_result, dense = step_gradients(backend, datums, HYPER, 512)
    assert "attention_fell_back" not in dense_result.extra

    calls: list[str] = []
    monkeypatch.setattr(flex, "_flex", _failing(where, calls))
    backend._flex_from = 0  # what auto chooses on CUDA for long rows, here for every row
    result, got = step_gradients(backend, datums, HYPER, 512)
    assert calls, "the step went through FlexAttention"
    assert backend._flex_from is None
    assert result.extra["attention_fell_back"] == 1.0
    assert result.loss == dense_result.loss
    assert len(got) == len(dense) > 0
    for g, want in zip(got, dense, strict=True):  # the redone step is the dense step
        assert torch.equal(g, want)
    [line] = [s for s in backend.said if "did not build" in s]
    assert 'attention = "auto"' in line and "dense mask for the rest of the run" in line
    assert "head size 8" in line and "shared memory" in line and "InductorError" in line

    calls.clear()  # the next step: dense from the start, nothing to report
    later = backend.train_step(datums_of(backend), HYPER)
    assert not calls and "attention_fell_back" not in later.extra


def test_auto_logprobs_take_the_dense_mask(backend, monkeypatch):
    prompt, completions = [5, 6, 7], [torch.tensor([8, 9]).numpy(), torch.tensor([4]).numpy()]
    with torch.no_grad():
        want = backend.completion_logprobs(prompt, completions, 1.0)
    calls: list[str] = []
    monkeypatch.setattr(flex, "_flex", _failing("forward", calls))
    backend._flex_from = 0
    with torch.no_grad():
        got = backend.completion_logprobs(prompt, completions, 1.0)
    assert calls and backend._flex_from is None
    assert torch.equal(got, want)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_flex_stops_with_the_option_named(backend, monkeypatch, where):
    datums = datums_of(backend)
    before = [p.detach().clone() for p in backend.params]
    monkeypatch.setattr(flex, "_flex", _failing(where, []))
    backend.options = dataclasses.replace(backend.options, attention="flex")
    backend._flex_from = 0
    with pytest.raises(BackendError) as caught:
        backend.train_step(datums, HYPER)
    text = str(caught.value)
    assert text.startswith('[backend.options] attention = "flex": FlexAttention')
    assert "head size 8" in text and "Hardware limit: 101376" in text
    assert text.endswith('Fix: attention = "dense"')
    assert backend._flex_from == 0
    for p, q in zip(backend.params, before, strict=True):  # the weights were not updated
        assert torch.equal(p, q)


def test_other_errors_are_not_taken_for_a_failed_build(backend, monkeypatch):
    def breaks(query, key, value, mask, scale):
        raise ValueError("a bug of ours")

    monkeypatch.setattr(flex, "_flex", breaks)
    backend._flex_from = 0
    with pytest.raises(ValueError, match="a bug of ours"):
        backend.train_step(datums_of(backend), HYPER)
    assert backend._flex_from == 0  # still FlexAttention: nothing fell back


class OutOfResources(Exception):  # triton's, by name (triton is not installed here)
    pass


@pytest.mark.parametrize(
    "error, failed",
    [
        (_build_error(), True),
        (RuntimeError(SHARED_MEMORY), True),  # inductor's own, unwrapped
        (OutOfResources("out of resource: shared memory"), True),
        (BackendError("x"), False),
        (torch.OutOfMemoryError("CUDA out of memory"), False),  # the back-off's
        # dynamo wraps whatever the compiler raised, memory running out too ("from None":
        # only its inner_exception holds it)
        (BackendCompilerFailed(print, torch.OutOfMemoryError("CUDA out of memory"), None), False),
        (BackendCompilerFailed(print, RuntimeError(SHARED_MEMORY), None), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (ValueError("No valid triton configs"), False),
    ],
)
def test_build_failed(error, failed):
    assert flex.build_failed(error) is failed


def test_memory_running_out_while_compiling_goes_to_the_back_off():
    """compile = true's error names the option for a compile failure, but lets a device
    out-of-memory error inside one out as itself, for the micro-batch back-off."""
    from retrain.kernels.compiled_blocks import compile_errors, device_error

    oom = torch.OutOfMemoryError("CUDA out of memory")
    wrapped = BackendCompilerFailed(print, oom, None)
    assert device_error(wrapped) is oom and device_error(RuntimeError("x")) is None
    with pytest.raises(torch.OutOfMemoryError) as caught, compile_errors(True):
        raise wrapped from None
    assert caught.value is oom
    with pytest.raises(BackendError, match="compile = true"), compile_errors(True):
        raise BackendCompilerFailed(print, RuntimeError("no kernel"), None) from None


def test_build_failed_looks_through_what_wraps_it():
    try:
        try:
            raise OutOfResources("out of resource: shared memory")
        except OutOfResources as inner:
            raise RuntimeError("rank 0 failed in a sharded forward/backward") from inner
    except RuntimeError as outer:
        assert flex.build_failed(outer)
