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


def decoder_for(option: str, device_type: str, sharded: bool = False) -> str:
    """`[backend.options] decode` on a device kind: auto is graphs on CUDA (launch
    overhead, not the weights, sets the pace of a GPU decode step) and dynamic elsewhere
    (a CPU saves the work of finished rows); graphs off CUDA is refused. With a sharded
    base (`sharded`: `shard = true`) the sampler reads blocks gathered anew after every
    training step, at new addresses, which a captured graph would not follow: auto is
    static there, and graphs or compiled (captured on CUDA) are refused."""
    problem = sharded_problem(option, device_type) if sharded else None
    if problem:
        raise BackendError(f"[backend.options] decode {problem}")
    if option == "auto":
        if device_type == "cuda":
            return "static" if sharded else "graphs"
        return "dynamic"
    if option == "graphs" and device_type != "cuda":
        raise BackendError(
            f'[backend.options] decode = "graphs" needs a CUDA device; the sampler runs on '
            f'{device_type}. Fix: decode = "auto" (or "static")'
        )
    if option not in DECODERS:
        raise BackendError(f"decode = {option!r}: one of auto, {', '.join(DECODERS)}")
    return option


def sharded_problem(option: str, device_type: str) -> str | None:
    """Why `decode = option` cannot sample from a sharded base on `device_type`, or None."""
    if device_type == "cuda" and option in ("graphs", "compiled"):
        return (
            f'= "{option}" with [backend.options] shard = true: a CUDA graph replays the '
            "addresses it was captured with, and the sampler's gathered blocks are "
            'allocated anew after every training step. Fix: decode = "auto" (static there)'
        )
    return None


def describe(decoder: str, device_type: str) -> str:
    """`decoder_for`'s answer in words (explain)."""
    text = f"{decoder} ({DECODERS[decoder]}"
    if decoder == "compiled" and device_type == "cuda":
        text += ", captured as a CUDA graph"
    return text + ")"
