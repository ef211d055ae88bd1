"""Packing a micro-batch for the trainer's forward pass.

Each prompt of a micro-batch becomes one row: the prompt, then each of its completions
(all tokens but the last, which predicts nothing), back to back; rows are right-padded to
the longest. A block-diagonal causal mask lets every token attend only to its prompt and
to the earlier tokens of its own completion, and the position ids continue from the prompt
into each completion. That is the same computation as one right-padded `prompt +
completion` row per completion, but a prompt runs once for its whole group and a
completion's padding is never computed, and the micro-batch is one large forward/backward
instead of a small one per group (bigger matmuls: 1.6x the bf16 rate on a 2-core CPU).
Logits are computed only at the positions that predict a completion token, and with the
model split at its output layer (retrain/kernels/logprobs.py) never kept whole.
(One row for the whole micro-batch would also work, but attention then costs the square
of the micro-batch's length instead of the sum of its groups' squares.)

The mask goes to the model in one of four styles: a bool L x L mask per row (SDPA, which
is handed it made additive once for all its layers: `additive`), an additive one (eager
attention), or no L x L mask at all, each position's segment (the
prompt, its completion, or padding) instead, from which FlexAttention's block mask is
built on the device (retrain/kernels/flex.py) or flash attention's variable-length
sequences are cut (retrain/kernels/varlen.py). A model with sliding-window layers gets the
window in its masks too (retrain/kernels/windows.py), measured in positions: a completion
token's distance to its prompt is what it would be in its own `prompt + completion` row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from retrain.errors import BackendError
from retrain.kernels import flex
from retrain.kernels.logprobs import LinearHead, chosen_logprobs
from retrain.kernels.masked_attention import ALIGNMENT
from retrain.kernels.transfer import to_device
from retrain.kernels.windows import NO_WINDOW, Windows, within

# How each attention implementation takes a custom tensor mask: SDPA a bool mask (True =
# attend), eager an additive one (0 = attend, -inf = blocked); retrain's FlexAttention
# implementation passes tensor masks on to SDPA.
MASK_STYLES = {"sdpa": "bool", "eager": "additive", flex.NAME: "bool"}
STYLES = ("bool", "additive", "flex", "varlen")

Group = tuple[Sequence[int], Sequence[np.ndarray]]  # (prompt ids, its completions)


def split(items: Sequence[tuple[Sequence[int], int]], budget: int) -> list[int]:
    """Micro-batch sizes for consecutive (prompt ids, completion length) items, in order,
    such that each micro-batch's packed layout, rows x longest row (the positions the
    forward pass computes, padding included: `padded_area`), stays within `budget`.
    Consecutive items with the same prompt share a row; a group that does not fit is split
    across micro-batches, its prompt then running once in each. Only an item that alone
    exceeds the budget (prompt + completion) gets a micro-batch over it.

    Bounding the padded area, not the token count, is what bounds memory: rows of 250 and
    40 tokens compute 500 positions, not 290."""
    sizes: list[int] = []
    rows: list[int] = []  # the open micro-batch's row lengths
    last = None
    for prompt, length in items:
        fed = length - 1  # a completion's last token predicts nothing
        if rows and prompt == last:
            grown = [*rows[:-1], rows[-1] + fed]
        else:
            grown = [*rows, len(prompt) + fed]
        if not rows or len(grown) * max(grown) > budget:
            sizes.append(0)  # a new micro-batch
            grown = [len(prompt) + fed]
        sizes[-1] += 1
        rows, last = grown, prompt
    return sizes


def row_width(groups: Sequence[Group]) -> int:
    """The longest packed row of `groups`: a prompt and its completions (each without its
    last token)."""
    return max(len(p) + sum(len(c) - 1 for c in cs) for p, cs in groups)


def mask_style(
    groups: Sequence[Group], dense: str, flex_from: int | None, varlen: bool = False
) -> str:
    """ "varlen" with `varlen` (`flex.varlen_chosen`), "flex" when the micro-batch's
    longest row reaches `flex_from` positions (None: never), else the `dense` style."""
    if varlen:
        return "varlen"
    if flex_from is not None and row_width(groups) >= flex_from:
        return "flex"
    return dense


def padded_area(items: Sequence[tuple[Sequence[int], int]]) -> int:
    """Rows x longest row of one micro-batch's packed layout (see `split`)."""
    rows: list[int] = []
    last = None
    for prompt, length in items:
        if rows and prompt == last:
            rows[-1] += length - 1
        else:
            rows.append(len(prompt) + length - 1)
        last = prompt
    return len(rows) * max(rows, default=0)


