"""The local backend training through compiled blocks (`[backend.options] compile = true`,
retrain/kernels/compiled_blocks.py) on this CPU, in the GPU's layout (the whole model in
bf16, the norms as torch's fused rms_norm). The option is CUDA's (the config refuses it
here), so the config's check is lifted for the build, and the blocks compile with
dynamo's trace and AOT autograd's graphs (`aot_eager`: inductor has no CPU kernel for
the GPU layout's float32-result matmuls). The compiled step must be the eager step to
bf16's rounding, the sampling copy must stay eager, and a failed compile must stop the
step with the option named. tests/integration/test_gpu.py compiles with inductor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from grad_recorder import step_gradients
from test_memory_sizing import HYPER, datums_of, make_backend, trained_adapter

from retrain.errors import BackendError
from retrain.kernels import compiled_blocks
from retrain.kernels.blocks import transformer_blocks as blocks
from retrain.kernels.compiled_blocks import compiled


@pytest.fixture
def compile_here(monkeypatch):
    """`compile = true` let through on this CPU, the blocks compiled by aot_eager."""
    import retrain.config.validate as validate

    checks = tuple(c for c in validate.CROSS_CHECKS if c is not validate._compile)
    monkeypatch.setattr(validate, "CROSS_CHECKS", checks)
    monkeypatch.setattr(compiled_blocks, "BACKEND", "aot_eager")


@pytest.fixture
def gpu_layout(monkeypatch, compile_here):
    """bf16 mode as a GPU runs it (the norms torch's fused ones), `compile_here`."""
    import retrain.hardware as hardware
    import retrain.kernels.norms as norms

    monkeypatch.setattr(hardware, "WHOLE_BF16", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(norms, "FUSED_NORM_DEVICES", frozenset({"cpu", "cuda"}))


def _backend(tiny_raw, tiny_model_dir, compile_: bool, said=None):
    tiny_raw["backend"]["options"].update(dtype="bf16", compile=compile_)
    return trained_adapter(make_backend(tiny_raw, tiny_model_dir, said))


def _relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """|got - want| / |want| over all the gradients together."""
    a = torch.cat([g.flatten().float() for g in got])
    b = torch.cat([g.flatten().float() for g in want])
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases) with layer 1 sliding over 4 positions: its blocks take
    a mask per layer type. The tests below run the tiny Llama (the quickstart's kind)."""
    from tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("sliding") / "model", sliding_window=4)


def test_a_step_through_compiled_blocks_is_the_eager_step(gpu_layout, tiny_raw, sliding_dir):
    from retrain.kernels.recompute import GatedMlp

    tiny_raw["model"]["model"] = str(sliding_dir)
    tiny_model_dir = sliding_dir
    eager = _backend(tiny_raw, tiny_model_dir, False)
    assert eager._siblings and not any(compiled(m) for m in eager.model.modules())
    datums = datums_of(eager)
    want_result, want = step_gradients(eager, datums, HYPER, 512)

    said: list[str] = []
    ours = _backend(tiny_raw, tiny_model_dir, True, said)
    layers = ours.model.get_base_model().config.num_hidden_layers
    found = blocks(ours.model)
    assert len(found) == layers and all(compiled(m) for m in found)
    assert any(f"{layers} transformer blocks to compile" in line for line in said)
    assert any("compiled blocks" in line for line in said if "ready" in line)
    # what the blocks cannot trace is left out: siblings run one by one, the gated
    # product is the model's own (the compiler recomputes what it chooses)
    assert ours._siblings == []
    assert not any(isinstance(m, GatedMlp) for m in ours.model.modules())
    # the sampling copy's blocks stay eager, and none of them is the trained model's
    trained = {id(m) for m in ours.model.modules()}
    copy_ = ours.engine.copy.model
    assert not any(compiled(m) for m in copy_.modules())
    assert not any(id(m) in trained for m in blocks(copy_))

    from torch._dynamo.utils import counters

    counters.clear()
    result, got = step_gradients(ours, datums, HYPER, 512)
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks ran compiled
    assert result.loss == pytest.approx(want_result.loss, rel=0.02, abs=1e-4)
    assert len(got) == len(want) > 0
    scale = max(g.abs().max() for g in want)
    assert scale > 0
    for grad, expected in zip(got, want, strict=True):  # bf16 rounding apart
        torch.testing.assert_close(grad, expected, rtol=0.05, atol=0.02 * scale)
    assert _relative(got, want) < 0.02
    # the next step reuses the graphs: sampling (eager copy) and training again
    counters.clear()
    ours.train_step(datums_of(ours), HYPER)
    assert counters["stats"]["unique_graphs"] == 0


def test_a_failed_compile_names_the_option(gpu_layout, tiny_raw, tiny_model_dir, monkeypatch):
    ours = _backend(tiny_raw, tiny_model_dir, True)
    datums = datums_of(ours)
    before = [p.detach().clone() for p in ours.params]

    def fails(gm, example_inputs):
        raise RuntimeError("no kernel for this")

    for block in blocks(ours.model):  # a compiler that fails on the block's graph
        block._compiled_call_impl = None
        block.compile(backend=fails, fullgraph=True, dynamic=True)
    with pytest.raises(BackendError, match=r"compile = true.*Fix: compile = false"):
        ours.train_step(datums, HYPER)
    for p, q in zip(ours.params, before, strict=True):  # the weights were not updated
        assert torch.equal(p, q)


def test_compile_is_refused_where_it_cannot_run(tiny_raw):
    from retrain.config import config_from_dict
    from retrain.errors import ConfigError

    tiny_raw["backend"]["options"]["compile"] = True
    with pytest.raises(ConfigError, match=r"compile.*GPU.*'cpu'"):
        config_from_dict(tiny_raw)
    tiny_raw["backend"]["devices"] = "gpu:0"
    tiny_raw["backend"]["options"]["attention"] = "varlen"
    with pytest.raises(ConfigError, match=r'compile.*attention = "varlen"'):
        config_from_dict(tiny_raw)


def test_compiled_blocks_under_activation_checkpointing(gpu_layout, tiny_raw, tiny_model_dir):
    # checkpointing = "auto" can turn on mid-run (a completion that runs out of memory):
    # each compiled block then runs inside the checkpoint and again in the backward
    eager = _backend(tiny_raw, tiny_model_dir, False)
    datums = datums_of(eager)
    want_result, want = step_gradients(eager, datums, HYPER, 512)
    tiny_raw["backend"]["options"]["checkpointing"] = True
    ours = _backend(tiny_raw, tiny_model_dir, True)
    assert ours.options.checkpointing is True
    assert all(compiled(m) for m in blocks(ours.model))
    result, got = step_gradients(ours, datums, HYPER, 512)
    assert result.extra["checkpointing"] == 1.0
    assert result.loss == pytest.approx(want_result.loss, rel=0.02, abs=1e-4)
    assert _relative(got, want) < 0.02


@pytest.mark.slow  # a long CLI-process test; the bf16 layout's compiled step runs by default
def test_compiled_float32_blocks_are_the_eager_ones(compile_here, tiny_raw, tiny_model_dir):
    # dtype = "fp32" on a GPU: no bf16 layout, PEFT's LoRA linears with the lean forward
    tiny_raw["backend"]["options"]["compile"] = False
    eager = make_backend(tiny_raw, tiny_model_dir)
    datums = datums_of(eager)
    want_result, want = step_gradients(eager, datums, HYPER, 512)
    tiny_raw["backend"]["options"]["compile"] = True
    ours = make_backend(tiny_raw, tiny_model_dir)
    assert all(compiled(m) for m in blocks(ours.model))
    result, got = step_gradients(ours, datums, HYPER, 512)
    assert result.loss == pytest.approx(want_result.loss, rel=1e-5, abs=1e-7)
    for grad, expected in zip(got, want, strict=True):
        torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-4)


