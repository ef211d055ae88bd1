"""Logprobs of the chosen tokens straight from the last hidden states, without keeping the
logits.

The trainer needs, for every completion token t, log softmax(z_r / T)[y_t], where z_r are
the logits at the position r that predicts it. Computed the plain way, the logits
(positions x vocabulary, float32: 79 MB for 400 positions on SmolLM2's 49k vocabulary)
and their copies in the log-softmax and in the backward pass were the largest tensors of
a micro-batch, several of them alive at once, and their size grew with the number of
completion tokens in it, so with the group size.

`chosen_logprobs` runs the output layer over LOGIT_ROWS positions at a time and keeps,
per position, only the log normaliser and, when a gradient is needed, the expected
output-layer row under the softmax, E_r = sum_v p_rv W_v. That is all the backward pass
needs: d logp_t / d h_r = (W[y_t] - E_r) / T. The memory is LOGIT_ROWS x vocabulary,
whatever the micro-batch, and the work is the same two matmuls as the plain forward and
backward (the logits, then the softmax times W). Both are float32 products: of float32
operands on a CPU; on a GPU's bf16 model, of the bf16 hidden states and output layer on
the tensor cores with a float32 result (`precision.mm_f32`, the softmax rounded to bf16
for the second), where a float32 copy of the output layer cost 1.6 GB at Qwen3-4B's
shapes and float32 matmuls ran an order of magnitude below the bf16 rate.

It is used only when the model's logits are exactly `output_layer(last hidden state)`
(`linear_head` checks that on a probe input): soft-capped or scaled logits, or an
adapter on the output layer, keep the plain path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retrain.kernels.precision import linear_f32, mm_f32
from retrain.memory import LOGIT_ROWS


@dataclass(frozen=True)
class LinearHead:
    """A causal LM split at its output layer: logits = linear(decoder(...), weight, bias)."""

    decoder: torch.nn.Module
    weight: torch.Tensor  # (vocabulary, hidden), frozen
    bias: torch.Tensor | None


def linear_head(model) -> LinearHead | None:
    """`model` (a PEFT or plain transformers causal LM) split at its output layer, when its
    logits are exactly that layer applied to the decoder's last hidden state (checked on a
    probe input) and the layer is a frozen plain linear; else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    get_decoder = getattr(base, "get_decoder", None)
    if type(head) is not torch.nn.Linear or head.weight.requires_grad or get_decoder is None:
        return None
    split = LinearHead(get_decoder(), head.weight, head.bias)
    device = head.weight.device
    ids = torch.arange(1, 6, device=device)[None] % head.weight.shape[0]
    was_training = model.training
    model.eval()  # no dropout: both passes must see the same network
    try:
        with torch.no_grad():
            whole = model(input_ids=ids, use_cache=False).logits.float()
            hidden = split.decoder(input_ids=ids, use_cache=False).last_hidden_state
            parts = torch.nn.functional.linear(hidden, split.weight, split.bias).float()
    except (TypeError, AttributeError):  # not a decoder we know how to call
        return None
    finally:
        model.train(was_training)
    if whole.shape != parts.shape or not torch.allclose(whole, parts, rtol=1e-4, atol=1e-4):
        return None
    return split


def chosen_logprobs(
    hidden: torch.Tensor,
    head: LinearHead,
    row: torch.Tensor,
    target: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """(T,) log softmax(linear(hidden[row_t]) / temperature)[target_t] for every t, from
    `hidden` (R, H): the kept positions' last hidden states. Differentiable in `hidden`."""
    return _ChosenLogprobs.apply(hidden, head.weight, head.bias, row, target, temperature)


class _ChosenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, row, target, temperature):
        rows = hidden.shape[0]
        lse = hidden.new_empty(rows, dtype=torch.float32)
        expected = None
        if ctx.needs_input_grad[0]:
            expected = hidden.new_empty(hidden.shape, dtype=torch.float32)
        for start in range(0, rows, LOGIT_ROWS):
            end = min(start + LOGIT_ROWS, rows)
            z = linear_f32(hidden[start:end], weight, bias)
            if temperature != 1.0:
                z.div_(temperature)
            lse[start:end] = torch.logsumexp(z, dim=-1)
            if expected is not None:  # the softmax, in place, times W
                p = z.sub_(lse[start:end, None]).exp_()
                # in W's dtype: a bf16 W takes p rounded to bf16 (a relative 2^-9, less
                # than the bf16 gradient this becomes) to multiply on the tensor cores
                expected[start:end] = mm_f32(p.to(weight.dtype), weight)
        chosen = (hidden[row].float() * weight[target].float()).sum(-1)
        if bias is not None:
            chosen = chosen + bias[target].float()
        ctx.save_for_backward(weight, row, target, expected)
        ctx.temperature = temperature
        ctx.rows = rows
        ctx.dtype = hidden.dtype
        return chosen / temperature - lse[row]

    @staticmethod
    def backward(ctx, grad):
        weight, row, target, expected = ctx.saved_tensors
        per_token = grad[:, None] * (weight[target].float() - expected[row]) / ctx.temperature
        grad_hidden = per_token.new_zeros((ctx.rows, weight.shape[1])).index_add_(0, row, per_token)
        return grad_hidden.to(ctx.dtype), None, None, None, None, None
