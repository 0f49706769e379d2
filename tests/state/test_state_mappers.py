"""Each mapper and its inverse, and the composites' key bookkeeping."""

from __future__ import annotations

import pytest
import torch
from state_helpers import TinyConfig, disk_state, module_state, tiny_mapper

from lightning_d9d.state import (
    Cast,
    Chunk,
    Concat,
    Drop,
    Group,
    Identity,
    MapperError,
    ModelStateMapper,
    NotInvertibleError,
    Parallel,
    Rename,
    Scope,
    Sequential,
    Stack,
    Transpose,
    Unstack,
    chain,
    per_layer,
    select_prefix,
)


def run(mapper: ModelStateMapper, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply every group of ``mapper`` to ``state`` (exactly its inputs) and collect the outputs."""
    assert set(state) == mapper.input_keys()
    out: dict[str, torch.Tensor] = {}
    for group in mapper.groups():
        result = mapper.apply({key: state[key] for key in group.inputs})
        assert set(result) == set(group.outputs)
        out.update(result)
    assert set(out) == mapper.output_keys()
    return out


def assert_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key in expected:
        assert actual[key].dtype == expected[key].dtype, key
        assert torch.equal(actual[key], expected[key]), key


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


ROUND_TRIPS = {
    "identity": (Identity(["a", "b"]), {"a": rand(2), "b": rand(3, 2)}),
    "rename": (Rename({"a": "x", "b": "y"}), {"a": rand(2), "b": rand(3)}),
    "rename_prefix": (Rename.prefix(["m.a", "m.b.c"], "m.", "model."), {"m.a": rand(2), "m.b.c": rand(1)}),
    "transpose": (Transpose(["w"], 0, 1), {"w": rand(3, 4)}),
    "transpose_3d": (Transpose(["w"], 1, 2), {"w": rand(2, 3, 4, dtype=torch.bfloat16)}),
    "stack": (Stack(["e0", "e1", "e2"], "experts", dim=0), {f"e{i}": rand(4, 5) for i in range(3)}),
    "stack_dim1": (Stack(["e0", "e1"], "experts", dim=1), {f"e{i}": rand(4, 5) for i in range(2)}),
    "unstack": (Unstack("experts", ["e0", "e1"], dim=0), {"experts": rand(2, 3, 4)}),
    "concat_equal": (Concat(["a", "b"], "ab", dim=1), {"a": rand(3, 2), "b": rand(3, 2)}),
    "concat_gqa": (
        Concat(["q", "k", "v"], "qkv", dim=0, sizes=[8, 2, 2]),
        {"q": rand(8, 4), "k": rand(2, 4), "v": rand(2, 4)},
    ),
    "chunk_equal": (Chunk("qkv", ["q", "k", "v"], dim=0), {"qkv": rand(6, 4)}),
    "chunk_sizes": (Chunk("gate_up", ["gate", "up"], dim=-1, sizes=[3, 5]), {"gate_up": rand(2, 8)}),
    "cast": (Cast(["w"], torch.float32, source_dtype=torch.bfloat16), {"w": rand(3, dtype=torch.bfloat16)}),
}


@pytest.mark.parametrize("name", list(ROUND_TRIPS))
def test_mapper_and_inverse_round_trip_exactly(name: str) -> None:
    mapper, state = ROUND_TRIPS[name]
    forward = run(mapper, state)
    inverse = mapper.inverse()
    assert inverse.input_keys() == mapper.output_keys()
    assert inverse.output_keys() == mapper.input_keys()
    assert_exact(run(inverse, forward), state)


def test_leaf_mappers_compute_what_they_say() -> None:
    q, k, v = rand(4, 2), rand(2, 2), rand(2, 2)
    assert torch.equal(
        Concat(["q", "k", "v"], "qkv").apply({"q": q, "k": k, "v": v})["qkv"], torch.cat([q, k, v])
    )
    e = [rand(3, 2) for _ in range(4)]
    stacked = Stack([f"e{i}" for i in range(4)], "s").apply({f"e{i}": t for i, t in enumerate(e)})["s"]
    assert stacked.shape == (4, 3, 2) and torch.equal(stacked[2], e[2])
    transposed = Transpose(["w"]).apply({"w": e[0]})["w"]
    assert transposed.is_contiguous() and torch.equal(transposed, e[0].T)
    assert Cast(["w"], torch.bfloat16).apply({"w": e[0]})["w"].dtype == torch.bfloat16
    assert Drop(["w"]).apply({"w": e[0]}) == {}
    assert Drop(["w"]).groups() == [Group(("w",), ())]


def test_non_invertible_mappers_say_so() -> None:
    for mapper in (Drop(["a"]), Cast(["a"], torch.float16), select_prefix(["a.x", "b"], "a.")):
        with pytest.raises(NotInvertibleError):
            mapper.inverse()


def test_scope_and_per_layer_templates() -> None:
    inner = Sequential([Rename({"q": "attn.q"}), Transpose(["attn.q"])])
    mapper = per_layer("layers.{i}.", range(3), inner)
    assert mapper.input_keys() == {f"layers.{i}.q" for i in range(3)}
    assert mapper.output_keys() == {f"layers.{i}.attn.q" for i in range(3)}
    w = rand(2, 3)
    assert torch.equal(mapper.apply({"layers.1.q": w})["layers.1.attn.q"], w.T)
    assert Scope("x.", inner).inverse().input_keys() == {"x.attn.q"}
    # A factory gives layers their own mappers (dense and MoE layers mixed).
    mixed = per_layer("l.{i}.", range(2), lambda i: Identity(["dense"] if i == 0 else ["moe"]))
    assert mixed.input_keys() == {"l.0.dense", "l.1.moe"}
    with pytest.raises(MapperError, match="must contain"):
        per_layer("layers.", range(2), inner)


def test_select_prefix() -> None:
    keys = ["model.a", "model.b", "lm_head.weight"]
    mapper = select_prefix(keys, "model.", strip=True)
    assert mapper.output_keys() == {"a", "b"}
    assert mapper.input_keys() == set(keys)
    assert select_prefix(keys, "model.").output_keys() == {"model.a", "model.b"}
    # Nothing dropped: it stays invertible.
    assert select_prefix(keys[:2], "model.", strip=True).inverse().output_keys() == {"model.a", "model.b"}


def test_sequential_passes_untouched_keys_through_and_merges_groups() -> None:
    mapper = Sequential([Rename({"a": "x", "b": "y"}), Stack(["x", "y"], "s"), Transpose(["s"], 1, 2)])
    # ``c`` is read by no stage at all: it is not part of the graph. ``d`` only by the last stage.
    mapper = Sequential([mapper, Rename({"d": "dd"})])
    assert mapper.groups() == [Group(("a", "b"), ("s",)), Group(("d",), ("dd",))]
    a, b, d = rand(2, 3), rand(2, 3), rand(1)
    out = run(mapper, {"a": a, "b": b, "d": d})
    assert torch.equal(out["s"], torch.stack([a, b]).transpose(1, 2))
    assert_exact(run(mapper.inverse(), out), {"a": a, "b": b, "d": d})
    assert chain(mapper) is mapper


def test_sequential_same_name_read_and_written_within_a_stage() -> None:
    # Stage 2 reads "x" (from stage 1) in one group and writes a new "x" in another: all reads come first.
    mapper = Sequential([Rename({"a": "x", "b": "y"}), Parallel([Rename({"x": "z"}), Rename({"y": "x"})])])
    a, b = rand(1), rand(2)
    out = run(mapper, {"a": a, "b": b})
    assert torch.equal(out["z"], a) and torch.equal(out["x"], b)


def test_consume_empties_its_inputs() -> None:
    mapper = Sequential([Stack(["a", "b"], "s"), Transpose(["s"])])
    inputs = {"a": rand(4, 3), "b": rand(4, 3)}
    out = mapper.consume(inputs)
    assert inputs == {} and out["s"].shape == (4, 2, 3)


def test_ill_formed_graphs_are_rejected_with_key_names() -> None:
    with pytest.raises(MapperError, match="'a'"):
        Parallel([Identity(["a"]), Rename({"a": "b"})])
    with pytest.raises(MapperError, match="'x'"):
        Parallel([Rename({"a": "x"}), Rename({"b": "x"})])
    with pytest.raises(MapperError, match="'a'"):  # read again after an earlier stage consumed it
        Sequential([Rename({"a": "b"}), Identity(["a"])])
    with pytest.raises(MapperError, match="'b'"):  # overwrites a key that passes through
        Sequential([Identity(["a", "b"]), Rename({"a": "b"})])
    with pytest.raises(MapperError, match="two groups"):
        Rename({"a": "x", "b": "x"}).groups() and Rename({"a": "x", "b": "x"}).input_keys()
    with pytest.raises(MapperError, match="exactly its inputs"):
        Stack(["a", "b"], "s").apply({"a": rand(1)})
    with pytest.raises(MapperError, match="different shapes"):
        Stack(["a", "b"], "s").apply({"a": rand(1), "b": rand(2)})
    with pytest.raises(MapperError, match="does not split"):
        Chunk("qkv", ["q", "k", "v"]).apply({"qkv": rand(4, 2)})
    with pytest.raises(MapperError, match="expected sizes"):
        Concat(["q", "k"], "qk", sizes=[2, 1]).apply({"q": rand(1, 2), "k": rand(1, 2)})


def test_tiny_model_graph_maps_and_inverts_exactly() -> None:
    cfg = TinyConfig()
    disk = disk_state(cfg)
    mapper = tiny_mapper(cfg)
    # Per layer: one group for the norm, the o proj, qkv, w1 and w2 (the stack and the transpose merged).
    assert len(mapper.groups()) == 3 + 5 * cfg.layers
    loaded = run(mapper, disk)
    assert_exact(loaded, module_state(cfg, disk))
    assert_exact(run(mapper.inverse(), loaded), disk)
