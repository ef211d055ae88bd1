"""A step's `gpu_peak_memory_gb`: the most GPU memory torch held during the step, the
largest over the CUDA devices it used, from torch's peak counters. Where each device
starts counting depends on who runs beside whom (`peak_windows`): with `overlap`, the
next step's sampling runs in the middle of this step's training and resets the sampler's
counters there, so each side is read in its own window."""

from __future__ import annotations

import torch


def peak_windows(
    infer: torch.device, train: torch.device, overlap: bool
) -> tuple[list[torch.device], list[torch.device]]:
    """Where a step's `gpu_peak_memory_gb` starts counting on each CUDA device: (devices
    counted from the step's sampling, devices counted from its training). One device, one
    step at a time: from its sampling to its update. A training device of its own (split
    mode) or training beside the next step's sampling (`overlap`, where the next sampling
    comes in the middle of it): from its training; the sampler's own device from its
    sampling."""
    if infer == train and not overlap:
        return ([train] if train.type == "cuda" else []), []
    sampling = [infer] if infer.type == "cuda" and infer != train else []
    return sampling, ([train] if train.type == "cuda" else [])


class PeakMemory:
    """The peak counters of a backend's devices, reset as each window opens and read into
    a step's metrics; nothing on a CPU."""

    def __init__(self, infer: torch.device, train: torch.device, overlap: bool):
        self.at_sampling, self.at_training = peak_windows(infer, train, overlap)
        self._sampling = False  # the step's sampling window is open

    def sampling_starts(self) -> None:
        """A sampling call of a step: its first opens the step's window. A step may sample
        several times (each turn of a multi-turn rollout, each round of dynamic
        sampling), and a reset at each would drop the earlier rounds' peaks."""
        if not self._sampling:
            _reset(self.at_sampling)
            self._sampling = True

    def training_starts(self) -> None:
        _reset(self.at_training)

    def sampled(self) -> dict[str, float]:
        """The sampler's device's peak since the step sampled, where its training is
        counted apart: read as the training starts, since with `overlap` the next step's
        sampling resets it meanwhile. The step's sampling is over: the next sampling call
        opens the next step's window."""
        self._sampling = False
        if not (self.at_sampling and self.at_training):
            return {}
        return {"gpu_peak_memory_gb": max(_peaks_gb(self.at_sampling))}

    def step(self, sampled: float | None) -> dict[str, float]:
        """`gpu_peak_memory_gb` of the step: `sampled` (`sampled()`'s reading), and the
        training device's since its training started, or (one device, one step at a time)
        since the step sampled."""
        peaks = _peaks_gb(self.at_training or self.at_sampling)
        if sampled is not None:
            peaks.append(sampled)
        return {"gpu_peak_memory_gb": max(peaks)} if peaks else {}


def _reset(devices: list[torch.device]) -> None:
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)


def _peaks_gb(devices: list[torch.device]) -> list[float]:
    """The most memory torch held on each CUDA device since its peak was last reset, GB."""
    return [torch.cuda.max_memory_allocated(d) / 1e9 for d in devices]
