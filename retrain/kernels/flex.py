"""Packed rows through FlexAttention (`[backend.options] attention`).

A packed row (retrain/kernels/packing.py) is a prompt, then its completions back to back:
a token attends to the earlier tokens of its own segment and to the whole prompt. The
dense path hands the model that rule as an L x L mask per row, and SDPA computes every
score of the L x L square before masking most of it: with 16 completions of 256 tokens a
row is ~4.2k positions, and all but ~1/16 of its completion-to-completion scores are
masked. FlexAttention takes the rule as a function of (query, key) and a block map built
from it, and skips the 128 x 128 blocks that are wholly masked, so attention costs about
the sum of the segments' squares instead of the row's square, and no mask is stored.

The model keeps one attention implementation, `NAME`, registered with transformers: a
BlockMask goes to FlexAttention (a `varlen.Mask`, one too, to flash attention's
variable-length kernel: retrain/kernels/varlen.py), a decode step of one query position
to `grouped_decode` (SDPA over the grouped heads, no copies of the cache), a tensor mask
over many query positions on CUDA to SDPA's memory-efficient kernel by name
(retrain/kernels/masked_attention.py: not cuDNN's, whose masked backward has given NaN
gradients), any other mask to transformers' own SDPA function. A tensor mask narrower
than the keys means "read the first that many keys": the static decoder's steps read
only the cache's filled prefix that way. The local backend puts an SDPA model on it on
CUDA whether or not its training uses FlexAttention, for the decode steps and the masked
passes. On CUDA FlexAttention runs compiled (torch.compile, recompiling once for a new
shape and then with dynamic shapes); on a CPU it runs torch's eager reference, forward
only: torch 2.13 has no FlexAttention backward on a CPU, which is why training uses it on
CUDA only (the config check says so). The CPU tests therefore check the forward pass
against the dense mask on random layouts; the opt-in `-m gpu` test checks the gradients
on CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from retrain.errors import BackendError, summary
from retrain.kernels import masked_attention
from retrain.kernels.windows import within

if TYPE_CHECKING:  # torch is imported where it is used: `explain` reads this module without it
    import torch
    from torch.nn.attention.flex_attention import BlockMask

NAME = "retrain_packed"  # the attention implementation's name in transformers' registry

# Segment ids of a packed row: the prompt, each completion (1, 2, ...), and padding.
PROMPT, PAD = 0, -1

# attention = "auto" on CUDA: the longest row (positions) from which a micro-batch runs
# through FlexAttention. Below it the L x L mask is small and the dense path costs little,
# while FlexAttention's first call compiles (13.5 s on an H100). Not tuned: at 4.2k
# positions (the headline's rows) FlexAttention trained in 0.53 s, the dense mask 0.60 s.
AUTO_FROM = 2048

VARLEN_LABEL = "flash attention's variable-length kernel (each completion over its prompt)"

_compiled: list = []  # the compiled FlexAttention, built on the first CUDA call


def sees(q, kv, q_segment, kv_segment):
    """The packed rows' rule (retrain/kernels/packing.py builds its dense mask from it
    too): a query at row index `q` sees a key at `kv` at or before it in its own segment
    or in the prompt, which comes first in the row."""
    return (kv <= q) & ((kv_segment == q_segment) | (kv_segment == PROMPT))


def block_mask(
    segments: torch.Tensor, positions: torch.Tensor, window: int | None = None
) -> BlockMask:
    """`sees` for `segments` (rows, L) on the training device, within `window` positions
    (retrain/kernels/windows.py; None: no limit). (A pad, after every real token of its
    row, sees the prompt and the pads before it; no real token sees a pad. The dense mask
    lets a pad see only itself; pads' outputs are never used.)"""

    def allowed(b, h, q, kv):
        return sees(q, kv, segments[b, q], segments[b, kv])

    def allowed_within(b, h, q, kv):
        return allowed(b, h, q, kv) & within(positions[b, q], positions[b, kv], window)

    from torch.nn.attention.flex_attention import create_block_mask

    rows, length = segments.shape
    rule = allowed if window is None else allowed_within
    return create_block_mask(rule, rows, None, length, length, device=segments.device)


def describe(option: str, device_kind: str, blocked: list[str] | None = None) -> str:
    """What `attention = option` does when training an SDPA model on `device_kind` with
    `blocked` (see `blockers`) in the way (for `explain`, after the config checks refused
    flex off CUDA and where blocked)."""
    cuda = device_kind == "cuda"
    if option == "flex" and blocked:
        return "FlexAttention, refused: " + ", ".join(blocked)
    if option == "auto" and cuda and blocked:  # what keeps auto from it
        return "dense mask (not FlexAttention: " + ", ".join(blocked) + ")" + ON_KERNEL
    if option == "varlen":
        return VARLEN_LABEL
    return label(flex_from(option, device_kind, "sdpa", "the model", blocked), kernel=cuda)


# where retrain's attention takes the dense mask on CUDA (retrain/kernels/masked_attention.py)
ON_KERNEL = ", on SDPA's memory-efficient kernel"


def label(start: int | None, varlen: bool = False, kernel: bool = False) -> str:
    """`flex_from`'s answer in words, or `varlen_chosen`'s (explain, the backend's ready
    line); `kernel`: the dense mask's passes call SDPA's memory-efficient kernel (an SDPA
    model on CUDA), said so."""
    if varlen:
        return VARLEN_LABEL
    on = ON_KERNEL if kernel else ""
    if start is None:
        return "dense mask" + on
    if start == 0:
        return "FlexAttention"
    return f"FlexAttention for rows of {start}+ positions, dense mask below{on}"


def blockers(model) -> list[str]:
    """What of a transformers model's attention FlexAttention here does not apply: logit
    soft-capping (Gemma 2), attention sinks (GPT-OSS), attention dropout."""
    config = model.config
    found = []
    if getattr(config, "attn_logit_softcapping", None) is not None:
        found.append("attention logit soft-capping")
    if any(hasattr(m, "sinks") for m in model.modules()):
        found.append("attention sinks")
    if getattr(config, "attention_dropout", 0.0):
        found.append("attention dropout")
    return found


def device_blockers(dtype: str, device_type: str, index: int = 0) -> list[str]:
    """`blockers` of the device rather than the model: on a GPU, no triton, which compiles
    FlexAttention, or bf16 matmuls (`dtype`, resolved) without native bf16, where triton
    has none."""
    from retrain.hardware import compiler_missing, triton_lacks_bf16

    found = []
    if device_type == "cuda" and (missing := compiler_missing("cuda")):
        found.append(f"{missing} (it compiles FlexAttention)")
    if why := triton_lacks_bf16(dtype, device_type, index):
        found.append(f"bf16 matmuls ({why}; triton has none there)")
    return found


def flex_from(
    option: str, device_type: str, attention: str, model: str, blocked: list[str] | None = None
) -> int | None:
    """`[backend.options] attention` = `option` for a model with the `attention`
    implementation trained on `device_type` (`blocked`: its `blockers`): the row length
    from which a micro-batch runs through FlexAttention (0: always), or None (always the
    dense mask)."""
    cuda = device_type == "cuda"
    if option in ("dense", "varlen") or (
        option == "auto" and (not cuda or attention != "sdpa" or blocked)
    ):
        return None
    if not cuda:
        raise BackendError(
            f'[backend.options] attention = "flex" trains on {device_type}, but torch has no '
            'FlexAttention backward there (CUDA only). Fix: attention = "auto" or "dense"'
        )
    _refuse_for_the_model(option, attention, model, blocked)
    return 0 if option == "flex" else AUTO_FROM


def _refuse_for_the_model(
    option: str, attention: str, model: str, blocked: list[str] | None
) -> None:
    """BackendError when `attention = option` (flex or varlen: either replaces the SDPA
    attention) cannot run `model`: another attention implementation, or `blocked`."""
    if attention not in ("sdpa", NAME):
        raise BackendError(
            f'[backend.options] attention = "{option}" replaces SDPA attention, but {model} '
            f'uses {attention!r}. Fix: attention = "dense"'
        )
    if blocked:
        raise BackendError(
            f'[backend.options] attention = "{option}" cannot apply the {", ".join(blocked)} '
            f'of {model}. Fix: attention = "dense" (or "auto")'
        )


def varlen_chosen(
    option: str, device_type: str, attention: str, model: str, blocked: list[str], dtype: str
) -> bool:
    """Whether `[backend.options] attention = option` trains through flash attention's
    variable-length kernel (retrain/kernels/varlen.py) a model with the `attention`
    implementation on `device_type` in `dtype` ("bf16"/"fp32", resolved), `blocked` as
    in `blockers`; BackendError where it cannot. (Whether this GPU's kernel computes the
    rule, `varlen.check` asks the device once the model is there.)"""
    if option != "varlen":
        return False
    fix = 'Fix: attention = "auto"'
    if device_type != "cuda":
        raise BackendError(
            f'[backend.options] attention = "varlen" trains on {device_type}, but flash '
            f'attention\'s variable-length kernel is CUDA only. {fix} or "dense"'
        )
    _refuse_for_the_model(option, attention, model, blocked)
    if dtype != "bf16":
        raise BackendError(
            '[backend.options] attention = "varlen" runs flash attention, which has no '
            'float32 kernel, but the matmuls are fp32. Fix: [backend.options] dtype = "bf16", '
            'or attention = "auto"'
        )
    return True


# How triton says a kernel does not fit the GPU (shared memory, registers, ptxas); inductor
# wraps them, or reports "No valid triton configs" when every block size failed.
_BUILD_ERRORS = ("OutOfResources", "PTXASError", "NoTritonConfigsError")


def build_failed(error: BaseException) -> bool:
    """Whether `error` is torch.compile failing to build FlexAttention's kernels: dynamo's
    or inductor's error, or triton's that no block size fits the GPU. FlexAttention's
    backward for a head size of 128 or more has needed more shared memory than the 99 KiB
    a block gets on compute capability 8.6, 8.9 and 12.x cards (RTX 3090, 4090, A10G, L40:
    pytorch/pytorch issues 133254, 180278, 198224), depending on torch's version. A
    device-side error or running out of device memory is not one."""
    from torch._dynamo.exc import TorchDynamoException

    from retrain.kernels.compiled_blocks import device_error

    if device_error(error) is not None:  # dynamo wraps those too
        return False
    seen: set[int] = set()
    while error is not None and id(error) not in seen:  # the error, then what it wraps
        seen.add(id(error))
        if isinstance(error, TorchDynamoException) or type(error).__name__ in _BUILD_ERRORS:
            return True
        if isinstance(error, RuntimeError) and "No valid triton configs" in str(error):
            return True
        error = error.__cause__
    return False


def build_failure(error: BaseException, device: torch.device, head_dim: int) -> str:
    """What failed, for the option's message: the GPU, the model's head size, and the
    error's first line."""
    import torch

    where = str(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"
    return f"{where}, head size {head_dim}: {summary(error)}"


def _flex(query, key, value, mask: BlockMask, scale: float | None) -> torch.Tensor:
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if query.device.type == "cuda":  # eager FlexAttention materialises every score
        if not _compiled:
            _compiled.append(torch.compile(flex_attention))
        fn = _compiled[0]
    gqa = query.shape[1] != key.shape[1]
    return fn(query, key, value, block_mask=mask, scale=scale, enable_gqa=gqa)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: (batch, heads, L, head_dim) in, (batch, L,
    heads, head_dim) and no weights out."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(attention_mask, BlockMask):
        if attention_mask is not None and attention_mask.shape[-1] < key.shape[2]:
            # the static decoder's mask covers only the cache's filled prefix (its key
            # span, retrain/engines/static_decode.py): read only those keys and values
            span = attention_mask.shape[-1]
            key, value = key[:, :, :span], value[:, :, :span]
        if one_query(query, key, attention_mask, dropout, kwargs):
            return grouped_decode(query, key, value, attention_mask, scaling), None
        if masked_attention.applies(query, attention_mask, dropout, kwargs):
            return masked_attention.attend(query, key, value, attention_mask, scaling), None
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    # A sliding layer's window is in its block mask already (the masks are built per
    # layer type, retrain/kernels/windows.py); the rest `flex_from` or `varlen_chosen`
    # refused beforehand.
    from retrain.kernels import varlen

    option = "varlen" if isinstance(attention_mask, varlen.Mask) else "flex"
    unsupported = [k for k in ("softcap", "s_aux") if kwargs.get(k) is not None]
    if dropout or unsupported:
        what = ", ".join(unsupported + (["attention dropout"] if dropout else []))
        raise ValueError(
            f"[backend.options] attention = {option} does not apply this model's {what}. "
            'Fix: attention = "dense"'
        )
    if option == "varlen":
        return varlen.attend(query, key, value, attention_mask, scaling), None
    out = _flex(query, key, value, attention_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def one_query(query, key, mask, dropout, kwargs) -> bool:
    """Whether a call is a decode step `grouped_decode` computes exactly: one query
    position, a tensor mask, grouped-query heads, and nothing SDPA would add (soft-capping,
    sinks, dropout)."""
    return (
        query.shape[2] == 1
        and mask is not None
        and mask.dim() == 4
        and mask.shape[1] == mask.shape[2] == 1
        and query.shape[1] != key.shape[1]
        and not dropout
        and all(kwargs.get(k) is None for k in ("softcap", "s_aux"))
    )


def grouped_decode(query, key, value, mask, scaling) -> torch.Tensor:
    """Attention of one query position per row with grouped-query heads, without copying
    the keys and values per query head. transformers' SDPA path repeats the cache's keys
    and values for every query head whenever a mask is given (every decode step of a
    left-padded batch), a copy that grows with rows x cache length (~30% of a decode
    step's GPU time at 16 rows of 128 positions on an H100). Here the query heads of one
    key/value head become that head's queries (a query head h reads key/value head
    h // group, as the repeat lays them out), so SDPA reads each cached key once.
    (batch, heads, 1, head_dim) in, (batch, 1, heads, head_dim) out, like transformers'
    attention functions."""
    import torch

    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    mask = mask[:, :, :, : key.shape[2]]  # (rows, 1, 1, keys): one row for every head
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, mask, scale=scaling)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2)


def register() -> None:
    """Make `NAME` a transformers attention implementation (idempotent): this module's
    function, and SDPA's mask builder for the 2-D masks the sampler passes."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_flex(model) -> None:
    """Switch a transformers model (SDPA attention) to `NAME`."""
    register()
    model.set_attn_implementation(NAME)
