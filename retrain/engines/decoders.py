"""The pytorch engine's decoders (`[backend.options] decode`), named and resolved without
importing torch, so `explain` can say which one a run gets."""

from __future__ import annotations

from retrain.errors import BackendError

# How a decoding batch is run, in words: "dynamic" (the CPU's default: retrain/engines/
# pytorch.py), the others through retrain/engines/static_decode.py.
DECODERS = {
    "dynamic": "the cache grows, finished rows leave the batch",
    "static": "a preallocated cache, one fixed-shape step",
    "graphs": "a preallocated cache, the step captured as a CUDA graph",
    "compiled": "a preallocated cache, the step compiled by torch.compile",
}


def decoder_for(option: str, device_type: str) -> str:
    """`[backend.options] decode` on a device kind: auto is graphs on CUDA (launch
    overhead, not the weights, sets the pace of a GPU decode step) and dynamic elsewhere
    (a CPU saves the work of finished rows); graphs off CUDA is refused."""
    if option == "auto":
        return "graphs" if device_type == "cuda" else "dynamic"
    if option == "graphs" and device_type != "cuda":
        raise BackendError(
            f'[backend.options] decode = "graphs" needs a CUDA device; the sampler runs on '
            f'{device_type}. Fix: decode = "auto" (or "static")'
        )
    if option not in DECODERS:
        raise BackendError(f"decode = {option!r}: one of auto, {', '.join(DECODERS)}")
    return option


def describe(decoder: str, device_type: str) -> str:
    """`decoder_for`'s answer in words (explain)."""
    text = f"{decoder} ({DECODERS[decoder]}"
    if decoder == "compiled" and device_type == "cuda":
        text += ", captured as a CUDA graph"
    return text + ")"
