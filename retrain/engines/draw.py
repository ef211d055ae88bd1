"""Drawing a token per row from the model's logits, at the sampling temperature and
top-p, with the logprob of the distribution it was drawn from (the behaviour policy the
trainer's importance ratio divides by). Pure torch, fixed shapes: used by the dynamic
decoder (retrain/engines/pytorch.py) and the static one (retrain/engines/static_decode.py).
"""

from __future__ import annotations

import torch

from retrain.types import SamplingParams


def uniforms(rows: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """The uniforms of a decoding batch, drawn up front: row r's token t is drawn with
    u[r, t] (float64 in [0, 1)). A row's completion then depends on its own uniforms
    only, not on which other rows are still decoding, so a decoder that drops finished
    rows and one that masks them (a fixed-shape, graph-captured step) draw the same
    tokens under a seed."""
    return torch.rand(
        (rows, width), generator=generator, dtype=torch.float64, device=generator.device
    )


def draw(
    logits: torch.Tensor, params: SamplingParams, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row, with `u` (rows, 1) its uniforms: (token, its logprob under the
    distribution it was drawn from, the full log-distribution before top-p). Temperature
    0 is greedy with logprob 0 (it was chosen with probability 1). Fixed shapes and no
    host synchronisation, so it runs inside a captured CUDA graph."""
    if params.temperature <= 0.0:
        full = torch.log_softmax(logits.float(), dim=-1)
        token = logits.argmax(dim=-1)
        return token, torch.zeros_like(token, dtype=torch.float32), full
    scaled = logits.float()
    if params.temperature != 1.0:
        scaled = scaled / params.temperature
    full = torch.log_softmax(scaled, dim=-1)
    logp = nucleus(full, params.top_p) if params.top_p < 1.0 else full
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
