"""The LM head fused with its loss for a ``transformers`` causal LM, as our own models have it.

``model_loss(model, inputs, labels, causal_lm_loss)`` on a ``transformers`` causal LM (``Qwen3ForCausalLM``,
``LlamaForCausalLM``, ...) computes the mean cross-entropy from the base model's last hidden states and the head's
weight chunk by chunk (:func:`~lightning_d9d.kernels.linear_cross_entropy`): no ``[tokens, vocab]`` logits, the
same loss as ``causal_lm_loss(model(*inputs), labels)``. Where it runs and where the logits path runs instead (the
loss, ``$LIGHTNING_D9D_FUSED_LOSS``, tensor parallelism) is decided as for our models, by the loss layer
(:mod:`lightning_d9d.loss.head`); this module says whether a ``transformers`` model's head *can* be fused, and runs
it: :class:`TransformersHead` declares the head as our models declare theirs
(:class:`~lightning_d9d.modules.head.FusedHead`).

Fused only where that is the model's own loss on its own logits (:func:`decoder_inputs` answers ``None``
otherwise, and the logits path runs):

- the head (``get_output_embeddings()``) is a plain bias-free ``nn.Linear``;
- the causal LM's ``forward`` computes its logits once, as ``self.lm_head(hidden_states)`` on the base model's
  last hidden states (sliced by ``logits_to_keep`` at most), and never changes them. This is read from the
  ``forward``'s own syntax tree, so a family that soft-caps (Gemma 2: ``final_logit_softcapping``), scales
  (Granite's ``logits_scaling``, Cohere's ``logit_scale``) or shifts the logits or the hidden states before the
  head keeps the logits path; a config field known to change the logits (:data:`LOGIT_FIELDS`) refuses too.
  A branch under ``if self.config.<field> is not None:`` whose field the config leaves None is not read: Gemma 3
  soft-caps its logits there, and its ``final_logit_softcapping`` is None by default;
- the decoder (``get_decoder()``) is the base model (``base_model``), so that running it is what ``forward``
  runs before the head (a vision-language model's decoder is not: it keeps the logits path);
- ``inputs`` bind to parameters of the causal LM's ``forward`` that the base model takes too
  (``input_ids``, ``attention_mask``, ``position_ids``, ``inputs_embeds``, ...; a ``None`` counts as not given):
  ``labels``, ``logits_to_keep`` or a cache keep the logits path.

Under pp the fused head never runs (the adapter's stages take no labels): the last stage returns the logits, after
the steps the forward takes on the head's output (:func:`logit_steps`: Gemma 2's soft cap, Granite's and Cohere's
scales, read from the same syntax tree and repeated in its order), and the loss runs on them.

The base model runs with ``use_cache=False``. Under FSDP the head belongs to the root's unit, whose parameters
FSDP gathers only around its ``forward`` and the methods registered with ``register_fsdp_forward_method``: the
fused loss runs as such a method, set on the model instance (:data:`FORWARD_LOSS`).

Nothing here imports ``transformers``.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import operator
import textwrap
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from lightning_d9d.kernels.linear_cross_entropy import linear_cross_entropy
from lightning_d9d.modules.head import HeadLoss
from lightning_d9d.modules.hf_init import is_transformers_model
from lightning_d9d.modules.inputs import ModelInputs

# Config fields with which a family changes its logits after the head (not None: the logits path runs).
LOGIT_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "logit_scale", "logits_scaling")
# Arguments of the causal LM's forward that the fused path does not take (the logits path runs).
NOT_FUSED = ("labels", "logits_to_keep", "num_logits_to_keep", "use_cache", "cache", "past_key_values")
# The instance method the fused loss runs as (registered with FSDP on an FSDP root).
FORWARD_LOSS = "d9d_forward_loss"
_REGISTERED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class TransformersHead:
    """A ``transformers`` causal LM's head as the loss layer asks for it (a
    :class:`~lightning_d9d.modules.head.FusedHead`): bound where :func:`decoder_inputs` hands the base model what
    the inputs hand the causal LM, run by :func:`forward_loss`. The adapter's pipeline stages take no labels."""

    stages_take_labels = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def bind_head_loss(self, inputs: ModelInputs) -> HeadLoss | None:
        model = self.model
        arguments = decoder_inputs(model, inputs)
        if arguments is None:
            return None

        def run(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
            return forward_loss(model, labels, ignore_index, arguments)

        return run


def transformers_head(model: nn.Module) -> TransformersHead | None:
    """The head of a ``transformers`` model; None for any other module."""
    return TransformersHead(model) if is_transformers_model(model) else None


def plain_head(model: nn.Module) -> nn.Linear | None:
    """The head of ``model`` if its logits are ``head(last hidden states)`` and nothing else (see the module
    docstring), else ``None``."""
    read = _read_head(model)
    if read is None or read[1] or logit_changes(model):
        return None
    return read[0]


class LogitSteps:
    """What ``model``'s forward does to its logits after the head, as its own code does it, in its order: Gemma 2's
    soft cap (``logits / cap``, ``tanh``, ``* cap``), Granite's ``logits / logits_scaling``, Cohere's
    ``logits * self.logit_scale``; no steps for a plain head. Read from the forward's syntax tree
    (:func:`logit_steps`), the constants taken from the config / the model when read. Called on the head's output
    (a ``DTensor`` sharded on the vocabulary under tp: every step is elementwise)."""

    def __init__(self, steps: Sequence[Callable[[torch.Tensor], Any]], fields: Sequence[str]) -> None:
        self.steps, self.fields = tuple(steps), tuple(fields)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            logits = step(logits)
        return logits


def logit_steps(model: nn.Module) -> LogitSteps | None:
    """The steps ``model``'s forward takes from ``head(last hidden states)`` to its logits (:class:`LogitSteps`),
    or ``None`` where they cannot be read or repeated: a head that is no plain linear layer, a forward whose logits
    come otherwise, a step other than ``logits = <expression of logits>`` at the forward's top level (after
    resolving ``if self.config.<field> is (not) None:`` by the config) made of numbers, ``self.config.<field>``,
    ``self.<attribute>`` (numbers), ``+ - * /``, ``torch.tanh`` and ``.float()``, or a config field of
    :data:`LOGIT_FIELDS` that is set but that no step reads (the change happens where this reading does not see)."""
    read = _read_head(model)
    if read is None:
        return None
    steps: list[Callable[[torch.Tensor], Any]] = []
    for node in read[1]:
        step = _compile_step(node, model)
        if step is None:
            return None
        steps.append(step)
    read_names = {n.attr for node in read[1] for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    if any(field not in read_names for field in logit_changes(model)):
        return None
    return LogitSteps(steps, sorted(read_names & set(LOGIT_FIELDS)))


def _read_head(model: nn.Module) -> tuple[nn.Linear, tuple[ast.expr, ...]] | None:
    """The head of ``model`` and the steps its forward takes after it (syntax trees, in order), where the head is
    a bias-free ``nn.Linear`` applied to the base model's last hidden states (see the module docstring)."""
    head = _call(model, "get_output_embeddings")
    if (
        not isinstance(head, nn.Linear)
        or type(head).forward is not nn.Linear.forward
        or head.bias is not None
    ):
        return None
    base = getattr(model, "base_model", None)
    decoder = _call(model, "get_decoder")
    if not isinstance(base, nn.Module) or base is model or decoder is not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    model_class: Any = type(model)  # cached per class and the config's disabled fields
    unset = frozenset(
        field for field in _guard_fields(model_class) if getattr(model.config, field, None) is None
    )
    reading = _head_reading(model_class, prefix, unset)
    if reading is None or getattr(model, reading[0], None) is not head:
        return None
    return head, reading[1]


def logit_changes(model: nn.Module) -> dict[str, Any]:
    """The fields of :data:`LOGIT_FIELDS` that ``model``'s config (or its text config) sets: a soft cap or a scale
    of the logits after the head (field -> value; empty where the logits are the head's)."""
    config: Any = model.config
    text_config = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    return {
        field: getattr(c, field)
        for c in (config, text_config)
        for field in LOGIT_FIELDS
        if getattr(c, field, None) is not None
    }


def decoder_inputs(model: nn.Module, inputs: Sequence[Any] | Mapping[str, Any]) -> dict[str, Any] | None:
    """The keyword arguments that hand the base model what ``model(*inputs)`` (``model(**inputs)`` for a dict)
    hands it, when ``model``'s head can be fused (:func:`plain_head`); else ``None``."""
    if plain_head(model) is None:
        return None
    model_class: Any = type(model)
    signature = _signature(model_class)
    if signature is None:
        return None
    try:
        bound = (
            signature.bind(model, **inputs) if isinstance(inputs, Mapping) else signature.bind(model, *inputs)
        )
    except TypeError:
        return None
    first = next(iter(signature.parameters))  # self
    # None is every one of these arguments' default: "not given"
    arguments = {
        name: value for name, value in bound.arguments.items() if name != first and value is not None
    }
    keep = signature.parameters.get("logits_to_keep", signature.parameters.get("num_logits_to_keep"))
    if keep is not None and keep.default not in (0, None):
        return None  # by default only the last positions' logits: not the loss over all
    base_class: Any = type(getattr(model, "base_model"))  # noqa: B009
    base_signature = _signature(base_class)
    if base_signature is None:
        return None
    base_parameters = base_signature.parameters
    if any(name in NOT_FUSED or name not in base_parameters for name in arguments):
        return None
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if any(signature.parameters[name].kind in variadic for name in arguments):
        return None
    if "use_cache" in base_parameters:
        arguments["use_cache"] = False
    return arguments


def forward_loss(
    model: nn.Module, labels: torch.Tensor, ignore_index: int, arguments: dict[str, Any]
) -> torch.Tensor:
    """``causal_lm_loss(model(**arguments), labels)`` without the logits (``arguments`` from
    :func:`decoder_inputs`); under FSDP as a registered forward method, so that the head is gathered."""
    if isinstance(model, FSDPModule):
        if model not in _REGISTERED:
            setattr(model, FORWARD_LOSS, types.MethodType(_forward_loss, model))
            register_fsdp_forward_method(model, FORWARD_LOSS)
            _REGISTERED.add(model)
        loss: torch.Tensor = getattr(model, FORWARD_LOSS)(labels, ignore_index, **arguments)
        return loss
    return _forward_loss(model, labels, ignore_index, **arguments)


def _forward_loss(
    model: nn.Module, labels: torch.Tensor, ignore_index: int, **arguments: Any
) -> torch.Tensor:
    base: Any = getattr(model, "base_model")  # noqa: B009 (a property of transformers' models)
    output = base(**arguments)
    hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
    head: nn.Linear = _call(model, "get_output_embeddings")
    return linear_cross_entropy(hidden, head.weight, labels, ignore_index=ignore_index)


def _call(model: nn.Module, method: str) -> Any:
    """``model.<method>()``, or None where it has no such method."""
    found = getattr(model, method, None)
    return found() if callable(found) else None


# ---------------------------------------------------------------------------------- reading the forward
@functools.cache
def _signature(module_class: Any) -> inspect.Signature | None:
    """The signature of ``module_class.forward`` (with ``self``), under its decorators."""
    try:
        return inspect.signature(inspect.unwrap(module_class.forward))
    except (TypeError, ValueError):
        return None


@functools.cache
def forward_tree(model_class: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The syntax tree of ``model_class.forward``, or ``None`` where its source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(model_class.forward)))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0] if tree.body else None
    return function if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef) else None


