"""A small Qwen3 with a trained-looking LoRA adapter, as the local backend builds it
(optionally wholly bf16, as on a GPU), and a count of what its backward keeps: shared by
the tests of the bf16 adapter and of the recomputed element-wise parts."""

from __future__ import annotations

import torch
import transformers

from retrain.kernels.lora_layers import adapter_in_input_dtype, lean_lora_forward
from retrain.kernels.precision import bf16_weights
from retrain.kernels.recompute import recompute_elementwise

HIDDEN, INTER, HEADS, KV, HEAD_DIM, LAYERS, RANK, VOCAB = 64, 160, 4, 2, 16, 2, 8, 97


def qwen3_lora(
    bf16: bool,
    switch: bool = False,
    recompute: bool = False,
    lean: bool = False,
    attention_bias: bool = False,
    **lora,
):
    """The model wrapped in a LoRA adapter on every linear with B drawn (not zero): its
    weights bf16 (`bf16`) or the same values in float32; `switch`: the adapter computed
    in the input's dtype; `recompute`: norms and gated MLPs recomputed in the backward;
    `lean`: the LoRA linears' lean forward; with norm weights away from one, so a norm's
    weight matters; `attention_bias`: q/k/v/o with biases (drawn, as Qwen2's). `lora`:
    more LoraConfig fields (lora_alpha: 2 x the rank)."""
    from peft import LoraConfig, get_peft_model

    cfg = transformers.Qwen3Config(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HEAD_DIM,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        attention_bias=attention_bias,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    bf16_weights(model)
    if not bf16:  # the bf16 model's values, held in float32: the reference
        model.float()
    config = LoraConfig(
        **{"r": RANK, "lora_alpha": 2 * RANK, "target_modules": "all-linear", **lora}
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # a trained adapter: B is not zero
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    if lean:
        lean_lora_forward(peft_model)
    if switch:
        adapter_in_input_dtype(peft_model)
    if recompute:
        recompute_elementwise(peft_model)
    return peft_model


def saved_bytes(model, positions: int) -> int:
    """Bytes of the activations the backward of the blocks and final norm keeps
    (parameters and buffers left out) for one row of `positions` tokens."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.arange(positions)[None] % VOCAB
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_base_model().model(input_ids=ids)
    return sum(seen.values())


def per_position(model) -> int:
    """Saved bytes per position: the difference of two lengths cancels what does not
    grow with them (the bf16 casts of A and B)."""
    return (saved_bytes(model, 48) - saved_bytes(model, 16)) // 32
