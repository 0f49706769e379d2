"""Model state: the checkpoint transformation graph and streaming safetensors IO.

A ``ModelStateMapper`` declares groups of keys read together and the keys they become; composites
(``Sequential``, ``Parallel``, ``Scope``, ``per_layer``) build one graph from the disk layout to the module
layout, and ``inverse()`` gives the way back. ``CheckpointReader`` streams a checkpoint through a graph group by
group; ``ShardedWriter`` writes HF-style shards atomically; ``load_into_module``, ``save_from_module`` and
``convert`` put them together; ``DCPReader`` reads the model state of a training checkpoint the same way (both
readers share one loop, ``stream.MappedReader``). ``lightning_d9d.state.training`` owns the training checkpoint
format (file names, sections, atomic save, checked load); ``atomic.AtomicDirectory`` makes both kinds of
checkpoint directory appear complete or not at all. ``lightning_d9d.state.hf`` holds the Hugging Face formats of
the shipped models.
"""

from .compose import Parallel, Scope, Sequential, Subset, chain, per_layer, select_prefix
from .dcp import DCPReader
from .dtensor import Distribute, Gather
from .errors import (
    CheckpointError,
    CheckpointFileError,
    ConfigMismatchError,
    CorruptIndexError,
    CorruptShardError,
    KeyCoverageError,
    MapperError,
    MissingKeyError,
    MissingShardError,
    NotInvertibleError,
    ShapeMismatchError,
)
from .graph import check_coverage, infer_shapes
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
from .module_io import convert, load_into_module, module_tensors, save_from_module, tied_aliases
from .reader import INDEX_NAME, SINGLE_FILE_NAME, CheckpointReader, GroupResult, ReadPlan, TensorInfo
from .writer import DEFAULT_MAX_SHARD_BYTES, ShardedWriter, parse_size

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
    "ConfigMismatchError",
    "CorruptIndexError",
    "CorruptShardError",
    "DCPReader",
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
    "Subset",
    "TensorInfo",
    "Transpose",
    "Unstack",
    "chain",
    "check_coverage",
    "convert",
    "infer_shapes",
    "load_into_module",
    "module_tensors",
    "parse_size",
    "per_layer",
    "save_from_module",
    "select_prefix",
    "tied_aliases",
]
