"""The local backend's bf16 mode (`[backend.options] dtype`): bf16 matmuls, float32 rest.

On a GPU, and on a CPU with native bf16 dot products (AVX512-BF16 or AMX), a bf16 matmul
runs 2-3x faster than a float32 one (2.2-2.7x on this project's 2-core AVX512-BF16 box).
Only the frozen weights of the linear layers inside the transformer blocks become bf16
(`Bf16Linear`: the input is rounded to bf16, the output goes back to float32). The
residual stream, norms, embeddings, the output layer (so the logits) and the LoRA adapter
stay float32: a model cast wholly to bf16 rounds the residual stream at every layer, and
its sampler and trainer, which run the same weights in different shapes (one token at a
time vs a packed row), disagreed by 0.02 on average and up to 0.5 in a token's logprob on
SmolLM2; with float32 outside the matmuls it is ~0.01 and ~0.1. The sampler records the
logprobs of the distribution it drew from, so the importance ratio corrects what remains
(`log_ratio_mean` / `log_ratio_max_abs` show it; docs/performance.md has the numbers).
"""

from __future__ import annotations

import torch

from retrain.hardware import matmul_dtype


def use_bf16(option: str, device: torch.device) -> bool:
    """Whether `[backend.options] dtype` means bf16 matmuls on `device`."""
    return matmul_dtype(option, device.type) == "bf16"


class Bf16Linear(torch.nn.Linear):
    """A frozen linear layer whose weight is stored in bf16: the matmul runs in bf16 and
    its output goes back to the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias)
        return out.to(x.dtype)


def bf16_linears(model: torch.nn.Module) -> int:
    """Turn every `nn.Linear` of `model` except its output layer into a `Bf16Linear` (in
    place, before the LoRA adapter is added); returns how many."""
    head = model.get_output_embeddings()
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module is not head:
            module.__class__ = Bf16Linear
            module.weight.data = module.weight.data.to(torch.bfloat16)
            if module.bias is not None:
                module.bias.data = module.bias.data.to(torch.bfloat16)
            count += 1
    return count