@dataclass(frozen=True)
class Packed:
    """A micro-batch as B rows (one per prompt) of length L; T completion tokens in order."""

    ids: torch.Tensor  # (B, L)
    positions: torch.Tensor  # (B, L)
    segments: torch.Tensor  # (B, L) flex.PROMPT, i for the i-th completion, flex.PAD
    mask: torch.Tensor | None  # (B, 1, L, L) bool: who may attend to whom; None: flex, varlen
    keep: torch.Tensor  # (B, L) bool: the positions whose logits are needed (R in all)
    row: torch.Tensor  # (T,) for each completion token, the kept row (row-major) predicting it
    targets: torch.Tensor  # (T,) the completion tokens
    lengths: tuple[int, ...]  # each completion's length, in order

    def slot(self, width: int) -> torch.Tensor:
        """(T,) each token's index in a row-major (completions, width) padded layout."""
        return torch.cat(
            [i * width + torch.arange(k, dtype=torch.long) for i, k in enumerate(self.lengths)]
        )


@dataclass
class _Row:
    """One prompt and its completions, laid out in a row."""

    ids: torch.Tensor
    positions: torch.Tensor
    segment: torch.Tensor  # (n,) 0 for the prompt, i for the i-th completion
    allowed: torch.Tensor | None  # (n, n) bool; None when not asked for
    keep: list[int]  # positions whose logits are needed, increasing
    row: list[int]  # for each completion token, its index in `keep`


def _row(prompt: Sequence[int], completions: Sequence[np.ndarray], dense: bool) -> _Row:
    p = len(prompt)
    if p < 1 or not completions or min(len(c) for c in completions) < 1:
        raise ValueError("every prompt and completion needs at least one token")
    fed = [np.asarray(c[:-1], dtype=np.int64) for c in completions]
    sizes = [len(f) for f in fed]
    ids = torch.from_numpy(np.concatenate([np.asarray(prompt, dtype=np.int64), *fed]))
    # segment 0 is the prompt, segment i + 1 the i-th completion
    segment = torch.repeat_interleave(torch.arange(len(fed) + 1), torch.tensor([p, *sizes]))
    positions = torch.cat([torch.arange(p), *(p + torch.arange(k) for k in sizes)])
    allowed = None
    if dense:
        i = torch.arange(len(segment))
        allowed = flex.sees(i[:, None], i[None, :], segment[:, None], segment[None, :])
    keep, row, start = [p - 1], [], p  # the prompt's last position predicts every first token
    for k in sizes:
        row.append(0)
        row.extend(range(len(keep), len(keep) + k))
        keep.extend(range(start, start + k))
        start += k
    return _Row(ids, positions, segment, allowed, keep, row)


def pack(groups: Sequence[Group], style: str) -> Packed:
    """Pack `groups` (each prompt with at least one completion of at least one token)
    for a mask of `style` (one of STYLES)."""
    if style not in STYLES:
        raise ValueError(f"unknown attention mask style {style!r}")
    dense = style not in ("flex", "varlen")
    rows = [_row(prompt, completions, dense) for prompt, completions in groups]
    b, width = len(rows), max(len(r.ids) for r in rows)
    ids = torch.zeros((b, width), dtype=torch.long)
    positions = torch.zeros((b, width), dtype=torch.long)
    segments = torch.full((b, width), flex.PAD, dtype=torch.long)
    # a padding position attends to itself only (a row with nothing to attend to is NaN)
    allowed = torch.eye(width, dtype=torch.bool).repeat(b, 1, 1) if dense else None
    keep = torch.zeros((b, width), dtype=torch.bool)
    row, offset = [], 0
    for i, r in enumerate(rows):
        n = len(r.ids)
        ids[i, :n], positions[i, :n], segments[i, :n] = r.ids, r.positions, r.segment
        if dense:
            allowed[i, :n, :n] = r.allowed
        keep[i, r.keep] = True
        row.extend(offset + j for j in r.row)
        offset += len(r.keep)
    targets = [np.asarray(c, dtype=np.int64) for _, cs in groups for c in cs]
    return Packed(
        ids=ids,
        positions=positions,
        segments=segments,
        mask=None if allowed is None else allowed[:, None],
        keep=keep,
        row=torch.tensor(row, dtype=torch.long),
        targets=torch.from_numpy(np.concatenate(targets)),
        lengths=tuple(len(t) for t in targets),
    )


