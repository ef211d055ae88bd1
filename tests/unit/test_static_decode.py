"""The static-cache decoder (retrain/engines/static_decode.py) against the dynamic one it
replaces on CUDA: the same tokens from the same uniforms and float32 logprobs within 1e-5,
for every row (different prompt lengths: left padding; rows that stop early: masked, not
removed), with top-p, at temperature 0, with entropies, with the eager attention's
additive mask, and with the rows padded up to a bucket as the graphs decode them. The
compiled step (`decode = "compiled"`) against the eager one, and its fallback when
compiling fails."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from retrain.engines.draw import uniforms  # noqa: E402
from retrain.engines.pytorch import PyTorchEngine  # noqa: E402
from retrain.engines.static_decode import (  # noqa: E402
    StaticDecoder,
    prefill_mask,
    row_bucket,
    rows_within,
)
from retrain.errors import BackendError  # noqa: E402
from retrain.hardware import compiler_missing  # noqa: E402
from retrain.types import SamplingParams  # noqa: E402

# decode = "compiled" on a CPU: inductor writes C++ (the config's check refuses it without)
needs_compiler = pytest.mark.skipif(
    compiler_missing("cpu") is not None, reason=str(compiler_missing("cpu"))
)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]
EOS = 3


def tiny_model(attention: str = "sdpa", seed: int = 0, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation=attention,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # make eos likely enough that some rows stop early
        model.lm_head.bias = None
        model.lm_head.weight[EOS] += 0.6 * model.lm_head.weight.mean(0)
    return model


def engines(model, decode: str, **kw) -> PyTorchEngine:
    return PyTorchEngine(
        model, {EOS}, 0, torch.device("cpu"), sampling_copy=False, decode=decode, **kw
    )


def sample_both(model, params: SamplingParams, n: int = 4, **kw):
    out = {}
    for decode in ("dynamic", "static"):
        out[decode] = engines(model, decode, **kw).sample(PROMPTS, n, params)
    return out["dynamic"], out["static"]


def assert_same(dynamic, static, *, entropies: bool = False):
    lengths = []
    for group_d, group_s in zip(dynamic, static, strict=True):
        for d, s in zip(group_d, group_s, strict=True):
            assert d.token_ids.tolist() == s.token_ids.tolist()
            assert d.stop_reason == s.stop_reason
            assert abs(d.logprobs - s.logprobs).max(initial=0.0) < 1e-5
            if entropies:
                assert abs(d.entropies - s.entropies).max(initial=0.0) < 1e-5
            lengths.append(len(d))
    return lengths


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_static_draws_what_dynamic_draws(top_p):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=top_p, seed=4)
    lengths = assert_same(*sample_both(tiny_model(), params))
    # the check covers rows that stopped early (masked, not removed) and rows that ran out
    assert min(lengths) < 12 and max(lengths) == 12


def test_greedy_and_entropies_agree():
    params = SamplingParams(max_tokens=10, temperature=0.0, seed=1, return_entropy=True)
    assert_same(*sample_both(tiny_model(seed=2), params), entropies=True)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=2, return_entropy=True)
    assert_same(*sample_both(tiny_model(seed=2), params), entropies=True)


def test_eager_attention_takes_the_additive_mask():
    params = SamplingParams(max_tokens=9, temperature=1.0, seed=7)
    assert_same(*sample_both(tiny_model("eager", seed=3), params))


def test_rows_padded_to_a_bucket_decode_the_same():
    """The graphs decode a power-of-two number of rows: filler rows must not change the
    real rows (the same decoder, told to pad as it does with graphs)."""
    model = tiny_model(seed=5)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9)
    rows = [p for p in PROMPTS for _ in range(3)]  # 9 rows -> bucket 16
    assert row_bucket(9) == 16 and row_bucket(3) == 8 and row_bucket(64) == 64
    u = uniforms(len(rows), params.max_tokens, torch.Generator().manual_seed(9))
    plain = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
    padded = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
    padded.graphs = True  # bucketed rows and lengths, without capturing (CPU)
    padded._graphs = lambda *a, **k: None
    a = plain.decode(model, rows, params, u)
    b = padded.decode(model, rows, params, u)
    assert a.tokens.shape[0] == b.tokens.shape[0] == 9
    assert torch.equal(a.lengths, b.lengths) and torch.equal(a.finished, b.finished)
    for r in range(9):
        n = int(a.lengths[r])
        assert torch.equal(a.tokens[r, :n], b.tokens[r, :n])
        assert torch.allclose(a.logprobs[r, :n], b.logprobs[r, :n], atol=1e-5)


def ops_a_layer_adds() -> dict[str, int]:
    """The operators (each a kernel on a GPU) one more layer adds to a decode step, by
    name: a step of a 3-layer model's counts less a 2-layer model's."""
    from op_count import OpCount

    params = SamplingParams(max_tokens=4, temperature=1.0)
    counted = []
    for layers in (2, 3):
        model = tiny_model(layers=layers)
        decoder = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
        cache, step = decoder._buffers(model, len(PROMPTS), 12)
        decoder._prefill(model, cache, step, PROMPTS, 7, 12)
        with torch.no_grad(), OpCount() as ops:
            decoder._step(model, cache, step, params, 12)
        counted.append(ops.seen)
    return counted[1] - counted[0]


def test_the_steps_attention_mask_is_made_once_not_once_a_layer():
    """SDPA turns a bool mask into an additive one in every layer it is given to (three
    kernels each: on CUDA a decode step's kernels, each with its launch and tail, set the
    pace); the decoder hands it the additive mask, made once a step, so a layer more adds
    no mask kernels."""
    per_layer = ops_a_layer_adds()
    assert (
        per_layer["scaled_dot_product_attention"]
        + per_layer["_scaled_dot_product_flash_attention_for_cpu"]
        == 1
    )  # the extra layer's attention, counted
    assert not {"where", "scalar_tensor", "masked_fill_", "logical_not"} & set(per_layer)


def test_a_layer_writes_its_keys_where_the_step_says_and_counts_nothing(monkeypatch):
    """transformers' StaticLayer works out its write position in every layer (an arange,
    an add and an in-place add of its count); the decoder's cache layers write at the
    position it sets once a step (retrain/kernels/static_cache.py): a layer more adds its
    two index copies and no position arithmetic, and the cache ends up holding exactly
    what transformers' own layers write, so the same tokens and logprobs come out."""
    from retrain.engines import static_decode
    from retrain.kernels.static_cache import PLAIN

    per_layer = ops_a_layer_adds()
    assert per_layer["index_copy_"] == 2
    assert per_layer["arange"] == per_layer["add_"] == 0
    assert per_layer["add"] == 6  # two residual adds, two rotary adds, two norm epsilons

    def transformers_own(model, length, writes):  # each layer counting for itself
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        cache = StaticCache(config=model.config, max_cache_len=length)
        assert all(type(layer) in PLAIN for layer in cache.layers)
        cache.layers = [StaticLayer(max_cache_len=length) for _ in cache.layers]
        return cache

    model = tiny_model(seed=6)
    params = SamplingParams(max_tokens=9, temperature=1.0, seed=3)
    u = uniforms(len(PROMPTS), params.max_tokens, torch.Generator().manual_seed(3))
    out, caches = [], []
    for make in (static_decode.full_length_cache, transformers_own):
        monkeypatch.setattr(static_decode, "full_length_cache", make)
        decoder = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
        decoder.keep = True  # to look at the cache afterwards
        out.append(decoder.decode(model, PROMPTS, params, u))
        ((cache, _),) = decoder._shapes.values()
        caches.append(cache)
    ours, theirs = out
    assert ours.tokens.shape[1] == params.max_tokens  # every step ran
    assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.logprobs, theirs.logprobs)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # what was filled: the longest prompt (7) and the tokens fed after it (all but the last)
    filled = max(map(len, PROMPTS)) + params.max_tokens - 1
    assert int(caches[0].get_seq_length()) == filled - 1  # the last step's, before its write
    assert int(caches[1].get_seq_length()) == filled


