"""The degrees a d9d strategy resolves and the mesh it builds, shared by the Trainer's and Fabric's strategies."""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from lightning_d9d.mesh import ParallelDims


class MeshTopology:
    """``parallel_dims``, ``device_mesh`` and the distributed sampler's ranks of a strategy that holds
    ``_dims`` (set by its ``setup_environment``)."""

    _dims: ParallelDims | None
    # where the strategy's mesh comes from, for the error raised before it exists
    _mesh_ready_after = "the processes are set up"

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