@functools.cache
def _guard_fields(model_class: Any) -> frozenset[str]:
    """The config fields ``model_class.forward`` branches on by ``if self.config.<field> is (not) None:``."""
    function = forward_tree(model_class)
    if function is None:
        return frozenset()
    tests = (_none_test(node.test) for node in ast.walk(function) if isinstance(node, ast.If))
    return frozenset(test[0] for test in tests if test is not None)


def _none_test(test: ast.expr) -> tuple[str, bool] | None:
    """``(field, True)`` for ``self.config.<field> is None``, ``(field, False)`` for ``... is not None``."""
    if not (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Is | ast.IsNot)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value is None
    ):
        return None
    left = test.left
    if (
        isinstance(left, ast.Attribute)
        and isinstance(left.value, ast.Attribute)
        and left.value.attr == "config"
        and _is_self(left.value.value)
    ):
        return left.attr, isinstance(test.ops[0], ast.Is)
    return None


class _KnownBranches(ast.NodeTransformer):
    """Replaces each ``if self.config.<field> is (not) None:`` on a field of ``fields`` (the forward's guard
    fields) by the branch that runs: the config leaves the ``unset`` ones None and sets the others (Gemma 3
    soft-caps its logits only under ``if self.config.final_logit_softcapping is not None:``; its default None
    drops the branch, a cap makes it part of the forward's top level)."""

    def __init__(self, fields: frozenset[str], unset: frozenset[str]) -> None:
        self.fields, self.unset = fields, unset

    def visit_If(self, node: ast.If) -> Any:
        test = _none_test(node.test)
        if test is None or test[0] not in self.fields:
            return self.generic_visit(node)
        is_none = test[0] in self.unset
        kept: list[ast.AST] = []
        for statement in node.body if test[1] == is_none else node.orelse:
            visited = self.visit(statement)
            kept.extend(visited if isinstance(visited, list) else [visited])
        return kept


