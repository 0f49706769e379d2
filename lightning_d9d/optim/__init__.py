"""Optimizers that know how the strategy keeps parameters."""

from lightning_d9d.optim.master_weights import MasterWeightAdamW, check_master_weight_run

__all__ = ["MasterWeightAdamW", "check_master_weight_run"]
