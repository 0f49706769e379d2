"""The device mesh: parallel degrees, their validation and the named mesh views."""

from lightning_d9d.mesh.parallel_dims import MESH_DIM_NAMES, VIEW_NAMES, ParallelDims

__all__ = ["MESH_DIM_NAMES", "VIEW_NAMES", "ParallelDims"]