def dense_mask(
    allowed: torch.Tensor, positions: torch.Tensor, window: int | None, style: str
) -> torch.Tensor:
    """`Packed.mask` (B, 1, L, L) limited to `window` positions back (None: no limit), in
    the model's `style`: bool, or additive (0 where allowed, -inf elsewhere). A pad still
    sees itself: its position is 0, like the keys it sees."""
    if window is not None:
        allowed = allowed & within(positions[:, None, :, None], positions[:, None, None, :], window)
    if style == "additive":
        return additive(allowed, torch.float32)
    return allowed


def additive(allowed: torch.Tensor, dtype: torch.dtype, blocked: float = float("-inf")):
    """The bool mask `allowed` as an additive one in `dtype`: 0 where allowed, `blocked`
    elsewhere. With -inf in the query's dtype it is the tensor SDPA makes of a bool mask
    in every layer (aten's `convert_boolean_attn_mask`: its backend is chosen before, on
    the mask's shape alone). Made once for the pass instead, it saves three kernels a
    layer, and the backward keeps this one mask rather than a converted copy per layer
    (30 copies of rows x L x L in SmolLM2's pass). Its rows are laid out a multiple of
    `masked_attention.ALIGNMENT` apart, as SDPA's memory-efficient kernel reads them:
    otherwise SDPA would pad a copy in every layer."""
    *lead, width = allowed.shape
    room = torch.zeros(*lead, width + -width % ALIGNMENT, dtype=dtype, device=allowed.device)
    return room[..., :width].masked_fill_(~allowed, blocked)


def completion_logprobs(
    model,
    groups: Sequence[Group],
    temperature: float,
    style: str,
    device: torch.device,
    head: LinearHead | None = None,
    windows: Windows = NO_WINDOW,
) -> torch.Tensor:
    """Logprobs (completions, longest) of every completion's tokens given its prompt, at
    `temperature`, in the order of `groups`, right-padded with 0. With `head` (the model
    split at its output layer, retrain/kernels/logprobs.py) the logits are never kept
    whole: their memory no longer grows with the completion tokens of the micro-batch.
    Styles "flex" and "varlen" need the model on retrain's attention implementation
    (flex.use_flex).
    `windows`: the model's sliding windows (retrain/kernels/windows.py `windows_of`)."""
    packed = pack(groups, style)
    # Every host tensor goes up queued (retrain/kernels/transfer.py), and the kept rows are
    # picked by index, not by a bool mask (which needs its count on the host): the whole
    # forward and backward are queued without waiting for the device.
    positions = to_device(packed.positions, device)
    if style == "flex":
        segments = to_device(packed.segments, device)
        mask = windows.masks(lambda w: flex.block_mask(segments, positions, w))
    elif style == "varlen":
        from retrain.kernels import varlen

        cut = varlen.layout(packed.segments).to(device)
        mask = windows.masks(lambda w: varlen.Mask(cut, w))
    else:
        allowed = to_device(packed.mask, device)
        dtype = model.get_input_embeddings().weight.dtype  # the queries' (the residual's)

        def dense(window: int | None) -> torch.Tensor:
            made = dense_mask(allowed, positions, window, style)
            return additive(made, dtype) if style == "bool" else made  # SDPA's, made once

        mask = windows.masks(dense)
    inputs = dict(
        input_ids=to_device(packed.ids, device),
        position_ids=positions,
        attention_mask=mask,
        use_cache=False,
    )
    row, target = to_device(packed.row, device), to_device(packed.targets, device)
    if head is not None:
        kept = to_device(_flat_index(packed.keep), device)
        hidden = head.decoder(**inputs).last_hidden_state.flatten(0, 1).index_select(0, kept)
        token_logp = chosen_logprobs(hidden, head, row, target, temperature)
    else:
        # (R, vocabulary): the kept positions, row-major. The model keeps the columns any
        # row keeps (a 1-D index: transformers before 5.2x takes no 2-D mask there).
        cols = torch.from_numpy(np.flatnonzero(packed.keep.numpy().any(0)))
        kept = to_device(_flat_index(packed.keep[:, cols]), device)
        logits = model(**inputs, logits_to_keep=to_device(cols, device)).logits
        logits = logits.flatten(0, 1).index_select(0, kept)
        # The log softmax at the chosen token only (logsumexp per row, then a gather), so
        # no (tokens x vocabulary) log-probability tensor is kept for the backward pass.
        scaled = logits.float() / temperature
        token_logp = scaled[row, target] - torch.logsumexp(scaled, dim=-1)[row]
    n, width = len(packed.lengths), max(packed.lengths)
    slots = to_device(packed.slot(width), device)
    return token_logp.new_zeros(n * width).index_copy(0, slots, token_logp).view(n, width)


