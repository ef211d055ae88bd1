"""Packed rows through flash attention's variable-length kernel (`[backend.options]
attention = "varlen"`, CUDA only).

A packed row (retrain/kernels/packing.py) is a prompt, then its completions back to back,
then padding; a completion attends to its prompt and to its own earlier tokens. The
variable-length kernel takes sequences laid end to end, each with keys of its own, causal
from the bottom right: a sequence of q queries over k >= q keys lets query i see keys up
to i + k - q. So a packed row becomes these sequences: the prompt over itself, each
completion over its prompt then itself (exactly its own `prompt + completion` row), and
the padding over itself. The queries are the row's positions in their own order, so the
packed layout goes in as it is; the keys and values are gathered, the prompt's once per
sequence of its row. Every score computed is one the rule allows: no
L x L mask is built, no wholly masked block is visited, and no partly masked one either
(FlexAttention evaluates its rule in those), in flash attention's own kernel. A window
(retrain/kernels/windows.py) is the kernel's left window, measured in the same positions.

The gather's backward is not `index_select`'s (an atomic `index_add` in bf16, in whatever
order the device runs it): a completion's or a pad's key is gathered once, so its
gradient is copied back; a prompt's key is gathered once per sequence of its row, and
those gradients are summed in float32 in a fixed order, then rounded once.

On a CPU, where torch has no such kernel and the config refuses the option, `attend` runs
`reference`, one SDPA call per sequence with the same rule as an explicit mask: the tests
check the layout and the gather through it against the dense mask, and at a run's start
(`check`) the device's kernel is checked against it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from retrain.errors import BackendError

PROMPT, PAD = 0, -1  # segment ids, as retrain/kernels/flex.py numbers them


@dataclass(frozen=True)
class Layout:
    """A micro-batch's packed rows (B, L) cut into the kernel's sequences.

    Positions are flat (row-major over B x L); `gather` lists, sequence by sequence,
    the flat position of each key. For the backward: `once` (its indices in `gather`,
    its flat positions) are the keys gathered exactly once; `prompts` holds per row
    (the indices in `gather` of its prompt's copies, copy after copy; the prompt's first
    flat position; its length)."""

    rows: int
    length: int
    cu_q: torch.Tensor  # (S + 1,) int32: where each sequence's queries start
    cu_k: torch.Tensor  # (S + 1,) int32: where each sequence's keys start in `gather`
    max_q: int
    max_k: int
    gather: torch.Tensor  # (K,) int64
    once_src: torch.Tensor  # int64, indices in `gather`
    once_dst: torch.Tensor  # int64, flat positions
    prompts: tuple[tuple[torch.Tensor, int, int], ...]

    def to(self, device: torch.device) -> Layout:
        """This layout's index tensors on `device`, queued (kernels/transfer.py)."""
        from retrain.kernels.transfer import to_device

        return Layout(
            self.rows,
            self.length,
            to_device(self.cu_q, device),
            to_device(self.cu_k, device),
            self.max_q,
            self.max_k,
            to_device(self.gather, device),
            to_device(self.once_src, device),
            to_device(self.once_dst, device),
            tuple((to_device(idx, device), start, p) for idx, start, p in self.prompts),
        )

    def bounds(self) -> list[tuple[int, int, int, int]]:
        """(query start, query end, key start, key end) of each sequence, on the host."""
        q, k = self.cu_q.tolist(), self.cu_k.tolist()
        return [(q[s], q[s + 1], k[s], k[s + 1]) for s in range(len(q) - 1)]


