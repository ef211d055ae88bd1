"""The `pytorch` inference engine: batched sampling with the KV cache from the model the
local backend trains.

Each prompt is prefilled once (left-padded across prompts, with position ids counted
from the first real token) and its cache is repeated for the group's completions, then
tokens are drawn step by step at the configured temperature (and, with top_p < 1, from
the renormalised nucleus) by inverse CDF, one uniform per row, and the recorded logprobs
are exactly those of the distribution each token was drawn from. A row that reaches
end-of-sequence leaves the batch (its cache rows are dropped), so the work follows the
real token count. Temperature 0 (held-out evaluation) decodes greedily: the argmax
token, with logprob 0 (it was chosen with probability 1). With `prompt_batch = 0` a step
is decoded in batches of at most `SAMPLE_ROWS` completions (`decoding_batches` in
retrain/memory.py, which explain's memory estimate reads too): whole prompts, or a group
larger than that in parts, each prefilling its prompt once. So sampling memory does not
grow with the group size.

Speed (docs/performance.md): a PEFT LoRA model runs four extra small operators per
adapted linear for every decoded token. When the model is a plain LoRA PEFT model, the
engine samples from a `MergedSampler` instead: an adapter-free copy whose adapted linears
hold W + scaling * B @ A, re-merged only when the adapter's weights changed (their version
counters moved). In float32 the merged logprobs equal the adapter's to rounding (~1e-6).
In the local backend's bf16 mode the copy's layers are bf16 matmuls like the trainer's
(W + BA rounded to bf16 once per update); `[inference] dtype = "bf16"` on a float32
trainer gives a wholly bf16 copy (its block linears the same tiled bf16 layer). Either
way the recorded logprobs are the sampler's own, so the trainer's importance ratio
corrects the difference (`log_ratio_mean` / `log_ratio_max_abs` show its size). A `retrain.threads.ThreadPolicy` picks torch's thread
count before each call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from retrain.errors import BackendError
from retrain.kernels.precision import bf16_linears
from retrain.memory import decoding_batches
from retrain.registry import ENGINES
from retrain.settings import EngineSettings
from retrain.types import EngineTraits, Sample, SamplingParams

TRAITS: EngineTraits = ENGINES.entry("pytorch").engine_traits


@dataclass
class _Batch:
    input_ids: torch.Tensor  # (R, L) left-padded
    attention_mask: torch.Tensor  # (R, L)
    position_ids: torch.Tensor  # (R, L)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> _Batch:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return _Batch(ids.to(device), mask.to(device), positions.to(device))


@dataclass(frozen=True)
class UnboundPyTorchEngine:
    """The registry factory's product: the engine's settings, waiting for the model the
    local backend loads (retrain/engines/base.py)."""

    settings: EngineSettings
    name: str = "pytorch"
    traits: EngineTraits = TRAITS

    def bind(
        self, model, *, eos_ids: set[int], pad_id: int, device, bf16: bool, threads: Any
    ) -> PyTorchEngine:
        s = self.settings
        return PyTorchEngine(
            model,
            eos_ids,
            pad_id,
            device,
            prefix_caching=s.prefix_caching,
            prompt_batch=s.prompt_batch,
            # bf16 trainer: the merged copy's layers are bf16 matmuls like the trainer's
            # (`[inference] dtype` "bf16" adds nothing then)
            dtype="auto" if bf16 else s.dtype,
            threads=threads,
        )


def build(
    settings: EngineSettings, *, tokenizer: Any, say: Callable[[str], None]
) -> UnboundPyTorchEngine:
    """The registry entry's factory: nothing to start or reach before the model loads."""
    return UnboundPyTorchEngine(settings)