def test_a_step_reads_only_the_cache_positions_that_hold_keys(monkeypatch):
    """With retrain's attention (flex.NAME, the local backend's on CUDA) a step reads the
    cache's filled prefix rounded up to the decoder's length step, not the whole cache:
    the keys that reach SDPA grow with the tokens decoded (here in steps of 4, up to the
    19-position cache), and what is drawn is what the dynamic decoder and the static one
    reading the whole cache draw."""
    from retrain.engines.static_decode import key_span
    from retrain.kernels import flex

    assert [key_span(f, 19, 4) for f in (1, 4, 5, 8, 9, 17, 19)] == [4, 4, 8, 8, 12, 19, 19]
    assert key_span(100, 384) == 128 and key_span(129, 384) == 256 and key_span(300, 384) == 384
    read: list[int] = []
    grouped = flex.grouped_decode

    def counted(query, key, value, mask, scaling):
        read.append(key.shape[2])
        return grouped(query, key, value, mask, scaling)

    monkeypatch.setattr(flex, "grouped_decode", counted)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=4, return_entropy=True)
    model = tiny_model(seed=1)
    whole = engines(model, "static")
    want = whole.sample(PROMPTS, 4, params)
    assert read == []  # SDPA attention: transformers' repeat-then-SDPA path, whole cache
    dynamic = engines(model, "dynamic").sample(PROMPTS, 4, params)
    flex.use_flex(model)
    spans = engines(model, "static")
    spans.static.length_step = 4
    got = spans.sample(PROMPTS, 4, params)
    lengths = assert_same(want, got, entropies=True)
    assert_same(dynamic, got, entropies=True)
    assert max(lengths) == 12  # every step ran: 12 rows, the longest prompt 7 positions
    # the step at t reads key_span(7 + t + 1): 8, then 12 x 4, 16 x 4, 19 x 2; two layers
    assert read[::2] == read[1::2] == [8, 12, 12, 12, 12, 16, 16, 16, 16, 19, 19]


