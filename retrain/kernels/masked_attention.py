"""Masked attention of many query positions on CUDA: SDPA's memory-efficient kernel, called
by name, not cuDNN's.

Given a tensor mask on an H100 or H200, SDPA in torch 2.11 to 2.13 prefers cuDNN's
attention kernel, whose backward has returned NaN gradients with a mask on rows that
hold nothing unusual: grad_q where a row's logsumexp is below ln(FLT_MAX) ~ -88.7 at key
lengths of 64 mod 128 (pytorch/pytorch#196678, from torch 2.11; a "massive activation"
head of Qwen2.5-0.5B reached it in TRL's DPO, huggingface/trl#7181), dK and dV for single
query rows with negative logsumexps (NVIDIA/cudnn-frontend#1072, cuDNN 9.26). A packed
micro-batch is masked and its lengths are anything, so the trainer would meet them.

SDPA's choice of kernel is process-wide (`torch.nn.attention.sdpa_kernel` sets global
flags, which a sampler on another thread, `[backend.options] overlap`, would see too), so
retrain's attention implementation (retrain/kernels/flex.py) calls the memory-efficient
kernel itself for a masked call of many query positions: what SDPA runs with cuDNN's
kernel off, with the same inputs (the keys and values repeated for grouped-query heads,
as transformers' SDPA path repeats them under a mask; the mask broadcast over the heads,
as SDPA's own `preprocess_mask` does). Where that kernel does not take the call (torch's
own check: head size, dtype, device), SDPA decides as before. A decode step's single
query position goes to `flex.grouped_decode` instead, forward only, unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used
    import torch

# SDPA pads a mask whose strides are not multiples of this many elements, in every call
# (aten's `preprocess_mask`); retrain/kernels/packing.py `additive` lays its masks out so.
ALIGNMENT = 8


def on_cuda(device_type: str) -> bool:
    """Whether tensors on `device_type` take this path (tests/unit/test_masked_attention.py
    runs it on a CPU, with CPU kernels given to the memory-efficient ones)."""
    return device_type == "cuda"


def applies(query, mask, dropout: float, kwargs: dict) -> bool:
    """Whether transformers' attention call (query (batch, heads, L, dim), `mask`,
    `dropout`, the rest of its arguments in `kwargs`) is one `attend` computes: on CUDA,
    more than one query position, a 4-D float mask in the query's dtype, and nothing SDPA's
    path would add (dropout, soft-capping, sinks, a position bias)."""
    import torch

    return (
        on_cuda(query.device.type)
        and query.shape[2] > 1
        and isinstance(mask, torch.Tensor)
        and mask.dim() == 4
        and mask.dtype == query.dtype
        and not dropout
        and all(kwargs.get(k) is None for k in ("softcap", "s_aux", "position_bias"))
    )


def kernel_takes(query, key, value, mask) -> bool:
    """torch's own check that its memory-efficient kernel takes these inputs."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention

    return can_use_efficient_attention(SDPAParams(query, key, value, mask, 0.0, False, False))


def attend(query, key, value, mask, scaling: float | None) -> torch.Tensor:
    """Attention of `query` (batch, heads, L, dim) over `key` and `value` (batch, kv heads,
    keys, dim) under the additive `mask` (batch or 1, 1, L, keys) through the
    memory-efficient kernel; (batch, L, heads, dim) out, like transformers' attention
    functions."""
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if kernel_takes(query, key, value, mask):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        bias = aligned(mask).expand(*query.shape[:3], key.shape[2])
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, grad, 0.0, False, scale=scaling
        )[0]
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, mask, scale=scaling
        )
    return out.transpose(1, 2).contiguous()


def aligned(mask: torch.Tensor) -> torch.Tensor:
    """`mask`, or a copy of it whose strides are multiples of ALIGNMENT (the kernel reads
    the mask's rows in aligned loads): what SDPA's `preprocess_mask` does."""
    import torch

    strides = mask.stride()
    if strides[-1] == 1 and all(s % ALIGNMENT == 0 for s in strides[:-1]):
        return mask
    width = mask.shape[-1]
    padded = torch.nn.functional.pad(mask, (0, -width % ALIGNMENT or ALIGNMENT))
    return padded[..., :width]