def _runs(segment: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values in `segment`."""
    cuts = np.flatnonzero(np.diff(segment)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(segment)]])
    return [(int(segment[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def layout(segments: torch.Tensor) -> Layout:
    """The sequences of packed rows whose segment ids (B, L, on the host) are `segments`
    (packing.Packed.segments: the prompt first, then each completion, then padding)."""
    seg = segments.numpy()
    rows, length = seg.shape
    q_sizes: list[int] = []
    k_sizes: list[int] = []
    gather: list[np.ndarray] = []
    once_src: list[np.ndarray] = []
    once_dst: list[np.ndarray] = []
    prompts = []
    taken = 0  # keys gathered so far
    for r in range(rows):
        base = r * length
        runs = _runs(seg[r])
        if runs[0][0] != PROMPT:
            raise ValueError(f"packed row {r} does not start with its prompt")
        p = runs[0][2]
        prompt = base + np.arange(p)
        copies = []
        for value, start, end in runs:
            own = base + np.arange(start, end)
            keys = own if value in (PROMPT, PAD) else np.concatenate([prompt, own])
            if value != PAD:  # the prompt's keys head every sequence but the padding's
                copies.append(taken + np.arange(p))
            if value != PROMPT:
                once_src.append(taken + len(keys) - len(own) + np.arange(len(own)))
                once_dst.append(own)
            q_sizes.append(end - start)
            k_sizes.append(len(keys))
            gather.append(keys)
            taken += len(keys)
        prompts.append((_index(copies), base, p))
    return Layout(
        rows=rows,
        length=length,
        cu_q=_starts(q_sizes),
        cu_k=_starts(k_sizes),
        max_q=max(q_sizes),
        max_k=max(k_sizes),
        gather=_index(gather),
        once_src=_index(once_src),
        once_dst=_index(once_dst),
        prompts=tuple(prompts),
    )


def _starts(sizes: list[int]) -> torch.Tensor:
    """Where each of consecutive runs of `sizes` starts, and where the last ends (int32:
    the kernel's cumulative lengths)."""
    return torch.from_numpy(np.cumsum([0, *sizes]).astype(np.int32))


def _index(parts: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(parts or [np.zeros(0)]).astype(np.int64))


class Mask(BlockMask):
    """What the model's layers get as their attention mask: the micro-batch's layout (on
    the training device) and the layer's window (None: unlimited). A BlockMask only so
    that transformers passes it to the attention function untouched, as it does a
    4-D mask; nothing of BlockMask's own is set, so any other use of it fails."""

    def __init__(self, layout: Layout, window: int | None = None):
        self.layout = layout
        self.window = window

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.layout.rows, 1, self.layout.length, self.layout.length)

    def __repr__(self) -> str:
        return f"varlen.Mask(rows={self.layout.rows}, length={self.layout.length}, window={self.window})"


class _Gathered(torch.autograd.Function):
    """The keys (or values) of every sequence, gathered from the flat (B * L, heads, dim)
    ones, with the deterministic backward the module docstring describes."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, lay: Layout) -> torch.Tensor:
        ctx.lay, ctx.rows = lay, flat.shape[0]
        return flat.index_select(0, lay.gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lay, rest = ctx.lay, grad.shape[1:]
        wide = torch.promote_types(grad.dtype, torch.float32)  # bf16 sums in float32
        out = grad.new_zeros((ctx.rows, *rest))
        out.index_copy_(0, lay.once_dst, grad.index_select(0, lay.once_src))
        for copies, start, p in lay.prompts:
            summed = grad.index_select(0, copies).view(-1, p, *rest).sum(0, dtype=wide)
            out[start : start + p] = summed
        return out, None


def _left(window: int | None) -> int:
    """The kernel's left window for `windows.within`'s rule (q - kv < window); -1: none."""
    return -1 if window is None else window - 1


def reference(q, k, v, lay: Layout, scale: float | None, window: int | None) -> torch.Tensor:
    """What the kernel computes, one SDPA call per sequence with the rule as a mask:
    q (Q, heads, dim), k and v (K, kv heads, dim) in, (Q, heads, dim) out."""
    out = torch.empty_like(q)
    left = _left(window)
    for q0, q1, k0, k1 in lay.bounds():
        n, m = q1 - q0, k1 - k0
        i = torch.arange(n, device=q.device)[:, None] + (m - n)  # bottom-right aligned
        j = torch.arange(m, device=q.device)[None, :]
        allowed = (j <= i) & ((i - j <= left) if left >= 0 else True)
        seq = torch.nn.functional.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1),
            k[k0:k1].transpose(0, 1),
            v[k0:k1].transpose(0, 1),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        out[q0:q1] = seq.transpose(0, 1)
    return out


def _flash(q, k, v, lay: Layout, scale: float | None, window: int | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    extra = {}
    if q.shape[1] != k.shape[1] and "enable_gqa" in inspect.signature(varlen_attn).parameters:
        extra["enable_gqa"] = True  # torch 2.13 asks; 2.11 takes grouped heads as they are
    return varlen_attn(
        q,
        k,
        v,
        lay.cu_q,
        lay.cu_k,
        lay.max_q,
        lay.max_k,
        scale=scale,
        window_size=(_left(window), 0),  # (-1, 0) is the kernel's causal
        **extra,
    )


def attend(query, key, value, mask: Mask, scaling: float | None = None) -> torch.Tensor:
    """transformers' attention arguments (batch, heads, L, dim) in, (batch, L, heads,
    dim) out: `mask`'s sequences through flash attention's variable-length kernel on
    CUDA, `reference` elsewhere."""
    return _attend(query, key, value, mask, scaling, _flash if query.is_cuda else reference)


def _attend(query, key, value, mask: Mask, scaling: float | None, kernel) -> torch.Tensor:
    """`attend` through `kernel` (`_flash` or `reference`)."""
    rows, heads, length, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(rows * length, -1, dim) for t in (query, key, value))
    k, v = (_Gathered.apply(t, mask.layout) for t in (k, v))
    out = kernel(q, k, v, mask.layout, scaling, mask.window)
    return out.view(rows, length, heads, dim)


# How far from `reference` (relative, in norm) a bf16 kernel's output and gradients may be
# on `check`'s probe: a few bf16 roundings (2**-8 each). A kernel aligned from the top
# left instead of the bottom right, or attending across sequences, is off by ~0.1-1.
CHECK_TOLERANCE = 2.0**-5


def check(device: torch.device, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
    """Raise BackendError unless this device's kernel gives `reference`'s output and
    gradients on a small packed layout (windowed and not) with the model's head shape:
    the kernel's alignment and its grouped heads are what the option relies on, and a
    GPU or torch without them would otherwise train on wrong logprobs."""
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 3], [0, 0, 1, 1, 1, 2, 2, 2, -1, -1]])
    lay = layout(segments).to(device)
    length = segments.shape[1]
    g = torch.Generator(device="cpu").manual_seed(0)
    inputs = tuple(
        torch.randn(2, h, length, dim, generator=g).to(device, dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(2, length, heads, dim, generator=g).to(device, dtype)
    try:
        for window in (None, 3):
            got = _probe(inputs, grad, Mask(lay, window), attend)
            want = _probe(inputs, grad, Mask(lay, window), _reference_attend)
            worst = max(float((a - b).norm() / b.norm()) for a, b in zip(got, want))
            if not worst <= CHECK_TOLERANCE:  # also NaN
                raise BackendError(
                    f'[backend.options] attention = "varlen": flash attention\'s '
                    f"variable-length kernel on {device} is {worst:.3g} (relative) away from "
                    f'the rule on a probe (window {window}). Fix: attention = "auto"'
                )
    except BackendError:
        raise
    except Exception as exc:
        raise BackendError(
            f'[backend.options] attention = "varlen": flash attention\'s variable-length '
            f"kernel fails on {device} ({type(exc).__name__}: {exc}). Fix: attention = "
            '"auto" (FlexAttention or the dense mask)'
        ) from exc


def _reference_attend(query, key, value, mask: Mask, scaling=None) -> torch.Tensor:
    """`attend` through `reference` on any device, in float32."""
    return _attend(query.float(), key.float(), value.float(), mask, scaling, reference)


def _probe(inputs, grad, mask: Mask, fn) -> list[torch.Tensor]:
    """`fn`'s output and its inputs' gradients for the output gradient `grad`."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves, mask)
    out.backward(grad.to(out.dtype))
    return [t.float() for t in (out.detach(), *(t.grad for t in leaves))]