def test_flexattention_inside_a_compiled_block_gives_the_eager_logprobs(
    gpu_layout, tiny_raw, tiny_model_dir, monkeypatch
):
    # the headline's path: packed rows as a BlockMask through FlexAttention inside the
    # compiled blocks. Forward only here (torch has no FlexAttention backward on a CPU:
    # the -m gpu test trains through it); the trace takes the mask as an input
    from retrain.kernels import flex

    monkeypatch.setattr(flex, "flex_from", lambda *args: 0)  # every micro-batch
    eager = _backend(tiny_raw, tiny_model_dir, False)
    ours = _backend(tiny_raw, tiny_model_dir, True)
    prompt, completions = [5, 6, 7, 8], [np.array([9, 10, 11]), np.array([12, 13])]
    seen = []
    real = flex._flex
    monkeypatch.setattr(flex, "_flex", lambda *a: seen.append(1) or real(*a))
    with torch.no_grad():
        want = eager.completion_logprobs(prompt, completions, 1.0)
        assert seen  # the eager blocks attended through FlexAttention
        got = ours.completion_logprobs(prompt, completions, 1.0)
    assert all(compiled(m) for m in blocks(ours.model))
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)
    assert got.abs().max() > 0


@pytest.mark.slow  # a long CLI-process test; the compiled step without KL runs by default
def test_a_kl_step_through_compiled_blocks_is_the_eager_step(gpu_layout, tiny_raw, tiny_model_dir):
    # the KL term's reference logprobs: the blocks without gradients and with the adapter
    # off (PEFT's own forward), a second graph beside training's
    import dataclasses

    hyper = dataclasses.replace(HYPER, kl_coef=0.5)
    eager = _backend(tiny_raw, tiny_model_dir, False)
    datums = datums_of(eager)
    want_result, want = step_gradients(eager, datums, hyper, 512)
    ours = _backend(tiny_raw, tiny_model_dir, True)
    result, got = step_gradients(ours, datums, hyper, 512)
    assert result.loss == pytest.approx(want_result.loss, rel=0.02, abs=1e-4)
    assert _relative(got, want) < 0.02