class PyTorchEngine:
    """Samples from an in-process transformers model (the one being trained)."""

    name = "pytorch"
    traits = TRAITS

    def __init__(
        self,
        model,
        eos_ids: set[int],
        pad_id: int,
        device: torch.device,
        *,
        prefix_caching: bool = True,
        prompt_batch: int = 0,
        dtype: str = "auto",
        merge_lora: bool = True,
        threads=None,
    ):
        self.model = model
        self.eos_ids = sorted(eos_ids)
        self.pad_id = pad_id
        self.device = device
        self.prefix_caching = prefix_caching
        self.prompt_batch = prompt_batch
        self.threads = threads  # retrain.threads.ThreadPolicy, or None to leave torch as is
        if dtype not in ("auto", "bf16"):
            raise BackendError(
                f'[inference] dtype = "{dtype}": the pytorch engine samples in "auto" (the model\'s dtype) or "bf16"'
            )
        # bf16 needs a copy of the weights; "auto" keeps the training model's dtype.
        target = torch.bfloat16 if dtype == "bf16" else None
        self.merged = MergedSampler.build(model, target) if merge_lora else None
        if self.merged is None and target is not None:
            raise BackendError(
                '[inference] dtype = "bf16" needs a plain LoRA adapter on the pytorch engine (set dtype = "auto")'
            )

    def metrics(self) -> dict[str, float]:
        return {}  # the threads it sampled with are the backend's (ThreadPolicy)

    def close(self) -> None:
        pass  # nothing of its own: the model is the backend's

    def _sampling_model(self):
        if self.merged is None:
            return self.model
        self.merged.refresh()
        return self.merged.model

    @torch.inference_mode()
    def sample(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        if self.threads is not None:
            self.threads.apply("sampling")
        out: list[list[Sample]] = [[] for _ in prompts_B]
        was_training = self.model.training
        self.model.eval()
        model = self._sampling_model()
        try:
            for first, prompts, rows in decoding_batches(len(prompts_B), n, self.prompt_batch):
                groups = self._sample_chunk(
                    model, prompts_B[first : first + prompts], rows, params, generator
                )
                for i, group in enumerate(groups):
                    out[first + i].extend(group)
        finally:
            self.model.train(was_training)
        return out

    def _prefill(self, model, prompts: list[list[int]], n: int) -> tuple[torch.Tensor, _Decode]:
        """Run the prompts once; returns the next-token logits per row (prompt x n) and
        the decoding state (cache, attention mask, positions)."""
        from transformers import DynamicCache

        if self.prefix_caching:
            batch = left_pad(prompts, self.pad_id, self.device)
        else:  # every completion prefills its own copy of the prompt
            batch = left_pad([p for p in prompts for _ in range(n)], self.pad_id, self.device)
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        mask = batch.attention_mask
        position = batch.position_ids[:, -1:]
        if self.prefix_caching:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            mask = mask.repeat_interleave(n, dim=0)
            position = position.repeat_interleave(n, dim=0)
        return logits, _Decode(cache, mask, position)

    def _next_logits(self, model, token: torch.Tensor, state: _Decode) -> torch.Tensor:
        """Feed one sampled token per row; finished rows keep decoding (their tokens are
        discarded) so shapes stay fixed."""
        rows = token.shape[0]
        state.mask = torch.cat([state.mask, state.mask.new_ones((rows, 1))], dim=1)
        state.position = state.position + 1
        out = model(
            input_ids=token[:, None],
            attention_mask=state.mask,
            position_ids=state.position,
            past_key_values=state.cache,
            use_cache=True,
        )
        return out.logits[:, -1, :]

    def _sample_chunk(
        self,
        model,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> list[list[Sample]]:
        logits, state = self._prefill(model, prompts, n)
        rows, width = logits.shape[0], params.max_tokens
        eos = torch.tensor(self.eos_ids, device=self.device)
        tokens = torch.zeros((rows, width), dtype=torch.long, device=self.device)
        logprobs = torch.zeros((rows, width), dtype=torch.float32, device=self.device)
        entropies = torch.zeros_like(logprobs) if params.return_entropy else None
        lengths = torch.full((rows,), width, dtype=torch.long, device=self.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        live = torch.arange(rows, device=self.device)  # the rows still decoding
        steps = 0
        for t in range(width):
            if not bool(torch.isfinite(logits).all()):
                raise BackendError(
                    "the model produced non-finite logits while sampling (have the weights diverged? try a lower [training] lr)"
                )
            token, logp_token, full = draw(logits, params, generator)
            tokens[live, t] = token
            logprobs[live, t] = logp_token
            if entropies is not None:  # the model's uncertainty: the untruncated distribution
                entropies[live, t] = -(full.exp() * full).sum(-1)
            steps = t + 1
            hit = torch.isin(token, eos)
            lengths[live[hit]] = t + 1
            finished[live[hit]] = True
            if t + 1 == width or bool(hit.all()):
                break
            if bool(hit.any()):  # finished rows leave the batch: no more work on them
                keep = (~hit).nonzero().squeeze(-1)
                live, token = live[keep], token[keep]
                state.select(keep)
            logits = self._next_logits(model, token, state)
        samples = _to_samples(tokens[:, :steps], logprobs[:, :steps], entropies, lengths, finished)
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]


def draw(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row: (token, its logprob under the distribution it was drawn from,
    the full log-distribution before top-p). Temperature 0 is greedy with logprob 0 (it
    was chosen with probability 1)."""
    if params.temperature <= 0.0:
        full = torch.log_softmax(logits.float(), dim=-1)
        token = logits.argmax(dim=-1)
        return token, torch.zeros_like(token, dtype=torch.float32), full
    scaled = logits.float()
    if params.temperature != 1.0:
        scaled = scaled / params.temperature
    full = torch.log_softmax(scaled, dim=-1)
    logp = nucleus(full, params.top_p) if params.top_p < 1.0 else full
    u = torch.rand(
        (logp.shape[0], 1), generator=generator, dtype=torch.float64, device=generator.device
    )
    token = inverse_cdf(logp.exp(), u)
    return token, logp.gather(-1, token[:, None]).squeeze(-1), full


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds u * total, for u in
    [0, 1) (float64, one per row): an exact draw from `probs` (rows need not sum to exactly
    1) with one uniform per row, where `torch.multinomial` draws an exponential per
    vocabulary entry (30 ms per decoded token on a 49k vocabulary, 2 CPU cores). Float64
    sums keep u * total strictly below the total, so a zero-probability token is never
    chosen."""
    cdf = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)


def nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probabilities of the top-p (nucleus) distribution: per row, the smallest set
    of most likely tokens whose probability reaches `top_p`, renormalised; every other
    token gets -inf. Sampling from it and recording its logprob keeps the behaviour
    policy exact."""
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    before = torch.cumsum(sorted_logp.exp(), dim=-1) - sorted_logp.exp()
    drop_sorted = before >= top_p  # the mass before this token already reaches top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)


class MergedSampler:
    """An adapter-free copy of a PEFT LoRA model for sampling: each adapted linear is a
    plain `nn.Linear` holding W + scaling * B @ A, re-merged when the adapter changed.

    In the model's own dtype the copy shares every weight that LoRA does not touch (only
    the merged weights are new memory); with another dtype (bf16) it is a full copy."""

    def __init__(self, model, pairs: list, dtype: torch.dtype | None):
        self.model = model
        self.pairs = pairs  # (PEFT lora.Linear in the trained model, nn.Linear in the copy)
        self.dtype = dtype
        self._seen: tuple = ()

    @classmethod
    def build(cls, peft_model, dtype: torch.dtype | None) -> MergedSampler | None:
        """None when `peft_model` is not a PEFT model with plain LoRA linears only (DoRA,
        several active adapters, embeddings, ...): the engine then samples from it as is."""
        import copy

        layers = _plain_lora_layers(peft_model)
        if not layers:
            return None
        base = peft_model.get_base_model()
        own = next(base.parameters()).dtype
        same = dtype is None or dtype == own
        # Sharing the frozen weights through deepcopy's memo keeps them out of the copy.
        memo = {id(p): p for p in base.parameters()} if same else {}
        copy_ = copy.deepcopy(base, memo)
        pairs = []
        for name, layer in layers:
            parent_name, _, attr = name.rpartition(".")
            parent = copy_.get_submodule(parent_name.removeprefix("base_model.model."))
            w = layer.base_layer.weight
            # the same class: a bf16-mode layer (Bf16Linear) keeps its bf16 matmul
            plain = type(layer.base_layer)(w.shape[1], w.shape[0], bias=False, device=w.device)
            plain.weight = torch.nn.Parameter(torch.empty_like(w), requires_grad=False)
            if layer.base_layer.bias is not None:
                plain.bias = layer.base_layer.bias if same else copy.deepcopy(layer.base_layer.bias)
            setattr(parent, attr, plain)
            pairs.append((layer, plain))
        if not same:
            copy_.to(dtype)
            if dtype == torch.bfloat16:
                # the tiled bf16 layer: on a CPU its matmuls run in a fixed set of row
                # counts, so oneDNN's per-shape kernel caches stop growing (precision.py)
                bf16_linears(copy_)
        copy_.requires_grad_(False)
        copy_.eval()
        return cls(copy_, pairs, None if same else dtype)

    def refresh(self) -> None:
        """Re-merge when any adapter tensor was replaced or updated in place."""
        seen = tuple(
            (id(t), t._version)
            for layer, _ in self.pairs
            for t in (_lora_a(layer).weight, _lora_b(layer).weight)
        )
        if seen == self._seen:
            return
        with torch.no_grad():
            for layer, plain in self.pairs:
                adapter = layer.active_adapters[0]
                a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
                w = layer.base_layer.weight
                if w.dtype == a.dtype == plain.weight.dtype:
                    torch.addmm(w, b, a, alpha=layer.scaling[adapter], out=plain.weight)
                else:  # a bf16 base with PEFT's float32 adapter: merge in float32, round once
                    merged = torch.addmm(w.to(a.dtype), b, a, alpha=layer.scaling[adapter])
                    plain.weight.copy_(merged)
        self._seen = seen


def _lora_a(layer):
    return layer.lora_A[layer.active_adapters[0]]


def _lora_b(layer):
    return layer.lora_B[layer.active_adapters[0]]


def _plain_lora_layers(model) -> list:
    """(name, layer) of every LoRA layer when all are plain, unmerged, single-adapter LoRA
    linears (weights stored out x in); else []."""
    try:
        from peft import PeftModel
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    if not isinstance(model, PeftModel):
        return []
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        plain = type(module) is LoraLinear and len(module.active_adapters) == 1
        adapter = module.active_adapters[0] if plain else None
        if (
            not plain
            or module.merged
            or module.fan_in_fan_out
            or module.use_dora.get(adapter, False)
            or getattr(module, "lora_bias", {}).get(adapter, False)
            or adapter not in module.lora_A
            or not isinstance(module.base_layer, torch.nn.Linear)
        ):
            return []
        layers.append((name, module))
    return layers


@dataclass
class _Decode:
    cache: object  # transformers DynamicCache
    mask: torch.Tensor  # (R, L) attention mask so far
    position: torch.Tensor  # (R, 1) position of the last token

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (the ones still decoding)."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.position = self.position[rows]


def _to_samples(
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    entropies: torch.Tensor | None,
    lengths: torch.Tensor,
    finished: torch.Tensor,
) -> list[Sample]:
    """One Sample per row, cut at its length (the eos token included)."""
    steps = tokens.shape[1]
    tokens_np = tokens.cpu().numpy()
    logprobs_np = logprobs.cpu().numpy().astype(np.float64)
    entropies_np = (
        entropies[:, :steps].cpu().numpy().astype(np.float64) if entropies is not None else None
    )
    lengths_l = lengths.tolist()
    finished_l = finished.tolist()
    return [
        Sample(
            token_ids=tokens_np[r, : lengths_l[r]].copy(),
            logprobs=logprobs_np[r, : lengths_l[r]].copy(),
            stop_reason="eos" if finished_l[r] else "length",
            entropies=entropies_np[r, : lengths_l[r]].copy() if entropies_np is not None else None,
        )
        for r in range(tokens_np.shape[0])
    ]
