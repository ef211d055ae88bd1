"""The `pytorch` inference engine: batched sampling with the KV cache from the model the
local backend trains.

Tokens are drawn at the configured temperature (and, with top_p < 1, from the
renormalised nucleus) by inverse CDF with one uniform per row and token, drawn up front
for the whole decoding batch (retrain/engines/draw.py): row r's token t uses u[r, t], so
a row's completion depends on its own uniforms only. The recorded logprobs are exactly
those of the distribution each token was drawn from. Temperature 0 (held-out evaluation)
decodes greedily: the argmax token, with logprob 0 (it was chosen with probability 1).

The decoders (`[backend.options] decode`, named in retrain/engines/decoders.py):

- dynamic (the CPU's default): each prompt is prefilled once (left-padded across
  prompts, with position ids counted from the first real token) and its cache repeated
  for the group's completions; a row that reaches end-of-sequence leaves the batch (its
  cache rows are dropped), so the work follows the real token count;
- static, and graphs (CUDA's default): a preallocated cache and one fixed-shape step,
  captured as a CUDA graph on a GPU (retrain/engines/static_decode.py). Finished rows
  are masked, not removed. With the same uniforms both draw the same tokens;
- compiled (opt-in): static, with the step compiled by inductor (fewer, fused kernels;
  a compile at the first sampling, at a new shape and per sampling setting), and on
  CUDA captured as a graph.

With `prompt_batch = 0` a step is decoded in batches of at most `SAMPLE_ROWS`
completions (`decoding_batches` in retrain/memory.py, which explain's memory estimate
reads too): whole prompts, or a group larger than that in parts. So sampling memory does
not grow with the group size. On CUDA the bound is what the free memory holds instead.
A call's uniforms are drawn at once and handed to its batches in row order, so how the
rows are batched does not change what is drawn; a batch that runs out of memory is
redone with the whole call at half the rows at once, which stays the bound for the run
(`sampling_oom_retries`).

Speed (docs/performance.md): a PEFT LoRA model runs four extra small operators per
adapted linear for every decoded token. When the model is a plain LoRA PEFT model, the
engine samples from a `SamplingCopy` instead (retrain/engines/sampling_copy.py), an
adapter-free copy refreshed only when the adapter's weights changed: a float32 adapted
linear holds W + scaling * B @ A (equal to the adapter's output to ~1e-6); a bf16 one
(the local backend's bf16 mode) keeps its bf16 W and adds the adapter's product beside
it in float32, as the trained model does (folding a small update into bf16 weights
rounds it away). `[inference] dtype = "bf16"` on a float32 trainer gives a wholly bf16
copy. The recorded logprobs are the sampler's own, so the trainer's importance ratio
corrects what kernel order leaves (`log_ratio_mean` / `log_ratio_max_abs` show its size).
A `retrain.threads.ThreadPolicy` picks torch's thread count before each call.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from retrain.engines.decoders import decoder_for
from retrain.engines.draw import draw, uniforms
from retrain.engines.sampling_copy import SamplingCopy
from retrain.errors import BackendError
from retrain.hardware import cuda_free_bytes
from retrain.kernels.cache_arg import cache_kwargs
from retrain.memory import decoding_batches, sampling_rows
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
    say: Callable[[str], None] = print
    name: str = "pytorch"
    traits: EngineTraits = TRAITS

    @property
    def dtype(self) -> str:
        return self.settings.dtype

    def bind(
        self,
        model,
        *,
        eos_ids: set[int],
        pad_id: int,
        device,
        bf16: bool,
        threads: Any,
        sharded: bool = False,
    ) -> PyTorchEngine:
        """`sharded`: the model's base is sharded over the ranks (`shard = true`), so the
        engine samples from it as it is, gathered (no sampling copy: no rank holds the
        whole weights to copy), and without CUDA graphs (`decoder_for`)."""
        s = self.settings
        return PyTorchEngine(
            model,
            eos_ids,
            pad_id,
            device,
            prefix_caching=s.prefix_caching,
            prompt_batch=s.prompt_batch,
            # bf16 trainer: the copy's block layers are the trainer's own bf16 matmuls
            # (`[inference] dtype` "bf16" adds nothing then)
            dtype="auto" if bf16 else s.dtype,
            sampling_copy=not sharded,
            threads=threads,
            decode=s.decode,  # resolved for the device by PyTorchEngine
            sharded=sharded,
            say=self.say,
        )


def build(
    settings: EngineSettings, *, tokenizer: Any, say: Callable[[str], None]
) -> UnboundPyTorchEngine:
    """The registry entry's factory: nothing to start or reach before the model loads."""
    return UnboundPyTorchEngine(settings, say)


