"""The spec language: each construct parses to the IR it means, and IR prints back as text."""

from __future__ import annotations

import pytest
from hypothesis import given

from shardc.errors import ShardcError
from shardc.ir.spec import Call, Contract, Dim, DType, Mesh, MeshAxis, Network, Spec, Statement, TensorRef
from shardc.spec.overrides import apply_overrides
from shardc.spec.parser import grammar_text, parse, parse_size
from shardc.testing import meshes, shardings, spec_texts, specs

DESIGN_EXAMPLE = """\
# FSDP over X, tensor parallel over Y (one transformer MLP block)
mesh X=16, Y=4                         # mesh axes, in device-mesh order, with sizes
dims B=3_000_000, D=5120, F=13824      # optional sizes: enable costs and cost-based choices
dtype bf16                             # optional, default bf16
param W_in, W_out                      # optional: trainable tensors (default: names starting with W)

Tmp[B_X, F_Y] = In[B_X, D_Y] · W_in[D_X, F_Y]
Out[B_X, D_Y] = Tmp[B_X, F_Y] · W_out[F_Y, D_X]
"""


def ref(name: str, *dims: str | tuple[str, tuple[str, ...]], u: tuple[str, ...] = ()) -> TensorRef:
    """A TensorRef from short dims: "B" or ("B", ("X", "Y"))."""
    return TensorRef(name, tuple(Dim(d) if isinstance(d, str) else Dim(*d) for d in dims), u)


def one(text: str) -> Statement:
    """The single statement of a spec on a mesh X=4, Y=2."""
    return parse("mesh X=4, Y=2\n" + text + "\n").statements[0]


def test_readme_example() -> None:
    spec = parse(DESIGN_EXAMPLE, "fsdp.shard")
    assert spec.mesh == Mesh((MeshAxis("X", 16), MeshAxis("Y", 4)))
    assert spec.dims == (("B", 3_000_000), ("D", 5120), ("F", 13824))
    assert spec.dtype is DType.BF16 and spec.params == ("W_in", "W_out") and spec.filename == "fsdp.shard"
    first = spec.statements[0]
    assert first.result == ref("Tmp", ("B", ("X",)), ("F", ("Y",)))
    operands = (ref("In", ("B", ("X",)), ("D", ("Y",))), ref("W_in", ("D", ("X",)), ("F", ("Y",))))
    assert first.expr == Contract(operands)
    assert not first.arrow


def test_header_lines() -> None:
    spec = parse("mesh X=16, Y=4, P=2 over dcn\ndims B=1e6, D=2.5e3\ndtype f32\nhardware tpu-v5p\n"
                 "layers 40\nO[B_P] = I[B_P]\n")
    assert [a.network for a in spec.mesh.axes] == [Network.ICI, Network.ICI, Network.DCN]
    assert spec.sizes == {"B": 1_000_000, "D": 2500}
    assert (spec.dtype, spec.hardware, spec.layers, spec.params) == (DType.F32, "tpu-v5p", 40, None)


def test_layers_dim_and_merged_dims_lines() -> None:
    spec = parse("mesh X=2\ndims B=4\ndims L=96\nlayers L\nparam W\nparam V\nO[B] = W[B] · V[B]\n")
    assert spec.dims == (("B", 4), ("L", 96)) and spec.layers == "L" and spec.params == ("W", "V")


def test_header_anywhere_and_comments_and_blank_lines() -> None:
    spec = parse("\n\n# c\nO[B_X] = I[B_X]   # trailing\n\n   # indented\nmesh X=2 # axes\n")
    assert spec.statements[0].result == ref("O", ("B", ("X",)))


def test_axes_forms() -> None:
    spec = parse("mesh data=4, model=2, X=2\nO[B_{data,model}, D_X] = I[B_{ data , model }, D_X]\n")
    assert spec.statements[0].result.dims == (Dim("B", ("data", "model")), Dim("D", ("X",)))
    assert spec.statements[0].expr.dims == spec.statements[0].result.dims  # type: ignore[union-attr]
    assert one("O[B_XY] = I[B_XY]").result.dims == (Dim("B", ("X", "Y")),)
    assert one("O[B_YX] = I[B_YX]").result.dims == (Dim("B", ("Y", "X")),)


