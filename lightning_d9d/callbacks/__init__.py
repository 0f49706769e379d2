"""Lightning callbacks: Hugging Face weights in (``LoadHFWeights``) and out (``ExportHF``) of a training run."""

from lightning_d9d.callbacks.hf import ExportHF, LoadHFWeights, find_hf_model

__all__ = ["ExportHF", "LoadHFWeights", "find_hf_model"]
