"""Sibling LoRA linears trained as one on a wholly bf16 model
(retrain/kernels/lora_layers.py `fuse_sibling_loras`): each layer's output and every
gradient as when each runs alone, the sampler's sum to the bit, the same bytes kept for
the backward, fewer operators, and nothing held after a failed pass."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from tiny_qwen3 import HIDDEN, LAYERS, VOCAB, per_position, qwen3_lora  # noqa: E402

from retrain.kernels.lora_layers import fuse_sibling_loras, plain_lora_layers  # noqa: E402


def wholly_bf16(fuse: bool, attention_bias: bool = False, **lora):
    """The tiny Qwen3 as the local backend trains it on a GPU: bf16, the adapter in the
    input's dtype, lean forward, element-wise parts recomputed; its siblings fused or not."""
    model = qwen3_lora(
        bf16=True, switch=True, recompute=True, lean=True, attention_bias=attention_bias, **lora
    )
    groups = fuse_sibling_loras(model) if fuse else []
    return model, groups


def forward_backward(model, seed: int = 7):
    """Logits and every LoRA factor's gradient for one packed row, the loss a random
    projection of the logits (every output element weighs in)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 19), generator=gen)
    logits = model(input_ids=ids).logits.float()
    probe = torch.randn(logits.shape, generator=gen)
    (logits * probe).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def test_every_set_of_siblings_becomes_one_group():
    model, groups = wholly_bf16(fuse=True)
    assert len(groups) == 2 * LAYERS  # q/k/v and gate/up in each block
    members = [len(g.layers) for g in groups]
    assert sorted(members) == [2] * LAYERS + [3] * LAYERS
    fused = {id(m) for g in groups for m in g.layers}
    alone = [n for n, layer in plain_lora_layers(model) if id(layer) not in fused]
    assert {n.rsplit(".", 1)[1] for n in alone} == {"o_proj", "down_proj"}


@pytest.mark.parametrize(
    "alpha, bias", [(16, False), (12, False), (12, True)]
)  # scaling 2 (exact) and 1.5; q/k/v with biases (Qwen2's)
def test_fused_siblings_give_each_layers_output_and_gradients(alpha, bias):
    """Stacked base weights, stacked A's and block-diagonal B's compute what each layer
    computes alone: the same logits to the bit, and every factor's gradient to the
    rounding of the bf16 backward (the input's gradient is one matmul over the members
    where it was three bf16 results added), as close to a float32 reference as the
    layers alone are. A B's block swapped, or a member's A read for another, moves a
    gradient by its whole size."""
    alone, _ = wholly_bf16(fuse=False, lora_alpha=alpha, attention_bias=bias)
    fused, groups = wholly_bf16(fuse=True, lora_alpha=alpha, attention_bias=bias)
    assert groups
    # the same values in float32
    reference = qwen3_lora(bf16=False, lora_alpha=alpha, attention_bias=bias)
    want_logits, want = forward_backward(alone)
    got_logits, got = forward_backward(fused)
    _, exact = forward_backward(reference)
    assert want.keys() == got.keys() == exact.keys() and len(want) == 2 * 7 * LAYERS
    assert torch.equal(got_logits, want_logits)

    def error(grads, name):
        return float((grads[name] - exact[name]).norm() / exact[name].norm())

    for name, grad in want.items():
        assert grad.norm() > 0, name
        assert (got[name] - grad).norm() < 2.0**-6 * grad.norm(), name  # measured <= 1.2%
    mean = {
        k: sum(error(g, n) for n in exact) / len(exact)
        for k, g in (("alone", want), ("fused", got))
    }
    assert mean["fused"] < 1.05 * mean["alone"], mean  # measured 2.47% and 2.47%


def test_fused_siblings_round_as_the_sampling_copy_does():
    """The trainer's fused siblings and the sampler's (`Siblings`) run the same matmuls
    on the same bf16 operands: the same output to the bit."""
    from retrain.engines.sampling_copy import SamplingCopy, Sibling

    model, groups = wholly_bf16(fuse=True, lora_alpha=12)
    copy = SamplingCopy.build(model, None)
    copy.refresh()
    blocks = model.get_base_model().model.layers
    copied = copy.model.model.layers
    gen = torch.Generator().manual_seed(3)
    checked = 0
    with torch.no_grad():
        for block, twin in zip(blocks, copied):
            for part, names in ((block.self_attn, "qkv"), (block.mlp, ("gate", "up"))):
                other = twin.self_attn if names == "qkv" else twin.mlp
                x = torch.randn(2, 5, HIDDEN, generator=gen).bfloat16()
                for name in names:
                    attr = f"{name}_proj"
                    assert isinstance(getattr(other, attr), Sibling)
                    assert torch.equal(getattr(part, attr)(x), getattr(other, attr)(x))
                    checked += 1
    assert checked == 5 * LAYERS


def test_fused_siblings_keep_the_same_bytes_for_the_backward():
    """The one input per set of siblings and a bf16 x A^T per member, stacked: no more
    bytes per position than the layers alone keep."""
    assert per_position(wholly_bf16(fuse=True)[0]) == per_position(wholly_bf16(fuse=False)[0])


def test_fused_siblings_dispatch_fewer_operators():
    """A forward and backward of the model: q/k/v's nine forward matmuls become three,
    gate/up's six three, and the operators over all (views too) drop by a tenth."""
    from op_count import OpCount

    counts = {}
    for fuse in (False, True):
        model, _ = wholly_bf16(fuse=fuse)
        ids = torch.arange(12)[None] % VOCAB
        with OpCount() as mode:
            model(input_ids=ids).logits.float().sum().backward()
        counts[fuse] = mode.seen
    products = {f: sum(counts[f][k] for k in ("mm", "addmm", "addmm_")) for f in (False, True)}
    # A block: forward 3 matmuls per adapted linear (7 of them: 21) -> 3 per group and
    # per single (2 + 2: 12); backward x A^T's and A's gradients and x's (2) per linear
    # (35) -> the same per group plus B's gradient per member (7 + 6) and 5 per single
    # (23). The first block's q/k/v input needs no gradient (the embeddings are frozen):
    # 6 matmuls alone, 2 fused. The output layer: 2 either way.
    assert products[False] == LAYERS * (21 + 35) - 6 + 2
    assert products[True] == LAYERS * (12 + 23) - 2 + 2
    assert sum(counts[True].values()) < 0.9 * sum(counts[False].values())  # 900 vs 1028


