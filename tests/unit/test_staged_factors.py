"""The trainer's bf16 LoRA operands staged between forward passes
(retrain/kernels/staged_factors.py): the outputs and gradients of the operands built per
call, to the bit, across optimizer steps, a resume's load, a factor replaced and a pass
under inference mode; copied once after the factors change and not otherwise; fewer
operators per pass."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from test_sibling_loras import wholly_bf16  # noqa: E402
from tiny_qwen3 import LAYERS, RANK, VOCAB  # noqa: E402

from retrain.kernels.lora_layers import lora_b, plain_lora_layers  # noqa: E402
from retrain.kernels.staged_factors import stage_factors  # noqa: E402


def trained(staged: bool, alpha: int = 12, fused: bool = False):
    """The tiny Qwen3 as the local backend trains it on a GPU (wholly bf16, lean forward,
    siblings fused), its factors staged or built per call, with its optimizer (`fused`:
    torch's fused AdamW, CUDA's)."""
    model, groups = wholly_bf16(fuse=True, lora_alpha=alpha)
    stage = stage_factors(model, groups) if staged else None
    params = [p for p in model.parameters() if p.requires_grad]
    return model, stage, torch.optim.AdamW(params, lr=1e-2, fused=fused)


def step(model, optimizer, seed: int):
    """One forward and backward of a random batch (the loss a random projection of the
    logits), then the optimizer's step, the factors' versions advanced after it as the
    local backend advances them (a fused AdamW does not): the logits and every gradient."""
    from torch.autograd.graph import increment_version

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 13), generator=gen)
    logits = model(input_ids=ids).logits.float()
    (logits * torch.randn(logits.shape, generator=gen)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    optimizer.step()
    increment_version([p for group in optimizer.param_groups for p in group["params"]])
    optimizer.zero_grad()
    return logits.detach(), grads


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def test_every_adapted_linear_is_staged_once():
    model, stage, _ = trained(staged=True)
    assert len(stage.units) == 4 * LAYERS  # q/k/v, gate/up, o and down in each block
    layers = {id(m) for u in stage.units for m in u.layers}
    assert layers == {id(m) for _, m in plain_lora_layers(model)}
    assert all(u.a.dtype == u.b.dtype == torch.bfloat16 for u in stage.units)


def test_the_memory_estimate_counts_what_is_staged():
    """retrain/memory.py counts the staged operands a GPU's trainer keeps (the estimate
    from the model's config, the bytes from the buffers), and nothing on a CPU."""
    from retrain.memory import Sizing, shape_from_config, staged_adapter_bytes

    model, stage, _ = trained(staged=True)
    shape = shape_from_config(model.get_base_model().config.to_dict())
    assert staged_adapter_bytes(shape, Sizing("cuda", "bf16", RANK, ())) == stage.nbytes()
    assert staged_adapter_bytes(shape, Sizing("cpu", "bf16", RANK, ())) == 0


@pytest.mark.parametrize(
    "alpha, fused", [(16, False), (12, False), (16, True)]
)  # scaling 2 (exact) and 1.5; CUDA's fused AdamW
def test_staged_operands_train_as_the_operands_built_per_call(alpha, fused):
    """Three optimizer steps: the logits and every gradient of each step to the bit. A
    staged copy left stale after a step would give the next step's logits of the old
    factors."""
    plain, _, plain_opt = trained(False, alpha, fused)
    model, stage, opt = trained(True, alpha, fused)
    for seed in range(3):
        assert same(step(model, opt, seed), step(plain, plain_opt, seed)), seed
    assert stage.refreshes == 3  # once per optimizer step, at the next forward pass


def test_the_factors_are_copied_only_after_they_change():
    """A second pass with the factors unchanged copies nothing and builds nothing: 15
    fewer operators a block than a pass that builds the operands per call (q/k/v 6,
    gate/up 5, o and down 2 each), and no foreach copy."""
    from op_count import OpCount

    ids = torch.arange(1, 12)[None] % VOCAB
    counts = {}
    for staged in (False, True):
        model, stage, _ = trained(staged)
        with torch.no_grad():
            model(input_ids=ids)  # the first pass copies (staged)
            with OpCount() as mode:
                model(input_ids=ids)
        counts[staged] = mode.seen
    assert stage.refreshes == 1
    assert counts[True]["_foreach_copy_"] == 0
    fewer = {op: counts[False][op] - counts[True][op] for op in counts[False]}
    assert fewer.pop("slice") == 2 * 5 * LAYERS  # views, no kernel: the 5 blocks of B
    # per block: the A's of q/k/v and of gate/up concatenated, a zeroed B for each set
    # with a copy per member (3 + 2), and the 7 casts of A and B (2 sets, 2 lone linears)
    assert {op: n for op, n in fewer.items() if n} == {
        "cat": 2 * LAYERS,
        "new_zeros": 2 * LAYERS,
        "copy_": 5 * LAYERS,
        "_to_copy": 6 * LAYERS,
    }
    assert counts[True]["set_"] == counts[False]["set_"] == 0  # stacked weights kept too