def test_with_graphs_a_call_captures_a_graph_per_key_span_before_its_prefill():
    """The graphs of a call, one per key span its steps read, are captured before the
    prefill (a capture's warm-up writes into the cache), and each step replays the graph
    of its span: here a stand-in graph that runs the real step (no CUDA on a CPU; the
    real capture runs in tests/integration/test_gpu.py), so what is drawn must be what
    the same decoder draws uncaptured. A second call of the same shape whose prompts are
    shorter reads fewer spans, all captured already."""
    from retrain.kernels import flex

    model = tiny_model(seed=2)
    flex.use_flex(model)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=8)
    events: list = []
    decoder = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
    decoder.graphs = decoder.keep = True  # refused off CUDA at construction
    decoder.length_step = 4

    class Graph:
        def __init__(self, model, cache, step, params, span):
            events.append(("capture", span))
            self.replay = lambda: (
                events.append(("replay", span)),
                decoder._run_step(model, cache, step, params, span),
            )

    decoder._capture = Graph
    prefill = decoder._prefill
    decoder._prefill = lambda *a: (events.append("prefill"), prefill(*a))[1]
    plain = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
    plain.graphs, plain.length_step = True, 4  # the same buckets, lengths and spans
    plain._graphs = lambda *a, **k: None
    shorter = [[5, 6, 7, 8, 9], [12, 13], [20, 21, 22]]
    for prompts in (PROMPTS, shorter):  # longest prompt 7, then 5: a cache of 20 both times
        rows = [p for p in prompts for _ in range(4)]
        u = uniforms(len(rows), params.max_tokens, torch.Generator().manual_seed(8))
        events.clear()
        got = decoder.decode(model, rows, params, u)
        want = plain.decode(model, rows, params, u)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)
        assert torch.equal(got.lengths, want.lengths)
        replayed = [span for kind, span in events[events.index("prefill") + 1 :]]
        assert replayed == sorted(replayed) and len(replayed) == got.tokens.shape[1] - 1
        if prompts is PROMPTS:  # 12 rows -> 16; cache 7 + 12 -> 20: spans 8, 12, 16, 20
            assert events[:5] == [("capture", s) for s in (8, 12, 16, 20)] + ["prefill"]
            assert set(replayed) == {8, 12, 16, 20}
        else:  # positions 6 to 16 filled: spans 8, 12 and 16
            assert events[0] == "prefill" and set(replayed) == {8, 12, 16}
    assert sorted(k[:3] for k in decoder._captured) == [(16, 20, s) for s in (8, 12, 16, 20)]


def test_kept_caches_are_reused_counted_and_released():
    """With graphs the decoder keeps each shape's cache between calls (a captured graph
    holds its addresses); `release` gives them back and the next call starts afresh with
    the same draws."""
    model = tiny_model(seed=5)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9)
    u = uniforms(len(PROMPTS), params.max_tokens, torch.Generator().manual_seed(9))
    decoder = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
    assert not decoder.keep  # without graphs nothing is kept
    decoder.decode(model, PROMPTS, params, u)
    assert decoder.kept_bytes() == 0
    decoder.keep = True
    first = decoder.decode(model, PROMPTS, params, u)
    ((cache, _),) = decoder._shapes.values()
    length = max(map(len, PROMPTS)) + params.max_tokens
    cfg = model.config
    per_layer = 2 * len(PROMPTS) * cfg.num_key_value_heads * length * cfg.head_dim * 4
    assert decoder.kept_bytes() == cfg.num_hidden_layers * per_layer  # keys and values, float32
    decoder.decode(model, PROMPTS, params, u)
    assert next(iter(decoder._shapes.values()))[0] is cache  # the same shape reuses it
    assert decoder.release() == cfg.num_hidden_layers * per_layer
    assert decoder.kept_bytes() == 0 and not decoder._captured
    again = decoder.decode(model, PROMPTS, params, u)
    assert next(iter(decoder._shapes.values()))[0] is not cache
    assert torch.equal(again.tokens, first.tokens)
    assert torch.equal(again.logprobs, first.logprobs)


def test_the_prefill_mask_never_lets_a_real_token_see_a_pad():
    key_valid = torch.tensor([[False, False, True, True, False], [True, True, True, True, False]])
    mask = prefill_mask(key_valid, 4)[:, 0]  # (R, 4 queries, 5 keys)
    # row 0: two pads, then two real tokens; a pad sees itself only
    assert mask[0, 0].tolist() == [True, False, False, False, False]
    assert mask[0, 1].tolist() == [False, True, False, False, False]
    assert mask[0, 3].tolist() == [False, False, True, True, False]
    # row 1: causal over real tokens, never the decode slot beyond the prompt
    assert mask[1, 2].tolist() == [True, True, True, False, False]


def test_graphs_are_refused_off_cuda():
    from retrain.errors import BackendError

    with pytest.raises(BackendError, match="CUDA graphs need a CUDA device"):
        StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"), graphs=True)