def test_a_pass_that_failed_between_siblings_leaves_nothing_held():
    """Outputs computed for siblings not yet asked (an out-of-memory error between q and
    k) are held until `forget`; a member given another input computes afresh, what the
    layer computes alone."""
    alone, _ = wholly_bf16(fuse=False)
    model, groups = wholly_bf16(fuse=True)
    group = next(g for g in groups if len(g.layers) == 3)
    q, k, _ = group.layers
    twin = alone.get_base_model().model.layers[0].self_attn.k_proj
    gen = torch.Generator().manual_seed(2)
    x, y = (torch.randn(1, 4, HIDDEN, generator=gen).bfloat16() for _ in range(2))
    with torch.no_grad():
        q(x)
        assert set(group._pending) == {1, 2} and group._input is x  # k's and v's
        group.forget()
        assert not group._pending and group._input is None
        assert torch.equal(k(y), twin(y))
        assert set(group._pending) == {0, 2} and group._input is y  # q's and v's, for y


def test_on_cuda_fused_siblings_take_the_float32_result_path(monkeypatch, meta_addmm):
    """The CUDA branch (bf16 operands into float32 results, which this CPU cannot run)
    of three siblings, traced on the meta device: one product each for x A^T, x W^T and
    B's (added into the float32 sum), each member's output bf16 of its own width, and
    the gradients of x in bf16 and of every A and B in float32 of its shape."""
    import retrain.kernels.precision as precision
    from retrain.kernels.lora_layers import _RoundOnce

    monkeypatch.setattr(precision, "f32_out_matmul", lambda device_type: True)
    meta = {"device": "meta"}
    widths, rank = (64, 32, 32), 8
    x = torch.empty(40, 96, dtype=torch.bfloat16, **meta).requires_grad_()
    w = torch.empty(sum(widths), 96, dtype=torch.bfloat16, **meta)
    a = [torch.empty(rank, 96, **meta).requires_grad_() for _ in widths]
    b = [torch.empty(n, rank, **meta).requires_grad_() for n in widths]
    outs = _RoundOnce.apply(x, w, None, 1.5, None, *a, *b)
    assert [(o.dtype, tuple(o.shape)) for o in outs] == [(torch.bfloat16, (40, n)) for n in widths]
    sum(o.float().sum() for o in outs).backward()
    assert (x.grad.dtype, x.grad.shape) == (torch.bfloat16, x.shape)
    for factor in (*a, *b):
        assert (factor.grad.dtype, factor.grad.shape) == (torch.float32, factor.shape)


