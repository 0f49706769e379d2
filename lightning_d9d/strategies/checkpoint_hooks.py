"""``D9DStrategy``'s checkpoint hooks: Lightning's save, load and remove on the training-checkpoint format
(``state/training.py``: atomic, a manifest, every rank's RNG states), background saves (``async_save.py``) and
their place in the fit, a LoRA run's frozen base (``state/frozen.py``), and where a resume picks up
(``resume.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeAlias

from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.optim import Optimizer
from typing_extensions import override

from lightning_d9d.callbacks.hf import LoadHFWeights
from lightning_d9d.plans import ParallelOptions
from lightning_d9d.state import frozen as frozen_checkpoint
from lightning_d9d.state import selection as checkpoint_selection
from lightning_d9d.state import training as training_checkpoint
from lightning_d9d.strategies.async_save import AsyncSaves
from lightning_d9d.strategies.hf_record import with_hf_config
from lightning_d9d.strategies.optimizers import unwrap_optimizer
from lightning_d9d.strategies.resume import PendingRandomState, resume_where_fit_stopped

FilePath: TypeAlias = str | Path  # a checkpoint path, as Lightning's strategy hooks take it


def check_checkpoint_format(save_distributed_checkpoint: bool, *, pp: int) -> None:
    """Refuse one full checkpoint file under a pipeline: Lightning's file save gathers the state of rank 0's
    module, which under ``pp > 1`` holds only its own stages (the other layers, the final norm and the head
    would be missing from the file, silently)."""
    if not save_distributed_checkpoint and pp > 1:
        raise ValueError(
            f"D9DStrategy(pp={pp}, save_distributed_checkpoint=False) would save only rank 0's pipeline stage: "
            "keep save_distributed_checkpoint=True (the default: every stage, atomic, with a manifest); for one "
            "set of weight files, export with the ExportHF callback or `python -m lightning_d9d.convert dcp-to-hf`"
        )


class CheckpointHooks(ModelParallelStrategy):
    """The checkpoint part of ``D9DStrategy`` (a base of it, never used alone)."""

    # set by D9DStrategy's constructor
    _options: ParallelOptions
    _async_saves: AsyncSaves | None  # with async_save=True
    _resumed_random_state: PendingRandomState  # a resume's, put back at its first batch

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not (self._async_saves is not None and self._in_training_loop()):
            state = super().lightning_module_state_dict()
        else:  # a background save stages the tensors into its pinned buffers: no synchronous copy to CPU here
            assert self.model is not None
            state = get_model_state_dict(self.model, options=StateDictOptions(cpu_offload=False))
        if self._options.lora is not None and self._save_distributed_checkpoint:
            # LoRA: the frozen base is left out, its fingerprint recorded instead (save_checkpoint, state/frozen.py)
            assert self.model is not None
            frozen = frozen_checkpoint.frozen_names(self.model)
            state = {key: value for key, value in state.items() if key not in frozen}
        return state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        optimizer = unwrap_optimizer(optimizer)
        assert self.model is not None
        # a background save stages the state into its pinned buffers: no synchronous copy to CPU here first
        on_device = self._async_saves is not None and self._in_training_loop()
        return training_checkpoint.optimizer_state(self.model, optimizer, cpu_offload=not on_device)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: FilePath, storage_options: Any | None = None
    ) -> None:
        resume_where_fit_stopped(checkpoint)  # saved after fit returned: resume at the next batch, not epoch
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError("D9DStrategy.save_checkpoint(..., storage_options=...) is not supported")
        # Collective: every rank returns once the directory is in place, or raises (all, with the reason).
        # with the model's HF config when it has one: `convert dcp-to-hf` then needs no --config
        path, content = self.broadcast(Path(filepath)), with_hf_config(checkpoint, self.lightning_module)
        if self._options.lora is not None and self.model is not None:
            content[frozen_checkpoint.FINGERPRINT_KEY] = frozen_checkpoint.fingerprint(self.model)
            # the settings `convert dcp-to-hf --base` merges the adapters with
            content[frozen_checkpoint.LORA_KEY] = frozen_checkpoint.lora_record(
                self._options.lora, self.model
            )
        if self._async_saves is not None and self._in_training_loop():
            self._async_saves.save(path, content)
            return
        # the save in flight first: it is the older checkpoint, and a save of the same name (last.ckpt at the end
        # of the last epoch) would remove its temporary directory
        self.finish_pending_saves()
        training_checkpoint.save(path, content)

    def finish_pending_saves(self) -> None:
        """Complete the checkpoint being written in the background (``async_save=True``), if any: every rank calls
        it (a collective). ``Preemption`` does before the requeue that ends the job."""
        if self._async_saves is not None:
            self._async_saves.finish()

    def _in_training_loop(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.training and not trainer.fit_loop.done

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._async_saves is not None:
            self._async_saves.setup()
            assert self.lightning_module is not None
            # ModelCheckpoint(save_last="link") links last.ckpt as soon as save_checkpoint returns
            self._async_saves.link_when_complete(self.lightning_module.trainer.checkpoint_callbacks)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The checkpoint's random states, if no ResumableDataLoader put them back at its first batch already (a
        # loader of the user's with its own state_dict): here, once, where the resume is mid-epoch. At an epoch
        # boundary the load's restore stands (the new iterator draws its seed from it, as uninterrupted).
        if self._async_saves is not None:  # a background save whose writes all ended becomes complete here
            self._async_saves.poll()
        if batch_idx > 0:
            self._resumed_random_state.restore()
        self._resumed_random_state.discard()

    @override
    def on_train_end(self) -> None:
        if self._async_saves is not None:  # the last save in flight completes before fit returns
            self._async_saves.close()
            self._async_saves.restore_links()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._async_saves is not None:
            self._async_saves.abandon()
            self._async_saves.restore_links()
        super().on_exception(exception)

    @override
    def load_checkpoint(self, checkpoint_path: FilePath, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if path.is_file():  # a checkpoint saved without a distributed checkpoint (Lightning's own format)
            refusal = checkpoint_selection.hf_model_error(path)  # a model's safetensors: LoadHFWeights' input
            if refusal is not None:
                raise refusal
            # weights_only unless the caller asked otherwise, as for meta.pt: a checkpoint is untrusted input
            checkpoint = super().load_checkpoint(path, weights_only is not False)
            resume_where_fit_stopped(checkpoint)  # written by another strategy, or by Lightning itself
            return checkpoint
        assert self.model is not None and self.lightning_module is not None
        optimizers = {i: opt for i, opt in enumerate(self.optimizers)}
        meta = training_checkpoint.load(
            path,
            self.model,
            optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
            frozen=self._frozen_base() if self._options.lora is not None else None,
        )
        self._resumed_random_state.capture()  # the states the load put back
        resume_where_fit_stopped(meta)
        return meta

    def _frozen_base(self) -> dict[str, tuple[float, float, int]]:
        """LoRA: the frozen base's fingerprint, once ``LoadHFWeights`` loaded it (a LoRA checkpoint holds none)."""
        assert self.model is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, LoadHFWeights):
                callback.load_frozen_base(trainer, self.lightning_module)
        return frozen_checkpoint.fingerprint(self.model)

    @override
    def remove_checkpoint(self, filepath: FilePath) -> None:
        # ModelCheckpoint deletes the checkpoint a new one replaces as soon as save_checkpoint returns: while that
        # one is written in the background the deletion waits for it to be complete
        path = Path(filepath)
        if self._async_saves is None or not self._async_saves.remove_when_complete(path, self._remove_now):
            self._remove_now(path)

    def _remove_now(self, path: Path) -> None:
        # save_top_k / keep-last-N never deletes the only complete checkpoint of its folder (it logs why)
        if self.is_global_zero and checkpoint_selection.keep(path):
            return
        super().remove_checkpoint(path)
