"""Optimizers that know how the strategy keeps parameters."""

from lightning_d9d.optim.master_weights import MasterWeightAdamW, check_master_weight_run
from lightning_d9d.optim.muon import Muon, default_muon_rule, muon_param_groups, newton_schulz

__all__ = [
    "MasterWeightAdamW",
    "Muon",
    "check_master_weight_run",
    "default_muon_rule",
    "muon_param_groups",
    "newton_schulz",
]
