"""Decoding with a preallocated KV cache and one fixed-shape step, so that on CUDA the
step can be captured once as a CUDA graph and replayed for every token.

The dynamic decoder (retrain/engines/pytorch.py) grows its cache token by token and
drops finished rows, which suits a CPU (it saves the work of finished rows) but pays
Python and kernel-launch overhead on every token: on an H100 that overhead, not the
weights, set the pace (59 ms per decode step at 64 rows, where the weights alone read in
~3 ms). This decoder instead:

- allocates the cache once for `rows` x `length` positions (transformers' StaticCache,
  every layer writing at the positions the decoder sets once per forward pass:
  retrain/kernels/static_cache.py), and keeps it for later calls of the same shape, so
  a captured graph's addresses stay valid; `release` gives the kept caches and their
  graphs back (the local backend does before training when a micro-batch would not fit
  beside them), and the next call allocates and captures again;
- prefills every row's prompt (left-padded) in one forward pass with an explicit 4-D
  mask: a real token attends to the real tokens at or before it; a pad attends only to
  itself (so no attention row is empty) and no real token ever attends to a pad. Rows
  that share a prompt (a group's completions) have it fed once and its keys and values
  copied to each (retrain/kernels/static_cache.py), as the dynamic decoder repeats a
  prompt's cache;
- for a model with sliding-window layers (retrain/kernels/windows.py), keeps every
  layer's cache at full length and hands the sliding layers a second mask that also
  drops the keys that fell out of the window (a row's real tokens are contiguous, so
  cache distance is position distance);
- decodes every row at every step, finished ones included (their tokens are discarded:
  masked, not removed), so the step's shapes never change. The step feeds one token per
  row, takes the logits and draws the next token with the row's pre-drawn uniform
  (retrain/engines/draw.py), recording its logprob (and entropy) inside the step;
- reads at each step only the cache's leading positions that hold keys, rounded up to a
  multiple of 128 (its "key span"), when the model's attention is retrain's
  (retrain/kernels/flex.py, which the local backend sets on CUDA): the mask handed to it
  is that wide and it reads the keys the mask covers. The positions beyond hold no key
  yet and are masked, so reading them only costs time: at the headline shape (256 new
  tokens after a prompt of ~55, a 384-position cache) every decode step read 384 keys a
  row and layer, ~7 GB a step at 128 rows, about as much as the weights; by span it reads
  ~35% fewer. transformers' own attention functions need a mask as wide as the keys, so any
  other model reads the whole cache;
- on CUDA (`graphs=True`) captures that step per (rows, length, key span, sampling
  settings) in a CUDA graph after a short warm-up, and replays it. Rows are padded up to
  a bucket (a power of two) and the length up to a multiple of 128, so few graphs are
  captured; a call's graphs are captured before its prefill (a warm-up writes into the
  cache). If capturing fails, it says so once and runs the same step eagerly;
- with `compiled=True` (`decode = "compiled"`) runs the step through torch.compile's
  inductor (`compiled_step`): the step's element-wise work (norms, rotary, casts,
  residual adds, the draw) fuses into fewer kernels, which on CUDA the graph then
  replays. On a CPU it is no faster (the matmuls set the pace there; docs/
  performance.md); it is built for a GPU's decode step, where each of a layer's ~30
  small element-wise kernels costs launch and tail time. If compiling fails, it says so once and
  runs the uncompiled step.

With the same uniforms it draws the same tokens as the dynamic decoder, and their fp32
logprobs agree to rounding (tests/unit/test_static_decode.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from retrain.engines.draw import draw
from retrain.errors import BackendError
from retrain.kernels.cache_arg import cache_kwargs
from retrain.kernels.compiled_blocks import device_error
from retrain.kernels.packing import additive
from retrain.kernels.static_cache import Writes, WrittenAt, full_length_cache
from retrain.kernels.windows import NO_WINDOW, Windows, within
from retrain.types import SamplingParams

log = logging.getLogger("retrain.engines.static_decode")

LENGTH_STEP = 128  # cache lengths (with graphs) and key spans are rounded up to this
KEPT_SHAPES = 4  # caches (and their graphs) kept with graphs; the least recently used goes
RECOMPILES = 32  # dynamo's compiles per function before it runs new guards eagerly (8)
CHECK_EVERY = 8  # steps between checks for "every row finished" with graphs (a host sync)


@dataclass
class Decoded:
    """One decoding batch's results, one row per completion (cut at `lengths`)."""

    tokens: torch.Tensor  # (R, steps) long
    logprobs: torch.Tensor  # (R, steps) float32
    entropies: torch.Tensor | None  # (R, steps) float32
    lengths: torch.Tensor  # (R,) long: tokens up to and including eos, else the width
    finished: torch.Tensor  # (R,) bool: ended with eos