def test_on_cuda_the_rows_decoded_at_once_follow_the_free_memory(monkeypatch):
    """The engine's row budget on CUDA comes from the free memory and the model's KV size
    (retrain.memory.decode_row_budget), not the CPU's 64; elsewhere it is the CPU's."""
    from retrain.memory import GIB, SAMPLE_ROWS, decode_row_budget, shape_from_config

    model = tiny_model()
    params = SamplingParams(max_tokens=30, temperature=1.0)
    cpu = engines(model, "dynamic")
    assert cpu._row_budget(model, PROMPTS, params) is None  # decoding_batches' SAMPLE_ROWS
    gpu = PyTorchEngine(model, {EOS}, 0, torch.device("cuda"), sampling_copy=False)
    free = {"bytes": 2 * GIB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 80 * GIB))
    shape = shape_from_config(model.config.to_dict())
    want = decode_row_budget(
        device_kind="cuda",
        free_bytes=2 * GIB,
        kv_bytes_per_token=shape.kv_bytes_per_token(),
        logit_bytes_per_row=shape.logit_bytes_per_row(),
        max_len=7 + 30,  # the longest prompt + max_tokens
    )
    assert gpu._row_budget(model, PROMPTS, params) == want > SAMPLE_ROWS
    free["bytes"] = GIB // 1024
    assert gpu._row_budget(model, PROMPTS, params) < want
    # memory torch's allocator keeps reserved but unused (after a training step) counts
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: GIB // 1024)
    assert gpu._row_budget(model, PROMPTS, params) == want


def test_rows_within_a_budget_stay_within_it_once_padded_to_their_bucket():
    assert [rows_within(b) for b in (1, 7, 8, 9, 15, 16, 17, 100, 128, 255)] == [
        1, 7, 8, 8, 8, 16, 16, 64, 128, 128,
    ]  # fmt: skip
    for budget in range(8, 600):
        rows = rows_within(budget)
        assert row_bucket(rows) <= budget < row_bucket(rows + 1)  # the most that fit