def test_with_activation_checkpointing_fused_siblings_give_the_same_gradients(monkeypatch):
    """Each block recomputed in the backward (`checkpointing = true`, non-reentrant): the
    siblings run again on the recomputed input (twice the computations) and the
    gradients are the ones without checkpointing, to the bit."""
    from retrain.backends.local import _checkpoint_activations
    from retrain.kernels.lora_layers import _RoundOnce

    runs = []
    real = _RoundOnce.forward
    monkeypatch.setattr(_RoundOnce, "forward", lambda *a: runs.append(1) or real(*a))
    plain, _ = wholly_bf16(fuse=True)
    checkpointed, _ = wholly_bf16(fuse=True)
    _checkpoint_activations(checkpointed)
    checkpointed.train()
    plain.train()
    runs.clear()  # building ran some (the recomputed parts' probes)
    want_logits, want = forward_backward(plain)
    once = len(runs)
    got_logits, got = forward_backward(checkpointed)
    assert once == 4 * LAYERS and len(runs) - once == 2 * once  # 2 sets and 2 singles a block
    assert torch.equal(got_logits, want_logits)
    assert want.keys() == got.keys()
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


@pytest.mark.parametrize("scaling", [1.0, 2.0, 4.0, 1.5, 0.5])
@pytest.mark.parametrize("widths", [(24,), (24, 8, 8)])
def test_the_backward_is_the_plain_lora_backward_to_the_bit(scaling, widths):
    """One LoRA linear, or three siblings, on random rows: every gradient the plain
    formulas give, to the bit (B's: each member's grad^T (x A^T) times the scaling; A's
    from bf16(grad B x scaling); x's: grad W + that A), whether the backward scales the
    gradient once before the products (a power of two >= 1, where that is exact) or each
    product after (1.5, 0.5). A scaling applied twice, or not at all, misses by 2x."""
    from retrain.kernels.lora_layers import _RoundOnce
    from retrain.kernels.precision import mm_f32

    gen = torch.Generator().manual_seed(5)

    def draw(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    rank, rows, width = 4, 10, 16
    x = draw(rows, width).bfloat16().requires_grad_()
    w = draw(sum(widths), width, scale=0.2).bfloat16()
    a = [draw(rank, width, scale=0.3).requires_grad_() for _ in widths]
    b = [draw(n, rank, scale=0.3).requires_grad_() for n in widths]
    outs = _RoundOnce.apply(x, w, None, scaling, None, *a, *b)
    outs = (outs,) if len(widths) == 1 else outs
    probes = [draw(*o.shape).bfloat16() for o in outs]
    torch.autograd.backward(outs, probes)

    stacked_a = torch.cat(a).bfloat16()
    block_b = torch.block_diag(*b).bfloat16()
    h = mm_f32(x.detach(), stacked_a.t()).bfloat16()
    grad = torch.cat(probes, dim=1)
    mids = h.split(rank, dim=1)
    for g, mid, factor in zip(probes, mids, b):
        assert torch.equal(factor.grad, mm_f32(g.t(), mid) * scaling)
    gh = (mm_f32(grad, block_b) * scaling).bfloat16()
    for got, want in zip(a, mm_f32(gh.t(), x.detach()).split(rank)):
        assert torch.equal(got.grad, want)
    assert torch.equal(x.grad, torch.addmm(torch.mm(grad, w), gh, stacked_a))
