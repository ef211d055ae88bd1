"""LoRA-Squeeze: spectrum analysis through QR cores, rank recommendation, compression into
adapters that plain PEFT loads."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from retrain.errors import RetrainError  # noqa: E402
from retrain.squeeze import (  # noqa: E402
    LayerSpectrum,
    SqueezeError,
    analyze_adapter,
    compress_adapter,
    default_target_ranks,
    squeeze_from_options,
)

# Energy spectrum for the synthetic layers: V(1) ~ 0.769, V(2) ~ 0.961, V(4) ~ 0.99991.
SPECTRUM = [10.0, 5.0, 2.0, 1.0, 0.1, 0.05, 0.01, 0.001]
TARGETS = ["q_proj", "v_proj", "down_proj"]


def variance(s, k):
    s2 = np.square(np.asarray(s, dtype=np.float64))
    return float(s2[:k].sum() / s2.sum())


def tiny_model(dtype=torch.float32, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).to(dtype)


def lora_modules(model):
    """(name, module) for every LoRA-wrapped linear layer of a PEFT model."""
    return [
        (n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A
    ]


def orthonormal(rng, n, k):
    q, _ = np.linalg.qr(rng.standard_normal((n, k)))
    return q[:, :k]


def set_factors(module, rng, spectrum, zero=False):
    """Give a LoRA layer B @ A = U diag(spectrum) V^T with random orthonormal U, V."""
    a = module.lora_A["default"].weight
    b = module.lora_B["default"].weight
    r = a.shape[0]
    with torch.no_grad():
        if zero:
            b.zero_()
            return
        u = orthonormal(rng, b.shape[0], r)
        v = orthonormal(rng, a.shape[1], r)
        root = np.sqrt(np.asarray(spectrum[:r], dtype=np.float64))
        # spread the singular values unevenly over the two factors, as training would
        tilt = np.linspace(0.5, 2.0, r)
        b.copy_(torch.from_numpy(u * (root * tilt)))
        a.copy_(torch.from_numpy((root / tilt)[:, None] * v.T))


def make_adapter(
    path,
    *,
    r=8,
    alpha=16,
    spectrum=SPECTRUM,
    dtype=torch.float64,
    seed=0,
    zero_layers=(),
    **lora_kwargs,
):
    """A real PEFT adapter of the tiny model with chosen spectra; returns the PEFT model."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model(dtype),
        LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, **lora_kwargs),
    )
    rng = np.random.default_rng(seed)
    for i, (_, module) in enumerate(lora_modules(model)):
        set_factors(module, rng, spectrum, zero=i in zero_layers)
    model.save_pretrained(str(path))
    return model


def deltas_from_file(path):
    """{layer stem: (B @ A) float64} from an adapter directory's safetensors file."""
    sd = load_file(str(Path(path) / "adapter_model.safetensors"))
    out = {}
    for key, a in sd.items():
        if key.endswith("lora_A.weight"):
            stem = key[: -len("lora_A.weight")]
            b = sd[stem + "lora_B.weight"]
            out[stem] = b.double() @ a.double()
    return out


@pytest.fixture(scope="module")
def adapter64(tmp_path_factory):
    path = tmp_path_factory.mktemp("squeeze") / "adapter"
    make_adapter(path)
    return path


# ------------------------------------------------------------------------------------------
# Analysis


def test_recommends_the_known_rank(adapter64):
    res = analyze_adapter(adapter64)
    assert res.source_rank == 8
    assert res.num_layers == 2 * len(TARGETS)
    assert [row.rank for row in res.rows] == [1, 2, 4, 8]
    for row in res.rows:
        want = variance(SPECTRUM, row.rank)
        assert row.mean_variance == pytest.approx(want, rel=1e-10)
        assert row.min_variance == pytest.approx(want, rel=1e-10)
        assert row.max_variance == pytest.approx(want, rel=1e-10)
    assert res.recommended_rank == 2  # V(1) = 0.769 < 0.95 <= V(2) = 0.961
    assert analyze_adapter(adapter64, min_variance_retention=0.99).recommended_rank == 4
    assert analyze_adapter(adapter64, min_variance_retention=0.5).recommended_rank == 1
    assert analyze_adapter(adapter64, min_variance_retention=1.0).recommended_rank == 8
    for layer in res.layers:
        assert layer.singular_values == pytest.approx(SPECTRUM, rel=1e-9, abs=1e-12)