@dataclass
class _Step:
    """The decode step's inputs and outputs: the same tensors at every step, so a captured
    graph reads and writes the same addresses on every replay."""

    token: torch.Tensor  # (R, 1) long: the token fed at this step
    position: torch.Tensor  # (R, 1) long: its position in its row
    write_at: torch.Tensor  # (1,) long: the cache position it is written at (every row's)
    writes: Writes  # where every cache layer writes: write_at, but the prefill's positions
    key_valid: torch.Tensor  # (R, L) bool: the cache positions a query may attend to
    key_window: torch.Tensor | None  # (R, L) bool: those of them in the sliding window
    uniform: torch.Tensor  # (R, 1) float64: this step's uniforms
    next_token: torch.Tensor  # (R,) long
    logprob: torch.Tensor  # (R,) float32
    entropy: torch.Tensor  # (R,) float32
    bad: torch.Tensor  # () bool: some logits were not finite

    @classmethod
    def allocate(cls, rows: int, length: int, device: torch.device, sliding: bool) -> _Step:
        long = dict(dtype=torch.long, device=device)
        keys = dict(size=(rows, length), dtype=torch.bool, device=device)
        write_at = torch.zeros(1, **long)
        return cls(
            token=torch.zeros((rows, 1), **long),
            position=torch.zeros((rows, 1), **long),
            write_at=write_at,
            writes=Writes(write_at),
            key_valid=torch.zeros(**keys),
            key_window=torch.zeros(**keys) if sliding else None,
            uniform=torch.full((rows, 1), 0.5, dtype=torch.float64, device=device),
            next_token=torch.zeros(rows, **long),
            logprob=torch.zeros(rows, dtype=torch.float32, device=device),
            entropy=torch.zeros(rows, dtype=torch.float32, device=device),
            bad=torch.zeros((), dtype=torch.bool, device=device),
        )


def _check_static_cache() -> None:
    """The decoder relies on transformers 5.x's cache interface, whose models pass no
    cache positions to the cache (its StaticLayer tracks its fill level on the device,
    `cumulative_length`, which is how it is recognised here); its own cache layers write
    where it says (retrain/kernels/static_cache.py), but an older transformers' models
    would build their masks and positions from cache positions it never sets."""
    import transformers
    from transformers.cache_utils import StaticLayer

    if not hasattr(StaticLayer(max_cache_len=1), "cumulative_length"):
        raise BackendError(
            f"[backend.options] decode: the static decoder needs a transformers whose "
            f"StaticCache keeps its length on the device (this one is {transformers.__version__}). "
            'Fix: upgrade transformers, or decode = "dynamic"'
        )


def compiled_step(step: Callable) -> Callable:
    """`step` compiled by inductor (`decode = "compiled"`): one graph, so rotary, norms,
    casts, residual adds and the draw's element-wise work fuse into fewer kernels, with
    bf16 intermediates rounded where eager rounds them (`emulate_precision_casts`), so
    it draws what the uncompiled step draws to rounding. Shapes start static; dynamo
    recompiles once with the dims (and the key span) that changed made dynamic, and once
    per sampling setting, so a run's few shapes and settings stay well inside the raised
    limit."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILES)
    return torch.compile(step, fullgraph=True, options={"emulate_precision_casts": True})


def failed_at(message: str) -> str:
    """Where in the traced code a Dynamo error `message` stopped, from the last frame of
    its "from user code:" trace: " at file:line (function): code", or "" without one.
    The first 200 characters of such a message name the failing operation, not the line
    that reached it (on the H200 of 2026-11-27: "does not know how to trace method
    `update` of class `<unknown type>`", with nothing to say where)."""
    _, found, trace = message.partition("from user code:")
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace) if found else []
    if not frames:
        return ""
    path, line, function, code = frames[-1]
    return f" at {path}:{line} ({function}): {code.strip()[:120]}"


