"""Optimizers that know how the strategy keeps parameters."""

from lightning_d9d.optim.master_weights import MasterWeightAdamW, check_master_weight_run
from lightning_d9d.optim.muon import Muon, default_muon_rule, muon_param_groups, newton_schulz
from lightning_d9d.optim.stochastic_adamw import StochasticAdamW

__all__ = [
    "MasterWeightAdamW",
    "Muon",
    "StochasticAdamW",
    "check_master_weight_run",
    "default_muon_rule",
    "muon_param_groups",
    "newton_schulz",
]
