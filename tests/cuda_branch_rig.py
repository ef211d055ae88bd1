"""The GPU's whole-bf16 sampler's decode step, with the branches only CUDA takes, traced by
torch.compile on a CPU: the products' float32-result bf16 matmuls (given CPU kernels
here), the fused norms, and the device query's own body (`hardware.f32_out_matmul` past
its CUDA test: it reads torch's version from the package's metadata). A CPU never runs
these branches otherwise, and one of them is what failed the compiled step on the H200
of 2026-11-27 (torch 2.11's Dynamo traced into importlib.metadata). Inductor cannot lower
CUDA's float32-result matmuls for a CPU, so the step compiles with AOT autograd's eager
backend: Dynamo's trace and the graph, not the kernels.

The trainer's side too: a forward and backward of the wholly bf16 LoRA model, its
siblings fused and its factors staged, once through CUDA's branch and once through the
CPU's. The CPU kernels given to CUDA's float32-result matmuls compute what the CPU's
branch computes (float32 copies of the operands), so the two must agree to the bit:
CUDA's branch multiplies the same operands, in the same places.

Run as its own process (the CPU kernels it registers stay for the process's life):
`python tests/cuda_branch_rig.py` prints one JSON line; tests/unit/test_static_decode.py
runs it."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

_LIBS: list = []  # the registrations, kept for the process's life


@functools.cache
def f32_out_matmul(device_type: str) -> bool:
    """`hardware.f32_out_matmul`'s body past its CUDA test (torch's version read from its
    package's metadata)."""
    from retrain.hardware import torch_at_least

    return torch_at_least(2, 8)


def cuda_branches() -> None:
    """This process takes the branches a GPU's whole-bf16 layout takes, on the CPU: the
    whole model in bf16 (`hardware.WHOLE_BF16`), the products' float32-result bf16
    matmuls (`mm.dtype`, `addmm.dtype` and its `out=` form: CUDA's only) given CPU kernels that multiply
    float32 copies of the operands, chosen by the device query's own body, and the norms
    as torch's rms_norm with the weight (`norms.FUSED_NORM_DEVICES`: one kernel on CUDA,
    its eight operators here). Once per process (benchmarks/train_step.py's `--layout
    gpu` uses it too)."""
    import retrain.engines.sampling_copy as sampling_copy
    import retrain.hardware as hardware
    import retrain.kernels.norms as norms
    import retrain.kernels.precision as precision

    if not _LIBS:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("mm.dtype", lambda a, b, out_dtype: torch.mm(a.float(), b.float()), "CPU")
        lib.impl(
            "addmm.dtype",
            lambda c, a, b, out_dtype, beta=1, alpha=1: torch.addmm(
                c.float(), a.float(), b.float(), beta=beta, alpha=alpha
            ),
            "CPU",
        )
        lib.impl(  # into `out`, which `precision.addmm_f32_` makes the input itself
            "addmm.dtype_out",
            lambda c, a, b, out_dtype, beta=1, alpha=1, *, out: out.copy_(
                torch.addmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha)
            ),
            "CPU",
        )
        _LIBS.append(lib)
    hardware.WHOLE_BF16 = frozenset({*hardware.WHOLE_BF16, "cpu"})
    norms.FUSED_NORM_DEVICES = frozenset({*norms.FUSED_NORM_DEVICES, "cpu"})
    precision.f32_out_matmul = sampling_copy.f32_out_matmul = f32_out_matmul


def training(precision) -> dict[str, bool]:
    """The tiny Qwen3's logits and LoRA gradients through CUDA's branch and the CPU's."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "unit"))
    from tiny_qwen3 import VOCAB, qwen3_lora

    from retrain.kernels.lora_layers import fuse_sibling_loras
    from retrain.kernels.rotary import turn_rotary
    from retrain.kernels.staged_factors import stage_factors

    results = []
    for query in (f32_out_matmul, lambda device_type: False):
        precision.f32_out_matmul = query
        model = qwen3_lora(bf16=True, switch=True, recompute=True, lean=True, lora_alpha=12)
        turn_rotary(model)
        groups = fuse_sibling_loras(model)
        assert groups and stage_factors(model, groups)  # as the local backend trains it
        ids = torch.arange(1, 30)[None] % VOCAB
        logits = model(input_ids=ids).logits.float()
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        results.append((logits.detach(), grads))
    (cuda_logits, cuda_grads), (cpu_logits, cpu_grads) = results
    precision.f32_out_matmul = f32_out_matmul
    return {
        "train_same_logits": torch.equal(cuda_logits, cpu_logits),
        "train_same_grads": all(torch.equal(a, b) for a, b in zip(cuda_grads, cpu_grads)),
    }


def main() -> None:
    import retrain.engines.static_decode as static_decode
    import retrain.kernels.precision as precision

    cuda_branches()
    static_decode.compiled_step = lambda step: torch.compile(
        step, fullgraph=True, backend="aot_eager"
    )

    from decode_cases import _qwen3_config
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from retrain.engines.draw import uniforms
    from retrain.engines.sampling_copy import SamplingCopy
    from retrain.engines.static_decode import StaticDecoder
    from retrain.kernels import flex
    from retrain.kernels.lora_layers import adapter_in_input_dtype, lean_lora_forward
    from retrain.kernels.precision import bf16_weights
    from retrain.kernels.recompute import recompute_elementwise
    from retrain.kernels.rotary import turn_rotary
    from retrain.types import SamplingParams

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_qwen3_config(attn_implementation="sdpa"))
    bf16_weights(base)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    lean_lora_forward(model)
    assert turn_rotary(model) == 1  # as the local backend: compiled, the original runs
    adapter_in_input_dtype(model)
    recompute_elementwise(model)
    flex.use_flex(model.get_base_model())
    model.eval()
    with torch.no_grad():  # a trained adapter: B not zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    copy = SamplingCopy.build(model, None)
    copy.refresh()
    fused = sum(type(m).__name__ == "RmsNorm" for m in copy.model.modules())
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]] * 3
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    u = uniforms(len(prompts), 8, torch.Generator().manual_seed(3))
    said: list[str] = []
    cpu = torch.device("cpu")
    eager = StaticDecoder(eos_ids=[2], pad_id=0, device=cpu)
    compiled = StaticDecoder(eos_ids=[2], pad_id=0, device=cpu, compiled=True, say=said.append)
    with torch.inference_mode():
        a = eager.decode(copy.model, prompts, params, u)
        b = compiled.decode(copy.model, prompts, params, u)
    print(
        json.dumps(
            {
                **training(precision),
                "compile_failures": compiled.compile_failures,
                "compiled": compiled._compiled_step is not None,
                "asked": f32_out_matmul.cache_info().currsize,
                "fused_norms": fused,
                "same_tokens": torch.equal(a.tokens, b.tokens)
                and torch.equal(a.lengths, b.lengths),
                "same_logprobs": torch.equal(a.logprobs, b.logprobs),
                "said": said,
            }
        )
    )


if __name__ == "__main__":
    main()
