"""The local backend sized to its device, on the tiny random model (CPU): `micro_batch_tokens
= "auto"` is 512 on a CPU and shown in the ready line and the metrics; on CUDA the run-start
check refuses a micro-batch over the free memory (a stand-in device: no GPU needed); and an
out-of-memory error in a training micro-batch (injected) halves the budget and redoes the
step, with the gradient of a step that never ran out, until one completion cannot fit."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from grad_recorder import GradRecorder, step_gradients

from retrain.backends.local import LocalBackend
from retrain.build import build_backend
from retrain.config import config_from_dict
from retrain.errors import BackendError, TrainingError
from retrain.kernels.packing import padded_area, split
from retrain.memory import (
    AUTO_MOST,
    GIB,
    Sizing,
    copy_adapter_bytes,
    largest_micro_batch,
    sampler_copy_bytes,
    shape_from_config,
)
from retrain.settings import LocalOptions
from retrain.types import Datum, SamplingParams, TrainHyper

HYPER = TrainHyper(lr=1e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8)
QWEN3_4B = {
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def make_backend(tiny_raw, tiny_model_dir, said: list[str] | None = None) -> LocalBackend:
    from transformers import AutoTokenizer

    raw = copy.deepcopy(tiny_raw)
    say = (lambda s: None) if said is None else said.append
    return build_backend(
        config_from_dict(raw), AutoTokenizer.from_pretrained(tiny_model_dir), say=say
    )


def trained_adapter(backend) -> LocalBackend:
    """`backend` with every LoRA B drawn N(0, 0.2) from a generator seeded by its name's
    length (the same draw in every backend): a trained adapter, whose A's gradient is not
    zero either."""
    with torch.no_grad():
        for name, p in backend.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return backend


@pytest.fixture
def backend(tiny_raw, tiny_model_dir):
    b = make_backend(tiny_raw, tiny_model_dir)
    with torch.no_grad():  # a non-trivial adapter, so the gradient reaches LoRA A too
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return b


def datums_of(backend) -> list[Datum]:
    prompts = [[5, 6, 7, 8], [9, 10]]
    groups = backend.sample(prompts, 4, SamplingParams(max_tokens=8, temperature=1.0, seed=2))
    return [
        Datum(prompt, s.token_ids, s.logprobs, [0.5 - (i % 2)] * len(s.token_ids))
        for prompt, g in zip(prompts, groups, strict=True)
        for i, s in enumerate(g)
    ]


def area(groups) -> int:
    """Positions of a packed micro-batch: rows x longest row (retrain/kernels/packing.py)."""
    rows = [len(p) + sum(len(c) - 1 for c in completions) for p, completions in groups]
    return len(rows) * max(rows)


def micro_batch_areas(datums: list[Datum], budget: int) -> list[int]:
    """The packed areas of the micro-batches `budget` splits the step into."""
    items = [(d.prompt_ids, len(d.completion_ids)) for d in datums]
    out, start = [], 0
    for size in split(items, budget):
        out.append(padded_area(items[start : start + size]))
        start += size
    return out


def run_out_of_memory_above(backend, monkeypatch, limit: int, compiling=False) -> list[int]:
    """Make the trainer's logprob forward raise torch.OutOfMemoryError for a micro-batch
    over `limit` positions, as a GPU would (`compiling`: inside torch.compile's failure,
    as dynamo raises memory running out while inductor compiles); returns the areas of
    the forwards that ran."""
    from torch._dynamo.exc import BackendCompilerFailed

    inner, ran = backend._logprobs, []

    def forward(groups, temperature):
        if area(groups) > limit:
            oom = torch.OutOfMemoryError("CUDA out of memory (injected)")
            if compiling:
                raise BackendCompilerFailed(print, oom, None) from None
            raise oom
        ran.append(area(groups))
        return inner(groups, temperature)

    monkeypatch.setattr(backend, "_logprobs", forward)
    return ran


def test_auto_is_512_on_a_cpu_and_shown(tiny_raw, tiny_model_dir):
    said: list[str] = []
    b = make_backend(tiny_raw, tiny_model_dir, said)
    assert b.settings.options.micro_batch_tokens == "auto"  # the default
    assert b.options.micro_batch_tokens == 512
    (ready,) = [s for s in said if "Local backend ready" in s]
    assert "micro_batch_tokens=512, attention=" in ready  # checkpointing auto: off on a CPU
    result = b.train_step(datums_of(b), HYPER)
    assert result.extra["micro_batch_tokens"] == 512 and result.extra["oom_retries"] == 0


def test_out_of_memory_halves_the_budget_and_keeps_the_gradient(backend, monkeypatch):
    datums = datums_of(backend)
    clean, grad_clean = step_gradients(backend, datums, HYPER, 10_000)
    assert clean.extra["oom_retries"] == 0
    said: list[str] = []
    backend._say = said.append
    ran = run_out_of_memory_above(backend, monkeypatch, limit=40)
    result, grads = step_gradients(backend, datums, HYPER, 10_000)
    # 10000 -> 5000 -> ...: halved until every micro-batch of the split fits 40 positions
    budget, retries = 10_000, 0
    while max(micro_batch_areas(datums, budget)) > 40:
        budget, retries = budget // 2, retries + 1
    assert retries >= 3 and budget < 40
    assert result.extra["oom_retries"] == retries
    assert backend.options.micro_batch_tokens == result.extra["micro_batch_tokens"] == budget
    assert max(ran) <= 40
    assert result.loss == pytest.approx(clean.loss, abs=1e-6)
    assert any(g.abs().max() > 1e-3 for g in grad_clean)  # a real gradient
    for a, b in zip(grad_clean, grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    (notice,) = said  # said once, with the new budget
    assert f"micro_batch_tokens lowered 10000 -> {budget} for the rest of the run" in notice
    # the next step keeps the lowered budget: no retries
    optimizer, backend.optimizer = backend.optimizer, GradRecorder(backend.params)
    try:
        again = backend.train_step(datums, HYPER)
    finally:
        backend.optimizer = optimizer
    assert again.extra["oom_retries"] == 0 and again.extra["micro_batch_tokens"] == budget
    assert len(said) == 1


def test_out_of_memory_while_compiling_halves_the_budget_too(backend, monkeypatch):
    """Inductor can run out of memory compiling a micro-batch's kernels; dynamo raises it
    inside its own BackendCompilerFailed, which once stopped the run as a compile failure
    (Fix: compile = false) instead of halving the budget."""
    datums = datums_of(backend)
    clean, _ = step_gradients(backend, datums, HYPER, 10_000)
    backend._say = lambda line: None
    ran = run_out_of_memory_above(backend, monkeypatch, limit=40, compiling=True)
    result, _ = step_gradients(backend, datums, HYPER, 10_000)
    assert result.extra["oom_retries"] >= 3 and max(ran) <= 40
    assert result.loss == pytest.approx(clean.loss, abs=1e-6)


def test_out_of_memory_in_the_selection_pre_pass_halves_the_budget(backend, monkeypatch):
    """kl_cov picks its tokens in a pre-pass over the whole step (no gradients) before the
    micro-batches train: an out-of-memory error there halves the budget too, and the step
    makes the update of a step that never ran out."""
    datums = datums_of(backend)
    hyper = dataclasses.replace(HYPER, policy_loss="kl_cov", kl_cov_fraction=0.2)
    torch.manual_seed(0)  # the selection draws from the global generator
    clean, grad_clean = step_gradients(backend, datums, hyper, 10_000)
    said: list[str] = []
    backend._say = said.append
    inner, passes = backend._logprobs, []

    def forward(groups, temperature):
        passes.append(torch.is_grad_enabled())
        if not torch.is_grad_enabled() and area(groups) > 40:  # the pre-pass only
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return inner(groups, temperature)

    monkeypatch.setattr(backend, "_logprobs", forward)
    torch.manual_seed(0)  # the clean step's draw
    result, grads = step_gradients(backend, datums, hyper, 10_000)
    assert passes.count(False) > 1 and passes[-1] is True  # the pre-pass ran again, then trained
    assert backend.options.micro_batch_tokens < 10_000
    assert result.loss == pytest.approx(clean.loss, abs=1e-6)
    for a, b in zip(grad_clean, grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_out_of_memory_in_the_optimizer_update_names_what_bounds_it(backend, monkeypatch):
    """Out of memory after the micro-batches (AdamW's update, injected): no traceback of
    torch's, a TrainingError naming the device and what to lower instead."""
    datums = datums_of(backend)

    def update(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(backend.optimizer, "step", update)
    with pytest.raises(TrainingError) as err:
        backend.train_step(datums, HYPER)
    message = str(err.value)
    assert message.startswith("out of memory on cpu outside the step's micro-batches")
    assert "micro_batch_tokens does not bound them" in message and "[lora] rank" in message
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)


def test_one_completion_that_cannot_fit_stops_with_the_keys_to_lower(backend, monkeypatch):
    """checkpointing = "auto" (off on a CPU) turns activation checkpointing on at the first
    completion that runs out of memory and runs the step again; when that completion
    still does not fit, the run stops naming the keys, the weights untouched."""
    datums = datums_of(backend)
    said: list[str] = []
    backend._say = said.append
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}
    assert backend.options.checkpointing is False and backend._auto_checkpointing
    run_out_of_memory_above(backend, monkeypatch, limit=3)  # below any prompt + completion
    with pytest.raises(TrainingError) as err:
        backend.train_step(datums, HYPER)
    message = str(err.value)
    assert "out of memory on cpu training a micro-batch of one completion" in message
    for key in ("[backend.options]", "micro_batch_tokens", "[training] max_tokens", "group_size"):
        assert key in message
    assert "checkpointing = true" not in message  # auto turned it on already
    (turned,) = [s for s in said if "checkpointing = auto turns" in s]
    assert turned.startswith("out of memory on cpu training one completion (up to ")
    assert backend.options.checkpointing is True
    for name, p in backend.model.named_parameters():
        if p.requires_grad:
            assert p.grad is None and torch.equal(p.detach(), before[name])  # not updated


