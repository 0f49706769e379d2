"""Configuration errors surface while the Trainer is built: before any process is launched or collective runs."""

from __future__ import annotations

import lightning as L
import pytest
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry

import lightning_d9d
from lightning_d9d import D9DStrategy


def make_trainer(strategy: object, devices: int, **kwargs: object) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, logger=False, **kwargs)  # type: ignore[arg-type]


def test_string_strategy_is_registered_once() -> None:
    assert "d9d" in StrategyRegistry
    D9DStrategy.register_strategies(StrategyRegistry)  # a second import must not raise
    trainer = make_trainer("d9d", devices=2)
    assert isinstance(trainer.strategy, D9DStrategy)
    assert isinstance(trainer.strategy.precision_plugin, lightning_d9d.D9DPrecision)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "devices", "message"),
    [
        ({"dp_shard": 3}, 2, "= 3 does not match the world size (2)"),
        ({"dp_replicate": 3}, 4, "does not divide the world size (4)"),
    ],
)
def test_mesh_that_does_not_tile_the_world(kwargs: dict, devices: int, message: str) -> None:
    with pytest.raises(ValueError) as error:
        make_trainer(D9DStrategy(**kwargs), devices=devices)
    assert message in str(error.value)
    assert not dist.is_initialized()


def test_negative_degree() -> None:
    with pytest.raises(ValueError, match=r"dp_replicate \(-1\) must be a positive integer"):
        D9DStrategy(dp_replicate=-1)


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown pipeline_schedule 'zigzag'; choose one of: GPipe, 1F1B"):
        D9DStrategy(pipeline_schedule="zigzag")
    assert D9DStrategy(pipeline_schedule="interleaved1f1b").pipeline_schedule == "Interleaved1F1B"


def test_unknown_compile_mode_names_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"compile='fast': use True, False or one of torch\.compile's modes 'default'"
    ):
        D9DStrategy(compile="fast")
    D9DStrategy(compile="max-autotune-no-cudagraphs")  # a torch.compile mode is accepted


def test_selective_recompute_of_pipelined_expert_parallel_stages_is_refused() -> None:
    """Torch's replay fails in the first backward there (its fix is in no torch version yet): refused when the strategy
    is built, naming the working alternatives; each degree alone with selective is accepted."""
    with pytest.raises(
        ValueError, match=r"'selective' with pp=2 and ep=2: .* use activation_checkpointing=True"
    ):
        D9DStrategy(pp=2, ep=2, activation_checkpointing="selective")
    D9DStrategy(pp=2, ep=2, activation_checkpointing=True)
    D9DStrategy(pp=2, activation_checkpointing="selective")
    D9DStrategy(ep=2, activation_checkpointing="selective")


def test_one_checkpoint_file_under_a_pipeline_is_refused() -> None:
    """Lightning's file save would hold rank 0's stage only (the other layers, the norm and the head lost)."""
    with pytest.raises(ValueError, match=r"pp=2, save_distributed_checkpoint=False\) would save only rank 0"):
        D9DStrategy(pp=2, save_distributed_checkpoint=False)
    D9DStrategy(pp=2)
    D9DStrategy(dp_shard=2, save_distributed_checkpoint=False)  # every rank's module is the whole model


def test_every_degree_has_a_plan() -> None:
    # ep is left to the model's plan (Qwen3-MoE splits experts; dense models and the default plan refuse it)
    assert D9DStrategy(ep=2)._requested_dims.ep == 2


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precision(precision: str) -> None:
    with pytest.raises(ValueError, match=f"precision='{precision}' is not supported by the d9d strategy"):
        make_trainer("d9d", devices=1, precision=precision)


@pytest.mark.parametrize(
    ("precision", "expected"), [("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-true")]
)
def test_precision_plugin_follows_the_trainer(precision: str, expected: str) -> None:
    trainer = make_trainer("d9d", devices=1, precision=precision)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, lightning_d9d.D9DPrecision)
    assert plugin.precision == expected
    policy = plugin.mixed_precision_policy()
    if precision == "bf16-mixed":
        assert policy is not None and str(policy.param_dtype) == "torch.bfloat16"
        assert str(policy.reduce_dtype) == "torch.float32"
    else:
        assert policy is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pp": 2, "pipeline_schedule": "1F1B", "microbatches": 1}, r"microbatches \(1\) must be at least"),
        ({"pp": 2, "pipeline_schedule": "ZBVZeroBubble", "stages_per_rank": 1}, "needs stages_per_rank=2"),
        ({"pp": 2, "pipeline_schedule": "GPipe", "stages_per_rank": 2}, "use Interleaved1F1B or LoopedBFS"),
        ({"pp": 2, "pipeline_schedule": "Interleaved1F1B", "microbatches": 5}, r"multiple of pp \(2\)"),
        ({"pp": 2, "microbatches": 0}, r"microbatches \(0\) must be positive"),
    ],
)
def test_bad_pipeline_configurations(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        D9DStrategy(**kwargs)
    assert not dist.is_initialized()


def test_v_schedules_default_to_two_stages_per_rank() -> None:
    strategy = D9DStrategy(pp=2, pipeline_schedule="DualPipeV")
    assert (strategy.pipeline.stages_per_rank, strategy.pipeline.microbatches) == (2, 4)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_split_backward_schedules_keep_parameters_gathered_until_backward(schedule: str) -> None:
    assert not D9DStrategy(pp=2, pipeline_schedule=schedule).parallel_options().reshard_after_forward
    # elsewhere the choice stands: the default (None: free where sharded) or what was asked
    assert D9DStrategy(pp=2, pipeline_schedule="1F1B").parallel_options().reshard_after_forward is None
    options = D9DStrategy(pp=2, pipeline_schedule="1F1B", reshard_after_forward=True).parallel_options()
    assert options.reshard_after_forward


def test_every_torch_schedule_is_accepted() -> None:
    from lightning_d9d.pipeline import SCHEDULES

    torch_schedules = {
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    }
    assert set(SCHEDULES) == torch_schedules


def test_tensorwise_fp8_under_tp_off_cuda_is_refused_when_the_trainer_or_fabric_is_built() -> None:
    """gloo has no float8 type for tp's float8 all-gathers: refused by name before any process starts."""
    from lightning_d9d import D9DFabricStrategy

    with pytest.raises(
        ValueError, match=r"D9DStrategy: fp8='tensorwise' with tp=2 on 'cpu': .*use CUDA GPUs"
    ):
        L.Trainer(strategy=D9DStrategy(tp=2, fp8="tensorwise"), accelerator="cpu", devices=2, logger=False)
    with pytest.raises(ValueError, match=r"D9DFabricStrategy: fp8='tensorwise' with tp=2 on 'cpu'"):
        L.Fabric(strategy=D9DFabricStrategy(tp=2, fp8="tensorwise"), accelerator="cpu", devices=2)
    L.Trainer(strategy=D9DStrategy(dp_shard=2, fp8="tensorwise"), accelerator="cpu", devices=2, logger=False)