def test_with_graphs_the_row_budget_counts_buckets_rounded_lengths_and_kept_caches(monkeypatch):
    """The graphs decode a power-of-two bucket of rows over a length rounded up to 128:
    the budget is of those, so a batch's padded cache stays within the free memory; the
    kept caches count as free (the decoder gives them back for a shape that needs their
    room)."""
    from retrain.memory import GIB, decode_row_budget, shape_from_config

    model = tiny_model()
    params = SamplingParams(max_tokens=30, temperature=1.0)
    gpu = PyTorchEngine(model, {EOS}, 0, torch.device("cuda"), sampling_copy=False)
    gpu.static = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
    gpu.static.graphs = True  # as on CUDA: bucketed rows, rounded lengths
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (GIB // 700, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    shape = shape_from_config(model.config.to_dict())

    def budget(free: int) -> int:
        return decode_row_budget(
            device_kind="cuda",
            free_bytes=free,
            kv_bytes_per_token=shape.kv_bytes_per_token(),
            logit_bytes_per_row=shape.logit_bytes_per_row(),
            max_len=128,  # 7 + 30, rounded up
        )

    assert budget(GIB // 700) not in (8, 16, 32, 64, 128)  # so the rounding shows
    assert gpu._row_budget(model, PROMPTS, params) == rows_within(budget(GIB // 700))
    monkeypatch.setattr(gpu.static, "kept_bytes", lambda: GIB // 700)
    assert gpu._row_budget(model, PROMPTS, params) == rows_within(budget(2 * (GIB // 700)))
    # the graphs' pool's unused memory is not free: no new tensor goes there
    gpu.static._pool = (0, 7)
    idle = {"device": 0, "segment_pool_id": (0, 7), "total_size": 2 * (GIB // 700)}
    monkeypatch.setattr(
        torch.cuda, "memory_snapshot", lambda pool, include_traces: [{**idle, "allocated_size": 0}]
    )
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 * (GIB // 700))
    monkeypatch.setattr(torch.cuda._utils, "_get_device_index", lambda device, optional: 0)
    assert gpu._row_budget(model, PROMPTS, params) == rows_within(budget(2 * (GIB // 700)))


def test_a_new_shape_that_does_not_fit_beside_the_kept_caches_has_them_released():
    """With graphs the decoder keeps each shape's cache; a new shape whose cache fits the
    free memory is added beside them, one that does not has them given back first."""
    model = tiny_model(seed=5)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9)
    free = {"bytes": 1 << 40}
    decoder = StaticDecoder(
        eos_ids=[EOS], pad_id=0, device=torch.device("cpu"), free_bytes=lambda: free["bytes"]
    )
    decoder.keep = True

    def decode(prompts):
        u = uniforms(len(prompts), params.max_tokens, torch.Generator().manual_seed(9))
        return decoder.decode(model, prompts, params, u)

    decode(PROMPTS)
    first = decoder.kept_bytes()
    decode(PROMPTS[:2])  # another shape: fits beside
    assert len(decoder._shapes) == 2 and decoder.kept_bytes() > first
    free["bytes"] = first // 2  # a third shape's cache does not fit beside the kept two
    third = decode(PROMPTS * 2)
    assert list(decoder._shapes) == [(6, 7 + 8)]
    alone = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
    u = uniforms(6, params.max_tokens, torch.Generator().manual_seed(9))
    want = alone.decode(model, PROMPTS * 2, params, u)
    assert torch.equal(third.tokens, want.tokens) and torch.equal(third.logprobs, want.logprobs)
    unknown = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
    unknown.keep = True  # the free memory unknown (not CUDA): a new shape takes the room
    decoder = unknown
    decode(PROMPTS)
    decode(PROMPTS[:2])
    assert list(unknown._shapes) == [(2, 7 + 8)]


def _cuda_stand_ins(monkeypatch, current, set_stream, stream_class, graph) -> None:
    """torch.cuda's stream and graph calls, standing in on a CPU for a capture's path (a
    fake only for what a CPU lacks): the thread's stream `current`, `set_stream` and
    `graph` (torch.cuda.graph's signature) as given, devices and streams as no-ops."""
    import contextlib

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(cuda, "set_stream", set_stream)
    monkeypatch.setattr(cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(cuda, "Stream", stream_class)
    monkeypatch.setattr(cuda, "CUDAGraph", object)
    monkeypatch.setattr(cuda, "graph", graph)


def test_a_failed_capture_decodes_eagerly_and_uncompiled_on_the_stream_it_was_on(monkeypatch):
    """No CUDA here: torch.cuda's stream and graph calls stand in (a fake only for what a
    CPU lacks; the real capture runs in tests/integration/test_gpu.py), the warm-up runs
    the real step. A capture that fails (here as one does when another thread calls an
    unsafe CUDA function under the "global" mode) was asked for this thread only, leaves
    the thread on its own stream, and drops a compiled step (it may be what failed, at
    run time); the rows decode eagerly, as a plain decoder draws them."""

    calls: list = []

    class Side:
        def __init__(self, device=None):
            calls.append(("stream on", device))

        def wait_stream(self, other):
            pass

    mine = object.__new__(Side)  # the thread's stream before the capture

    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        calls.append(("capture", capture_error_mode, type(stream)))
        raise RuntimeError("operation not permitted when stream is capturing")

    def back(stream):
        calls.append(("back to", stream))

    _cuda_stand_ins(monkeypatch, mine, back, Side, graph)
    ended: list = []  # the allocator's routing into the pool, ended after the failure
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda *a: ended.append(a))
    model = tiny_model(seed=5)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9)
    u = uniforms(len(PROMPTS), params.max_tokens, torch.Generator().manual_seed(9))
    said: list[str] = []
    cpu = torch.device("cpu")
    decoder = StaticDecoder(eos_ids=[EOS], pad_id=0, device=cpu, say=said.append)
    decoder.graphs = True  # refused off CUDA at construction
    decoder._compiled_step = decoder._step  # standing in for a compiled step
    out = decoder.decode(model, PROMPTS, params, u)
    assert calls == [("stream on", cpu), ("capture", "thread_local", Side), ("back to", mine)]
    assert ended == [(cpu.index, "pool")]
    assert decoder.graph_failures == 1 and decoder.compile_failures == 1
    assert decoder._compiled_step is None
    (warning,) = [m for m in said if "could not capture" in m]  # said once
    assert "decoding eagerly and uncompiled" in warning
    plain = StaticDecoder(eos_ids=[EOS], pad_id=0, device=cpu)
    plain.graphs = True  # the same buckets and lengths
    plain._graphs = lambda *a, **k: None
    want = plain.decode(model, PROMPTS, params, u)
    assert torch.equal(out.tokens, want.tokens) and torch.equal(out.logprobs, want.logprobs)
    # another shape is not tried again (what failed would fail it too), nor said again
    more = PROMPTS * 4
    decoder.decode(model, more, params, uniforms(len(more), 8, torch.Generator().manual_seed(1)))
    assert len(calls) == 3 and len([m for m in said if "could not capture" in m]) == 1


def test_static_decoder_samples_the_bf16_copy_and_follows_an_adapter_update():
    """bf16 mode's sampling copy (the adapter beside the bf16 blocks) under the static
    decoder equals the eager static decoder before and after an in-place adapter update
    (on CUDA the same case runs with the step captured: tests/integration/test_gpu.py)."""
    pytest.importorskip("peft")
    from decode_cases import adapter_update_case

    adapter_update_case(torch.device("cpu"), graphs=False, tokens=12)


@needs_compiler
def test_the_compiled_step_draws_what_the_eager_step_draws():
    """decode = "compiled" (the step through inductor, here its C++ backend) against the
    eager static step, both sampling a LoRA model's sampling copy: the same tokens,
    float32 logprobs and entropies within 1e-5, with top-p (a sort inside the compiled
    step) and rows that stop early; after an in-place adapter update (an optimizer step)
    the compiled step reads the refreshed weights, not values frozen into its code; and
    at a second shape, which dynamo compiles again with the changed sizes dynamic."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(tiny_model(seed=4), lora)
    device = torch.device("cpu")
    compiled, static = (
        PyTorchEngine(model, {EOS}, 0, device, decode=d) for d in ("compiled", "static")
    )
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=5, return_entropy=True)
    drawn = []
    for update in range(2):
        if update:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
        want = static.sample(PROMPTS, 4, params)
        lengths = assert_same(want, compiled.sample(PROMPTS, 4, params), entropies=True)
        assert min(lengths) < 10 and max(lengths) == 10
        drawn.append([s.token_ids.tolist() for group in want for s in group])
    assert drawn[0] != drawn[1]  # the update changed what was drawn
    params = SamplingParams(max_tokens=7, temperature=1.0, seed=6, return_entropy=True)
    assert_same(
        static.sample(PROMPTS, 2, params), compiled.sample(PROMPTS, 2, params), entropies=True
    )
    assert compiled.static.compiled and not compiled.static.graphs  # no CUDA graphs on a CPU
    assert compiled.metrics() == {"engine_compiled": 1.0}


def test_a_step_that_cannot_compile_runs_uncompiled_and_says_so():
    """Compiling fails (here: the compiler backend raises, as inductor does without a
    C++ compiler) before any of the step runs, so the same step runs uncompiled and draws
    what the static decoder draws."""
    said = []
    model = tiny_model(seed=6)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=2)
    u = uniforms(len(PROMPTS), 6, torch.Generator().manual_seed(2))
    decoder = StaticDecoder(
        eos_ids=[EOS], pad_id=0, device=torch.device("cpu"), compiled=True, say=said.append
    )

    def no_compiler(graph, inputs):
        raise RuntimeError("no C++ compiler")

    decoder._compiled_step = torch.compile(decoder._step, fullgraph=True, backend=no_compiler)
    plain = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
    with torch.inference_mode():
        got = decoder.decode(model, PROMPTS, params, u)
        want = plain.decode(model, PROMPTS, params, u)
    assert decoder.compile_failures == 1 and decoder._compiled_step is None
    assert len(said) == 2 and said[0].startswith("compiling the decode step")
    assert "could not compile the decode step" in said[1]
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)


def test_a_compile_that_runs_out_of_memory_raises_it_and_compiles_again():
    """Memory running out while the step compiles (inductor benchmarks its kernels) is no
    compile failure: dynamo's wrapped error is raised as the out-of-memory error itself,
    for the engine's back-off to take fewer rows, and the compiled step is kept."""
    model = tiny_model(seed=6)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=2)
    u = uniforms(len(PROMPTS), 6, torch.Generator().manual_seed(2))
    decoder = StaticDecoder(
        eos_ids=[EOS], pad_id=0, device=torch.device("cpu"), compiled=True, say=lambda _: None
    )

    def out_of_memory(graph, inputs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    step = torch.compile(decoder._step, fullgraph=True, backend=out_of_memory)
    decoder._compiled_step = step
    with torch.inference_mode(), pytest.raises(torch.OutOfMemoryError, match="injected"):
        decoder.decode(model, PROMPTS, params, u)
    assert decoder.compile_failures == 0 and decoder._compiled_step is step


def _rows_over(model, limit: int, seen: list[int]):
    """The model's forward raises CUDA's out-of-memory error for more than `limit` rows
    (an injected OOM: no CUDA here; what torch raises there), recording the rows asked."""
    forward = model.forward

    def limited(*args, **kwargs):
        rows = kwargs["input_ids"].shape[0]
        # a static prefill feeding each distinct prompt once fills every row of the cache:
        # those rows are what the decoder holds at once
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        layers = getattr(cache, "layers", None) or [None]
        writes = getattr(layers[0], "writes", None)
        if writes is not None and writes.fan is not None:
            rows = len(writes.fan)
        seen.append(rows)
        if rows > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return forward(*args, **kwargs)

    model.forward = limited


@pytest.mark.parametrize("decode", ["dynamic", "static"])
@pytest.mark.parametrize("prompt_batch", [0, 3])
def test_sampling_out_of_memory_halves_the_rows_and_draws_the_same(decode, prompt_batch):
    """A decoding batch that runs out of memory is redone, the whole call at half the rows
    at once, a bound that stays (prompt_batch no longer applies): said once, counted in
    `sampling_oom_retries`, and what is drawn is what an engine that never ran out draws
    (each row keeps its uniforms however the rows are batched)."""
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, return_entropy=True)
    want = engines(tiny_model(seed=7), decode).sample(PROMPTS, 4, params)
    model, seen, said = tiny_model(seed=7), [], []
    engine = engines(model, decode, prompt_batch=prompt_batch, say=said.append)
    _rows_over(model, 6, seen)
    got = engine.sample(PROMPTS, 4, params)  # 12 rows: out of memory, then 4 at a time
    assert_same(want, got, entropies=True)
    after = seen[seen.index(12) + 1 :]  # 12 rows ran out of memory, then at most 6 at once
    assert after and max(after) <= 6
    assert said == [
        "warning: out of memory on cpu decoding 12 completions at once; decoding at most 6 "
        "at once from now on"
    ]
    assert engine.metrics()["sampling_oom_retries"] == 1.0
    seen.clear()
    assert_same(want, engine.sample(PROMPTS, 4, params), entropies=True)
    assert max(seen) <= 6 and engine.metrics()["sampling_oom_retries"] == 1.0  # no retry


def test_with_graphs_sampling_out_of_memory_shrinks_the_bucket_below_8():
    """Batches captured as graphs are padded to a bucket of at least 8 rows; once
    sampling ran out of memory at fewer, the bucket shrinks with the bound (a power of
    two not above it), so the redo asks for less memory, down to one row. Eager steps
    stand in for the graphs (no CUDA here); what is drawn is what a decoder that never
    ran out draws."""
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    want = engines(tiny_model(seed=7), "static").sample(PROMPTS, 4, params)
    model, seen, said = tiny_model(seed=7), [], []
    engine = engines(model, "static", say=said.append)
    engine.static.graphs = True  # refused off CUDA at construction: buckets, no capture
    engine.static._graphs = lambda *a, **k: None
    _rows_over(model, 2, seen)
    got = engine.sample(PROMPTS, 4, params)
    assert_same(want, got)
    # 12 rows in a bucket of 16, out of memory; the bound 6 -> 4 (bucket 4), out of
    # memory; then 2 rows in buckets of 2
    assert seen[0] == 16 and 4 in seen and max(seen[seen.index(4) + 1 :]) == 2
    assert engine.static.least_rows == 2 and engine.row_cap == 2
    assert [m.split("decoding at most ")[1] for m in said] == [
        "4 at once from now on",
        "2 at once from now on",
    ]


def test_the_back_off_frees_what_the_failed_batch_held_before_giving_memory_back():
    """A traceback keeps its frames' locals: without clearing them, the failed batch's
    tensors (here one allocated where the injected OOM is raised) would still be alive
    when the engine releases its caches and empties torch's cache, so that memory could
    not go back."""
    import weakref

    model = tiny_model(seed=7)
    engine = engines(model, "static")
    forward, held = model.forward, []

    def failing(*args, **kwargs):
        if not held:
            big = torch.empty(1 << 20)  # what the failed batch holds
            held.append(weakref.ref(big))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return forward(*args, **kwargs)

    model.forward = failing
    alive_at_release: list[bool] = []
    release = engine.release
    engine.release = lambda: (alive_at_release.append(held[0]() is not None), release())[1]
    engine.sample(PROMPTS, 2, SamplingParams(max_tokens=6, temperature=1.0, seed=1))
    assert alive_at_release == [False]


def test_a_row_batched_call_draws_what_one_batch_draws():
    """The call's uniforms are drawn once and handed out in row order: one prompt per
    batch draws what every prompt in one batch draws."""
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5)
    model = tiny_model(seed=8)
    together = engines(model, "dynamic").sample(PROMPTS, 4, params)
    apart = engines(model, "dynamic", prompt_batch=1).sample(PROMPTS, 4, params)
    assert_same(together, apart)
    assert together[0][0].token_ids.tolist() != together[1][0].token_ids.tolist()


def test_sampling_one_completion_out_of_memory_names_what_to_lower():
    model = tiny_model(seed=7)
    engine = engines(model, "dynamic", say=lambda m: None)
    _rows_over(model, 0, [])
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    with pytest.raises(BackendError) as caught:
        engine.sample(PROMPTS, 2, params)
    assert str(caught.value).startswith(
        "out of memory on cpu sampling one completion at a time (a prompt of up to 7 tokens "
        "and max_tokens = 10). Fix: lower max_tokens"
    )
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert engine.oom_retries == 2  # 6 rows, then one prompt's 2, then 1 (a part of its group)


def test_every_graph_is_captured_on_one_stream(monkeypatch):
    """The graphs share one memory pool, whose freed blocks the caching allocator reuses
    only on the stream that freed them: every span's and every shape's graph is captured
    on the same side stream, made once (stand-ins for torch.cuda's calls, a fake only for
    what a CPU lacks; the warm-up runs the real step)."""
    import contextlib

    made: list = []
    captured_on: list = []

    class Stream:
        def __init__(self, device=None):
            made.append(self)

        def wait_stream(self, other):
            pass

    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        captured_on.append((stream, pool))
        return contextlib.nullcontext()

    import types

    from retrain.kernels import flex

    model = tiny_model(seed=5)
    flex.use_flex(model)  # reads by key span: several graphs a shape
    with torch.no_grad():  # transformers' lazy imports, before torch.cuda is stood in for
        model(input_ids=torch.tensor([PROMPTS[0]]))
    mine = object.__new__(Stream)
    _cuda_stand_ins(monkeypatch, mine, lambda s: None, Stream, graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(replay=lambda: None))
    decoder = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
    decoder.graphs = decoder.keep = True  # refused off CUDA at construction
    decoder.length_step = 4
    decoder.free_bytes = lambda: 1 << 40  # room for both shapes' caches: both kept
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9)
    for rows in (PROMPTS, PROMPTS * 4):  # two shapes: buckets of 8 and 16 rows
        u = uniforms(len(rows), 8, torch.Generator().manual_seed(9))
        decoder.decode(model, rows, params, u)
    assert len({k[:2] for k in decoder._captured}) == 2 and len(captured_on) > 4
    assert made == [decoder._side] and {s for s, _ in captured_on} == {decoder._side}
    assert {pool for _, pool in captured_on} == {"pool"}


@pytest.mark.parametrize("ended_on_it", [False, True])
def test_a_capture_that_runs_out_of_memory_raises_it_and_keeps_the_graphs(monkeypatch, ended_on_it):
    """Running out of memory while capturing is not the step's fault: it is raised (the
    engine then decodes fewer rows at once), not taken for a step that cannot be captured
    (which would decode eagerly for the rest of the run); also when the graph context's
    exit raised on top of it. The thread is back on its stream."""
    import contextlib

    streams: list = []

    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        @contextlib.contextmanager
        def capturing():
            try:
                yield
            except torch.OutOfMemoryError:
                if ended_on_it:  # as capture_end does (implicit context) on a spoilt capture
                    raise RuntimeError("operation failed due to a previous error during capture")  # noqa: B904
                raise

        return capturing()

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    mine = Stream()
    _cuda_stand_ins(monkeypatch, mine, streams.append, Stream, graph)
    ended: list = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda *a: ended.append(a))
    model = tiny_model(seed=5)
    decoder = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
    decoder.graphs = True  # refused off CUDA at construction
    runs = []

    def step(*args):  # the warm-up runs, then the captured run is out of memory
        runs.append(args[-1])
        if len(runs) > 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    decoder._run_step = step
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9)
    u = uniforms(len(PROMPTS), 8, torch.Generator().manual_seed(9))
    with pytest.raises(torch.OutOfMemoryError):
        decoder.decode(model, PROMPTS, params, u)
    assert streams == [mine] and decoder.graph_failures == 0 and not decoder._captured
    assert ended == [(None, "pool")]  # the allocator gives memory back for the retry


def test_the_pools_routing_is_ended_only_where_torch_still_has_it(monkeypatch):
    """`end_pool_routing` after a failed capture: torch's own call where the allocator
    still routes into the pool; its refusal (the capture ended cleanly, or never began)
    taken for nothing to end; no pool, no call."""
    from retrain.engines.static_decode import end_pool_routing

    routed = {(0, (1, 2))}

    def end(index, pool):
        if (index, pool) not in routed:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        routed.remove((index, pool))

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end)
    cuda0 = torch.device("cuda", 0)
    assert end_pool_routing(cuda0, (1, 2)) and not routed
    assert not end_pool_routing(cuda0, (1, 2))  # ended already
    assert not end_pool_routing(cuda0, None)


def test_a_compile_failure_says_the_line_that_reached_it():
    """A Dynamo error's first 200 characters name the operation it could not trace; the
    warning adds the last frame of its "from user code:" trace."""
    from retrain.engines.static_decode import failed_at

    message = (
        "Dynamo does not know how to trace method `update` of class `<unknown type>`\n"
        "  Hint: avoid calling it\n\nfrom user code:\n"
        '   File "/x/retrain/engines/static_decode.py", line 454, in _step\n    out = model(\n'
        '  File "/x/transformers/models/qwen3/modeling_qwen3.py", line 252, in forward\n'
        "    query_states = self.q_norm(self.q_proj(hidden_states))\n"
    )
    assert failed_at(message) == (
        " at /x/transformers/models/qwen3/modeling_qwen3.py:252 (forward): "
        "query_states = self.q_norm(self.q_proj(hidden_states))"
    )
    assert failed_at("RuntimeError: no C++ compiler") == ""  # no trace: nothing added
    assert failed_at("from user code:\n  nothing parseable") == ""


def test_the_whole_bf16_step_traces_whole_with_the_branches_only_cuda_takes():
    """The GPU's whole-bf16 sampler's decode step with CUDA's branches (float32-result
    bf16 matmuls, fused norms, the device query's own body), run on this CPU in a process
    of its own (tests/cuda_branch_rig.py): torch.compile traces it whole and it draws what
    the eager step draws, to the bit. The same rig on torch 2.11 failed at the old device
    query exactly as the H200 of 2026-11-27 did, and traces whole now. The trainer's
    forward and backward through CUDA's branch equal the CPU branch's."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, str(tests / "cuda_branch_rig.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tests.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["compile_failures"] == 0 and got["compiled"], got["said"]
    assert got["asked"] == 1 and got["fused_norms"] > 0  # the CUDA branches were taken
    assert got["same_tokens"] and got["same_logprobs"]
    # the trainer, siblings fused: CUDA's branch multiplies what the CPU's does, to the bit
    assert got["train_same_logits"] and got["train_same_grads"]


def test_distinct_rows_worked_by_hand():
    from retrain.engines.static_decode import distinct_rows

    assert distinct_rows([[1, 2], [3], [1, 2], [3], [5]]) == ([0, 1, 4], [0, 1, 0, 1, 2])
    assert distinct_rows([[1, 2], [3], [5]]) == (None, None)  # nothing to share


def test_a_prefill_feeds_each_distinct_prompt_once_and_fills_every_row(monkeypatch):
    """A group's completions share a prompt: the prefill feeds it once (3 prompts and a
    filler row, not 16 rows) and copies its keys and values to every row, so the cache
    holds what a prefill of every row writes and the same tokens come out."""
    from retrain.engines import static_decode

    model = tiny_model(seed=5)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2)
    rows = [p for p in PROMPTS for _ in range(4)] + [[0]] * 4  # as a bucket of 16 pads them
    u = uniforms(len(rows), params.max_tokens, torch.Generator().manual_seed(2))
    forward, fed = model.forward, []

    def counted(*args, **kwargs):
        fed.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    model.forward = counted
    out, caches = [], []
    for share in (True, False):
        if not share:  # every row fed, as before
            monkeypatch.setattr(static_decode, "distinct_rows", lambda prompts: (None, None))
        decoder = StaticDecoder(eos_ids=[EOS], pad_id=0, device=torch.device("cpu"))
        decoder.keep = True
        fed.clear()
        out.append(decoder.decode(model, rows, params, u))
        assert fed[0] == (4 if share else 16) and set(fed[1:]) == {16}  # prefill, then steps
        ((cache, _),) = decoder._shapes.values()
        caches.append(cache)
    shared, every = out
    assert torch.equal(shared.tokens, every.tokens)
    torch.testing.assert_close(shared.logprobs, every.logprobs, atol=1e-6, rtol=0)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=1e-6, rtol=0)
