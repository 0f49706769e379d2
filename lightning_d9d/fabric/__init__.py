"""Lightning Fabric glue: ``Fabric(strategy="d9d")`` for a training loop of one's own (``strategy.py``) and its
checkpoints in the Trainer's format (``checkpoint.py``)."""

from lightning_d9d.fabric.strategy import D9DFabricStrategy

__all__ = ["D9DFabricStrategy"]