def _head_attribute(model_class: Any, base_prefix: str, unset: frozenset[str] = frozenset()) -> str | None:
    """The attribute name of the head in ``model_class.forward`` if that forward computes its logits as
    ``self.<head>(h)`` once, ``h`` being the base model's last hidden states, optionally sliced, and never
    changes them; else ``None`` (also where the source cannot be read). ``unset``: config fields that are None,
    whose ``if self.config.<field> is not None:`` branches cannot run and are not read."""
    reading = _head_reading(model_class, base_prefix, unset)
    return reading[0] if reading is not None and not reading[1] else None


@functools.cache
def _head_reading(
    model_class: Any, base_prefix: str, unset: frozenset[str] = frozenset()
) -> tuple[str, tuple[ast.expr, ...]] | None:
    """The head's attribute name in ``model_class.forward`` and the values it then assigns to ``logits`` in
    order (``logits = logits / cap``, ...), where that forward computes its logits first as ``self.<head>(h)``,
    ``h`` being the base model's last hidden states, optionally sliced, every assignment to ``logits`` is a
    statement of the forward's top level (after :class:`_KnownBranches`) and nothing changes them in place; else
    ``None`` (also where the source cannot be read). ``unset``: the guard fields (:func:`_guard_fields`) the
    config leaves None; the others are set."""
    tree = forward_tree(model_class)
    if tree is None:
        return None
    fields = _guard_fields(model_class)
    function = _KnownBranches(fields, unset).visit(copy.deepcopy(tree)) if fields else tree
    values = _assigned_values(function)
    logits = values.get("logits", [])
    top_level = [
        statement.value
        for statement in function.body
        if isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
        and statement.targets[0].id == "logits"
    ]
    if not logits or len(top_level) != len(logits):
        return None
    call, steps = top_level[0], tuple(top_level[1:])
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and _is_self(call.func.value)
        and len(call.args) == 1
        and not call.keywords
    ):
        return None
    hidden = _sliced_name(call.args[0])
    if hidden is None or not values.get(hidden):
        return None
    if not all(_selects_hidden(value, hidden, base_prefix, values) for value in values[hidden]):
        return None
    if _changes_in_place(function, {"logits", hidden}):
        return None
    return call.func.attr, steps