def test_target_ranks_and_source_rank(adapter64):
    res = analyze_adapter(adapter64, target_ranks=[3, 6], source_rank=8)
    assert [row.rank for row in res.rows] == [3, 6, 8]  # the source rank is always listed
    assert res.recommended_rank == 3
    assert res.mean_variance[6] == pytest.approx(variance(SPECTRUM, 6))
    with pytest.raises(SqueezeError, match="source_rank = 16"):
        analyze_adapter(adapter64, source_rank=16)
    with pytest.raises(SqueezeError, match="target_ranks"):
        analyze_adapter(adapter64, target_ranks=[0, 2])
    with pytest.raises(SqueezeError, match="target_ranks"):
        analyze_adapter(adapter64, target_ranks=[32])
    with pytest.raises(SqueezeError, match="min_variance_retention"):
        analyze_adapter(adapter64, min_variance_retention=0.0)
    assert default_target_ranks(8) == [1, 2, 4, 8]
    assert default_target_ranks(12) == [1, 2, 4, 8, 12]
    assert default_target_ranks(1) == [1]


def test_qr_path_matches_dense_svd(tmp_path):
    # random factors, including a layer whose output (32 for v_proj) is narrow
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_model(torch.float64), LoraConfig(r=8, lora_alpha=8, target_modules=TARGETS)
    )
    g = torch.Generator().manual_seed(1)
    for _, m in lora_modules(model):
        with torch.no_grad():
            m.lora_B["default"].weight.copy_(
                torch.randn(m.lora_B["default"].weight.shape, generator=g)
            )
    model.save_pretrained(str(tmp_path))
    res = analyze_adapter(tmp_path)
    dense = deltas_from_file(tmp_path)
    by_name = {layer.name: layer for layer in res.layers}
    assert len(by_name) == len(dense)
    for stem, delta in dense.items():
        want = torch.linalg.svdvals(delta)[:8].tolist()
        got = by_name[stem.rstrip(".")].singular_values
        assert got == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_zero_update_layers_are_left_out_of_the_statistics(tmp_path):
    from peft import LoraConfig, get_peft_model

    fresh = tmp_path / "fresh"
    get_peft_model(tiny_model(), LoraConfig(r=8, target_modules=TARGETS)).save_pretrained(
        str(fresh)
    )
    res = analyze_adapter(fresh)
    assert res.zero_layers == res.num_layers == 6
    assert all(row.mean_variance == 1.0 for row in res.rows)
    assert res.recommended_rank == 1
    assert analyze_adapter(fresh, min_variance_retention=1.0).recommended_rank == 1
    assert "nan" not in res.format_table().lower()

    mixed = tmp_path / "mixed"
    make_adapter(mixed, zero_layers=(0, 3))
    res = analyze_adapter(mixed)
    assert res.zero_layers == 2
    v1 = variance(SPECTRUM, 1)
    # the four trained layers alone: a zero layer counted as V = 1 would lift the mean
    assert res.row(1).mean_variance == pytest.approx(v1)
    assert res.row(1).min_variance == pytest.approx(v1)
    assert res.row(1).max_variance == pytest.approx(v1)
    make_adapter(tmp_path / "trained")  # the same layers, none of them zero
    trained = analyze_adapter(tmp_path / "trained")
    assert res.recommended_rank == trained.recommended_rank
    assert res.row(1).mean_variance == pytest.approx(trained.row(1).mean_variance)


def test_reads_adapter_model_bin(adapter64, tmp_path):
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "adapter_config.json").write_text((adapter64 / "adapter_config.json").read_text())
    torch.save(
        load_file(str(adapter64 / "adapter_model.safetensors")), legacy / "adapter_model.bin"
    )
    a, b = analyze_adapter(adapter64), analyze_adapter(legacy)
    assert a.rows == b.rows and a.recommended_rank == b.recommended_rank


def test_format_table_marks_the_recommended_row(adapter64):
    res = analyze_adapter(adapter64)
    table = res.format_table()
    marked = [line for line in table.splitlines() if "<- recommended" in line]
    assert len(marked) == 1 and marked[0].split()[0] == "2"
    assert f"{variance(SPECTRUM, 2):.4f}" in marked[0]
    summary = res.as_dict()
    json.dumps(summary)
    assert summary["recommended_rank"] == 2 and len(summary["ranks"]) == 4