def test_a_factor_changed_in_place_or_replaced_is_copied_again():
    """An in-place change (a resume's load copies into the factors) and a factor replaced
    by another tensor both reach the next pass: its output is the per-call build's."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    (plain, _, _), (model, stage, _) = trained(False), trained(True)
    ids = torch.arange(1, 12)[None] % VOCAB

    def logits(m):
        with torch.no_grad():
            return m(input_ids=ids).logits

    assert torch.equal(logits(model), logits(plain))
    # a resume: every factor loaded in place from a state dict of other values
    state = {k: torch.randn_like(v) * 0.05 for k, v in get_peft_model_state_dict(plain).items()}
    for m in (plain, model):
        set_peft_model_state_dict(m, state)
    assert torch.equal(logits(model), logits(plain))
    assert stage.refreshes == 2
    # one factor replaced by another tensor
    for m in (plain, model):
        layer = plain_lora_layers(m)[5][1]
        lora_b(layer).weight = torch.nn.Parameter(lora_b(layer).weight.detach() + 0.5)
    assert torch.equal(logits(model), logits(plain))
    assert stage.refreshes == 3


def test_a_pass_under_inference_mode_leaves_nothing_a_backward_cannot_save():
    """The trainer's model sampling itself (under inference mode) first, and again right
    after an optimizer step: the factors are copied then, and the stacked base weights
    made then are not kept (inference tensors, which no backward may save), so the
    training passes that follow give the per-call build's logits and gradients."""
    (plain, _, plain_opt), (model, stage, opt) = trained(False), trained(True)
    ids = torch.arange(1, 12)[None] % VOCAB
    for seed in range(2):
        with torch.inference_mode():
            assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
        assert stage.refreshes == seed + 1
        assert same(step(model, opt, seed), step(plain, plain_opt, seed)), seed


def test_the_copies_that_share_their_strides_go_in_one_call():
    """CUDA's foreach copy runs a list in a few kernels only where every pair shares its
    sizes and strides, else one kernel per pair: the A's (rows of a stacked buffer) and a
    lone layer's B go in one call, 9 a block; the B's of a set (blocks of a
    block-diagonal buffer) in another, 5 a block. The sampler's refresh does the same."""
    from op_count import OpCount

    from retrain.engines.sampling_copy import SamplingCopy

    class Lists(OpCount):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_foreach_copy_":
                alike = {c.stride() == s.stride() for c, s in zip(args[0], args[1])}
                calls.append((len(args[0]), alike))
            return super().__torch_dispatch__(func, types, args, kwargs)

    model, stage, _ = trained(staged=True)
    calls = []
    with Lists():
        stage.refresh()
    assert calls == [(9 * LAYERS, {True}), (5 * LAYERS, {False})]
    copy = SamplingCopy.build(model, None)
    calls.clear()
    with Lists():
        copy.refresh()
    assert calls == [(9 * LAYERS, {True}), (5 * LAYERS, {False})]


def test_a_copy_of_the_model_builds_its_operands_per_call():
    """A deep copy (the sampling copy's start, split mode's model on the other device)
    takes no staged operands: neither a copy of the buffers (memory) nor the trained
    model's (another device); its layers build theirs per call and compute the same."""
    import copy
    import gc

    from retrain.kernels.staged_factors import StagedFactors

    def staged_factors() -> int:
        gc.collect()
        return sum(isinstance(o, StagedFactors) for o in gc.get_objects())

    model, stage, _ = trained(staged=True)
    ids = torch.arange(1, 12)[None] % VOCAB
    with torch.no_grad():
        model(input_ids=ids)  # the sets keep their stacked base weights
    before = staged_factors()
    twin = copy.deepcopy(model)
    assert staged_factors() == before
    for _, m in plain_lora_layers(twin):
        if hasattr(m, "sibling_of"):  # its set: the copy's members, nothing kept
            group = m.sibling_of[0]
            assert m in group.layers and group._base[1] is None
    copied = [m for _, m in plain_lora_layers(twin)]
    assert copied and all(m.__dict__.get("staged") is None for m in copied)
    assert all(
        g.__dict__.get("staged") is None
        for g in {m.sibling_of[0] for m in copied if hasattr(m, "sibling_of")}
    )
    with torch.no_grad():
        assert torch.equal(twin(input_ids=ids).logits, model(input_ids=ids).logits)