# ------------------------------------------------------------------------- repeating the logits' steps
_OPERATORS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _compile_step(node: ast.expr, model: nn.Module) -> Callable[[torch.Tensor], Any] | None:
    """``node`` (a value assigned to ``logits``) as a function of the logits, or ``None`` where it is no step
    :func:`logit_steps` repeats (or does not read the logits)."""
    if not any(isinstance(n, ast.Name) and n.id == "logits" for n in ast.walk(node)):
        return None
    return _compile(node, model)


def _compile(node: ast.expr, model: nn.Module) -> Callable[[torch.Tensor], Any] | None:
    if isinstance(node, ast.Name):
        return (lambda logits: logits) if node.id == "logits" else None
    if isinstance(node, ast.Constant | ast.Attribute):
        value = _constant(node, model)
        return None if value is None else (lambda logits: value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        apply = _OPERATORS[type(node.op)]
        left, right = _compile(node.left, model), _compile(node.right, model)
        if left is None or right is None:
            return None
        return lambda logits: apply(left(logits), right(logits))
    if isinstance(node, ast.Call) and not node.keywords and isinstance(node.func, ast.Attribute):
        function = node.func
        if function.attr == "float" and not node.args:  # x.float()
            cast = _compile(function.value, model)
            if cast is None:
                return None
            return lambda logits: cast(logits).float()
        if (
            function.attr == "tanh"
            and isinstance(function.value, ast.Name)
            and function.value.id == "torch"
            and len(node.args) == 1
        ):
            capped = _compile(node.args[0], model)
            if capped is None:
                return None
            return lambda logits: torch.tanh(capped(logits))
    return None


def _constant(node: ast.expr, model: nn.Module) -> float | None:
    """A number: a literal, ``self.config.<field>`` or ``self.<attribute>`` (read now); else ``None``."""
    if isinstance(node, ast.Constant):
        value: Any = node.value
    elif isinstance(node, ast.Attribute) and _is_self(node.value):
        value = getattr(model, node.attr, None)
    elif (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "config"
        and _is_self(node.value.value)
    ):
        value = getattr(model.config, node.attr, None)
    else:
        return None
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _assigned_values(function: ast.AST) -> dict[str, list[ast.AST | None]]:
    """Every value assigned to each plain name in ``function`` (``None`` for an augmented assignment, a
    for-loop target or a ``with ... as``: values that cannot be read)."""
    values: dict[str, list[ast.AST | None]] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in _names(target):
                    values.setdefault(name, []).append(node.value if isinstance(target, ast.Name) else None)
        elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and isinstance(node.target, ast.Name):
            values.setdefault(node.target.id, []).append(node.value)
        elif isinstance(node, ast.AugAssign | ast.For | ast.comprehension):
            for name in _names(node.target):
                values.setdefault(name, []).append(None)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            for name in _names(node.optional_vars):
                values.setdefault(name, []).append(None)
    return values


def _names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List | ast.Starred):
        elements = target.elts if isinstance(target, ast.Tuple | ast.List) else [target.value]
        return [name for element in elements for name in _names(element)]
    return []


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _sliced_name(node: ast.AST) -> str | None:
    """``h`` for ``h`` or ``h[...]``."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _selects_hidden(value: ast.AST | None, hidden: str, base_prefix: str, values: dict) -> bool:
    """Whether ``value`` (assigned to ``hidden``) is the base model's output's last hidden states
    (``outputs.last_hidden_state`` / ``outputs[0]`` with ``outputs = self.<base>(...)``) or a slice of
    ``hidden`` (``hidden[:, s, :]``, ``slice_logits_to_keep(hidden, n)``)."""
    if value is None:
        return False
    if isinstance(value, ast.Subscript) and _sliced_name(value) == hidden:
        return True
    if (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "slice_logits_to_keep"
        and value.args
        and _sliced_name(value.args[0]) == hidden
    ):
        return True
    if (isinstance(value, ast.Attribute) and value.attr == "last_hidden_state") or (
        isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and value.slice.value == 0
    ):
        source = value.value
    else:
        return False
    if isinstance(source, ast.Name):  # outputs = self.model(...)
        assigned = values.get(source.id, [])
        return len(assigned) == 1 and _calls_base(assigned[0], base_prefix)
    return _calls_base(source, base_prefix)


def _calls_base(node: ast.AST | None, base_prefix: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and _is_self(node.func.value)
        and node.func.attr == base_prefix
    )


def _changes_in_place(function: ast.AST, names: set[str]) -> bool:
    """Whether ``function`` writes into one of ``names`` in place (``x[...] = ``, ``x.mul_(...)``)."""
    for node in ast.walk(function):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        if any(
            isinstance(t, ast.Subscript | ast.Attribute) and _sliced_name(_root(t)) in names for t in targets
        ):
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr.endswith("_")
            and not node.func.attr.startswith("_")
            and _sliced_name(node.func.value) in names
        ):
            return True
    return False


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Subscript | ast.Attribute) and isinstance(
        node.value, ast.Subscript | ast.Attribute
    ):
        node = node.value
    return node.value if isinstance(node, ast.Subscript | ast.Attribute) else node
