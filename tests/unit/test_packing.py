"""Packed completions (retrain/kernels/packing.py): the mask and row bookkeeping worked by
hand, and the packed forward pass against one plain full forward per completion on a tiny
random Llama, for random completion lengths (1 token included), both attention kinds, and
with the logits kept whole or computed from the split-off output layer
(retrain/kernels/logprobs.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from retrain.kernels.logprobs import linear_head  # noqa: E402
from retrain.kernels.packing import (  # noqa: E402
    completion_logprobs,
    dense_mask,
    pack,
    padded_area,
    split,
)


def test_layout_worked_by_hand():
    # prompt [1, 2] with completions [7, 8, 9] and [5]; prompt [3] with completion [6, 4]
    groups = [([1, 2], [np.array([7, 8, 9]), np.array([5])]), ([3], [np.array([6, 4])])]
    packed = pack(groups, "bool")
    # one row per prompt: the prompt, then each completion without its last token
    assert packed.ids.tolist() == [[1, 2, 7, 8], [3, 6, 0, 0]]
    assert packed.positions.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]
    assert packed.mask[0, 0].int().tolist() == [
        [1, 0, 0, 0],  # the prompt: causal
        [1, 1, 0, 0],
        [1, 1, 1, 0],  # 7: its prompt and itself
        [1, 1, 1, 1],  # 8: its prompt, 7 and itself
    ]
    assert packed.mask[1, 0].int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],  # 6: its prompt and itself
        [0, 0, 1, 0],  # padding attends to itself only (never to real tokens)
        [0, 0, 0, 1],
    ]
    # logits kept (row-major): row 0 at 1 (prompt's last), 2 (7), 3 (8); row 1 at 0, 1 (6)
    assert packed.keep.int().tolist() == [[0, 1, 1, 1], [1, 1, 0, 0]]
    # 7 <- prompt 1's last, 8 <- 7, 9 <- 8, 5 <- prompt 1's last, 6 <- prompt 2's last, 4 <- 6
    assert packed.row.tolist() == [0, 1, 2, 0, 3, 4]
    assert packed.targets.tolist() == [7, 8, 9, 5, 6, 4]
    assert packed.lengths == (3, 1, 2)
    assert packed.slot(3).tolist() == [0, 1, 2, 3, 6, 7]


def test_completions_do_not_see_each_other():
    packed = pack([([1], [np.array([2, 3, 4]), np.array([5, 6])])], "bool")
    # row: prompt 1 | 2 3 | 5 ; the second completion's token (5) sees the prompt and itself
    assert packed.mask[0, 0, 3].int().tolist() == [1, 0, 0, 1]
    assert packed.positions.tolist() == [[0, 1, 2, 1]]


def _additive(packed, window=None):
    return dense_mask(packed.mask, packed.positions, window, "additive")


def test_additive_style_blocks_with_minus_infinity():
    packed = pack([([1], [np.array([2, 3]), np.array([4, 5])])], "additive")
    inf = float("-inf")
    assert _additive(packed)[0, 0].tolist() == [[0.0, inf, inf], [0.0, 0.0, inf], [0.0, inf, 0.0]]
    two = pack([([1, 2, 3], [np.array([4])]), ([5], [np.array([6])])], "additive")
    assert _additive(two)[1, 0, 1].tolist() == [inf, 0.0, inf]  # padding: itself only


def test_a_window_counts_positions_not_row_indices_worked_by_hand():
    """Prompt [1, 2] (positions 0, 1), completions fed [3, 4] and [5, 6] (positions 2, 3
    each). With a window of 2 a token sees itself and one position back: the second
    completion's first token (row index 4, position 2) sees the prompt's last token."""
    packed = pack([([1, 2], [np.array([3, 4, 9]), np.array([5, 6, 9])])], "bool")
    assert packed.positions[0].tolist() == [0, 1, 2, 3, 2, 3]
    seen = dense_mask(packed.mask, packed.positions, 2, "bool")[0, 0].int().tolist()
    assert seen == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]
    pad = pack([([1, 2, 3], [np.array([4])]), ([5], [np.array([6])])], "bool")
    assert dense_mask(pad.mask, pad.positions, 1, "bool")[1, 0, 1].tolist() == [
        False,
        True,
        False,
    ]  # a pad still sees itself


def test_rejects_empty_prompts_and_completions():
    with pytest.raises(ValueError, match="at least one token"):
        pack([([1], [np.array([1]), np.array([], dtype=np.int64)])], "bool")
    with pytest.raises(ValueError, match="at least one token"):
        pack([([], [np.array([1])])], "bool")


def test_split_worked_by_hand():
    a, b = [1] * 10, [2] * 4  # two prompts of 10 and 4 tokens
    # rows: a + 5 + 5 = 20 tokens (one row), then b adds a row of 4 + 3 = 7: 2 x 20 = 40
    assert split([(a, 6), (a, 6), (b, 4)], 40) == [3]
    assert split([(a, 6), (a, 6), (b, 4)], 39) == [2, 1]  # the second row would pad to 20
    # one group: a row of 10 + 5 per completion; over the budget it is split, its prompt
    # running again in each part
    assert split([(a, 6)] * 3, 25) == [3]
    assert split([(a, 6)] * 3, 20) == [2, 1]
    assert split([(a, 6)] * 3, 19) == [1, 1, 1]
    # an item alone over the budget still gets a micro-batch of its own
    assert split([(a, 30), (b, 2)], 8) == [1, 1]
    assert split([], 8) == []


def _area(items) -> int:
    """Rows x longest row of one micro-batch, from the packed layout itself."""
    groups: list = []
    for prompt, length in items:
        completion = np.arange(length) % 50
        if groups and groups[-1][0] == prompt:
            groups[-1][1].append(completion)
        else:
            groups.append((prompt, [completion]))
    return pack(groups, "bool").ids.numel()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30)), max_size=30),
    st.integers(1, 120),
)
def test_split_bounds_the_padded_layout_and_is_greedy(raw, budget):
    prompts = {k: [k + 1] * (3 + 5 * k) for k in range(4)}  # prompts of 3, 8, 13, 18 tokens
    items = [(prompts[k], length) for k, length in raw]
    sizes = split(items, budget)
    assert sum(sizes) == len(items) and all(s >= 1 for s in sizes)
    start = 0
    for size in sizes:
        chunk = items[start : start + size]
        start += size
        # what the forward pass computes stays within the budget, unless one item alone
        # is over it
        assert padded_area(chunk) == _area(chunk)
        assert size == 1 or _area(chunk) <= budget
        if start < len(items):  # greedy: the next item would not have fit
            assert _area([*chunk, items[start]]) > budget


def test_local_micro_batches_run_largest_first_and_keep_their_place():
    from types import SimpleNamespace

    from retrain.backends.local import LocalBackend

    a, b = [1] * 10, [2] * 4
    lengths = [(b, 3), (a, 6), (a, 6), (b, 9)]
    datums = [SimpleNamespace(prompt_ids=p, completion_ids=np.zeros(n)) for p, n in lengths]
    backend = SimpleNamespace(options=SimpleNamespace(micro_batch_tokens=20))
    chunks = LocalBackend._micro_batches(backend, datums)
    # split in order: [b 3] (area 6), [a 6, a 6] (20), [b 9] (12); run largest first
    assert [(first, len(chunk)) for first, chunk in chunks] == [(1, 2), (3, 1), (0, 1)]
    assert all(chunk == datums[first : first + len(chunk)] for first, chunk in chunks)


def _tiny_llama(attention: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attention,
    )
    model = LlamaForCausalLM(config).eval()
    model.lm_head.weight.requires_grad_(False)  # frozen, as under LoRA: it can be split off
    return model


MODELS = {}


def plain_logprobs(model, prompt, completion, temperature=1.0):
    """The reference: prompt + completion as one ordinary row."""
    logits = model(input_ids=torch.tensor([list(prompt) + completion.tolist()])).logits[0]
    logp = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.from_numpy(completion)[:, None]).squeeze(-1)


@settings(max_examples=25)
@given(
    shape=st.lists(
        st.tuples(st.integers(1, 6), st.lists(st.integers(1, 7), min_size=1, max_size=4)),
        min_size=1,
        max_size=3,
    ),
    attention=st.sampled_from(["sdpa", "eager"]),
    temperature=st.sampled_from([1.0, 0.7]),
    seed=st.integers(0, 2**16),
    split_head=st.booleans(),
)
def test_packed_equals_one_full_forward_per_completion(
    shape, attention, temperature, seed, split_head
):
    model = MODELS.setdefault(attention, _tiny_llama(attention))
    head = linear_head(model) if split_head else None
    assert (head is not None) == split_head
    rng = np.random.default_rng(seed)
    groups = [
        (rng.integers(0, 40, p).tolist(), [rng.integers(0, 40, k) for k in lengths])
        for p, lengths in shape
    ]
    style = {"sdpa": "bool", "eager": "additive"}[attention]
    with torch.no_grad():
        packed = completion_logprobs(model, groups, temperature, style, torch.device("cpu"), head)
        i = 0
        for prompt, completions in groups:
            for c in completions:
                plain = plain_logprobs(model, prompt, c, temperature)
                torch.testing.assert_close(packed[i, : len(c)], plain, atol=2e-5, rtol=0)
                assert torch.all(packed[i, len(c) :] == 0)  # right padding
                i += 1
    assert i == packed.shape[0]


@pytest.mark.parametrize("split_head", [False, True])
def test_gradients_match_the_plain_forward(split_head):
    """The packed path is differentiable like the plain one: same gradient of a weighted
    sum of logprobs with respect to every trained weight."""
    model = _tiny_llama("sdpa")
    head = linear_head(model) if split_head else None
    rng = np.random.default_rng(3)
    groups = [
        (rng.integers(0, 40, 5).tolist(), [rng.integers(0, 40, k) for k in (4, 1, 6)]),
        (rng.integers(0, 40, 2).tolist(), [rng.integers(0, 40, 3)]),
    ]
    pairs = [(prompt, c) for prompt, cs in groups for c in cs]
    weights = [torch.from_numpy(rng.normal(size=len(c))).float() for _, c in pairs]
    packed = completion_logprobs(model, groups, 1.0, "bool", torch.device("cpu"), head)
    sum(packed[i, : len(c)] @ w for i, ((_, c), w) in enumerate(zip(pairs, weights))).backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    got = [p.grad.clone() for p in trained]
    model.zero_grad()
    total = sum(plain_logprobs(model, prompt, c) @ w for (prompt, c), w in zip(pairs, weights))
    total.backward()
    for g, p in zip(got, trained):
        torch.testing.assert_close(g, p.grad, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpas_mask_made_once_gives_the_bool_masks_results_to_the_bit(dtype, monkeypatch):
    """The trainer hands SDPA its mask already additive in the queries' dtype
    (`packing.additive`), once for the pass: the logprobs and every gradient are those of
    the bool mask SDPA converts in each layer, bit for bit, and the backward keeps that
    one mask where the bool path keeps a converted copy per layer."""
    import retrain.kernels.packing as packing

    model = _tiny_llama("sdpa").to(dtype)
    rng = np.random.default_rng(5)
    groups = [
        (rng.integers(0, 40, 5).tolist(), [rng.integers(0, 40, k) for k in (4, 1, 6)]),
        (rng.integers(0, 40, 2).tolist(), [rng.integers(0, 40, 3)]),
    ]
    length = pack(groups, "bool").ids.shape[1]
    probe = torch.from_numpy(rng.normal(size=(4, 6))).float()

    def step():
        model.zero_grad()
        masks = set()

        def keep(t):
            if t.dim() == 4 and t.shape[-2:] == (length, length):
                masks.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            logp = completion_logprobs(model, groups, 1.0, "bool", torch.device("cpu"))
        (logp.float() * probe).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        return logp.detach(), grads, len(masks)

    once = step()
    monkeypatch.setattr(packing, "additive", lambda allowed, dtype: allowed)  # SDPA's own
    per_layer = step()
    assert torch.equal(once[0], per_layer[0])
    assert all(torch.equal(a, b) for a, b in zip(once[1], per_layer[1], strict=True))
    assert any(g.abs().max() > 0 for g in once[1])
    assert (once[2], per_layer[2]) == (1, model.config.num_hidden_layers)
