"""Parallel degrees, their validation, and the device mesh with its named views.

The mesh dims are ``pp, dp_replicate, dp_shard, cp, tp`` (outermost first). Everything that can be checked
without a process group is checked here, so a bad configuration fails before any collective starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from math import prod
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Views made by flattening several mesh dims into one. "batch" is an alias of "dp" (see ``mesh_for``).
_FLATTENED_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),
    "fsdp": ("dp_shard", "cp"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
}
# Views that only differ from another one under tp (made only then: each flattened view is a process group).
_ROUTING_VIEWS = {
    "sequence": ("cp", "tp"),
    "routing": ("dp_replicate", "dp_shard", "cp", "tp"),
}
VIEW_NAMES = (
    *MESH_DIM_NAMES, "dp", "batch", "fsdp", "loss", "hsdp", "sequence", "routing", "ep", "efsdp", "ehsdp",
)  # fmt: skip
# The expert layout: the dp_shard*cp*tp ranks of each (pp, dp_replicate) cell cut into ``efsdp`` groups of
# ``ep`` consecutive ranks (ep innermost: an ep group is ranks next to each other, on one host when it can be).
EXPERT_MESH_DIM_NAMES = ("pp", "dp_replicate", "efsdp", "ep")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the 6-D layout. ``dp_shard=-1`` means "whatever the world size leaves over".

    ``ep`` (expert parallel) is not a mesh dim of its own: it is carved out of ``dp_shard * cp * tp``. With
    ``ep > 1`` a second mesh of the same ranks, ``(pp, dp_replicate, efsdp, ep)``, holds the expert layout:
    experts are sharded over ``ep`` and their shards over the remaining ``efsdp = dp_shard*cp*tp / ep`` ranks.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    _views: dict[str, DeviceMesh] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("mesh", "_views"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{f.name} must be an int, got {value!r} ({type(value).__name__})")
            if f.name == "dp_shard" and value == -1:
                continue
            if value < 1:
                hint = " (or -1 for 'the rest of the world')" if f.name == "dp_shard" else ""
                raise ValueError(f"{f.name} ({value}) must be a positive integer{hint}")

    # ----------------------------------------------------------------------------------------- degrees
    @property
    def is_resolved(self) -> bool:
        return self.dp_shard != -1

    @property
    def world_size(self) -> int:
        self._require_resolved("world_size")
        return prod(getattr(self, name) for name in MESH_DIM_NAMES)

    def resolve(self, world_size: int) -> ParallelDims:
        """Fill in ``dp_shard=-1`` and check that the degrees tile ``world_size`` exactly."""
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be positive")
        fixed = self.pp * self.dp_replicate * self.cp * self.tp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % fixed != 0:
                raise ValueError(
                    f"dp_shard=-1 cannot be resolved: pp*dp_replicate*cp*tp = {self.pp}*{self.dp_replicate}*"
                    f"{self.cp}*{self.tp} = {fixed} does not divide the world size ({world_size}). "
                    f"Choose degrees whose product divides {world_size}, or change the number of devices."
                )
            dp_shard = world_size // fixed
        product = fixed * dp_shard
        if product != world_size:
            raise ValueError(
                f"the mesh pp*dp_replicate*dp_shard*cp*tp = {self.pp}*{self.dp_replicate}*{dp_shard}*{self.cp}*"
                f"{self.tp} = {product} does not match the world size ({world_size}). Set dp_shard=-1 to fill "
                f"the rest, or change the degrees or the number of devices so that they multiply to {world_size}."
            )
        ep_domain = dp_shard * self.cp * self.tp
        if ep_domain % self.ep != 0:
            raise ValueError(
                f"ep ({self.ep}) must divide dp_shard*cp*tp ({dp_shard}*{self.cp}*{self.tp} = {ep_domain}): "
                "experts are sharded over those ranks."
            )
        return replace(self, dp_shard=dp_shard)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed at once."""
        self._require_resolved("dp")
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks that parameters are sharded over (context-parallel ranks shard parameters too)."""
        self._require_resolved("fsdp")
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks that one expert shard is sharded over (the data ranks of the ep domain that hold the same
        experts): ``dp_shard * cp * tp / ep``."""
        self._require_resolved("efsdp")
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    # -------------------------------------------------------------------------------------------- mesh
    def build_mesh(self, device_type: str, timeout: timedelta | None = None) -> ParallelDims:
        """Create the device mesh (a collective-free call once the process group exists). ``timeout``: the
        collective timeout of every process group the mesh makes (its dims over a subset of the ranks, the
        flattened views, the expert mesh), as the default group's; None keeps torch's defaults there."""
        self._require_resolved("build_mesh")
        # Imported here, not at the top: compat imports Lightning, and the checkpoint code reaches this package
        # (mesh.arrival) from `python -m lightning_d9d.convert`, which must not pay for importing Lightning.
        from lightning_d9d.compat import flatten_mesh, group_options

        options = group_options(timeout)
        shape = tuple(getattr(self, name) for name in MESH_DIM_NAMES)
        mesh = init_device_mesh(
            device_type,
            shape,
            mesh_dim_names=MESH_DIM_NAMES,
            backend_override=dict.fromkeys(MESH_DIM_NAMES, options) if options else None,
        )
        # Keep the flattened meshes themselves: slicing flattened dims out of the root mesh is deprecated.
        views = {name: mesh[name] for name in MESH_DIM_NAMES}
        views.update(
            {view: flatten_mesh(mesh, dims, view, options) for view, dims in _FLATTENED_VIEWS.items()}
        )
        views["batch"] = views["dp"]
        views["hsdp"] = mesh["dp_replicate", "dp_shard"] if self.cp == 1 else mesh["dp_replicate", "fsdp"]
        if self.tp > 1:
            views.update(
                {view: flatten_mesh(mesh, dims, view, options) for view, dims in _ROUTING_VIEWS.items()}
            )
        else:
            views.update(sequence=views["cp"], routing=views["loss"])
        views.update(self._expert_views(mesh, views, options))
        return replace(self, mesh=mesh, _views=views)

    def _expert_views(
        self, mesh: DeviceMesh, views: dict[str, DeviceMesh], options: tuple[str, Any] | None = None
    ) -> dict[str, DeviceMesh]:
        """``ep``, ``efsdp`` and the 2-D ``ehsdp`` (dp_replicate, efsdp). Without ep, experts shard like every
        other parameter (``efsdp`` is ``fsdp``) and no extra process group is made."""
        if self.ep == 1:
            return {"efsdp": views["fsdp"], "ehsdp": views["hsdp"]}
        ranks = mesh.mesh.reshape(self.pp, self.dp_replicate, self.efsdp, self.ep)
        # Its own root (ep cuts across dp_shard, cp and tp), so that FSDP can compose efsdp with ep: both are
        # dims of one mesh, as FSDP requires of a data-parallel mesh and the mesh its parameters are split on.
        expert_mesh = DeviceMesh(
            mesh.device_type,
            ranks,
            mesh_dim_names=EXPERT_MESH_DIM_NAMES,
            backend_override=(options,) * len(EXPERT_MESH_DIM_NAMES) if options else None,
        )
        return {
            "ep": expert_mesh["ep"],
            "efsdp": expert_mesh["efsdp"],
            "ehsdp": expert_mesh["dp_replicate", "efsdp"],
        }

    def mesh_for(self, view: str) -> DeviceMesh:
        """A named view of the mesh.

        ``pp, dp_replicate, dp_shard, cp, tp``: single dims; ``dp`` / ``batch``: ranks that see different data
        (samplers, metrics); ``fsdp``: parameter sharding (dp_shard*cp); ``loss``: ranks whose losses are
        averaged (dp*cp); ``hsdp``: the 2-D (dp_replicate, fsdp) mesh used for HSDP; ``sequence``: the ranks that
        hold parts of the same sequences when MoE blocks route (cp*tp: under tp each rank routes its sequence
        shard); ``routing``: the ranks that route different tokens (dp*cp*tp); ``ep``: the ranks that
        split the experts (only when ep > 1); ``efsdp``: the ranks that shard one expert shard; ``ehsdp``: the
        2-D (dp_replicate, efsdp) mesh for the experts under HSDP.
        """
        if self.mesh is None:
            raise RuntimeError(
                "ParallelDims.mesh_for() needs a mesh: call build_mesh() after the process group exists"
            )
        if view == "ep" and self.ep == 1:
            raise KeyError("the 'ep' mesh view exists only when ep > 1 (experts are not split over ranks)")
        if view not in self._views:
            raise KeyError(f"unknown mesh view {view!r}; known views: {', '.join(VIEW_NAMES)}")
        return self._views[view]

    def _require_resolved(self, what: str) -> None:
        if not self.is_resolved:
            raise RuntimeError(f"ParallelDims.{what} needs resolved degrees: call resolve(world_size) first")