def _round_up(x: int, step: int) -> int:
    return -(-x // step) * step


LEAST_ROWS = 8  # the smallest bucket, for few graphs (lowered once sampling ran out of memory)


def row_bucket(rows: int, least: int = LEAST_ROWS) -> int:
    """The captured batch size for `rows` rows: the next power of two, at least `least`."""
    return max(least, 1 << (rows - 1).bit_length())


def rows_within(budget: int, least: int = LEAST_ROWS) -> int:
    """The most rows a batch may have when its cache holds at most `budget` rows once
    padded to its bucket: the largest power of two not above it (below `least`, the
    budget: no bucket is smaller)."""
    return budget if budget < least else 1 << (budget.bit_length() - 1)


def key_span(filled: int, length: int, step: int = LENGTH_STEP) -> int:
    """The leading cache positions a step reads when `filled` of them hold keys: `filled`
    rounded up to `step` (few spans, so few graphs), at most the cache's `length`."""
    return min(length, _round_up(filled, step))


def reads_prefix(model) -> bool:
    """Whether `model`'s attention reads only the keys its mask covers (retrain's,
    retrain/kernels/flex.py); transformers' own need the mask as wide as the cache."""
    from retrain.kernels.flex import NAME

    return getattr(model.config, "_attn_implementation", None) == NAME


def prefill_mask(key_valid: torch.Tensor, width: int, window: int | None = None) -> torch.Tensor:
    """(R, 1, width, L) bool: query i attends to key j <= i when key j is a real token
    within `window` positions (None: any), and to itself (a pad's only key: no row of the
    attention is empty)."""
    length = key_valid.shape[1]
    i = torch.arange(width, device=key_valid.device)[:, None]
    j = torch.arange(length, device=key_valid.device)[None, :]
    allowed = (j <= i)[None] & (key_valid[:, None, :] | (j == i)[None]) & within(i, j, window)
    return allowed[:, None]


def distinct_rows(prompts: list[list[int]]) -> tuple[list[int], list[int]] | tuple[None, None]:
    """(the first row of each distinct prompt, for every row the index of its prompt
    among those), or (None, None) when every row's prompt is its own."""
    first: dict[tuple[int, ...], int] = {}  # each distinct prompt's first row
    for row, p in enumerate(prompts):
        first.setdefault(tuple(p), row)
    if len(first) == len(prompts):
        return None, None
    index = {p: i for i, p in enumerate(first)}
    return list(first.values()), [index[tuple(p)] for p in prompts]


def copies_rows(cache) -> bool:
    """Whether every layer of `cache` can copy a fed row to many (`WrittenAt`)."""
    return all(isinstance(layer, WrittenAt) for layer in cache.layers)


def styled(mask: torch.Tensor, style: str, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask as the model's attention takes it, in `dtype` (the residual
    stream's): for SDPA ("bool" style) what SDPA would make of it in every layer, once a
    step (retrain/kernels/packing.py `additive`); for the eager attention additive with
    the dtype's lowest value for -inf."""
    return additive(mask, dtype, float("-inf") if style == "bool" else torch.finfo(dtype).min)


def end_pool_routing(device: torch.device, pool) -> bool:
    """After a capture that failed: have the caching allocator stop sending allocations
    into the graphs' pool `pool` on `device`, if it still does; whether it did. When a
    capture is spoilt (an unsafe call in it, memory run out in it), torch 2.11's
    `CUDAGraph.capture_end` raises at `cudaStreamEndCapture`, before it ends that routing:
    the allocator then counts a capture still under way, and `empty_cache` gives nothing
    back for the rest of the run, while the engine's and the trainer's out-of-memory
    back-off rely on it. torch cannot be asked whether the routing ended; where it did
    (or never began), ending it raises, which is taken for "nothing to end"."""
    if pool is None:
        return False
    try:
        torch._C._cuda_endAllocateToPool(device.index, pool)
    except RuntimeError:
        return False
    return True


class StaticDecoder:
    """Decodes batches of rows with a preallocated cache; see the module docstring."""

    def __init__(
        self,
        *,
        eos_ids: list[int],
        pad_id: int,
        device: torch.device,
        graphs: bool = False,
        compiled: bool = False,
        mask_style: str = "bool",
        windows: Windows = NO_WINDOW,
        say: Callable[[str], None] | None = None,
        free_bytes: Callable[[], int] | None = None,
    ):
        """`free_bytes`: the bytes a new cache can take on the device (default on CUDA:
        the driver's free memory and the allocator's unused, less the unused part of the
        graphs' pool, `hardware.cuda_free_bytes`; elsewhere unknown)."""
        if graphs and device.type != "cuda":
            raise BackendError(f"CUDA graphs need a CUDA device; the sampler runs on {device}")
        _check_static_cache()
        self.eos = torch.tensor(sorted(eos_ids), device=device)
        self.pad_id = pad_id
        self.device = device
        self.graphs = graphs
        self.mask_style = mask_style  # retrain.kernels.packing.MASK_STYLES of the model
        self.say = say or log.warning
        self._shapes: dict[tuple[int, int], tuple[Any, _Step]] = {}  # (R, L) -> cache, step
        self._captured: dict[tuple, Any] = {}  # (R, L, key span, sampling settings) -> graph
        self._pool = None
        self._side = None  # the stream every graph is captured on (`_capture`)
        self.length_step = LENGTH_STEP  # cache lengths (with graphs) and key spans round to it
        self.keep = graphs  # caches kept between calls: a captured graph holds their addresses
        self.least_rows = LEAST_ROWS  # the smallest bucket (the engine's OOM back-off lowers it)
        self.graph_failures = 0
        self.compiled = compiled
        self._compiled_step = compiled_step(self._step) if compiled else None
        self.compile_failures = 0
        self._compile_said = False
        self.windows = windows  # the model's sliding windows (retrain/kernels/windows.py)
        if free_bytes is None and device.type == "cuda":
            free_bytes = self._cuda_free_bytes
        self.free_bytes = free_bytes

    # ------------------------------------------------------------ one batch

    def decode(
        self, model, prompts: list[list[int]], params: SamplingParams, u: torch.Tensor
    ) -> Decoded:
        """Decode one completion per prompt (`prompts` has one entry per row) with the
        uniforms `u` (rows, max_tokens)."""
        rows, width = len(prompts), params.max_tokens
        bucket = row_bucket(rows, self.least_rows) if self.graphs else rows
        prompts = prompts + [[self.pad_id]] * (bucket - rows)  # filler rows, finished at once
        longest = max(len(p) for p in prompts)
        length = self.cache_length(longest + width)
        span = self._spans(model, length)
        cache, step = self._buffers(model, bucket, length)
        replays = None
        if self.graphs:  # the step at t feeds the token at cache position longest + t
            spans = sorted({span(longest + t + 1) for t in range(width - 1)})
            replays = self._graphs(model, cache, step, params, length, spans)
        logits = self._prefill(model, cache, step, prompts, longest, span(longest))
        u = torch.cat([u, u.new_full((bucket - rows, width), 0.5)]) if bucket > rows else u
        return self._decode_steps(
            model, cache, step, logits, params, u, longest, rows, span, replays
        )

    def cache_length(self, need: int) -> int:
        """The cache length a call that needs `need` positions per row decodes with."""
        return _round_up(need, self.length_step) if self.graphs else need

    def _spans(self, model, length: int) -> Callable[[int], int]:
        """filled cache positions -> the key span a step or prefill reads (`key_span`;
        the whole cache for a model whose attention cannot read less)."""
        if not reads_prefix(model):
            return lambda filled: length
        return lambda filled: key_span(filled, length, self.length_step)

    def _buffers(self, model, rows: int, length: int) -> tuple[Any, _Step]:
        """The cache and step buffers of this shape: kept for the next call with graphs
        (a captured graph holds their addresses), else made for this call only. A new
        shape whose cache does not fit the free memory beside the kept ones has them
        released first (the engine's row budget counts them as free)."""
        key = (rows, length)
        if key in self._shapes:
            self._shapes[key] = self._shapes.pop(key)  # most recently used last
            return self._shapes[key]
        if self._shapes and not self._fits(model, rows, length):
            self.release()
        step = _Step.allocate(rows, length, self.device, self.windows.sliding is not None)
        buffers = (full_length_cache(model, length, step.writes), step)
        if self.keep:
            if len(self._shapes) >= KEPT_SHAPES:  # a cache and graphs hold device memory
                oldest = next(iter(self._shapes))
                del self._shapes[oldest]
                for graph_key in [k for k in self._captured if k[:2] == oldest]:
                    del self._captured[graph_key]
            self._shapes[key] = buffers
        return buffers

    def _cuda_free_bytes(self) -> int:
        from retrain.hardware import cuda_free_bytes

        return cuda_free_bytes(self.device, self.pools())

    def pools(self) -> list:
        """The private memory pool of the captured graphs, while there are any."""
        return [] if self._pool is None else [self._pool]

    def kept_bytes(self) -> int:
        """Bytes of the keys and values the kept caches hold (allocated at their first
        prefill)."""
        return sum(
            t.nbytes
            for cache, _ in self._shapes.values()
            for layer in cache.layers
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if isinstance(t, torch.Tensor)
        )

    def _fits(self, model, rows: int, length: int) -> bool:
        """Whether a cache of rows x length positions fits the free memory now (unknown
        free memory, or a model whose sizes retrain/memory.py cannot read: it does not,
        and the kept caches make way)."""
        from retrain.memory import HEADROOM, cache_bytes_per_token

        per_token = cache_bytes_per_token(model)
        if self.free_bytes is None or per_token is None:
            return False
        return rows * length * per_token <= HEADROOM * self.free_bytes()

    def release(self) -> int:
        """Give back the kept caches and the graphs captured on them; returns the cache
        bytes released. The next call of each shape allocates and captures again. On
        CUDA the memory goes back to the device: a cache first written during a capture's
        warm-up was allocated on that side stream, whose pool another stream's tensors
        would not otherwise reuse."""
        released = self.kept_bytes()
        self._shapes.clear()
        self._captured.clear()
        self._pool = None  # the graphs' private memory goes with the last of them
        if released and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return released

    def _prefill(self, model, cache, step: _Step, prompts: list[list[int]], width: int, span: int):
        """Every row's prompt, left-padded to `width`, into the reset cache, its attention
        reading the first `span` cache positions; returns the next-token logits (R, V) and
        leaves the step's position, key mask and cache write position set. Rows with
        the same prompt (a group's completions, the filler rows) are fed once and their
        keys and values copied to each (`distinct_rows`): at the headline's 8 prompts x 16
        completions, a sixteenth of the prefill's work."""
        rows = len(prompts)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        real = torch.zeros((rows, width), dtype=torch.bool)
        for r, p in enumerate(prompts):
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            real[r, width - len(p) :] = True
        ids, real = ids.to(self.device), real.to(self.device)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        step.key_valid.zero_()
        step.key_valid[:, :width] = real
        if step.key_window is not None:  # what the last prompt position's window holds
            step.key_window.copy_(step.key_valid)
            step.key_window[:, : max(0, width - self.windows.sliding)] = False
        cache.reset()
        step.writes.at = torch.arange(width, device=self.device)  # the prompts' positions
        fed, fan = distinct_rows(prompts) if copies_rows(cache) else (None, None)
        keys, feed, copies = step.key_valid[:, :span], slice(None), None
        if fan is not None:  # the fed rows' keys only: `width` of them (static_cache.py)
            feed = torch.tensor(fed, device=self.device)
            copies = step.writes.fan = torch.tensor(fan, device=self.device)
            keys = step.key_valid[feed, :width]
        try:
            out = model(
                input_ids=ids[feed],
                attention_mask=self.windows.masks(
                    lambda w: self._mask(prefill_mask(keys, width, w), model)
                ),
                position_ids=positions[feed],
                **cache_kwargs(model, cache),
                use_cache=True,
                logits_to_keep=1,
            )
        finally:  # the steps (and the graphs captured on them) write at write_at
            step.writes.at, step.writes.fan = step.write_at, None
        step.position.copy_(positions[:, -1:])
        step.write_at.fill_(width)
        logits = out.logits[:, -1, :]
        return logits if copies is None else logits.index_select(0, copies)

    def _decode_steps(
        self, model, cache, step: _Step, logits, params, u, width: int, rows: int, span, replays
    ) -> Decoded:
        """Decode from the prefill's `logits`: the step at t feeds the token at cache
        position width + t and reads `span(width + t + 1)` positions, replayed from
        `replays` (key span -> a captured graph's replay) or run (None)."""
        bucket, max_tokens = u.shape
        tokens = torch.zeros((bucket, max_tokens), dtype=torch.long, device=self.device)
        logprobs = torch.zeros((bucket, max_tokens), dtype=torch.float32, device=self.device)
        entropies = torch.zeros_like(logprobs) if params.return_entropy else None
        lengths = torch.full((bucket,), max_tokens, dtype=torch.long, device=self.device)
        finished = torch.zeros(bucket, dtype=torch.bool, device=self.device)
        finished[rows:] = True  # filler rows
        step.bad.copy_(~torch.isfinite(logits).all())
        token, logp, full = draw(logits, params, u[:, :1])
        step.next_token.copy_(token)
        step.logprob.copy_(logp)
        if entropies is not None:
            step.entropy.copy_(-(full.exp() * full).sum(-1))
        steps, check = max_tokens, 1 if replays is None else CHECK_EVERY
        for t in range(max_tokens):
            tokens[:, t], logprobs[:, t] = step.next_token, step.logprob
            if entropies is not None:
                entropies[:, t] = step.entropy
            hit = ~finished & torch.isin(step.next_token, self.eos)
            lengths.masked_fill_(hit, t + 1)
            finished |= hit
            if t + 1 == max_tokens or ((t + 1) % check == 0 and bool(finished.all())):
                steps = t + 1
                break
            # feed token t at cache position width + t; its row may now attend to it
            step.token.copy_(step.next_token[:, None])
            step.position.add_(1)
            step.write_at.fill_(width + t)
            step.key_valid[:, width + t] = True
            if step.key_window is not None:  # and the key a window back falls out
                step.key_window[:, width + t] = True
                if width + t >= self.windows.sliding:
                    step.key_window[:, width + t - self.windows.sliding] = False
            step.uniform.copy_(u[:, t + 1 : t + 2])
            keys = span(width + t + 1)
            if replays is not None:
                replays[keys]()
            else:
                self._run_step(model, cache, step, params, keys)
        if bool(step.bad):
            raise BackendError(
                "the model produced non-finite logits while sampling (have the weights "
                "diverged? try a lower [training] lr)"
            )
        lengths.clamp_(max=steps)
        ent = None if entropies is None else entropies[:rows, :steps]
        return Decoded(
            tokens[:rows, :steps], logprobs[:rows, :steps], ent, lengths[:rows], finished[:rows]
        )

    def _mask(self, mask: torch.Tensor, model) -> torch.Tensor:
        return styled(mask, self.mask_style, model.get_input_embeddings().weight.dtype)

    # ------------------------------------------------------------ the step

    def _step(self, model, cache, step: _Step, params: SamplingParams, span: int) -> None:
        """Feed `step.token`, draw the next token: fixed shapes, no host synchronisation.
        The attention reads the first `span` cache positions (the mask's width)."""

        def mask(window: int | None) -> torch.Tensor:
            keys = step.key_valid if window is None else step.key_window
            return self._mask(keys[:, None, None, :span], model)

        out = model(
            input_ids=step.token,
            attention_mask=self.windows.masks(mask),
            position_ids=step.position,
            **cache_kwargs(model, cache),
            use_cache=True,
        )
        logits = out.logits[:, -1, :]
        step.bad.logical_or_(~torch.isfinite(logits).all())
        token, logp, full = draw(logits, params, step.uniform)
        step.next_token.copy_(token)
        step.logprob.copy_(logp)
        if params.return_entropy:
            step.entropy.copy_(-(full.exp() * full).sum(-1))

    def _run_step(self, model, cache, step: _Step, params: SamplingParams, span: int) -> None:
        """The step, compiled while compiling has not failed. Compiled as one graph
        (`fullgraph`), a step either compiles whole before any of it runs or fails before
        touching the cache, so the same step can then run eagerly."""
        if self._compiled_step is not None:
            if not self._compile_said:  # a silent minute would look like a hang
                self._compile_said = True
                self.say(
                    "compiling the decode step (torch.compile): the first sampling takes "
                    "longer, and so does the first at a new shape or sampling setting"
                )
            try:
                self._compiled_step(model, cache, step, params, span)
                return
            except torch._dynamo.exc.TorchDynamoException as exc:
                inner = device_error(exc)
                if inner is not None:  # memory ran out while compiling: the engine's
                    raise inner from exc  # back-off takes fewer rows, then compiles again
                self._compiled_step = None
                self.compile_failures += 1
                self.say(
                    f"warning: could not compile the decode step ({type(exc).__name__}: "
                    f"{str(exc).strip()[:200]}{failed_at(str(exc))}); decoding with the "
                    f'uncompiled step (slower). Set [backend.options] decode = "graphs" (or '
                    '"static" off CUDA) to skip the attempt'
                )
        self._step(model, cache, step, params, span)

    def _graphs(
        self, model, cache, step: _Step, params: SamplingParams, length: int, spans: list[int]
    ) -> dict[int, Callable[[], None]] | None:
        """Key span -> a replay of the step captured for this shape, these sampling
        settings and that span; None (eager) once capturing has failed, for any shape:
        what fails a capture (an operator that cannot be captured) fails every shape's,
        and each attempt would warn again."""
        if self.graph_failures:
            return None
        rows = step.token.shape[0]
        settings = (params.temperature, params.top_p, params.return_entropy)
        replays = {}
        for span in spans:
            key = (rows, length, span, *settings)
            if key not in self._captured:
                self._captured[key] = self._capture(model, cache, step, params, span)
            if self._captured[key] is None:
                return None
            replays[span] = self._captured[key].replay
        return replays

    def _capture(self, model, cache, step: _Step, params: SamplingParams, span: int):
        """Warm the step up on a side stream of the sampler's device, then capture it on
        that stream: the same stream for every graph, since the caching allocator hands a
        freed block of the graphs' shared pool only to the stream that freed it (a stream
        per capture left each graph its own temporaries: the logits and draw buffers,
        vocabulary-wide, per key span). The warm-up writes into the cache, which the next
        prefill resets (in place: the addresses stay). The capture forbids unsafe CUDA calls in this thread
        only (`thread_local`): with `overlap`, a training step on another thread allocates
        and synchronises meanwhile. A failed capture leaves the thread on the stream it
        was on, and a compiled step that failed in it is not run again; running out of
        memory is raised as such."""
        current = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.device(self.device):
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                step.key_valid[:, 0] = True
                if self._side is None:  # one for all: a pool's freed block is reused only
                    self._side = torch.cuda.Stream(device=self.device)  # on its stream
                side = self._side
                side.wait_stream(current)
                with torch.cuda.stream(side):
                    cache.reset()
                    for _ in range(3):  # the first compiles the step when it is compiled
                        self._run_step(model, cache, step, params, span)
                current.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    graph, pool=self._pool, stream=side, capture_error_mode="thread_local"
                ):
                    self._run_step(model, cache, step, params, span)
            return graph
        except Exception as exc:  # an op that cannot be captured: decode eagerly
            torch.cuda.set_stream(current)  # torch's graph context may not have restored it
            end_pool_routing(self.device, self._pool)
            if isinstance(exc, torch.OutOfMemoryError):  # not the step's fault: the engine
                raise  # decodes fewer rows at once (pytorch.py `_back_off`)
            if isinstance(exc.__context__, torch.OutOfMemoryError):  # the capture ended on it
                raise exc.__context__ from exc
            self.graph_failures += 1
            also = ""
            if self._compiled_step is not None:  # it may be what failed, at run time
                self._compiled_step = None
                self.compile_failures += 1
                also = " and uncompiled"
            self.say(
                f"warning: could not capture the decode step as a CUDA graph "
                f"({type(exc).__name__}: {str(exc)[:200]}); decoding eagerly{also} with the "
                'static cache (slower). Set [backend.options] decode = "static" to skip the '
                "attempt"
            )
            return None
