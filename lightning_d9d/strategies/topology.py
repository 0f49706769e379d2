"""The degrees a d9d strategy was given, the mesh it builds from them and the views it reads, shared by the
Trainer's and Fabric's strategies."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_d9d.mesh import ParallelDims
from lightning_d9d.plans import IMPLEMENTED, ParallelOptions, require_degrees
from lightning_d9d.plans.async_tp import enable_async_tp
from lightning_d9d.strategies.options import check_options_on_device, checked_parallel_options
from lightning_d9d.strategies.process_exit import destroy_process_group_at_exit


class MeshTopology:
    """``parallel_dims``, ``device_mesh`` and the distributed sampler's ranks of a d9d strategy, from the degrees
    and plan options its constructor takes (:meth:`_take_degrees`) and the mesh its ``setup_environment`` builds
    (:meth:`_build_mesh`)."""

    _owner = "the d9d strategy"  # the class the errors name
    # where the strategy's mesh comes from, for the error raised before it exists
    _mesh_ready_after = "the processes are set up"
    _requested_dims: ParallelDims  # as given: dp_shard=-1 until resolved against the world
    _options: ParallelOptions  # as given, checked; the precision's part is set when the plans apply
    _dims: ParallelDims | None  # resolved, with the mesh: set by setup_environment

    if TYPE_CHECKING:  # from the Lightning or Fabric strategy this class is mixed into
        _timeout: timedelta | None
        _device_mesh: DeviceMesh | None
        num_nodes: int

        @property
        def num_processes(self) -> int: ...

        @property
        def root_device(self) -> torch.device: ...

        def _setup_distributed(self) -> None: ...

    def _take_degrees(self, dims: ParallelDims, **options: Any) -> None:
        """The constructor's part: the degrees (one without a plan refused: every degree has one, and this
        keeps a degree added to ParallelDims from training without one) and the plan options, each refused here
        if it cannot apply, before any process group."""
        require_degrees(dims, supported=IMPLEMENTED, owner=self._owner)
        self._requested_dims = dims
        self._dims = None
        self._options = checked_parallel_options(dims, owner=self._owner, **options)

    def _resolve_dims(self) -> ParallelDims:
        return self._requested_dims.resolve(self.num_nodes * self.num_processes)

    def _check_options_on_device(self, dims: ParallelDims) -> None:
        """What the accelerator decides (async tp and some FP8 layouts need CUDA), before any process group."""
        check_options_on_device(self._options, dims, self.root_device.type, owner=self._owner)

    def _build_mesh(self, dims: ParallelDims) -> None:
        """The process group, then the mesh of ``dims``; with async tp, the tp group in symmetric memory (before
        any block compiles)."""
        self._setup_distributed()
        destroy_process_group_at_exit()  # not left to the interpreter's teardown, where gloo can abort
        self._dims = dims.build_mesh(self.root_device.type, timeout=self._timeout)
        self._device_mesh = self._dims.mesh
        if self._options.async_tp:
            enable_async_tp(self._dims.mesh_for("tp").get_group().group_name)

    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved degrees and the mesh (available once the processes are set up)."""
        if self._dims is None or self._dims.mesh is None:
            raise RuntimeError(
                f"{type(self).__name__}.parallel_dims is available after {self._mesh_ready_after}"
            )
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        mesh = self.parallel_dims.mesh
        assert mesh is not None
        return mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the ranks that hold different samples: the data-parallel ranks (pp, cp and tp peers share a batch)
        dp_mesh = self.parallel_dims.mesh_for("dp")
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}