def test_unreduced_suffix() -> None:
    statement = one("O[B_X]{U_Y} = I[B_X, D_Y] · W[D_Y]")
    assert statement.result.unreduced == ("Y",)
    spec = parse("mesh data=2, model=2\nO[B]{U_{data,model}} = I[B, D_{data,model}] · W[D_{data,model}]\n")
    assert spec.statements[0].result.unreduced == ("data", "model")


def test_unreduced_axes_are_a_set_sorted_when_made() -> None:
    """{U_YX} and {U_XY} are one value in the IR, in the planner and in print (a bug class once)."""
    yx = one("O[B]{U_YX} = I[B, D_XY] · W[D_XY]").result
    assert yx == one("O[B]{U_XY} = I[B, D_XY] · W[D_XY]").result and yx.unreduced == ("X", "Y")
    assert str(yx) == "O[B]{U_XY}" and hash(yx) == hash(ref("O", "B", u=("X", "Y")))
    assert ref("T", u=("Y", "X")).unreduced == ("X", "Y")
    spec = parse("mesh data=2, model=2\nO[B]{U_{model,data}} = I[B, D_{model,data}] · W[D_{model,data}]\n")
    assert spec.statements[0].result.unreduced == ("data", "model")
    assert parse(str(spec)) == spec and "{U_{data,model}}" in str(spec)
    assert ref("T", u=("X", "X")).unreduced == ("X", "X")  # kept, for validate to report


def test_const_line() -> None:
    text = "mesh X=2\nconst Tok\nconst Mask\nparam W\nOut[B_X, F] = Tok[B_X, D] · W[D, F] · Mask[F]\n"
    spec = parse(text)
    assert spec.const == ("Tok", "Mask") and spec.params == ("W",)
    assert "const Tok, Mask\n" in str(spec) and parse(str(spec)) == spec
    assert parse("mesh X=2\nOut[B] = In[B]\n").const == ()
    assert parse("mesh X=2\nconst In\nOut[B] = In[B]\n") != parse("mesh X=2\nOut[B] = In[B]\n")
    assert parse("mesh X=2\nconstant[B] = In[B]\n").statements[0].result.name == "constant"


def test_zero_dim_tensor_and_names_with_underscores() -> None:
    statement = one("S[] = W_in_2[I] · x_[I]")
    assert statement.result == TensorRef("S", ())
    assert [r.name for r in statement.expr.operands] == ["W_in_2", "x_"]  # type: ignore[union-attr]


@pytest.mark.parametrize("op", ["·", "@", "*", "×"])
def test_operators_mean_the_same(op: str) -> None:
    statement = one(f"O[I, K] = A[I, J] {op} B[J, K]")
    assert isinstance(statement.expr, Contract) and statement.expr.op == op
    assert statement == one("O[I, K] = A[I, J] · B[J, K]")


def test_contract_is_flat_and_groups_nest() -> None:
    flat = one("O[I, L] = A[I, J] · B[J, K] · C[K, L]").expr
    assert isinstance(flat, Contract) and len(flat.operands) == 3
    nested = one("O[I, L] = (A[I, J] · B[J, K]) · C[K, L]").expr
    assert isinstance(nested, Contract) and isinstance(nested.operands[0], Contract)
    assert str(nested) == "(A[I, J] · B[J, K]) · C[K, L]"
    # a group around a whole expression is dropped
    assert one("O[I, L] = ((A[I, J] · B[J, K] · C[K, L]))").expr == flat
    assert one("O[I] = (A[I])").expr == ref("A", "I")


@pytest.mark.parametrize("arrow", ["->", "→"])
def test_chain_form(arrow: str) -> None:
    statement = one(f"A[I, J_X] · B[J_X, K] · C[K, L] {arrow} O[I, L]")
    assert statement.arrow and statement.result == ref("O", "I", "L")
    assert len(statement.expr.operands) == 3  # type: ignore[union-attr]
    assert str(statement) == "A[I, J_X] · B[J_X, K] · C[K, L] -> O[I, L]"


