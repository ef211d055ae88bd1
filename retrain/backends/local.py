"""The local backend: a transformers model with a PEFT LoRA adapter, trained in-process.

Loss: retrain/loss.py's objective. By default (policy_loss = "is", loss_agg =
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
Each group's prompt is run once per micro-batch and its KV cache shared by the
completions (exact: it only skips recomputing identical prefixes).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retrain.backends.base import backend_options
from retrain.errors import BackendError, CheckpointError, TrainingError
from retrain.loss import LossStats, policy_objective, sequence_weights
from retrain.models import resolve_model
from retrain.registry import BACKENDS
from retrain.types import (
    CheckpointInfo,
    Datum,
    Sample,
    SamplingParams,
    TrainHyper,
    TrainResult,
)

log = logging.getLogger("retrain.backends.local")

TRAINING_STATE = "training_state.pt"


def parse_devices(spec: str, warn: Callable[[str], None]) -> list[torch.device]:
    """`gpu:0,gpu:1` -> devices; without CUDA every gpu falls back to the CPU (warned)."""
    devices = []
    for part in (p.strip() for p in spec.split(",")):
        if part == "cpu":
            devices.append(torch.device("cpu"))
        elif part == "mps":
            devices.append(torch.device("mps"))
        else:
            index = int(part.split(":")[1])
            if not torch.cuda.is_available():
                warn(f"[backend] devices = {spec!r}: CUDA is not available, using the CPU")
                return [torch.device("cpu")]
            if index >= torch.cuda.device_count():
                raise BackendError(
                    f"[backend] devices: {part} does not exist ({torch.cuda.device_count()} CUDA devices visible)"
                )
            devices.append(torch.device("cuda", index))
    return devices


class LocalBackend:
    capabilities = BACKENDS.entry("local").capabilities

    def __init__(self, config, tokenizer, *, say: Callable[[str], None] = print, model=None):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.config = config
        self.options = backend_options("local", config.backend.options)
        from retrain.threads import ThreadPolicy

        # threads = 0: chosen from the free cores before each phase (retrain/threads.py).
        self.threads = ThreadPolicy(self.options["threads"])
        say(self.threads.describe(self.threads.apply()))
        # A server engine is reached before the model loads, so a server that is down (or
        # cannot hot-swap LoRA) fails first, with its URL and start command.
        self.server = None
        if config.inference.engine != "pytorch":
            from retrain.engines.http import build_engine

            eos0 = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
            self.server = build_engine(config, tokenizer, eos0, say)
        devices = parse_devices(config.backend.devices, say)
        self.train_device = devices[-1]
        self.infer_device = devices[0]
        self.split_mode = len(devices) > 1
        dtype = torch.bfloat16 if self.train_device.type == "cuda" else torch.float32
        seed = config.training.seed
        if seed >= 0:  # LoRA init draws from the global RNG
            torch.manual_seed(seed)
        if model is None:
            resolved = resolve_model(config.model.model)
            say(
                f"Loading train model: {config.model.model} on {self.train_device} ({resolved.origin})..."
            )
            model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=dtype)
        model.to(self.train_device)
        rank = config.model.lora_rank
        lora = LoraConfig(
            r=rank,
            lora_alpha=config.lora.alpha or 2 * rank,
            lora_dropout=config.lora.dropout,
            target_modules=list(config.lora.target_modules) or "all-linear",
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(model, lora)
        trainable, total = self.model.get_nb_trainable_parameters()
        say(
            f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        t, o = config.training, config.optimizer
        self.optimizer = torch.optim.AdamW(
            self.params, lr=t.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=t.weight_decay
        )
        self.tokenizer = tokenizer
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos |= set(
            gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        )
        if not eos:
            raise BackendError(
                f"{config.model.model}: the tokenizer defines no eos token; completions could never stop"
            )
        self.eos_ids = eos
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        self.sampler_model = self.model
        self._lock = threading.Lock()
        if self.split_mode:
            import copy

            self.sampler_model = copy.deepcopy(self.model).to(self.infer_device)
            self.sampler_model.requires_grad_(False)
        self.engine = self._build_engine(config, pad)
        say(
            f"Local backend ready (engine={self.engine.name}, split_mode={self.split_mode}, device={self.train_device})."
        )

    def _build_engine(self, config, pad: int):
        if self.server is not None:
            from retrain.engines.sync import LIVE_DIR, LiveAdapterDir

            self.server.eos_ids = sorted(self.eos_ids)
            self.live = LiveAdapterDir(Path(config.backend.adapter_path) / LIVE_DIR, keep=2)
            return self.server
        from retrain.engines.pytorch import PyTorchEngine

        return PyTorchEngine(
            self.sampler_model,
            self.eos_ids,
            pad,
            self.infer_device,
            prefix_caching=config.inference.prefix_caching,
            prompt_batch=self.options["prompt_batch"],
            dtype=config.inference.dtype,
            threads=self.threads,
        )

    # ------------------------------------------------------------ sampling

    def sample(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        with self._lock:
            return self.engine.sample(prompts_B, n, params)

    # ------------------------------------------------------------ training

    def completion_logprobs(
        self, prompt_ids: list[int], completions: Sequence[np.ndarray], temperature: float
    ) -> torch.Tensor:
        """Logprobs (n, Cmax) of each completion's tokens given the prompt, at the sampling
        temperature, with the prompt's KV cache shared across completions. Pads are 0."""
        from transformers import DynamicCache

        device = self.train_device
        prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1, :]  # predicts each completion's first token
        n = len(completions)
        width = max(len(c) for c in completions)
        comp_np = np.zeros((n, width), dtype=np.int64)
        for i, c in enumerate(completions):
            comp_np[i, : len(c)] = c
        comp = torch.from_numpy(comp_np).to(device)
        cache.batch_repeat_interleave(n)
        positions = torch.arange(len(prompt_ids), len(prompt_ids) + width, device=device).expand(
            n, width
        )
        # Right padding needs no attention mask: causal attention never lets a real
        # token see the pads that follow it, and pad positions are masked from the loss.
        rest = (
            self.model(
                input_ids=comp[:, :-1],
                position_ids=positions[:, :-1],
                past_key_values=cache,
                use_cache=True,
            ).logits
            if width > 1
            else None
        )
        logits = first[:, None, :].expand(n, 1, first.shape[-1])
        if rest is not None:
            logits = torch.cat([logits, rest], dim=1)
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return logp.gather(-1, comp[:, :, None]).squeeze(-1)

    def _micro_batches(self, datums: list[Datum]) -> list[list[Datum]]:
        """Consecutive datums sharing a prompt, split so each chunk fits the token budget."""
        budget = self.options["micro_batch_tokens"]
        chunks: list[list[Datum]] = []
        current: list[Datum] = []
        for d in datums:
            same_prompt = current and current[0].prompt_ids == d.prompt_ids
            width = (
                max([len(x.completion_ids) for x in current] + [len(d.completion_ids)])
                if same_prompt
                else len(d.completion_ids)
            )
            fits = same_prompt and len(d.prompt_ids) + (len(current) + 1) * width <= budget
            if current and not fits:
                chunks.append(current)
                current = []
            current.append(d)
        if current:
            chunks.append(current)
        return chunks

    def train_step(self, datums: list[Datum], hyper: TrainHyper) -> TrainResult:
        self.threads.apply("training")
        result = self._optimize(datums, hyper)
        # The counts the thread policy chose this step (metrics.jsonl: is the box busy?)
        result.extra.update(self.threads.metrics())
        if self.server is not None:
            if datums:  # the weights changed: the server samples from them next step
                self._push_adapter()
            result.extra.update(self.server.metrics())
        return result

    def _push_adapter(self) -> None:
        """Publish the adapter to a new live folder and have the server load it."""
        version, folder = self.live.publish(
            lambda tmp: self.model.save_pretrained(tmp, safe_serialization=True)
        )
        self.server.sync_adapter(folder, version)

    def _optimize(self, datums: list[Datum], hyper: TrainHyper) -> TrainResult:
        if not datums:
            return TrainResult(loss=0.0, num_tokens=0)
        if self.split_mode:  # training runs on its own thread; the sampler waits for the snapshot
            result: dict[str, Any] = {}

            def work():
                try:
                    result["value"] = self._train_step(datums, hyper)
                except BaseException as exc:  # re-raised on the caller's thread
                    result["error"] = exc

            thread = threading.Thread(target=work, name="retrain-train", daemon=True)
            thread.start()
            thread.join()
            if "error" in result:
                raise result["error"]
            self._snapshot()
            return result["value"]
        return self._train_step(datums, hyper)

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
        weights, denominator = sequence_weights(
            [d.num_trained_tokens for d in datums], hyper.loss_agg
        )
        temperature = self.config.training.temperature
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        ratio_sum = 0.0
        ratio_max = 0.0
        stats = LossStats()
        start = 0
        for chunk in self._micro_batches(datums):
            prompt, completions = chunk[0].prompt_ids, [d.completion_ids for d in chunk]
            logp = self.completion_logprobs(prompt, completions, temperature)
            mask, adv, old = _padded(chunk, logp.shape[1], logp.device)
            ref = self._reference_logprobs(prompt, completions, temperature, hyper)
            seq_w = None
            if hyper.loss_agg != "token_mean":
                seq_w = torch.from_numpy(weights[start : start + len(chunk)]).to(logp)
            start += len(chunk)
            loss, chunk_stats = policy_objective(
                logp,
                old,
                adv,
                mask,
                hyper,
                denominator=denominator,
                seq_weights=seq_w,
                ref_logp=ref,
            )
            stats.add(chunk_stats)
            log_ratio = torch.where(mask, logp - old, torch.zeros_like(logp))
            value = float(loss.detach())
            if not math.isfinite(value):
                self.optimizer.zero_grad(set_to_none=True)
                raise TrainingError(
                    f"loss is {value} (non-finite) in a micro-batch of {len(chunk)} completions; the weights were not updated"
                )
            loss.backward()
            loss_sum += value
            lr_det = log_ratio.detach()[mask]
            ratio_sum += float(lr_det.sum())
            ratio_max = max(ratio_max, float(lr_det.abs().max()))
        max_norm = hyper.max_grad_norm if hyper.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise TrainingError(
                f"gradient norm is {grad_norm} (non-finite); the weights were not updated"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return TrainResult(
            loss=loss_sum,
            num_tokens=total,
            grad_norm=grad_norm,
            log_ratio_mean=ratio_sum / max(total, 1),
            log_ratio_max_abs=ratio_max,
            extra=stats.metrics(),
        )

    def _reference_logprobs(
        self,
        prompt_ids: list[int],
        completions: Sequence[np.ndarray],
        temperature: float,
        hyper: TrainHyper,
    ) -> torch.Tensor | None:
        """The reference model's logprobs (the same weights with the LoRA adapter off), only
        when the objective has a KL term."""
        if hyper.kl_coef <= 0:
            return None
        with torch.no_grad(), self.model.disable_adapter():
            return self.completion_logprobs(prompt_ids, completions, temperature)

    def _snapshot(self) -> None:
        """Copy the trained LoRA weights into the sampler's model (split mode)."""
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
        result = set_peft_model_state_dict(
            self.model, load_file(str(weights), device=str(self.train_device))
        )
        if getattr(result, "unexpected_keys", None):
            raise CheckpointError(
                f"checkpoint {path} does not match this model's LoRA layers: unexpected {result.unexpected_keys[:3]}"
            )
        state_file = path / TRAINING_STATE
        if state_file.exists():
            state = torch.load(state_file, map_location=self.train_device, weights_only=False)
            self.optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["torch_rng"].cpu())
            if state.get("cuda_rng") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state["cuda_rng"])
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
    return tuple(torch.from_numpy(x).to(device) for x in (mask, adv, old))


def _fsync_dir(path: Path) -> None:
    """Flush a directory's files to disk before it is renamed into place."""
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
