"""CUDA's AdamW (fused: retrain/backends/local.py `adamw_options`) updates the adapter
without advancing its tensors' version counters, which the sampling copy (and on a GPU
the staged bf16 operands) read to see that the adapter changed. The local backend
advances them after each step, so the sampler samples from the adapter just trained: a
step taken with the fused AdamW samples next what a step with the default one does."""

from __future__ import annotations

import dataclasses

import torch
from test_memory_sizing import HYPER, datums_of, make_backend, trained_adapter

from retrain.types import SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10]]
DRAW = SamplingParams(max_tokens=8, temperature=1.0, seed=11)


def sampled_logprobs(backend) -> list[list[float]]:
    """Each completion's sampled tokens' logprobs (the sampler's, the behaviour policy's)."""
    return [list(s.logprobs) for g in backend.sample(PROMPTS, 4, DRAW) for s in g]


def firsts(logprobs: list[list[float]]) -> torch.Tensor:
    return torch.tensor([row[0] for row in logprobs])


def test_the_sampler_samples_from_the_adapter_the_step_trained(tiny_raw, tiny_model_dir):
    runs = {}
    for kind in ("default", "fused"):
        backend = trained_adapter(make_backend(tiny_raw, tiny_model_dir))
        if kind == "fused":  # as on CUDA
            for group in backend.optimizer.param_groups:
                group.update(fused=True, foreach=False)
        datums = datums_of(backend)
        before = sampled_logprobs(backend)
        versions = [p._version for p in backend.params]
        backend.train_step(datums, dataclasses.replace(HYPER, lr=3e-2))
        assert all(p._version > v for p, v in zip(backend.params, versions)), kind
        runs[kind] = before, sampled_logprobs(backend)
    before, after = runs["default"]
    moved = (firsts(after) - firsts(before)).abs().max()
    assert moved > 1e-2  # the step moved the sampler's policy
    fused_before, fused_after = runs["fused"]
    assert fused_before == before
    # the fused update is AdamW's to float32 rounding: the same draws, nearly the same
    # logprobs; a sampler left on the old adapter misses by the step's move
    assert [len(row) for row in fused_after] == [len(row) for row in after]
    flat = torch.tensor([lp for row in fused_after for lp in row])
    want = torch.tensor([lp for row in after for lp in row])
    torch.testing.assert_close(flat, want, rtol=0, atol=1e-4)