def test_reshard_is_a_bare_operand() -> None:
    statement = one("A2[I, J_X] = A[I_X, J]")
    assert statement.expr == ref("A", ("I", ("X",)), "J")


def test_elementwise_calls_nest() -> None:
    statement = one("H[B_X, F_Y] = gelu(In[B_X, D] · W[D, F_Y])")
    assert isinstance(statement.expr, Call) and statement.expr.func == "gelu"
    assert isinstance(statement.expr.arg, Contract)
    nested = one("H[B] = tanh(relu(In[B]))").expr
    assert nested == Call("tanh", Call("relu", ref("In", "B")))
    mixed = one("O[B, K] = silu(In[B, D] · W[D, F]) · V[F, K]").expr
    assert isinstance(mixed, Contract) and isinstance(mixed.operands[0], Call)


def test_spans_point_at_tokens() -> None:
    spec = parse("mesh X=4\nO[B_X] = In[B_X, D] · W[D]\n", "f.shard")
    result = spec.statements[0].result
    assert result.span is not None and (result.span.line, result.span.column, result.span.length) == (2, 1, 6)
    operand = spec.statements[0].expr.operands[0]  # type: ignore[union-attr]
    assert isinstance(operand, TensorRef) and operand.span is not None and operand.dims[1].span is not None
    assert operand.dims[1].span.column == 18 and operand.span.filename == "f.shard"
    assert spec.span_of("mesh") is not None and spec.span_of("mesh").line == 1  # type: ignore[union-attr]


def test_equality_ignores_spans() -> None:
    a = parse("mesh X=4\nO[B_X] = I[B_X]\n")
    b = parse("\n\n  mesh   X=4   \n\n   O[ B_X ]=I[B_X]")
    assert a == b and hash(a) == hash(b)


@pytest.mark.parametrize(("text", "value"), [("5120", 5120), ("3_000_000", 3_000_000), ("1e6", 10**6),
                                             ("2.5e3", 2500), ("1E2", 100), ("1.0", 1), ("64e-1", None),
                                             ("0", None), ("1.5", None), ("abc", None), ("1__0", None),
                                             ("1e99", None), ("", None), ("-3", None)])
def test_parse_size(text: str, value: int | None) -> None:
    if value is None:
        with pytest.raises(ShardcError, match="size|whole|large"):
            parse_size(text, "B")
    else:
        assert parse_size(text, "B") == value


def test_str_of_each_node() -> None:
    assert str(MeshAxis("P", 2, Network.DCN)) == "P=2 over dcn"
    assert str(Mesh((MeshAxis("X", 4), MeshAxis("data", 2)))) == "mesh X=4, data=2"
    assert str(Dim("B")) == "B" and str(Dim("B", ("X", "Y"))) == "B_XY"
    assert str(Dim("B", ("data", "X"))) == "B_{data,X}"
    assert str(ref("W", "D", u=("X", "Y"))) == "W[D]{U_XY}" and str(TensorRef("S", ())) == "S[]"
    assert str(ref("W", "D", u=("data",))) == "W[D]{U_{data}}"
    assert str(Contract((ref("A", "I"), ref("B", "I")), op="@")) == "A[I] @ B[I]"
    assert str(Call("gelu", ref("A", "I"))) == "gelu(A[I])"
    assert str(Statement(ref("O", "I"), ref("A", "I"))) == "O[I] = A[I]"
    assert str(Statement(ref("O", "I"), ref("A", "I"), arrow=True)) == "A[I] -> O[I]"
    spec = Spec(Mesh((MeshAxis("X", 2),)), (Statement(ref("O", "I"), ref("A", "I")),), dims=(("I", 4),),
                dtype=DType.F8, params=("A",), hardware="h100", layers="I")
    assert str(spec) == "mesh X=2\ndims I=4\ndtype f8\nparam A\nhardware h100\nlayers I\nO[I] = A[I]\n"
    assert parse(str(spec)) == spec