def test_bad_inputs_raise_clear_errors(tmp_path, adapter64, monkeypatch):
    import retrain.backends.tinker as tinker_backend
    from retrain.errors import BackendError

    def unreachable(*args, **kwargs):  # never touch the network from a unit test
        raise BackendError("cannot connect to Tinker: no service here")

    monkeypatch.setattr(tinker_backend, "fetch_adapter", unreachable)
    with pytest.raises(
        RetrainError, match="cannot fetch the adapter tinker://run-123/weights/final"
    ):
        analyze_adapter("tinker://run-123/weights/final")
    with pytest.raises(SqueezeError, match="not found"):
        analyze_adapter(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SqueezeError, match="adapter_config.json"):
        analyze_adapter(tmp_path / "empty")
    half = tmp_path / "half"
    half.mkdir()
    (half / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    sd = load_file(str(adapter64 / "adapter_model.safetensors"))
    save_file(
        {k: v for k, v in sd.items() if "lora_B" not in k or "layers.0.self" not in k},
        str(half / "adapter_model.safetensors"),
    )
    with pytest.raises(SqueezeError, match="no matching"):
        analyze_adapter(half)
    # a run's adapter_path, which holds its saved adapters: they are named, final first
    run = tmp_path / "run"
    for name in ("checkpoint_step_5", "checkpoint_step_10", "final"):
        shutil.copytree(adapter64, run / name)
    with pytest.raises(SqueezeError) as err:
        analyze_adapter(run)
    assert str(err.value).endswith(
        f"adapter_config.json is missing; it holds the saved adapters {run / 'final'}, "
        f"{run / 'checkpoint_step_10'}, {run / 'checkpoint_step_5'}"
    )
    with pytest.raises(SqueezeError, match="adapter_path is empty"):
        squeeze_from_options("")


def test_device_selection(adapter64):
    with pytest.raises(SqueezeError, match="device"):
        analyze_adapter(adapter64, device="no-such-device")
    if not torch.cuda.is_available():  # gpu:N, [backend] devices' spelling, is CUDA's N
        with pytest.raises(SqueezeError) as got:
            analyze_adapter(adapter64, device="gpu:0")
        assert "'gpu:0' is not usable here" in str(got.value)
        assert "device type at start of device string" not in str(got.value)
    else:
        assert analyze_adapter(adapter64, device="gpu:0").recommended_rank
    if torch.cuda.is_available():
        cpu, gpu = analyze_adapter(adapter64), analyze_adapter(adapter64, device="cuda")
        assert gpu.recommended_rank == cpu.recommended_rank
        for a, b in zip(cpu.rows, gpu.rows):
            assert a.mean_variance == pytest.approx(b.mean_variance, rel=1e-9)


# ------------------------------------------------------------------------------------------
# Compression


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_compressed_delta_error_is_the_discarded_energy(adapter64, tmp_path, k):
    out = compress_adapter(adapter64, tmp_path / f"r{k}", k)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == k
    assert cfg["lora_alpha"] == pytest.approx(16 * k / 8)
    assert cfg["lora_alpha"] / cfg["r"] == pytest.approx(16 / 8)  # PEFT scale unchanged
    old, new = deltas_from_file(adapter64), deltas_from_file(out)
    assert old.keys() == new.keys()
    discarded = float(np.square(SPECTRUM[k:]).sum())
    for stem in old:
        err = float(torch.sum((old[stem] - new[stem]) ** 2))
        if discarded:
            assert err == pytest.approx(discarded, rel=1e-6)
        else:
            assert err < 1e-20
        # and it is the best rank-k approximation: the dense truncated SVD
        u, s, vh = torch.linalg.svd(old[stem], full_matrices=False)
        best = u[:, :k] @ torch.diag(s[:k]) @ vh[:k]
        assert torch.allclose(new[stem], best, atol=1e-10)
    sd = load_file(str(out / "adapter_model.safetensors"))
    assert all(v.dtype == torch.float64 for v in sd.values())
    assert {tuple(v.shape)[:1] for key, v in sd.items() if "lora_A" in key} == {(k,)}
    res = analyze_adapter(out)
    assert res.source_rank == k
    assert res.row(k).mean_variance == 1.0


def test_compressed_adapter_loads_with_plain_peft(tmp_path):
    from peft import PeftModel

    src = tmp_path / "src"
    trained = make_adapter(src, dtype=torch.float32, seed=3)
    trained.eval()
    out = compress_adapter(src, tmp_path / "small", 4)
    base = tiny_model(torch.float32)  # same seed -> same base weights
    loaded = PeftModel.from_pretrained(base, str(out))
    loaded.eval()
    mods = dict(lora_modules(loaded))
    ref_mods = dict(lora_modules(trained))
    assert mods.keys() == ref_mods.keys()
    for name, m in mods.items():
        assert m.r["default"] == 4
        assert m.scaling["default"] == pytest.approx(ref_mods[name].scaling["default"])
        got = m.get_delta_weight("default").double()
        full = ref_mods[name].get_delta_weight("default").double()
        u, s, vh = torch.linalg.svd(full, full_matrices=False)
        want = u[:, :4] @ torch.diag(s[:4]) @ vh[:4]
        assert torch.allclose(got, want, atol=1e-5)
    # the loaded model computes base + truncated delta: merge it by hand and compare outputs
    merged = tiny_model(torch.float32)
    base_mods = dict(merged.named_modules())
    with torch.no_grad():
        for name in mods:
            full = ref_mods[name].get_delta_weight("default").double()
            u, s, vh = torch.linalg.svd(full, full_matrices=False)
            w = base_mods[name.removeprefix("base_model.model.")].weight
            w += (u[:, :4] @ torch.diag(s[:4]) @ vh[:4]).float()
        ids = torch.arange(12).reshape(2, 6)
        assert torch.allclose(loaded(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5)


def test_full_rank_compression_is_lossless_through_peft(tmp_path):
    from peft import PeftModel

    src = tmp_path / "src"
    trained = make_adapter(src, dtype=torch.float32, seed=4)
    trained.eval()
    out = compress_adapter(src, tmp_path / "same", 8)
    loaded = PeftModel.from_pretrained(tiny_model(torch.float32), str(out)).eval()
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        assert torch.allclose(
            trained(input_ids=ids).logits, loaded(input_ids=ids).logits, atol=1e-4
        )


@pytest.mark.parametrize(
    "lora_kwargs",
    [
        {"use_rslora": True},
        {"rank_pattern": {"q_proj": 4}, "alpha_pattern": {"q_proj": 32}},
    ],
)
def test_scaling_is_preserved_with_rslora_and_patterns(tmp_path, lora_kwargs):
    from peft import PeftModel

    src = tmp_path / "src"
    trained = make_adapter(src, dtype=torch.float64, seed=5, **lora_kwargs)
    out = compress_adapter(src, tmp_path / "small", 2)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["rank_pattern"] == {} and cfg["alpha_pattern"] == {}
    loaded = PeftModel.from_pretrained(tiny_model(torch.float64), str(out))
    ref = dict(lora_modules(trained))
    if lora_kwargs.get("use_rslora"):
        assert cfg["lora_alpha"] == pytest.approx(16 * math.sqrt(2 / 8))  # alpha / sqrt(r) kept
        for name, m in lora_modules(loaded):
            assert m.scaling["default"] == pytest.approx(ref[name].scaling["default"])
    for name, m in lora_modules(loaded):
        full = ref[name].get_delta_weight("default")
        u, s, vh = torch.linalg.svd(full, full_matrices=False)
        want = u[:, :2] @ torch.diag(s[:2]) @ vh[:2]
        assert torch.allclose(m.get_delta_weight("default"), want, atol=1e-10), name


def test_compress_rejects_bad_ranks(adapter64, tmp_path):
    for k in (0, 9, -1, 2.0):
        with pytest.raises(SqueezeError, match="target rank"):
            compress_adapter(adapter64, tmp_path / "x", k)
    with pytest.raises(SqueezeError, match="differ"):
        compress_adapter(adapter64, adapter64, 2)
    with pytest.raises(SqueezeError, match="source_rank"):
        compress_adapter(adapter64, tmp_path / "x", 2, source_rank=4)


def test_squeeze_from_options_prints_and_compresses(adapter64, tmp_path):
    printed = []
    res = squeeze_from_options(
        adapter64, 0.95, None, 0, tmp_path / "auto", 0, "cpu", print_fn=printed.append
    )
    assert res.recommended_rank == 2 and res.compressed_rank == 2
    assert json.loads((tmp_path / "auto" / "adapter_config.json").read_text())["r"] == 2
    assert len(printed) == 1 and "<- recommended" in printed[0] and "compressed" in printed[0]

    res = squeeze_from_options(
        adapter64, output_path=tmp_path / "four", compress_to=4, print_fn=None
    )
    assert res.compressed_rank == 4
    assert json.loads((tmp_path / "four" / "adapter_config.json").read_text())["r"] == 4

    res = squeeze_from_options(adapter64, output_path="", print_fn=None)
    assert res.compressed_path is None


# ------------------------------------------------------------------------------------------
# Properties


@settings(max_examples=50, deadline=None)
@given(
    spectrum=st.lists(st.floats(0.0, 1e3), min_size=1, max_size=16),
)
def test_variance_is_monotone_and_complete(spectrum):
    s = tuple(sorted(spectrum, reverse=True))
    layer = LayerSpectrum("x", len(s), s)
    vs = [layer.variance_at(k) for k in range(1, len(s) + 1)]
    assert all(0.0 <= v <= 1.0 and not math.isnan(v) for v in vs)
    assert all(a <= b for a, b in zip(vs, vs[1:]))
    assert vs[-1] == 1.0


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), r=st.sampled_from([2, 3, 4, 8]))
def test_random_adapters_have_monotone_rows(tmp_path_factory, seed, r):
    path = tmp_path_factory.mktemp("rand")
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i, (out_f, in_f) in enumerate([(16, 24), (3, 10), (24, 2)]):
        stem = f"base_model.model.layer{i}.proj."
        weights[stem + "lora_A.weight"] = torch.randn(r, in_f, generator=g, dtype=torch.float64)
        weights[stem + "lora_B.weight"] = torch.randn(out_f, r, generator=g, dtype=torch.float64)
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r}))
    res = analyze_adapter(path, target_ranks=list(range(1, r + 1)))
    means = [row.mean_variance for row in res.rows]
    mins = [row.min_variance for row in res.rows]
    assert all(a <= b + 1e-15 for a, b in zip(means, means[1:]))
    assert all(a <= b + 1e-15 for a, b in zip(mins, mins[1:]))
    assert res.row(r).mean_variance == 1.0 and res.row(r).min_variance == 1.0
    # narrow layers (3 outputs, 2 inputs) have at most 3 / 2 directions: complete there
    names = [layer.name for layer in res.layers]
    assert len(res.layers[names.index("base_model.model.layer2.proj")].singular_values) == min(r, 2)