def _drop_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames in `exc`'s tracebacks (and its causes'):
    a traceback keeps its frames, and so the failed decoding batch's cache, logits and
    step buffers, alive until the exception is gone, where freeing memory needs them
    gone now."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


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
        sampling_copy: bool = True,
        threads=None,
        decode: str = "dynamic",
        say=None,
        sharded: bool = False,
    ):
        self.model = model
        self.eos_ids = sorted(eos_ids)
        self.pad_id = pad_id
        self.say = say or logging.getLogger(__name__).warning
        self.row_cap: int | None = None  # rows decoded at once, once sampling ran out of memory
        self.oom_retries = 0
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
        self.copy = SamplingCopy.build(model, target) if sampling_copy else None
        if self.copy is None and target is not None:
            raise BackendError(
                '[inference] dtype = "bf16" needs a plain LoRA adapter on the pytorch engine (set dtype = "auto")'
            )
        decode = self.decode = decoder_for(decode, device.type, sharded)  # "auto" resolved
        self._shape = None  # the model's sizes, for the CUDA row budget (retrain/memory.py)
        self.static = None
        if decode != "dynamic":
            from retrain.engines.static_decode import StaticDecoder
            from retrain.kernels.packing import MASK_STYLES
            from retrain.kernels.windows import windows_of

            self.static = StaticDecoder(
                eos_ids=self.eos_ids,
                pad_id=pad_id,
                device=device,
                graphs=decode == "graphs" or (decode == "compiled" and device.type == "cuda"),
                compiled=decode == "compiled",
                mask_style=MASK_STYLES.get(model.config._attn_implementation, "bool"),
                windows=windows_of(model.config),  # the sampling copy's: the same config
                say=say,
            )

    def metrics(self) -> dict[str, float]:
        """With CUDA graphs, whether the decode step runs captured (1) or eagerly (0);
        compiled, whether it runs compiled (1) or compiling failed (0)."""
        out = {}  # the threads it sampled with are the backend's (ThreadPolicy)
        if self.device.type == "cuda" or self.oom_retries:
            out["sampling_oom_retries"] = float(self.oom_retries)
        if self.static is not None and self.static.graphs:
            out["engine_cuda_graphs"] = float(self.static.graph_failures == 0)
        if self.static is not None and self.static.compiled:
            out["engine_compiled"] = float(self.static.compile_failures == 0)
        return out

    def close(self) -> None:
        pass  # nothing of its own: the model is the backend's

    def graph_pools(self) -> list:
        """The private memory pools of the static decoder's captured graphs
        (`hardware.cuda_free_bytes` leaves their unused memory out)."""
        return [] if self.static is None else self.static.pools()

    def kept_bytes(self) -> int:
        """Device bytes the static decoder keeps between calls for its CUDA graphs."""
        return 0 if self.static is None else self.static.kept_bytes()

    def release(self) -> int:
        """Give the static decoder's kept caches and graphs back (static_decode.py
        `release`); returns the bytes released."""
        return 0 if self.static is None else self.static.release()

    def _sampling_model(self):
        if self.copy is None:
            return self.model
        self.copy.refresh()
        return self.copy.model

    @torch.inference_mode()
    def sample(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()
        if params.prompt_offset:  # the uniforms of the earlier ranks' rows, skipped
            uniforms(params.prompt_offset * n, params.max_tokens, generator)
        u = uniforms(len(prompts_B) * n, params.max_tokens, generator)  # row i * n + j: u[i*n+j]
        if self.threads is not None:
            self.threads.apply("sampling")
        # The trainer's model samples itself only without a copy; a copy is in eval mode
        # from its build. Switching modes walks every module (~2.5k with an adapter, a few
        # ms each way), so it is done only when the model is the one sampling.
        own = self.copy is None
        was_training = self.model.training
        if own and was_training:
            self.model.eval()
        model = self._sampling_model()
        try:
            max_rows = self._row_budget(model, prompts_B, params)
            while True:
                try:
                    return self._decode_batches(model, prompts_B, n, params, u, max_rows)
                except torch.OutOfMemoryError as exc:
                    max_rows = self._back_off(prompts_B, n, params, max_rows, exc)
        finally:
            if own and was_training:
                self.model.train()

    def _decode_batches(
        self, model, prompts_B: list[list[int]], n: int, params: SamplingParams, u, max_rows
    ) -> list[list[Sample]]:
        """Every prompt's `n` completions, in `decoding_batches`, each batch taking the next
        rows of `u`."""
        out: list[list[Sample]] = [[] for _ in prompts_B]
        start = 0
        for first, prompts, rows in decoding_batches(
            len(prompts_B), n, self.prompt_batch, max_rows
        ):
            chunk = prompts_B[first : first + prompts]
            mine = u[start : start + prompts * rows]
            start += prompts * rows
            for i, group in enumerate(self._decode(model, chunk, rows, params, mine)):
                out[first + i].extend(group)
        return out

    def _back_off(
        self, prompts_B: list[list[int]], n: int, params: SamplingParams, max_rows, exc
    ) -> int:
        """After a decoding batch ran out of memory: the kept caches and the allocator's
        unused memory given back, and half as many completions decoded at once from now
        on, in batches of whole prompts or parts of one (`prompt_batch` no longer
        applies), said and counted. One completion cannot be halved: BackendError."""
        used = sampling_rows(len(prompts_B), n, self.prompt_batch, max_rows)
        _drop_frames(exc)  # what the failed batch's frames hold can go back with the rest
        self.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if used <= 1:
            longest = max(len(p) for p in prompts_B)
            raise BackendError(
                f"out of memory on {self.device} sampling one completion at a time (a prompt "
                f"of up to {longest} tokens and max_tokens = {params.max_tokens}). Fix: lower "
                "max_tokens ([training], or [eval] for held-out sampling), free memory on the "
                'device, or sample on a device of its own ([backend] devices = "gpu:0,gpu:1")'
            ) from exc
        self.row_cap, self.prompt_batch = used // 2, 0
        static = self.static
        if static is not None and static.graphs:  # the bucket a batch pads to shrinks too
            from retrain.engines.static_decode import rows_within

            self.row_cap = rows_within(self.row_cap, least=1)  # a power of two
            static.least_rows = min(static.least_rows, self.row_cap)
        self.oom_retries += 1
        self.say(
            f"warning: out of memory on {self.device} decoding {used} completions at once; "
            f"decoding at most {self.row_cap} at once from now on"
        )
        return self.row_cap

    def _row_budget(self, model, prompts_B: list[list[int]], params: SamplingParams) -> int | None:
        """Completions decoded at once: on CUDA as many as the free memory holds (the KV
        cache of the longest prompt plus max_tokens, and the logits, per row: so a step's
        completions are decoded together when they fit); elsewhere None (SAMPLE_ROWS, the
        CPU's bound). Never more than `row_cap`, once sampling ran out of memory."""
        if self.device.type != "cuda":
            return self.row_cap
        from retrain.engines.static_decode import rows_within
        from retrain.memory import cache_bytes_per_token, decode_row_budget, shape_from_config

        if self._shape is None:
            self._shape = shape_from_config(self.model.config.to_dict())
        if self._shape is None:  # sizes retrain/memory.py cannot read: the CPU's bound
            return self.row_cap
        need = max(len(p) for p in prompts_B) + params.max_tokens
        static = self.static
        rows = decode_row_budget(
            device_kind="cuda",
            # the last training step's activations, which the caching allocator holds
            # unused, included; and the static decoder's kept caches, which it gives back
            # when a new shape's cache does not fit beside them
            free_bytes=cuda_free_bytes(self.device, self.graph_pools()) + self.kept_bytes(),
            kv_bytes_per_token=cache_bytes_per_token(model, self._shape),
            logit_bytes_per_row=self._shape.logit_bytes_per_row(),
            # with graphs the length is rounded up and the rows padded to a bucket
            max_len=need if static is None else static.cache_length(need),
        )
        rows = min(rows, self.row_cap or rows)
        return (
            rows_within(rows, static.least_rows) if static is not None and static.graphs else rows
        )

    def _decode(self, model, prompts, n: int, params: SamplingParams, u) -> list[list[Sample]]:
        """`n` completions of each prompt, row i * n + j drawn with the uniforms u[i*n + j]:
        by the static decoder when there is one, else the dynamic one."""
        if self.static is None:
            return self._sample_chunk(model, prompts, n, params, u)
        rows = [p for p in prompts for _ in range(n)]
        d = self.static.decode(model, rows, params, u)
        samples = _to_samples(d.tokens, d.logprobs, d.entropies, d.lengths, d.finished)
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

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
            **cache_kwargs(model, cache),
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
            **cache_kwargs(model, state.cache),
            use_cache=True,
        )
        return out.logits[:, -1, :]

    def _sample_chunk(
        self,
        model,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        u: torch.Tensor,
    ) -> list[list[Sample]]:
        """The dynamic decoder: the cache grows token by token and finished rows leave the
        batch (no work on them: what a CPU wants). Token t of row r is drawn with u[r, t]."""
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
            token, logp_token, full = draw(logits, params, u[live, t : t + 1])
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