def test_one_completion_that_cannot_fit_names_checkpointing_when_set_off(
    tiny_raw, tiny_model_dir, monkeypatch
):
    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["options"] = {"checkpointing": False}
    backend = make_backend(raw, tiny_model_dir)
    datums = datums_of(backend)
    run_out_of_memory_above(backend, monkeypatch, limit=3)
    with pytest.raises(TrainingError) as err:
        backend.train_step(datums, HYPER)
    assert "Fix: [backend.options] checkpointing = true (each block keeps only" in str(err.value)
    assert backend.options.checkpointing is False  # set by hand: left alone


def test_auto_checkpointing_trains_a_completion_that_ran_out_of_memory(backend, monkeypatch):
    """A completion that runs out of memory without activation checkpointing and fits
    with it (injected: only while it is off): the step runs again with it on, at the
    step's first budget, and makes the update a step that never ran out would make;
    every later step keeps it (the metrics row says checkpointing 1)."""
    datums = datums_of(backend)
    clean, grad_clean = step_gradients(backend, datums, HYPER, 10_000)
    assert clean.extra["checkpointing"] == 0.0
    said: list[str] = []
    backend._say = said.append
    inner = backend._logprobs

    def forward(groups, temperature):
        if not backend.options.checkpointing and len(groups[0][1]) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return inner(groups, temperature)

    monkeypatch.setattr(backend, "_logprobs", forward)
    result, grads = step_gradients(backend, datums, HYPER, 1)  # one completion a micro-batch
    assert result.extra["checkpointing"] == 1.0 and result.extra["oom_retries"] == 1
    assert result.extra["micro_batch_tokens"] == 1  # the step's first budget, not halved
    assert backend.options.checkpointing is True
    assert any(getattr(m, "gradient_checkpointing", False) for m in backend.model.modules())
    (turned,) = said
    assert "checkpointing = auto turns activation checkpointing on for the rest of the run" in (
        turned
    )
    assert result.loss == pytest.approx(clean.loss, abs=1e-6)
    for a, b in zip(grad_clean, grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_a_resumed_run_keeps_the_checkpointing_auto_turned_on(tiny_raw, tiny_model_dir, tmp_path):
    """A checkpoint of a run whose checkpointing = "auto" turned activation checkpointing
    on resumes with it on (no second out-of-memory step); one set false stays off."""
    first = make_backend(tiny_raw, tiny_model_dir)
    first._checkpoint_from_now()  # as the switch in _back_off does
    info = first.save_checkpoint(tmp_path / "ckpt")
    resumed = make_backend(tiny_raw, tiny_model_dir)
    assert resumed.options.checkpointing is False  # a CPU: auto decides off at start
    resumed.load_checkpoint(info)
    assert resumed.options.checkpointing is True and resumed.sizing.checkpointing is True
    assert any(getattr(m, "gradient_checkpointing", False) for m in resumed.model.modules())
    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["options"] = {"checkpointing": False}
    kept_off = make_backend(raw, tiny_model_dir)
    kept_off.load_checkpoint(info)
    assert kept_off.options.checkpointing is False
    assert not any(getattr(m, "gradient_checkpointing", False) for m in kept_off.model.modules())


# ----------------------------------------------------------------------------- the
# sampler's kept caches on a shared CUDA device (stand-ins: the device's free memory,
# and caches kept on the CPU as the graphs keep them on CUDA)


def kept_sampler(tiny_raw, tiny_model_dir, monkeypatch, free: float) -> LocalBackend:
    import retrain.backends.local as local

    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["options"]["decode"] = "static"
    b = make_backend(raw, tiny_model_dir)
    b.engine.static.keep = True  # as decode = "graphs" keeps them on CUDA
    monkeypatch.setattr(b, "_decoder_beside_training", lambda: True)
    b.engine.static._pool = (0, 5)  # as its captured graphs' pool would be

    def free_beside(device, pools):
        assert pools == [(0, 5)]  # whose unused memory is not free (hardware.py)
        return free

    monkeypatch.setattr(local, "cuda_free_bytes", free_beside)
    b._shape = shape_from_config(b.model.config.to_dict())
    return b


def test_kept_caches_stay_when_a_micro_batch_fits_beside_them(
    tiny_raw, tiny_model_dir, monkeypatch
):
    b = kept_sampler(tiny_raw, tiny_model_dir, monkeypatch, free=1000 * GIB)
    datums = datums_of(b)
    kept = b.engine.kept_bytes()
    assert kept > 0
    result = b.train_step(datums, HYPER)
    assert result.extra["sampler_cache_released"] == 0 and result.extra["oom_retries"] == 0
    assert b.engine.kept_bytes() == kept


def test_kept_caches_give_way_to_a_micro_batch_that_would_not_fit(
    tiny_raw, tiny_model_dir, monkeypatch
):
    b = kept_sampler(tiny_raw, tiny_model_dir, monkeypatch, free=0)
    datums = datums_of(b)
    result = b.train_step(datums, HYPER)
    assert result.extra["sampler_cache_released"] == 1 and result.extra["oom_retries"] == 0
    assert b.engine.kept_bytes() == 0
    datums_of(b)  # the next sampling phase keeps its cache again
    assert b.engine.kept_bytes() > 0


def test_kept_caches_stay_when_the_steps_micro_batch_fits_though_the_budget_would_not(
    tiny_raw, tiny_model_dir, monkeypatch
):
    """`auto` sizes the budget to the whole free memory at the start, so the budget never
    fits beside the caches; what has to fit is the step's largest packed micro-batch (a
    few short completions here), and then the caches and their graphs stay."""
    import retrain.backends.local as local
    from retrain.memory import HEADROOM, training_memory

    b = kept_sampler(tiny_raw, tiny_model_dir, monkeypatch, free=0)
    datums = datums_of(b)
    monkeypatch.setattr(b, "options", dataclasses.replace(b.options, micro_batch_tokens=60_000))
    largest = max(local._packed_area(chunk) for _, chunk in b._micro_batches(datums))

    def need(positions: int) -> float:
        peak = training_memory(b._shape, b.sizing, positions)
        return peak.training * peak.slack / HEADROOM

    assert need(60_000) > 2 * need(largest)
    monkeypatch.setattr(local, "cuda_free_bytes", lambda device, pools: 1.5 * need(largest))
    kept = b.engine.kept_bytes()
    result = b.train_step(datums, HYPER)
    assert result.extra["sampler_cache_released"] == 0 and b.engine.kept_bytes() == kept
    monkeypatch.setattr(local, "cuda_free_bytes", lambda device, pools: 0.5 * need(largest))
    result = b.train_step(datums, HYPER)  # and when it does not fit, they give way
    assert result.extra["sampler_cache_released"] == 1 and b.engine.kept_bytes() == 0


def test_out_of_memory_releases_kept_caches_before_halving(tiny_raw, tiny_model_dir, monkeypatch):
    b = kept_sampler(tiny_raw, tiny_model_dir, monkeypatch, free=1000 * GIB)
    datums = datums_of(b)
    with torch.no_grad():  # a non-trivial adapter, so the gradient reaches LoRA A too
        for name, p in b.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    clean, grad_clean = step_gradients(b, datums, HYPER, 10_000)
    inner, failures = b._logprobs, []

    def once(groups, temperature):  # the estimate was wrong once: a real OOM
        if not failures:
            failures.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return inner(groups, temperature)

    monkeypatch.setattr(b, "_logprobs", once)
    result, grads = step_gradients(b, datums, HYPER, 10_000)
    assert result.extra["oom_retries"] == 1 and result.extra["sampler_cache_released"] == 1
    assert result.extra["micro_batch_tokens"] == 10_000  # the same budget, not halved
    assert b.engine.kept_bytes() == 0
    for a, g in zip(grad_clean, grads, strict=True):
        assert torch.allclose(a, g, rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------------------- the
# run-start check on CUDA, with a stand-in device and model shape


ON_CUDA = Sizing("cuda", "bf16", 32)  # what cuda_stand_in sizes with


def cuda_stand_in(
    micro_batch_tokens, free_gib: float, monkeypatch, max_tokens: int = 256, **options
) -> SimpleNamespace:
    """What LocalBackend._size_memory reads of a backend training on cuda:0, with the
    shape of Qwen3-4B and `free_gib` free (torch.cuda.mem_get_info stands in)."""
    options = LocalOptions.from_mapping({"micro_batch_tokens": micro_batch_tokens, **options})
    lora = SimpleNamespace(rank=32, target_modules=())
    stand_in = SimpleNamespace(
        options=options,
        train_device=torch.device("cuda", 0),
        bf16=True,
        settings=SimpleNamespace(model="qwen3-4b-shaped", lora=lora, max_tokens=max_tokens),
        _model_shape=lambda model: shape_from_config(QWEN3_4B),
    )
    free = int(free_gib * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    return stand_in


def test_the_run_start_check_refuses_a_micro_batch_over_the_gpu(monkeypatch):
    said: list[str] = []
    b = cuda_stand_in(20480, 79.0, monkeypatch)
    largest = largest_micro_batch(shape_from_config(QWEN3_4B), ON_CUDA, 79 * GIB)
    with pytest.raises(BackendError) as err:
        LocalBackend._size_memory(b, None, said.append)
    assert str(err.value).startswith(
        "[backend.options] micro_batch_tokens = 20480: the step needs ~"
    )
    assert f"the largest that fits is {largest}" in str(err.value)
    assert "over the 79.0 GiB free on cuda:0 (of 80.0 GiB)" in str(err.value)
    # the largest value passes; auto resolves to AUTO_MOST below it and says so
    b = cuda_stand_in(largest, 79.0, monkeypatch)
    LocalBackend._size_memory(b, None, said.append)
    assert b.options.micro_batch_tokens == largest and not said
    b = cuda_stand_in("auto", 79.0, monkeypatch)
    LocalBackend._size_memory(b, None, said.append)
    assert b.options.micro_batch_tokens == AUTO_MOST < largest
    assert said == [f"micro_batch_tokens = auto: {AUTO_MOST} positions (79.0 GiB free on cuda:0)"]
    # a completion longer than AUTO_MOST: auto holds it whole (its budget is what the
    # memory check sized), up to the largest that fits
    b = cuda_stand_in("auto", 79.0, monkeypatch, max_tokens=9000)
    LocalBackend._size_memory(b, None, lambda s: None)
    assert b.options.micro_batch_tokens == 9472  # 256 + 9000, up to a multiple of 256
    # a GPU the weights alone fill: auto refuses too, naming the key
    b = cuda_stand_in("auto", 9.0, monkeypatch)  # (12 GiB fits a few with checkpointing)
    with pytest.raises(BackendError, match=r"\[backend.options\] micro_batch_tokens: not even 256"):
        LocalBackend._size_memory(b, None, said.append)


def test_auto_checkpointing_at_the_run_start(monkeypatch):
    """checkpointing = "auto" on CUDA: on when a completion of max_tokens (and a 256-token
    prompt) is longer than the largest micro-batch without it, said at the start, and
    the auto micro-batch is then sized with it; off otherwise, and on a CPU."""
    shape = shape_from_config(QWEN3_4B)
    without = largest_micro_batch(shape, ON_CUDA, 23 * GIB)
    said: list[str] = []
    b = cuda_stand_in("auto", 23.0, monkeypatch, max_tokens=without - 256 + 1)
    LocalBackend._size_memory(b, None, said.append)
    assert b.options.checkpointing is True and b.sizing.checkpointing is True
    with_it = largest_micro_batch(shape, dataclasses.replace(ON_CUDA, checkpointing=True), 23 * GIB)
    assert with_it > AUTO_MOST > without  # checkpointing makes room; auto takes AUTO_MOST
    assert b.options.micro_batch_tokens == AUTO_MOST
    assert said[0] == (
        f"checkpointing = auto: on (a completion of {without - 256 + 1} tokens after a prompt "
        "would not fit the largest micro-batch without it; 23.0 GiB free on cuda:0)"
    )
    b = cuda_stand_in("auto", 23.0, monkeypatch, max_tokens=without - 256)  # it just fits
    LocalBackend._size_memory(b, None, lambda s: None)
    assert b.options.checkpointing is False and b.options.micro_batch_tokens == without
    said.clear()
    b = cuda_stand_in("auto", 23.0, monkeypatch, max_tokens=100_000, checkpointing=False)
    LocalBackend._size_memory(b, None, said.append)
    assert b.options.checkpointing is False  # set by hand: kept, and warned about
    assert said[0].startswith(
        "WARNING: [backend.options] checkpointing = false: a completion of 100000 tokens"
    )
    assert said[0].endswith("; set it true or auto")
    b = cuda_stand_in("auto", 23.0, monkeypatch, max_tokens=100_000)
    b.train_device = torch.device("cpu")
    LocalBackend._size_memory(b, None, lambda s: None)
    assert b.options.checkpointing is False  # a CPU's runs do not change


def test_the_cpu_is_not_checked(monkeypatch):
    b = cuda_stand_in(1_000_000, 1.0, monkeypatch)
    b.train_device = torch.device("cpu")
    LocalBackend._size_memory(b, None, lambda s: None)  # no check, no error
    assert b.options.micro_batch_tokens == 1_000_000
    b.options = dataclasses.replace(b.options, micro_batch_tokens="auto")
    LocalBackend._size_memory(b, None, lambda s: None)
    assert b.options.micro_batch_tokens == 512


def test_the_metrics_row_carries_the_budget_and_the_retries(tiny_raw, tmp_path):
    from run_helpers import QuietConsole

    from retrain.logs.jsonl import read_jsonl
    from retrain.trainer import train

    raw = copy.deepcopy(tiny_raw)
    raw["training"]["max_steps"] = 1
    raw["eval"] = {"every": 0}
    assert train(config_from_dict(raw), console=QuietConsole()) == 0
    rows, _ = read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert rows[-1]["micro_batch_tokens"] == 512 and rows[-1]["oom_retries"] == 0


@pytest.mark.parametrize("whole", [False, True], ids=["cpu-layout", "whole-bf16"])
def test_the_estimate_holds_the_sampling_copys_own_adapter_to_the_byte(
    tiny_raw, tiny_model_dir, monkeypatch, whole
):
    """What `copy_adapter_bytes` counts is what the sampler's copy holds beside the
    shared bf16 weights: every distinct storage of its A's and B's, the siblings' stacked
    and block-diagonal ones included."""
    import retrain.hardware as hardware

    if whole:  # the GPU's layout on this CPU
        monkeypatch.setattr(hardware, "WHOLE_BF16", frozenset({"cpu", "cuda"}))
    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["options"]["dtype"] = "bf16"
    b = make_backend(raw, tiny_model_dir)
    storages = {}
    for module in b.engine.copy.model.modules():
        for name in ("a", "b"):
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    layers = b.model.config.num_hidden_layers  # q/k/v, gate/up, o, down: an A and a B each
    assert len(storages) == 2 * 4 * layers
    shape = shape_from_config(b.model.config.to_dict())
    rank = raw["model"]["lora_rank"]
    assert sum(storages.values()) == copy_adapter_bytes(shape, Sizing("cpu", "bf16", rank))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_estimate_holds_a_bf16_sampling_copy_of_its_own_to_the_byte(
    tiny_raw, tiny_model_dir, dtype
):
    """`[inference] dtype = "bf16"`: on a float32 trainer the copy is a bf16 model of its
    own, with a float32 output layer (this tiny model's is not tied) and the adapter's A
    and B beside it; on a CPU's bf16 trainer it adds nothing but those A and B. Every
    storage the copy holds and the trainer does not is what `sampler_copy_bytes` counts
    (the rotary frequencies aside: a few hundred bytes of buffers)."""
    raw = copy.deepcopy(tiny_raw)
    raw["backend"]["options"]["dtype"] = dtype
    raw["inference"] = {"dtype": "bf16"}
    b = make_backend(raw, tiny_model_dir)
    assert b.sizing.sampler == "bf16"  # what the backend's own sizing counts too
    trainer = {t.untyped_storage().data_ptr() for t in [*b.model.parameters(), *b.model.buffers()]}
    own = {}
    for name, t in [*b.engine.copy.model.named_parameters(), *b.engine.copy.model.named_buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in trainer and "inv_freq" not in name:
            own[ptr] = t.untyped_storage().nbytes()
    shape = shape_from_config(b.model.config.to_dict())
    rank = raw["model"]["lora_rank"]
    want = sampler_copy_bytes(shape, Sizing("cpu", dtype, rank, sampler="bf16"))
    assert sum(own.values()) == want
    if dtype == "fp32":  # the whole model once more, in bf16
        assert want > shape.params * 2
    else:  # a bf16 trainer's own bf16 matmuls: only the adapter's copies beside them
        assert want == copy_adapter_bytes(shape, Sizing("cpu", "bf16", rank))