def _flat_index(keep: torch.Tensor) -> torch.Tensor:
    """(R,) the True positions of the host mask `keep` (B, L) in its row-major (B * L)
    layout: the order a bool index of `keep` takes them in. Counted on the host (numpy),
    where `keep` was built."""
    return torch.from_numpy(np.flatnonzero(keep.numpy()))


# How far a packed completion's logprobs may be from its own row's, in float32 (the
# tests measure ~5e-7); a model that leaks between completions is off by far more.
PACKING_TOLERANCE = 1e-3


def check_packing(model, style: str, windows: Windows = NO_WINDOW, name: str = "the model"):
    """Raise BackendError unless `model` (in float32, eval mode) gives two completions
    packed in one row the logprobs each gets in a row of its own. Packing relies on the
    model honouring `position_ids` and a custom 4-D mask in every layer: one that
    rebuilds its own mask (ALiBi from the 2-D mask), carries state along the row
    (state-space layers) or ignores the mask would otherwise train on wrong logprobs,
    or stop later with an error that does not say why. 20 tokens, once, where the model
    is (the local backend: on the CPU, before the bf16 blocks and the move)."""
    try:
        g = torch.Generator().manual_seed(0)
        vocab = model.get_input_embeddings().weight.shape[0]
        prompt = torch.randint(0, vocab, (5,), generator=g).tolist()
        completions = [torch.randint(0, vocab, (k,), generator=g).numpy() for k in (8, 7)]
        device = next(model.parameters()).device
        with torch.no_grad():
            packed = completion_logprobs(
                model, [(prompt, completions)], 1.0, style, device, None, windows
            )
            worst = 0.0
            for i, c in enumerate(completions):
                ids = torch.tensor([prompt + c.tolist()], device=device)
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
                target = torch.from_numpy(c).to(device)[:, None]
                own = logp[len(prompt) - 1 : -1].gather(-1, target)[:, 0]
                worst = max(worst, float((packed[i, : len(c)] - own).abs().max()))
    except Exception as exc:  # any failure here means: it cannot be packed
        raise BackendError(
            _unpackable(name, f"a packed row fails in it ({type(exc).__name__}: {exc})")
        ) from exc
    if not worst <= PACKING_TOLERANCE:  # also NaN
        raise BackendError(
            _unpackable(
                name,
                f"a completion packed beside another gets logprobs {worst:.3g} away from its own row's",
            )
        )


def _unpackable(name: str, what: str) -> str:
    return (
        f"{name} cannot be trained by the local backend: it packs a prompt's completions "
        f"into one row (position ids and a custom attention mask), and {what}. Fix: a "
        "model whose layers take both (Llama, Qwen, Mistral, Gemma, Phi, GPT-2, ...), or "
        'backend = "tinker" / "prime_rl"'
    )