def test_grammar_is_found() -> None:
    assert "statement" in grammar_text()


def test_96_layer_spec_parses() -> None:
    """A deep spec parses whole (its speed is measured by benchmarks/plan_speed.py, not here)."""
    lines = ["mesh X=16, Y=4", "dims B=4096, D=5120, F=13824"]
    previous = "In"
    for layer in range(96):
        lines.append(f"H{layer}[B_X, F_Y] = gelu({previous}[B_X, D] · Win{layer}[D_X, F_Y])")
        lines.append(f"O{layer}[B_X, D] = H{layer}[B_X, F_Y] · Wout{layer}[F_Y, D_X]")
        previous = f"O{layer}"
    spec = parse("\n".join(lines))
    assert len(spec.statements) == 192 and spec.statements[-1].result.name == "O95"


def test_overrides() -> None:
    spec = parse("mesh X=4, Y=2\ndims B=8, D=16, L=2\nlayers L\nO[B_X, D_Y] = I[B_X, D_Y]\n")
    new = apply_overrides(spec, {"Y": 8, "D": 64, "L": 40})
    assert new.mesh.size("Y") == 8 and new.sizes == {"B": 8, "D": 64, "L": 40}
    assert spec.mesh.size("Y") == 2  # the original is untouched
    added = apply_overrides(parse("mesh X=4\nO[B_X] = I[B_X]\n"), {"B": 12})
    assert added.dims == (("B", 12),)
    assert apply_overrides(spec, {"B": 6}).sizes["B"] == 6  # uneven over X=4: padded, as XLA does
    with pytest.raises(ShardcError, match="smaller than its 4 devices") as err:
        apply_overrides(spec, {"B": 2})
    assert err.value.span is not None and err.value.span.line == 4
    with pytest.raises(ShardcError, match="neither a mesh axis nor a dim") as err:
        apply_overrides(spec, {"Q": 2})
    assert err.value.fix == "set one of X, Y, B, D, L"
    with pytest.raises(ShardcError, match="positive"):
        apply_overrides(spec, {"X": 0})


@given(specs())
def test_round_trip(spec: Spec) -> None:
    assert parse(str(spec)) == spec
    assert str(parse(str(spec))) == str(spec)


@given(spec_texts())
def test_decorated_texts_parse(text: str) -> None:
    assert parse(str(parse(text))) == parse(text)


@given(meshes(max_devices=8).flatmap(lambda m: shardings(("B", "D", "F"), m).map(lambda d: (m, d))))
def test_shardings_use_each_axis_once(mesh_and_dims: tuple[Mesh, tuple[Dim, ...]]) -> None:
    mesh, dims = mesh_and_dims
    axes = [a for d in dims for a in d.axes]
    assert len(axes) == len(set(axes)) and set(axes) <= set(mesh.names) and mesh.devices <= 8


@pytest.mark.parametrize("module", ["shardc.spec.parser", "shardc.spec.validate", "shardc.spec.exprs",
                                    "shardc.spec.walk", "shardc.spec.overrides", "shardc.spec.functions",
                                    "shardc.ir.spec", "shardc.testing", "shardc.names"])
def test_docstring_examples(module: str) -> None:
    import doctest
    import importlib

    failures, _ = doctest.testmod(importlib.import_module(module))
    assert failures == 0


@given(specs(dims=True))
def test_specs_with_dims_always_have_sizes(spec: Spec) -> None:
    assert spec.dims and all(i in spec.sizes for s in spec.statements for i in s.result.indices)


def test_a_refs_cached_hash_and_layout_never_leave_the_process() -> None:
    import pickle

    from shardc.ir.spec import Dim, TensorRef

    ref = TensorRef("W", (Dim("D", ("X",)), Dim("F")), ("Y", "X"))
    assert hash(ref) == hash(TensorRef("W", (Dim("D", ("X",)), Dim("F")), ("X", "Y"))) and ref.layout == (("X",), ())
    again = pickle.loads(pickle.dumps(ref))
    assert again == ref and "_hash" not in again.__dict__ and "_layout" not in again.__dict__
