"""Lightning callbacks: Hugging Face weights in (``LoadHFWeights``) and out (``ExportHF``) of a training run, the
auxiliary-loss-free MoE bias update with the experts' load (``ExpertLoadBalancing``), training speed
(``Throughput``: tokens/s, TFLOP/s, MFU, step time, peak memory), and Python's garbage collector at fixed steps
(``GarbageCollection``), and a clean stop with a checkpoint on a preemption signal (``Preemption``)."""

from lightning_d9d.callbacks.garbage_collection import GarbageCollection
from lightning_d9d.callbacks.hf import ExportHF, LoadHFWeights, find_hf_model
from lightning_d9d.callbacks.moe import ExpertLoadBalancing
from lightning_d9d.callbacks.preemption import Preemption
from lightning_d9d.callbacks.throughput import PEAK_BF16_FLOPS, Throughput, count_input_tokens, peak_flops_of

__all__ = [
    "PEAK_BF16_FLOPS",
    "ExpertLoadBalancing",
    "ExportHF",
    "GarbageCollection",
    "LoadHFWeights",
    "Preemption",
    "Throughput",
    "count_input_tokens",
    "find_hf_model",
    "peak_flops_of",
]
