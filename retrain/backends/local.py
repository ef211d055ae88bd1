"""The local backend: a transformers model with a PEFT LoRA adapter, trained in-process.

Loss: the objective of retrain/loss/ (resolved once, by build.py). By default (policy_loss = "is", loss_agg =
"token_mean") the importance-sampling policy gradient over the completion tokens of all
datums:

    loss = -(1/N) * sum_t A_t * exp(logp_t - logp_sampler_t),   N = completion tokens in the step

so the gradient is the advantage-weighted score function, corrected for any drift between
the weights that sampled and the weights being trained. PPO clipping (with clip-higher and
dual clip), advantage clipping, the other aggregations and a KL penalty to the reference
model are options; the reference logprobs come from the same model with the LoRA adapter
disabled (PEFT's `disable_adapter()`), so no second model is held in memory.
Micro-batches split a step by a token budget; each micro-batch uses the step's
denominator (and per-completion weights), so the result does not depend on the split.
A micro-batch runs packed (retrain/kernels/packing.py): each prompt once, its completions
after it under a block-diagonal mask, no padding, logits only where a completion token is
predicted; exact, like one plain row per completion. `[backend.options] dtype` chooses
bf16 matmuls in the transformer blocks (retrain/kernels/precision.py).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.autograd.graph import increment_version

from retrain import distributed
from retrain.backends.device_fit import CudaMemory, back_off, fit_to_device
from retrain.backends.peak_memory import PeakMemory
from retrain.checkpoint import TRAINING_STATE, read_checkpoint_file
from retrain.engines.base import Engine, ServerEngine, UnboundEngine
from retrain.errors import (
    BackendError,
    CheckpointError,
    ConfigError,
    RetrainError,
    TrainingError,
)
from retrain.hardware import (
    TorchBuild,
    cuda_free_bytes,
    torch_lacks_gpus,
    whole_model_bf16,
)
from retrain.kernels import flex
from retrain.kernels.compiled_blocks import compile_blocks, compile_errors, device_error
from retrain.kernels.logprobs import linear_head
from retrain.kernels.lora_layers import (
    adapter_in_input_dtype,
    fuse_sibling_loras,
    lean_lora_forward,
)
from retrain.kernels.packing import (
    MASK_STYLES,
    Group,
    check_packing,
    completion_logprobs,
    mask_style,
    padded_area,
    split,
)
from retrain.kernels.precision import bf16_linears, bf16_weights, use_bf16
from retrain.kernels.recompute import recompute_elementwise
from retrain.kernels.rotary import turn_rotary
from retrain.kernels.staged_factors import stage_factors
from retrain.kernels.transfer import to_device
from retrain.kernels.windows import windows_of
from retrain.loss import (
    LossFn,
    LossInputs,
    LossStats,
    StepTokens,
    covariance_selection,
    needs_selection,
    resolve_objective,
    step_weights,
)
from retrain.loss.records import read_numbers
from retrain.memory import (
    HEADROOM,
    ModelShape,
    Sizing,
    sampler_on_device,
    shape_from_config,
    training_memory,
)
from retrain.models import resolve_model, resolved_model_shape
from retrain.registry import BACKENDS
from retrain.settings import LocalSettings
from retrain.types import (
    CheckpointInfo,
    Datum,
    Sample,
    SamplingParams,
    TrainHyper,
    TrainResult,
)
from retrain.world import World

log = logging.getLogger("retrain.backends.local")


def parse_devices(spec: str, warn: Callable[[str], None]) -> list[torch.device]:
    """`gpu:0,gpu:1` -> devices. torch has the last word on CUDA (the startup checks asked
    nvidia-smi): a GPU it does not see is a config error, never a silent move to the CPU.
    (`warn` is kept for the caller's signature; nothing here is only worth a warning.)"""
    devices = []
    for part in (p.strip() for p in spec.split(",")):
        if part == "cpu":
            devices.append(torch.device("cpu"))
        elif part == "mps":
            devices.append(torch.device("mps"))
        else:
            index = int(part.split(":")[1])
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if index >= count:
                raise ConfigError(f"[backend] devices = {spec!r} asks for {part}: {_unseen(count)}")
            devices.append(torch.device("cuda", index))
    return devices


def _unseen(count: int) -> str:
    """Why torch, numbering `count` CUDA devices, lacks the one asked for, and the fix:
    the GPUs nvidia-smi lists may be there (`hardware.torch_lacks_gpus`)."""
    lacking = torch_lacks_gpus(TorchBuild.of(torch), count)
    if lacking is not None:
        return f"{lacking[0]}. Fix: {lacking[1]}"
    has = f"{count} CUDA device(s)" if count else "no CUDA device"
    fix = "gpu:0" if count else "cpu"
    return (
        f'torch finds {has} on this machine. Fix: devices = "{fix}" in [backend] (or the '
        f"flag --devices {fix})"
    )


def rank_devices(devices: list[torch.device], world: World) -> list[torch.device]:
    """Under torchrun a rank's device: its node-local GPU (LOCAL_RANK), or the CPU."""
    if not world.distributed or devices[0].type != "cuda":
        return devices
    return [torch.device("cuda", world.local_rank)]


class TrainingInFlight:
    """One optimizer step running on a background thread (`[backend.options] overlap`)."""

    def __init__(
        self,
        run: Callable[[], TrainResult],
        publish: Callable[[TrainResult], TrainResult],
    ):
        self._publish = publish
        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(
            target=self._work, args=(run,), name="retrain-train", daemon=True
        )
        self._thread.start()

    def _work(self, run: Callable[[], TrainResult]) -> None:
        try:
            self._out["value"] = run()
        except BaseException as exc:  # re-raised on the caller's thread by finish()
            self._out["error"] = exc

    def wait(self) -> None:
        """Wait for the step to end, leaving its result or error unread (the run is
        already failing)."""
        self._thread.join()

    def finish(self) -> TrainResult:
        """Wait for the step, re-raise its error here, or publish the new weights to the
        sampler and return the result."""
        self.wait()
        if "error" in self._out:
            raise self._out["error"]
        return self._publish(self._out["value"])


class LocalBackend:
    capabilities = BACKENDS.entry("local").capabilities

    def __init__(
        self,
        settings: LocalSettings,
        tokenizer,
        *,
        engine: Engine | UnboundEngine,
        say: Callable[[str], None] = print,
        model=None,
    ):
        """`engine` is built by retrain/build.py from `[inference]` (a server engine is
        already connected: a server that is down failed before the model loads)."""
        from retrain.threads import ThreadPolicy

        self.settings = settings
        self.options = settings.options
        self.loss_fn = settings.loss  # the policy loss, resolved once by build.py
        # threads = 0: chosen from the free cores before each phase (retrain/threads.py).
        self.threads = ThreadPolicy(self.options.threads)
        say(self.threads.describe(self.threads.apply()))
        self.world = settings.world
        devices = rank_devices(parse_devices(settings.devices, say), self.world)
        self.train_device = devices[-1]
        self.infer_device = devices[0]
        self.split_mode = len(devices) > 1
        self.peaks = PeakMemory(self.infer_device, self.train_device, self.options.overlap)
        self.bf16 = use_bf16(self.options.dtype, self.train_device)
        in_process = engine.traits.in_process  # only an unbound in-process engine has a dtype
        here = sampler_on_device(
            in_process, self.infer_device == self.train_device, engine.dtype if in_process else ""
        )
        self._size_memory(model, say, here)
        if settings.seed >= 0:  # LoRA init draws from the global RNG
            torch.manual_seed(settings.seed)
        self.model = self._load_model(model, say)
        self._full = True  # the sharded base is whole (sampling) or in shards (training)
        if self.world.shard:
            self._shard(say)
        # the output layer split off, so training never holds the whole logits (None: the
        # model's logits are not a plain linear of its hidden states; logits are kept)
        self.head = linear_head(self.model)
        trainable, total = self.model.get_nb_trainable_parameters()
        say(
            f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        distributed.broadcast_params(self.world, self.params)  # one init on every rank
        o = settings.optimizer
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            **adamw_options(self.train_device),
        )
        self.tokenizer = tokenizer
        self.eos_ids = stop_ids(tokenizer, self.model, settings.model)
        self.sampler_model = self.model
        self._lock = threading.Lock()
        if self.split_mode:
            import copy

            self.sampler_model = copy.deepcopy(self.model).to(self.infer_device)
            self.sampler_model.requires_grad_(False)
        self.engine, self.server = self._attach(engine, tokenizer)
        if self.options.compile:  # after the sampling copy is made: its blocks stay eager
            self._compile_blocks(say)
        say(
            f"Local backend ready (engine={self.engine.name}, split_mode={self.split_mode}, device={self.train_device}, matmuls={'bf16' if self.bf16 else 'fp32'}, micro_batch_tokens={self.options.micro_batch_tokens}{', activation checkpointing' if self.options.checkpointing else ''}{', compiled blocks' if self.options.compile else ''}, attention={flex.label(self._flex_from, self._varlen, self._masked_kernel)})."
        )
        if self._flex_from is not None and self.train_device.type == "cuda":
            say(
                "FlexAttention compiles at its first two uses in training (a shape, then "
                "dynamic shapes: 8-14 s each on an H100; torch's cache on disk shortens "
                "later runs'), which those steps' training time includes"
            )

    def _size_memory(self, model, say: Callable[[str], None], sampler: str | None = "auto") -> None:
        """Before the model loads: `checkpointing` and `micro_batch_tokens` fitted to the
        training device (retrain/backends/device_fit.py). `sampler`: what samples on the
        training device (`memory.Sizing.sampler`). `say` is kept for the OOM back-off."""
        self._say = say
        device, lora = self.train_device, self.settings.lora
        sizing = Sizing(
            device_kind=device.type,
            dtype="bf16" if self.bf16 else "fp32",
            lora_rank=lora.rank,
            target_modules=tuple(lora.target_modules),
            sampler=sampler,
        )
        cuda = shape = None
        if device.type == "cuda":
            cuda = CudaMemory(str(device), *torch.cuda.mem_get_info(device))
            shape = self._model_shape(model)
        self._auto_checkpointing = self.options.checkpointing == "auto"  # for _back_off
        fitted = fit_to_device(
            self.options,
            sizing,
            max_tokens=self.settings.max_tokens,
            model=self.settings.model,
            cuda=cuda,
            shape=shape,
            say=say,
        )
        # what its memory is sized with: _room_for_training, benchmarks/memory_fit.py
        self.options, self.sizing, self._shape = fitted.options, fitted.sizing, fitted.shape

    def _model_shape(self, model) -> ModelShape | None:
        """The trained model's shape: a given model's config, else its config.json."""
        if model is not None:
            return shape_from_config(model.config.to_dict())
        return resolved_model_shape(self.settings.model)

    def _load_model(self, model, say: Callable[[str], None]):
        """The base model (loaded unless given), in bf16-matmul mode when chosen, on the
        training device, with a fresh LoRA adapter."""
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        name = self.settings.model
        if model is None:
            resolved = resolve_model(name)
            config = AutoConfig.from_pretrained(resolved.path)
            # sliding layers' masks; a model whose layers cannot be packed stops here,
            # before its weights load
            self._windows = windows_of(config, name)
            say(f"Loading train model: {name} on {self.train_device} ({resolved.origin})...")
            model = AutoModelForCausalLM.from_pretrained(
                resolved.path, config=config, dtype=torch.float32
            )
        else:
            self._windows = windows_of(model.config, name)
        attention = model.config._attn_implementation
        if attention not in MASK_STYLES:
            raise BackendError(
                f"{name} uses the {attention!r} attention; the local backend trains with {sorted(MASK_STYLES)}"
            )
        self._mask_style = MASK_STYLES[attention]
        # in float32, before any bf16 or move: packing must give its own rows' logprobs
        check_packing(model, self._mask_style, self._windows, name)
        whole = self.bf16 and whole_model_bf16("bf16", self.train_device.type)
        if self.bf16:  # before the move: a GPU never holds the float32 blocks
            # a GPU: the whole model in bf16; a CPU: bf16 matmuls, float32 residual
            # stream (either way the adapter's weights and the logits are float32; precision.py)
            (bf16_weights if whole else bf16_linears)(model)
        if not self.world.shard:  # sharded: only this rank's shards reach the device
            model.to(self.train_device)
        lora = self.settings.lora
        peft_config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.effective_alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules) or "all-linear",
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(model, peft_config)  # PEFT keeps the adapter in float32
        lean_lora_forward(peft_model)  # each LoRA linear adds its adapter inside one addmm
        turn_rotary(peft_model)  # the rotary turn's backward in 4 operators, not ~9
        compiling = self.options.compile  # blocks compiled once the sampler is bound
        if whole:  # computed in bf16 from the bf16 stream, not from float32 copies of it
            adapter_in_input_dtype(peft_model)
            # norms and gated products keep their bf16 inputs only (retrain/kernels/recompute.py)
            recompute_elementwise(peft_model, mlps=not compiling)
        # q/k/v and gate/up each one matmul, as the sampler runs them (not on a sharded
        # base: FSDP holds the weights in shards, not stacked; nor in compiled blocks,
        # retrain/kernels/compiled_blocks.py)
        fuse = whole and not self.world.shard and not compiling
        self._siblings = fuse_sibling_loras(peft_model) if fuse else []
        # their bf16 A's and B's copied once per optimizer step, not built per forward
        # pass (retrain/kernels/staged_factors.py)
        self._staged = stage_factors(peft_model, self._siblings) if fuse else None
        if self.options.checkpointing:
            _checkpoint_activations(peft_model)
        device, dtype = self.train_device, "bf16" if self.bf16 else "fp32"
        option, blocked = self.options.attention, flex.blockers(peft_model.get_base_model())
        self._varlen = flex.varlen_chosen(option, device.type, attention, name, blocked, dtype)
        blocked = blocked + flex.device_blockers(dtype, device.type, device.index or 0)
        self._flex_from = flex.flex_from(option, device.type, attention, name, blocked)
        self._flex_fell_back = False  # `_flex_guard` took the dense mask since the last step
        # on CUDA an SDPA model takes retrain's attention for its decode steps and its
        # masked passes too (retrain/kernels/masked_attention.py: not cuDNN's kernel)
        cuda = "cuda" in (self.infer_device.type, self.train_device.type)
        self._masked_kernel = attention == "sdpa" and device.type == "cuda"  # the ready line
        if self._flex_from is not None or self._varlen or (attention == "sdpa" and cuda):
            flex.use_flex(peft_model.get_base_model())
        if self._varlen:  # this GPU's kernel, against the rule, before any step
            from retrain.kernels import varlen

            varlen.check(device, *_head_shape(peft_model), torch.bfloat16)
        return peft_model

    def _shard(self, say: Callable[[str], None]) -> None:
        """`[backend.options] shard`: the frozen blocks split over the ranks (FSDP2,
        retrain/distributed.py), then what stays whole (embeddings, output layer, LoRA)
        moved to this rank's device."""
        blocks = distributed.shard_base(self.model, self.world, self.train_device)
        self.model.to(self.train_device)
        self._full = False
        say(
            f"Sharded the frozen base's {blocks} transformer blocks over {self.world.size} "
            "ranks (FSDP2); the LoRA adapter stays whole on every rank."
        )

    def _compile_blocks(self, say: Callable[[str], None]) -> None:
        """`compile = true`: the trained model's blocks compiled (retrain/kernels/
        compiled_blocks.py), refused where the engine samples from the trained model
        itself (its decode steps would run the compiled blocks)."""
        copy_ = getattr(self.engine, "copy", None)
        if self.server is None and not self.split_mode and copy_ is None:
            raise BackendError(
                "[backend.options] compile = true compiles the trained model's blocks, but "
                "the pytorch engine samples from that model itself (no sampling copy: an "
                "adapter it cannot copy, or shard = true). Fix: compile = false"
            )
        count = compile_blocks(self.model)
        if not count:
            raise BackendError(
                "[backend.options] compile = true compiles the transformer blocks that "
                f"transformers names for {self.settings.model!r} (_no_split_modules), and it "
                "names none. Fix: compile = false"
            )
        say(f"{count} transformer blocks to compile with torch.compile at the first training step")

    def _attach(self, engine, tokenizer) -> tuple[Engine, ServerEngine | None]:
        """(the sampling engine, the server engine or None): an in-process engine is bound
        to the sampler's model; a server gets the stop tokens and a live-adapter folder
        to load each step's adapter from."""
        if engine.traits.in_process:
            pad = tokenizer.pad_token_id
            bound = engine.bind(
                self.sampler_model,
                eos_ids=self.eos_ids,
                pad_id=pad if pad is not None else min(self.eos_ids),
                device=self.infer_device,
                bf16=self.bf16,
                threads=self.threads,
                sharded=self.world.shard,
            )
            return bound, None
        from retrain.engines.sync import LIVE_DIR, LiveAdapterDir

        engine.set_stop_ids(sorted(self.eos_ids))
        self.live = LiveAdapterDir(Path(self.settings.adapter_path) / LIVE_DIR, keep=2)
        return engine, engine

    # ------------------------------------------------------------ sampling

    def sample(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        with self._lock:
            if not params.held_out:  # an evaluation between steps is in no step's window
                self.peaks.sampling_starts()
            if not self._full:  # the first sampling call since the last training step
                distributed.full_weights(self.world, self.model)
                self._full = True
            return self.engine.sample(prompts_B, n, params)

    # ------------------------------------------------------------ training

    def completion_logprobs(
        self, prompt_ids: list[int], completions: Sequence[np.ndarray], temperature: float
    ) -> torch.Tensor:
        """Logprobs (n, Cmax) of each completion's tokens given the prompt, at the sampling
        temperature; pads are 0."""
        with compile_errors(self.options.compile):
            return self._flex_guard(
                lambda: self._logprobs([(prompt_ids, completions)], temperature)
            )

    def _logprobs(self, groups: list[Group], temperature: float) -> torch.Tensor:
        """(completions, longest) logprobs of several prompts' completions, packed into one
        forward pass (retrain/kernels/packing.py)."""
        style = mask_style(groups, self._mask_style, self._flex_from, self._varlen)
        for group in self._siblings:  # what a failed pass left (an out-of-memory retry)
            group.forget()
        return completion_logprobs(
            self.model, groups, temperature, style, self.train_device, self.head, self._windows
        )

    def _micro_batches(self, datums: list[Datum]) -> list[tuple[int, list[Datum]]]:
        """(first index, datums) of each micro-batch: consecutive datums whose packed layout
        (rows x longest row) fits the token budget (retrain/kernels/packing.py `split`),
        largest first. The order does not change the step (gradients add up), but the
        later, smaller micro-batches then fit into the memory the first one freed, which
        keeps the allocator's heap from growing with their number (docs/performance.md,
        Memory)."""
        items = [(d.prompt_ids, len(d.completion_ids)) for d in datums]
        chunks, start = [], 0
        for size in split(items, self.options.micro_batch_tokens):
            chunks.append(
                (start, datums[start : start + size], padded_area(items[start : start + size]))
            )
            start += size
        chunks.sort(key=lambda c: -c[2])  # stable: equal areas keep their order
        return [(first, chunk) for first, chunk, _ in chunks]

    def train_step(self, datums: list[Datum], hyper: TrainHyper) -> TrainResult:
        """One optimizer step; the sampler has the new weights when it returns."""
        self.threads.apply("training")
        seen = self._sampling_metrics()
        return self._publish(self._optimize(datums, hyper), seen, changed=bool(datums))

    def start_train_step(self, datums: list[Datum], hyper: TrainHyper) -> TrainingInFlight:
        """`[backend.options] overlap`: start one optimizer step on a background thread and
        return at once. The sampler keeps the weights it has, so the next step samples one
        optimizer step behind, until the handle's `finish()` publishes the new ones."""
        if not self.split_mode and self.server is None:
            raise BackendError(
                f"[backend.options] overlap = true: the sampler would read the weights being "
                f"trained ([backend] devices = {self.settings.devices!r} gave one device "
                "here, with the in-process pytorch engine). Fix: two devices, a server "
                "[inference] engine, or overlap = false"
            )
        self.threads.apply("training")
        seen = self._sampling_metrics()  # taken now: the next step's sampling changes them
        return TrainingInFlight(
            lambda: self._optimize(datums, hyper),
            lambda result: self._publish(result, seen, changed=bool(datums)),
        )

    def _sampling_metrics(self) -> dict[str, float]:
        """The step's sampling side of the metrics: the thread counts the policy chose
        (is the box busy?), the engine's own (with a server, which adapter version
        sampled; with CUDA graphs, whether the step ran captured)."""
        out = self.threads.metrics()
        out.update(self.engine.metrics())
        out.update(self.peaks.sampled())
        return out

    def _publish(
        self, result: TrainResult, seen: dict[str, float], *, changed: bool
    ) -> TrainResult:
        """Give the sampler the new weights (split mode: its copy; a server: the adapter)
        and complete the result's metrics."""
        if changed:
            if self.split_mode:
                self._snapshot()
            if self.server is not None:
                self._push_adapter()
        result.extra.update(seen)
        result.extra.update(self.peaks.step(seen.get("gpu_peak_memory_gb")))
        if self.server is not None:  # the reload just made; the sampled version stays
            now = self.server.metrics()
            now.pop("engine_adapter_version", None)
            result.extra.update(now)
        return result

    def _push_adapter(self) -> None:
        """Publish the adapter to a new live folder and have the server load it."""
        version, folder = self.live.publish(
            lambda tmp: self.model.save_pretrained(tmp, safe_serialization=True)
        )
        self.server.sync_adapter(folder, version)

    def _optimize(self, datums: list[Datum], hyper: TrainHyper) -> TrainResult:
        """One optimizer step on the trained model (none without datums). The sampler does
        not see it until _publish."""
        if not datums:
            return TrainResult(loss=0.0, num_tokens=0)
        self.peaks.training_starts()
        if self.world.shard and self._full:  # training holds the shards only
            distributed.sharded_weights(self.model)
            self._full = False
        try:
            with compile_errors(self.options.compile):
                return self._flex_guard(lambda: self._train_step(datums, hyper))
        except torch.OutOfMemoryError as exc:  # a micro-batch's is handled in the step
            raise TrainingError(
                f"out of memory on {self.train_device} outside the step's micro-batches (the "
                "gradient clip or the optimizer's update, whose state AdamW makes at the "
                "first step; [backend.options] micro_batch_tokens does not bound them). "
                "Fix: free memory on the device (does another process hold some?), or a "
                "lower [lora] rank"
            ) from exc

    def _flex_guard(self, run: Callable[[], Any]) -> Any:
        """`run` (a training step, or logprobs) where FlexAttention's kernels may not build
        on this GPU (`flex.build_failed`): they compile at the first micro-batch that takes
        them. With `attention = "flex"` that stops the run with the option named; "auto",
        which promised a choice that runs, says so and takes the dense mask for the rest of
        the run, and `run` goes again from its start (nothing was stepped yet: the
        optimizer steps after every micro-batch's backward). The weights stand either way.
        With `compile = true` FlexAttention is inside the compiled blocks:
        `compile_errors` names that option."""
        try:
            return run()
        except Exception as error:
            if self._flex_from is None or self.options.compile or not flex.build_failed(error):
                raise
            detail = flex.build_failure(error, self.train_device, _head_shape(self.model)[2])
            # under torchrun one rank alone cannot change how its passes attend
            if self.options.attention != "auto" or self.world.distributed:
                raise BackendError(
                    f'[backend.options] attention = "{self.options.attention}": '
                    f"FlexAttention's kernels did not build ({detail}); the weights were not "
                    'updated. Fix: attention = "dense"'
                ) from error
        # out of the except block: the failed pass's frames and tensors are freed
        self._flex_from = None
        self._flex_fell_back = True
        self._say(
            f'[backend.options] attention = "auto": FlexAttention\'s kernels did not build '
            f"({detail}); packed rows take the dense mask for the rest of the run (attention "
            '= "dense" starts that way)'
        )
        return run()

    def _train_step(self, datums: list[Datum], hyper: TrainHyper) -> TrainResult:
        for group in self.optimizer.param_groups:
            group.update(
                lr=hyper.lr,
                weight_decay=hyper.weight_decay,
                betas=(hyper.beta1, hyper.beta2),
                eps=hyper.eps,
            )
        # Only trained tokens count (a multi-turn environment's tokens are context).
        total = sum(d.num_trained_tokens for d in datums)
        weights, denominator = step_weights([d.num_trained_tokens for d in datums], hyper)
        weighted = hyper.loss_agg != "token_mean"  # token_mean's weights are all 1
        loss_fn = self._loss_for(hyper)
        if not self.model.training:  # the walk over every module, only when it changes
            self.model.train()
        before, retries = self.options.micro_batch_tokens, 0
        # Out of memory in a micro-batch: the step is redone from its first one with half
        # the budget (kept for later steps), until a micro-batch of one completion fails.
        # Under torchrun each rank takes its slice of the step's datums; the weights and the
        # denominator above are the whole step's, so the gradients add up to one process's.
        start, stop = self.world.bounds(len(datums))
        mine, weights = datums[start:stop], weights[start:stop]
        filler = min(datums, key=_area) if self.world.shard else None
        released = self._room_for_training(mine)
        # the pre-pass of an objective that selects tokens over the whole step, then the step
        while isinstance(selected := self._step_selection(datums, hyper), int):
            retries += 1
            released = self._make_room(selected, datums, before) or released
        self._selected = selected
        while isinstance(
            sums := self._accumulate_on_rank(
                mine, hyper, loss_fn, denominator, weights, weighted, filler
            ),
            int,
        ):
            retries += 1
            released = self._make_room(sums, mine, before) or released
        if self.options.micro_batch_tokens != before:
            self._say(
                f"out of memory on {self.train_device} in a training micro-batch: "
                f"[backend.options] micro_batch_tokens lowered {before} -> "
                f"{self.options.micro_batch_tokens} for the rest of the run ({retries} "
                "retries of this step; set it lower to skip them)"
            )
        loss_sum, ratio_sum, ratio_max, stats = self._reduce(sums)
        self._selected = {}
        max_norm = hyper.max_grad_norm if hyper.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(
                f"gradient norm is {grad_norm} (non-finite); the weights were not updated"
            )
        self.optimizer.step()
        # torch's fused AdamW (CUDA's: `adamw_options`) updates the parameters without
        # advancing their version counters (torch 2.11 and 2.13), which is how the
        # sampling copy and the staged operands see that the adapter changed: advanced here
        increment_version(self.params)
        self.optimizer.zero_grad(set_to_none=True)
        extra = stats.metrics()
        extra.update(micro_batch_tokens=self.options.micro_batch_tokens, oom_retries=retries)
        extra.update(checkpointing=float(bool(self.options.checkpointing)))
        if self._flex_fell_back:  # FlexAttention's kernels did not build (`_flex_guard`)
            extra["attention_fell_back"], self._flex_fell_back = 1.0, False
        if self._decoder_beside_training():
            extra["sampler_cache_released"] = float(released)
        if self.world.shard:
            extra["shard_padding_passes"] = self._padding
        return TrainResult(
            loss=loss_sum,
            num_tokens=total,
            grad_norm=grad_norm,
            log_ratio_mean=ratio_sum / max(total, 1),
            log_ratio_max_abs=ratio_max,
            extra=extra,
        )

    def _reduce(
        self, sums: tuple[float, float, float, LossStats]
    ) -> tuple[float, float, float, LossStats]:
        """Under torchrun: the LoRA gradients summed over the ranks (an explicit all-reduce
        once per optimizer step, not DDP: ranks run different numbers of micro-batches,
        and DDP reduces in every backward) and the step's sums gathered."""
        if not self.world.distributed:
            return sums
        distributed.all_reduce_grads(self.world, self.params)
        parts = distributed.gather(self.world, sums, "the step's loss sums")
        stats = LossStats()
        for part in parts:
            stats.add(part[3])
        return (
            sum(p[0] for p in parts),
            sum(p[1] for p in parts),
            max(p[2] for p in parts),
            stats,
        )

    def _accumulate_on_rank(
        self,
        datums: list[Datum],
        hyper: TrainHyper,
        loss_fn: LossFn,
        denominator: float,
        weights: np.ndarray,
        weighted: bool,
        filler: Datum | None,
    ) -> tuple[float, float, float, LossStats] | int:
        """`_accumulate`; with a sharded base, padded to the ranks' largest number of
        micro-batches with zero-weight passes over `filler` (the step's smallest datum).
        Every forward and backward all-gathers each sharded block, so every rank must run
        the same passes; a rank's count depends on its completions' lengths. A collective
        that fails names the rank that failed."""
        if filler is None:
            return self._accumulate(datums, hyper, loss_fn, denominator, weights, weighted)
        counts = distributed.gather(
            self.world, len(self._micro_batches(datums)), "the micro-batch counts"
        )
        pad = max(counts) - counts[self.world.rank]
        self._padding = sum(max(counts) - c for c in counts)  # over the ranks: their imbalance
        try:
            sums = self._accumulate(datums, hyper, loss_fn, denominator, weights, weighted)
            for _ in range(pad if not isinstance(sums, int) else 0):
                ones = np.ones(1, dtype=np.float32) if weighted else None
                self._backward([filler], hyper, loss_fn, denominator, ones, scale=0.0)
        except (RetrainError, torch.OutOfMemoryError):
            raise
        except Exception as exc:  # a peer's failure, seen in FSDP's own collectives
            raise distributed.named_failure(self.world, "a sharded forward/backward", exc) from exc
        return sums

    def _accumulate(
        self,
        datums: list[Datum],
        hyper: TrainHyper,
        loss_fn: LossFn,
        denominator: float,
        weights: np.ndarray,
        weighted: bool,
    ) -> tuple[float, float, float, LossStats] | int:
        """Forward and backward of every micro-batch from zeroed gradients: (loss, sum and
        max |log ratio| over the trained tokens, loss stats); or, when one runs out of
        memory, its number of completions, with the gradients zeroed again."""
        self.optimizer.zero_grad(set_to_none=True)
        parts: list[tuple] = []  # each micro-batch's loss, log-ratio sum and max, and size
        stats = LossStats()
        for start, chunk in self._micro_batches(datums):
            seq_w = weights[start : start + len(chunk)] if weighted else None
            failed = 0
            try:
                *sums, chunk_stats = self._backward(chunk, hyper, loss_fn, denominator, seq_w)
            except Exception as exc:  # as raised, or inside a compile's failure
                if not _out_of_memory(exc):
                    raise
                failed = len(chunk)
            if failed:  # out of the except block: the error's frames and tensors are freed
                self.optimizer.zero_grad(set_to_none=True)
                return failed
            if self._reads_each_micro_batch():
                sums, chunk_stats = read_numbers(sums), chunk_stats.settled()
            stats.add(chunk_stats)
            parts.append((*sums, len(chunk)))
        return self._settle(parts, stats)

    def _reads_each_micro_batch(self) -> bool:
        """Off CUDA a micro-batch's sums are read as it ends: there is nothing to wait for,
        and read then no small tensor outlives its micro-batch in the middle of the heap
        it freed (docs/performance.md, Memory). On CUDA they are read once a step."""
        return self.train_device.type != "cuda"

    def _settle(
        self, parts: list[tuple], stats: LossStats
    ) -> tuple[float, float, float, LossStats]:
        """The step's sums as numbers, read from the device once, after its last backward
        (on CUDA a micro-batch queues its work and never waits for the device: retrain/
        kernels/transfer.py). A non-finite micro-batch loss stops the step before the
        optimizer does: its gradients are zeroed and the weights keep their values."""
        read = iter(read_numbers([x for part in parts for x in part[:3]]))
        rows = [(next(read), next(read), next(read), part[3]) for part in parts]
        for value, _, _, size in rows:
            if not math.isfinite(value):
                self.optimizer.zero_grad(set_to_none=True)
                raise TrainingError(
                    f"loss is {value} (non-finite) in a micro-batch of {size} completions; "
                    "the weights were not updated"
                )
        total = sum(r[0] for r in rows), sum(r[1] for r in rows)
        return *total, max((r[2] for r in rows), default=0.0), stats.settled()

    def _decoder_beside_training(self) -> bool:
        """Whether an in-process sampler shares the CUDA device training runs on."""
        return (
            self.train_device.type == "cuda"
            and self.engine.traits.in_process
            and self.infer_device == self.train_device
        )

    def _room_for_training(self, datums: list[Datum]) -> bool:
        """Before a step's micro-batches on CUDA: the in-process sampler keeps its static
        caches and CUDA graphs between steps (retrain/engines/static_decode.py; 128 rows of
        2,304 positions of Qwen3-4B are ~40 GiB), and gives them back here when the step's
        largest micro-batch's estimated activations would not fit beside them, or the
        model's shape is unknown; the next sampling phase captures its graphs again. The
        estimate is of the micro-batch this step packs, not of the budget: `auto` sizes the
        budget to the free memory at the start, before the weights and the caches took
        theirs, so the budget seldom fits beside the caches, and a run of short
        completions (the quickstart) would give them back, and capture its graphs again,
        every step. Whether it released them."""
        if not self._decoder_beside_training() or not self.engine.kept_bytes():
            return False
        if self._shape is not None:
            batches = self._micro_batches(datums)  # the largest first
            largest = _packed_area(batches[0][1]) if batches else 0
            peak = training_memory(self._shape, self.sizing, largest)
            free = cuda_free_bytes(self.train_device, self.engine.graph_pools())
            if peak.training * peak.slack <= HEADROOM * free:
                return False
        return self.engine.release() > 0

    def _make_room(self, failed: int, datums: list[Datum], before: int) -> bool:
        """After a pass over `failed` completions ran out of memory: the sampler's kept
        caches go first, and the same budget runs again (not with a sharded base: the
        other ranks are already in the next pass); else `_back_off`. Whether the caches
        were given back."""
        if not self.world.shard and self._decoder_beside_training() and self.engine.release():
            return True
        self._back_off(failed, datums, before)
        return False

    def _back_off(self, failed: int, datums: list[Datum], before: int) -> None:
        """After a micro-batch of `failed` completions ran out of memory: the cached memory
        given back, and the budget (and checkpointing) device_fit.py's `back_off` says;
        its TrainingError when one completion cannot fit."""
        if self.train_device.type == "cuda":
            torch.cuda.empty_cache()
        plan = back_off(
            failed,
            longest=max((_area(d) for d in datums), default=0),
            budget=self.options.micro_batch_tokens,
            before=before,
            where=str(self.train_device),
            shard=self.world.shard,
            auto_checkpointing=self._auto_checkpointing,
            checkpointing=bool(self.options.checkpointing),
        )
        if plan.checkpoint:
            self._checkpoint_from_now()
        self.options = replace(self.options, micro_batch_tokens=plan.micro_batch_tokens)
        if plan.notice:
            self._say(plan.notice)

    def _checkpoint_from_now(self) -> None:
        """`checkpointing = "auto"` turning activation checkpointing on mid-run (a
        completion ran out of memory without it, or the resumed checkpoint's run had)."""
        _checkpoint_activations(self.model)
        self.options = replace(self.options, checkpointing=True)
        self.sizing = replace(self.sizing, checkpointing=True)

    def _loss_for(self, hyper: TrainHyper) -> LossFn:
        """The objective build.py resolved from `[training] policy_loss`; a step whose
        hyper names another one (a caller driving the backend directly) resolves it once
        and keeps it."""
        if self.loss_fn.name != hyper.policy_loss:
            self.loss_fn = resolve_objective(hyper.policy_loss)
        return self.loss_fn

    def _backward(
        self,
        chunk: list[Datum],
        hyper: TrainHyper,
        loss_fn: LossFn,
        denominator: float,
        seq_weights: np.ndarray | None,
        scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LossStats]:
        """Forward and backward of one micro-batch, gradients added to the parameters';
        returns (loss, sum and max |log ratio| over its trained tokens, loss stats), as
        0-d tensors on the device, queued, not read (`_accumulate` and `_settle` read
        them). Its other tensors die on return, before the next micro-batch allocates.
        `scale = 0`: a padding pass (the same collectives, zero gradients)."""
        groups = _prompt_groups(chunk)
        temperature = hyper.temperature
        logp = self._logprobs(groups, temperature)
        mask, adv, old = _padded(chunk, logp.shape[1], logp.device)
        selected = weights = None
        if getattr(self, "_selected", None):  # the step's pre-pass picks (_step_selection)
            picks = np.zeros(mask.shape, dtype=bool)
            for i, d in enumerate(chunk):
                picks[i, : d.completion_ids.size] = self._selected[id(d)]
            selected = to_device(torch.from_numpy(picks), logp.device)
        if seq_weights is not None:
            weights = to_device(torch.from_numpy(seq_weights), logp.device).to(logp.dtype)
        inputs = LossInputs(
            logp,
            old,
            adv,
            mask,
            denominator,
            seq_weights=weights,
            ref_logp=self._reference_logprobs(groups, temperature, hyper),
            selected=selected,
        )
        out = loss_fn(inputs, hyper)
        (out.loss if scale == 1.0 else out.loss * scale).backward()
        # 0-d tensors, not read here: nothing in a micro-batch waits for the device
        gap = torch.where(mask, logp.detach() - old, 0.0)
        return out.loss.detach(), gap.sum(), gap.abs().amax(), out.stats

    def _step_selection(
        self, datums: list[Datum], hyper: TrainHyper
    ) -> dict[int, np.ndarray] | int:
        """The pre-pass of an objective that picks tokens over the whole step (clip_cov,
        kl_cov: retrain/loss/selection.py): the trainer's logprobs of every completion
        without gradients, micro-batch by micro-batch, then one selection over the step in
        its datums' order, so it does not depend on the split. {id(datum): its tokens'
        picks}; {} when the objective selects nothing; or, when a micro-batch runs out of
        memory, its number of completions. The draw comes from the global torch generator
        (seeded by [training] seed, saved in checkpoints), after the logprobs are read.

        Under torchrun each rank reads the logprobs of its own slice of the step and the
        ranks share them, then all select alike with rank 0's draw (the ranks' generators
        need not agree). A sharded base reads the whole step on every rank: its ranks must
        run the same passes."""
        if not needs_selection(hyper.policy_loss):
            return {}
        split = self.world.distributed and not self.world.shard
        start, stop = self.world.bounds(len(datums)) if split else (0, len(datums))
        logps = self._step_logprobs(datums[start:stop], hyper.temperature)
        if isinstance(logps, int):
            return logps  # the other ranks wait in the gather while this one backs off
        seed = int(torch.randint(0, 2**62, ()).item())
        if self.world.distributed:
            parts = distributed.gather(
                self.world, (seed, logps if split else []), "the selection's logprobs"
            )
            seed = parts[0][0]
            if split:
                logps = [row for _, rows in parts for row in rows]
        step = [
            StepTokens(lp, d.sampler_logprobs, d.advantages, d.trained_mask)
            for lp, d in zip(logps, datums, strict=True)
        ]
        picks = covariance_selection(step, hyper, np.random.default_rng(seed))
        return {id(d): p for d, p in zip(datums, picks, strict=True)}

    def _step_logprobs(self, datums: list[Datum], temperature: float) -> list[np.ndarray] | int:
        """The trainer's logprobs of each datum's completion, without gradients; or, when
        a micro-batch runs out of memory, its number of completions."""
        out: list[np.ndarray] = [np.empty(0, np.float32)] * len(datums)
        for first, chunk in self._micro_batches(datums):
            failed = 0
            try:
                with torch.no_grad():
                    rows = self._logprobs(_prompt_groups(chunk), temperature).float().cpu()
            except Exception as exc:  # as raised, or inside a compile's failure
                if not _out_of_memory(exc):
                    raise
                failed = len(chunk)
            if failed:  # out of the except block: the error's frames and tensors are freed
                return failed
            for i, d in enumerate(chunk):
                out[first + i] = rows[i, : d.completion_ids.size].numpy()
        return out

    def _reference_logprobs(
        self, groups: list[Group], temperature: float, hyper: TrainHyper
    ) -> torch.Tensor | None:
        """The reference model's logprobs (the same weights with the LoRA adapter off), only
        when the objective has a KL term."""
        if hyper.kl_coef <= 0:
            return None
        with torch.no_grad(), self.model.disable_adapter():
            return self._logprobs(groups, temperature)

    def _snapshot(self) -> None:
        """Copy the trained LoRA weights into the sampler's model (split mode), between
        sampling calls (the lock): a step never samples from half-copied weights."""
        with self._lock, torch.no_grad():
            src = dict(self.model.named_parameters())
            for name, p in self.sampler_model.named_parameters():
                if "lora_" in name:
                    p.copy_(src[name].to(p.device))

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str | Path) -> CheckpointInfo:
        """Write the adapter (PEFT format) + optimizer and RNG state to `directory`,
        atomically: everything goes to a temporary sibling that is renamed at the end."""
        target = Path(directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            self.model.save_pretrained(tmp, safe_serialization=True)
            state = {
                "optimizer": self.optimizer.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                # checkpointing = "auto" turned on: a resumed run starts with it on again
                "checkpointing": bool(self.options.checkpointing),
            }
            torch.save(state, tmp / TRAINING_STATE)
            _fsync_dir(tmp)
            if target.exists():  # re-saving the same name: move the old one aside first
                old = target.with_name(f".{target.name}.old-{os.getpid()}")
                os.replace(target, old)
                os.replace(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return CheckpointInfo("local", adapter=str(target), state=str(target))

    def load_checkpoint(self, info: CheckpointInfo) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(info.state)
        weights = path / "adapter_model.safetensors"
        if not weights.exists():
            raise CheckpointError(f"checkpoint {path} has no adapter_model.safetensors")
        tensors = read_checkpoint_file(
            weights, lambda: load_file(str(weights), device=str(self.train_device))
        )
        result = set_peft_model_state_dict(self.model, tensors)
        if getattr(result, "unexpected_keys", None):
            raise CheckpointError(
                f"checkpoint {path} does not match this model's LoRA layers: unexpected {result.unexpected_keys[:3]}"
            )
        state_file = path / TRAINING_STATE
        if state_file.exists():
            state = read_checkpoint_file(
                state_file,
                lambda: torch.load(state_file, map_location=self.train_device, weights_only=False),
            )
            self.optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["torch_rng"].cpu())
            auto_off = self._auto_checkpointing and not self.options.checkpointing
            if state.get("checkpointing") and auto_off:
                self._checkpoint_from_now()
            if state.get("cuda_rng") is not None and torch.cuda.is_available():
                # loaded onto the training device like the rest, but torch takes RNG
                # states as CPU byte tensors only; a machine with fewer GPUs than the one
                # that saved them restores those it has
                saved = state["cuda_rng"][: torch.cuda.device_count()]
                torch.cuda.set_rng_state_all([s.cpu() for s in saved])
        else:
            log.warning(
                "checkpoint %s has no %s: the optimizer restarts from zero moments",
                path,
                TRAINING_STATE,
            )
        if self.split_mode:
            self._snapshot()
        if self.server is not None:  # the server samples from the resumed adapter
            self._push_adapter()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def adamw_options(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation on `device`: on CUDA the fused one, the whole update of
    every adapter tensor in a few kernels with the step count on the device (torch's
    default there, the foreach one, launches ~10 kernels per ~100 tensors and reads each
    tensor's step count on the host: a small model's step is host-bound); HF Trainer's
    default on CUDA too. Elsewhere torch's default (a CPU's results as before)."""
    return {"fused": True} if device.type == "cuda" else {}


def _checkpoint_activations(peft_model) -> None:
    """Activation checkpointing on: each block keeps its input and recomputes the rest in
    the backward (in train mode only; non-reentrant, so no input needs a gradient)."""
    enable = getattr(peft_model, "activation_checkpointing_enable", None)
    (enable or peft_model.gradient_checkpointing_enable)({"use_reentrant": False})


def stop_ids(tokenizer, model, name: str) -> set[int]:
    """The tokens that end a completion: the tokenizer's eos and the generation config's."""
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if not eos:
        raise BackendError(
            f"{name}: the tokenizer defines no eos token; completions could never stop"
        )
    return eos


def _prompt_groups(chunk: Sequence[Datum]) -> list[Group]:
    """Runs of consecutive datums with the same prompt: (prompt, their completions)."""
    groups: list[Group] = []
    for d in chunk:
        if groups and groups[-1][0] == d.prompt_ids:
            groups[-1][1].append(d.completion_ids)
        else:
            groups.append((d.prompt_ids, [d.completion_ids]))
    return groups


def _area(d: Datum) -> int:
    return _packed_area([d])


def _head_shape(model) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size) of a PEFT-wrapped transformers model."""
    text = model.get_base_model().config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(text, "head_dim", None) or text.hidden_size // heads


def _packed_area(chunk: Sequence[Datum]) -> int:
    """Positions of `chunk` packed (rows x longest row, retrain/kernels/packing.py)."""
    return padded_area([(d.prompt_ids, len(d.completion_ids)) for d in chunk])


def _padded(
    chunk: Sequence[Datum], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask, advantages, sampler logprobs) of a micro-batch, right-padded to `width`."""
    n = len(chunk)
    mask = np.zeros((n, width), dtype=bool)
    adv = np.zeros((n, width), dtype=np.float32)
    old = np.zeros((n, width), dtype=np.float32)
    for i, d in enumerate(chunk):
        k = d.completion_ids.size
        mask[i, :k] = d.trained_mask  # environment tokens stay out of the loss
        adv[i, :k] = d.advantages
        old[i, :k] = d.sampler_logprobs
    return tuple(to_device(torch.from_numpy(x), device) for x in (mask, adv, old))


def _fsync_dir(path: Path) -> None:
    """Flush a directory's files to disk before it is renamed into place."""
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def _out_of_memory(error: BaseException) -> bool:
    """A micro-batch ran out of device memory: raised as it is, or inside torch.compile's
    failure (retrain.kernels.compiled_blocks.device_error)."""
    return isinstance(device_error(error), torch.OutOfMemoryError)
