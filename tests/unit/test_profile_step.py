"""benchmarks/profile_step.py's pure summary: kernel categories (first match wins), shares,
the top-N table and kernels per decoded token, on hand-made profiler records."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from benchmark_module import load

profile_step = load("profile_step")
CATEGORIES, category, finite = profile_step.CATEGORIES, profile_step.category, profile_step.finite
summarise, table = profile_step.summarise, profile_step.table
records_from = profile_step.records_from
covered_us, kernel_spans = profile_step.covered_us, profile_step.kernel_spans

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas"
FMHA = "fmha_cutlassF_bf16_aligned_64x64_rf_sm80"
FLASH = "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, cutlass::bfloat16_t>>"
FLASH_ADD = "flash_fwd_splitkv_combine_add_kernel"  # an elementwise word, but flash first
ADD = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>"
COPY = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>"
RMS = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (GEMM, "matmul"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTT", "matmul"),
        ("aten::mm", "matmul"),
        ("aten::addmm", "matmul"),  # not "add": matmul comes first
        ("aten::bmm", "matmul"),
        (FMHA, "attention"),  # says cutlass, but attention comes before matmul
        (FLASH, "attention"),
        (FLASH_ADD, "attention"),
        ("triton_tem_fused_flex_attention_0", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        (RMS, "norm"),  # its `_to_copy` would make it a copy, but norm comes first
        ("aten::_fused_rms_norm", "norm"),
        ("cunn_SoftMaxForward", "softmax_sample"),
        ("aten::multinomial", "softmax_sample"),  # not elementwise's "mul"
        ("Memcpy HtoD (Pageable -> Device)", "copy"),
        (COPY, "copy"),  # an elementwise kernel that copies: copy comes first
        ("aten::cat", "copy"),
        (ADD, "elementwise"),
        ("triton_poi_fused_add_mul_0", "elementwise"),  # elementwise sits above triton
        ("triton_poi_fused_0", "triton_fused"),
        ("at::native::reduce_kernel<512, 1>", "other"),
        ("", "other"),
    ],
)
def test_category_first_match_wins(name, kind):
    assert category(name) == kind


def test_the_order_is_attention_matmul_norm_then_the_broad_kinds():
    kinds = [k for k, _ in CATEGORIES]
    assert kinds[:3] == ["attention", "matmul", "norm"]
    assert kinds.index("copy") < kinds.index("elementwise") < kinds.index("triton_fused")


def test_the_table_ends_with_a_catch_all():
    assert [k for k, _ in CATEGORIES][-1] == "other"
    assert len({k for k, _ in CATEGORIES}) == len(CATEGORIES)


RECORDS = [
    (GEMM, 100.0, True),
    (GEMM, 300.0, True),
    (FLASH_ADD, 150.0, True),
    (ADD, 10.0, True),
    (ADD, 20.0, True),
    (ADD, 30.0, True),
    (COPY, 40.0, True),
    ("at::native::reduce_kernel<512, 1>", 350.0, True),
]


def test_summary_totals_categories_and_shares():
    s = summarise(RECORDS, top=30, tokens=4)
    assert s["total_us"] == 1000.0
    assert s["kernels"] == 8
    assert s["kernels_per_token"] == 2.0
    assert s["device_kernels_seen"] is True
    cats = s["categories"]
    assert [k for k in cats] == [k for k, _ in CATEGORIES]  # every kind, in table order
    assert cats["matmul"] == {"us": 400.0, "kernels": 2, "share": 0.4}
    assert cats["attention"] == {"us": 150.0, "kernels": 1, "share": 0.15}
    assert cats["elementwise"] == {"us": 60.0, "kernels": 3, "share": pytest.approx(0.06)}
    assert cats["copy"]["us"] == 40.0 and cats["other"]["us"] == 350.0
    assert cats["norm"] == {"us": 0.0, "kernels": 0, "share": 0.0}
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    assert sum(c["kernels"] for c in cats.values()) == 8


def test_top_is_ordered_by_total_time_with_counts_and_means():
    s = summarise(RECORDS, top=3)
    assert s["kernels_per_token"] is None
    assert [t["name"] for t in s["top"]] == [GEMM, "at::native::reduce_kernel<512, 1>", FLASH_ADD]
    gemm = s["top"][0]
    assert gemm["count"] == 2 and gemm["total_us"] == 400.0 and gemm["mean_us"] == 200.0
    assert gemm["share"] == 0.4 and gemm["category"] == "matmul"
    everything = summarise(RECORDS, top=100)["top"]
    assert len(everything) == 5  # one row per distinct name
    assert sum(t["share"] for t in everything) == pytest.approx(1.0)
    add = next(t for t in everything if t["name"] == ADD)
    assert (add["count"], add["total_us"], add["mean_us"]) == (3, 60.0, 20.0)


def test_cpu_op_records_summarise_and_empty_is_safe():
    cpu = [("aten::mm", 5.0, False), ("aten::mm", 3.0, False), ("aten::add", 2.0, False)]
    s = summarise(cpu, top=5, tokens=8)
    assert s["device_kernels_seen"] is False
    assert s["categories"]["matmul"]["share"] == 0.8
    assert s["kernels_per_token"] == 3 / 8
    assert "CUDA-graph replays" not in table("sampling", s, cuda=False)
    assert "decode=static" in table("sampling", s, cuda=True)  # no kernels seen on CUDA
    empty = summarise([], top=5, tokens=0)
    assert empty["total_us"] == 0 and empty["kernels_per_token"] is None
    assert all(c["share"] == 0.0 for c in empty["categories"].values())
    json.dumps(empty, allow_nan=False)


def test_table_lists_kinds_and_top_kernels():
    text = table("training", summarise(RECORDS, top=2), cuda=True)
    assert "| matmul | 40.0 | 0.40 | 2 |" in text
    assert "| norm |" not in text  # kinds with no kernels are left out of the table
    assert "decode=static" not in text


def test_finite_makes_json_valid():
    out = finite({"a": float("nan"), "b": [1.0, float("inf")], "c": None, "d": (2, 3)})
    assert out == {"a": None, "b": [1.0, None], "c": None, "d": [2, 3]}
    json.dumps(out, allow_nan=False)


class _Prof:
    """A stand-in for a finished torch.profiler.profile: only `events()` is read."""

    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def _event(name, kind, us, **extra):
    span = SimpleNamespace(elapsed_us=lambda: us)
    return SimpleNamespace(
        name=name,
        device_type=SimpleNamespace(name=kind),  # like torch's DeviceType enum members
        time_range=span,
        self_cpu_time_total=us if kind == "CPU" else 0,
        **extra,
    )


def test_records_from_takes_device_kernels_and_skips_gpu_annotations():
    prof = _Prof(
        [
            _event("aten::mm", "CPU", 7.0),
            _event("cudaLaunchKernel", "CPU", 3.0),
            _event(GEMM, "CUDA", 40.0, is_user_annotation=False),
            _event("Optimizer.step#AdamW.step", "CUDA", 90.0, is_user_annotation=True),
            _event(ADD, "CUDA", 2.0),  # no is_user_annotation attribute (older torch)
        ]
    )
    assert records_from(prof) == [(GEMM, 40.0, True), (ADD, 2.0, True)]


def test_records_from_falls_back_to_cpu_self_time():
    prof = _Prof(
        [
            _event("aten::mm", "CPU", 7.0, is_async=False),
            _event("aten::add", "CPU", 1.0),
            _event("async thing", "CPU", 5.0, is_async=True),
        ]
    )
    assert records_from(prof) == [("aten::mm", 7.0, False), ("aten::add", 1.0, False)]


@pytest.mark.parametrize(
    ("spans", "covered"),
    [
        ([], 0.0),
        ([(0.0, 10.0)], 10.0),
        ([(0.0, 10.0), (20.0, 25.0)], 15.0),  # a gap: the device idle for 10
        ([(0.0, 10.0), (5.0, 12.0)], 12.0),  # overlapping streams count once
        ([(5.0, 12.0), (0.0, 10.0), (1.0, 2.0)], 12.0),  # any order; one inside another
        ([(0.0, 4.0), (4.0, 6.0)], 6.0),  # back to back
    ],
)
def test_covered_us_is_the_union_of_the_kernels_spans(spans, covered):
    assert covered_us(spans) == covered


def test_kernel_spans_are_the_device_kernels_without_annotations():
    def event(name, kind, start, end, **extra):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(
            name=name, device_type=SimpleNamespace(name=kind), time_range=span, **extra
        )

    prof = _Prof(
        [
            event("aten::mm", "CPU", 0, 50),
            event(GEMM, "CUDA", 10, 30, is_user_annotation=False),
            event("Optimizer.step#AdamW.step", "CUDA", 0, 100, is_user_annotation=True),
            event(ADD, "CUDA", 40, 45),
        ]
    )
    assert kernel_spans(prof) == [(10.0, 30.0), (40.0, 45.0)]
    assert covered_us(kernel_spans(prof)) == 25.0


def test_the_hosts_time_is_split_by_thread_busiest_first():
    """Top-level CPU events (thread, start, end): per thread the time they cover (an
    overlap counted once), busiest first; on CUDA the backward runs on a thread of its
    own."""
    rows = profile_step.host_threads([(1, 0, 10), (1, 5, 20), (7, 0, 30), (1, 40, 41)])
    assert rows == [
        {"thread": 7, "busy_ms": 0.03, "events": 1},
        {"thread": 1, "busy_ms": 0.021, "events": 3},
    ]
    assert profile_step.host_threads([]) == []
