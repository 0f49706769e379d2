"""benchmarks/profile_step.py's breakdown of a profiled step by kind of kernel: the GEMMs split by whose operands
they multiply (the adapters' rank, the LM head's vocabulary, the rest), the other kernels by name."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_step as ps

RANK, VOCAB = 16, 151936
# one step on an H100 as torch.profiler names its kernels (microseconds)
GEMM_BASE = "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT"
GEMM_SMALL = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1"
KERNELS = {
    GEMM_BASE: 3000.0,
    GEMM_SMALL: 700.0,
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": 900.0,
    "_softmax_ce_grad_kernel": 200.0,
    "triton_poi_fused__to_copy_add_mul_silu_0": 400.0,
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_1": 150.0,
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": 50.0,
    "Memcpy HtoD (Pageable -> Device)": 5.0,
    "some_new_kernel": 95.0,
}
LAUNCHES = [  # (op, operand shapes, kernel, us): the GEMM ops and what they launched
    ("aten::mm", [[4096, 4096], [4096, 4096]], GEMM_BASE, 1000.0),
    ("aten::mm", [[4096, 4096], [4096, RANK]], GEMM_SMALL, 400.0),
    ("aten::mm", [[RANK, 4096], [4096, 4096]], GEMM_SMALL, 300.0),
    ("aten::mm", [[2048, 4096], [4096, VOCAB]], GEMM_BASE, 800.0),
]


def _rows(text: str) -> dict[str, list[str]]:
    return {
        cells[0]: cells[1:]
        for line in text.splitlines()
        if line.startswith("| ")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }


def test_kinds_split_the_gemms_by_operand_and_add_up_to_the_kernels() -> None:
    text = ps.breakdown_table(
        KERNELS.items(), [launch[1:] for launch in LAUNCHES], steps=1, rank=RANK, vocab=VOCAB
    )
    ms = {kind: float(cells[0]) for kind, cells in _rows(text).items() if kind != "kind"}
    assert ms == {
        ps.BLOCK_GEMMS: 2.2,  # 3.0 + 0.7 of GEMM kernels, less the adapters' 0.7 and the head's 0.8
        ps.ADAPTER_GEMMS: 0.7,
        ps.HEAD_GEMMS: 0.8,
        "attention": 0.9,
        "loss": 0.2,
        "element-wise": 0.4,
        "norms and reductions": 0.15,
        "optimizer": 0.05,
        "copies": 0.01,  # 5 us, two decimals
        "other": 0.1,
        "all kernels": 5.5,
    }
    assert "some_new_kernel 0.10" in text
    # every kind a kernel's name can get has its row
    named = {kind for kind, _ in ps.KERNEL_MARKS if kind != ps.GEMM}
    assert set(ps.KINDS) == named | {ps.BLOCK_GEMMS, ps.ADAPTER_GEMMS, ps.HEAD_GEMMS, "other"}


def _event(name: str, us: float, **fields: Any) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=0.0, end=us), **fields)


def test_a_profile_is_read_from_its_device_kernels_and_the_kernels_its_gemm_ops_launched() -> None:
    device = [
        _event(name, us, device_type=DeviceType.CUDA, is_user_annotation=False)
        for name, us in KERNELS.items()
    ]
    annotation = _event("backward", 9e9, device_type=DeviceType.CUDA, is_user_annotation=True)
    host = [
        _event(
            op,
            0.0,
            device_type=DeviceType.CPU,
            input_shapes=shapes,
            kernels=[SimpleNamespace(name=k, duration=us)],
        )
        for op, shapes, k, us in LAUNCHES
    ]
    linear = _event("aten::linear", 0.0, device_type=DeviceType.CPU, input_shapes=[[4096, RANK]], kernels=[])
    profile = SimpleNamespace(events=lambda: [*device, annotation, *host, linear])
    table = ps.breakdown_table(
        KERNELS.items(), [launch[1:] for launch in LAUNCHES], 2, rank=RANK, vocab=VOCAB
    )
    assert ps.step_breakdown(profile, 2, rank=RANK, vocab=VOCAB) == table
    assert ps.breakdown_table([], [], 2, rank=RANK, vocab=VOCAB) == "no device kernels profiled (a CPU run)\n"
