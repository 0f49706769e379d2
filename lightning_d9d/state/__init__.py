"""Model state: the checkpoint transformation graph and streaming safetensors IO.

A ``ModelStateMapper`` declares groups of keys read together and the keys they become; composites
(``Sequential``, ``Parallel``, ``Scope``, ``per_layer``) build one graph from the disk layout to the module
layout, and ``inverse()`` gives the way back. ``CheckpointReader`` streams a checkpoint through a graph group by
group; ``ShardedWriter`` writes HF-style shards atomically; ``load_into_module``, ``save_from_module`` and
``convert`` put them together.
"""

from .compose import Parallel, Scope, Sequential, chain, per_layer, select_prefix
from .dtensor import Distribute, Gather
from .errors import (
    CheckpointError,
    CheckpointFileError,
    CorruptIndexError,
    CorruptShardError,
    KeyCoverageError,
    MapperError,
    MissingKeyError,
    MissingShardError,
    NotInvertibleError,
    ShapeMismatchError,
)
from .graph import check_coverage
from .mapper import (
    Cast,
    Chunk,
    Concat,
    Drop,
    Group,
    Identity,
    ModelStateMapper,
    Rename,
    Stack,
    Transpose,
    Unstack,
)
from .module_io import convert, load_into_module, save_from_module
from .reader import INDEX_NAME, SINGLE_FILE_NAME, CheckpointReader, GroupResult, ReadPlan
from .writer import DEFAULT_MAX_SHARD_BYTES, ShardedWriter

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_NAME",
    "SINGLE_FILE_NAME",
    "Cast",
    "CheckpointError",
    "CheckpointFileError",
    "CheckpointReader",
    "Chunk",
    "Concat",
    "CorruptIndexError",
    "CorruptShardError",
    "Distribute",
    "Drop",
    "Gather",
    "Group",
    "GroupResult",
    "Identity",
    "KeyCoverageError",
    "MapperError",
    "MissingKeyError",
    "MissingShardError",
    "ModelStateMapper",
    "NotInvertibleError",
    "Parallel",
    "ReadPlan",
    "Rename",
    "Scope",
    "Sequential",
    "ShapeMismatchError",
    "ShardedWriter",
    "Stack",
    "Transpose",
    "Unstack",
    "chain",
    "check_coverage",
    "convert",
    "load_into_module",
    "per_layer",
    "save_from_module",
    "select_prefix",
]