def test_patterns_and_lora_bias_compress_as_peft_scales_them(tmp_path):
    """PEFT groups an alpha_pattern key (`q_proj|v_proj` names both) and scales lora_B's
    bias like B A: with patterns, each layer's scale changes by its own ratio, and the
    compressed bias must carry it. Checked through PEFT's own delta weights and biases."""
    from peft import PeftModel

    src = tmp_path / "src"
    trained = make_adapter(
        src,
        dtype=torch.float32,
        seed=5,
        alpha_pattern={"q_proj|v_proj": 64, "layers.0.mlp.down_proj": 4},
        lora_bias=True,
    )
    rng = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, m in lora_modules(trained):
            m.lora_B["default"].bias.copy_(
                torch.randn(m.lora_B["default"].bias.shape, generator=rng)
            )
    trained.save_pretrained(str(src))
    out = compress_adapter(src, tmp_path / "small", 4)
    loaded = dict(lora_modules(PeftModel.from_pretrained(tiny_model(torch.float32), str(out))))
    for name, ref in lora_modules(trained):
        full = ref.get_delta_weight("default").double()
        u, s, vh = torch.linalg.svd(full, full_matrices=False)
        got = loaded[name]
        want = u[:, :4] @ torch.diag(s[:4]) @ vh[:4]
        assert torch.allclose(got.get_delta_weight("default").double(), want, atol=1e-5), name
        bias = lambda m: m.lora_B["default"].bias * m.scaling["default"]  # noqa: E731
        assert torch.allclose(bias(got), bias(ref), rtol=1e-5, atol=1e-6), name


def test_adapters_of_target_parameters_are_refused(adapter64, tmp_path):
    """Mixture-of-experts adapters stack one block per expert into each factor: read as
    one layer, both the spectrum and a compression would be wrong."""
    moe = tmp_path / "moe"
    shutil.copytree(adapter64, moe)
    cfg = json.loads((moe / "adapter_config.json").read_text())
    cfg["target_parameters"] = ["experts.down_proj"]
    (moe / "adapter_config.json").write_text(json.dumps(cfg))
    for call in (lambda: analyze_adapter(moe), lambda: compress_adapter(moe, tmp_path / "o", 2)):
        with pytest.raises(SqueezeError, match="target_parameters"):
            call()
    assert not (tmp_path / "o").exists()
