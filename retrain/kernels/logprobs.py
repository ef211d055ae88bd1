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
backward (the logits, then the softmax times W).

It is used only when the model's logits are exactly `output_layer(last hidden state)`
(`linear_head` checks that on a probe input): soft-capped or scaled logits, or an
adapter on the output layer, keep the plain path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
        hidden32 = hidden.float()
        w = weight.float()
        b = None if bias is None else bias.float()
        rows = hidden.shape[0]
        lse = hidden32.new_empty(rows)
        expected = hidden32.new_empty(hidden32.shape) if ctx.needs_input_grad[0] else None
        for start in range(0, rows, LOGIT_ROWS):
            end = min(start + LOGIT_ROWS, rows)
            z = torch.nn.functional.linear(hidden32[start:end], w, b)
            if temperature != 1.0:
                z.div_(temperature)
            lse[start:end] = torch.logsumexp(z, dim=-1)
            if expected is not None:  # the softmax, in place, times W
                expected[start:end] = z.sub_(lse[start:end, None]).exp_() @ w
        chosen = (hidden32[row] * w[target]).sum(-1)
        if b is not None:
            chosen = chosen + b[target]
        ctx.save_for_backward(w, row, target, expected)
        ctx.temperature = temperature
        ctx.rows = rows
        ctx.dtype = hidden.dtype
        return chosen / temperature - lse[row]

    @staticmethod
    def backward(ctx, grad):
        w, row, target, expected = ctx.saved_tensors
        per_token = grad[:, None] * (w[target] - expected[row]) / ctx.temperature
        grad_hidden = per_token.new_zeros((ctx.rows, w.shape[1])).index_add_(0, row, per_token)
        return grad_hidden.to(ctx.dtype), None, None, None, None, None
