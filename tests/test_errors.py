"""Every mistake is a ShardcError that points at the text: file:line:col, the line, a caret, a fix."""

from __future__ import annotations

import pytest

from shardc.errors import ShardcError
from shardc.spec.parser import parse


def error(text: str) -> ShardcError:
    with pytest.raises(ShardcError) as info:
        parse(text, "bad.shard")
    return info.value


def caret_under(err: ShardcError) -> str:
    """The text the caret underlines, read back from the rendering."""
    lines = str(err).splitlines()
    source, caret = lines[1][4:], lines[2][4:]
    start = caret.index("^")
    return source[start:start + caret.count("^")]


def check(text: str, where: str, message: str, under: str, fix: str) -> ShardcError:
    """The error of ``text`` is at ``where`` (line:col), says ``message``, underlines ``under``."""
    err = error(text)
    rendered = str(err)
    assert rendered.startswith(f"bad.shard:{where}: error: "), rendered
    assert message in err.message, rendered
    assert caret_under(err) == under, rendered
    assert err.fix is not None and fix in err.fix, rendered
    assert rendered.splitlines()[-1] == f"fix: {err.fix}"
    return err


def test_rendering_layout() -> None:
    err = error("mesh X=4\nTmp[B_X, F_Z] = In[B_X, D] · W_in[D_X, F]\n")
    assert str(err).splitlines() == [
        "bad.shard:2:10: error: axis Z is not in the mesh (mesh X=4)",
        "    Tmp[B_X, F_Z] = In[B_X, D] · W_in[D_X, F]",
        "             ^^^",
        "fix: use one of the mesh axes X, or add Z to the `mesh` line",
    ]


# --- 1. an axis twice in one tensor ---------------------------------------------------

def test_axis_twice_across_dims() -> None:
    check("mesh X=4\nA[I] = B[I_X, J_X] · C[J]\n", "2:15", "axis X is used twice in B[I_X, J_X]", "J_X",
          "remove X from one of them")


def test_axis_twice_in_one_dim() -> None:
    check("mesh X=4\nA[I] = B[I_XX]\n", "2:10", "axis X is used twice", "I_XX", "at most one dim")


def test_axis_twice_in_dim_and_unreduced() -> None:
    check("mesh X=4\nA[I_X]{U_X} = B[I_X, J_X] · C[J]\n", "2:7", "used twice in A[I_X]{U_X}", "{U_X}",
          "unreduced")


# --- 2. an axis not in the mesh --------------------------------------------------------

def test_axis_not_in_mesh_braced() -> None:
    check("mesh data=4\nA[I_{data,model}] = B[I]\n", "2:3", "axis model is not in the mesh",
          "I_{data,model}", "add model to the `mesh` line")


def test_dim_name_with_underscore_hint() -> None:
    err = check("mesh X=4\nA[I] = B[I, d_model] · C[d_model]\n", "2:13", "axis m is not in the mesh",
                "d_model", "dim names cannot contain `_`")
    assert "m, o, d, e, l" in (err.fix or "")


# --- 3. sizes --------------------------------------------------------------------------

def test_fewer_elements_than_devices() -> None:
    # an uneven dim is padded as XLA pads it (B=12 over 8 is 2 a device); one smaller than its
    # devices would leave a device nothing but padding
    check("mesh X=4, Y=2\ndims B=6\nA[B_XY] = C[B]\n", "3:3", "B=6 is smaller than its 8 devices", "B_XY",
          "at least 8")


def test_dim_without_size() -> None:
    check("mesh X=4\ndims B=8\nA[B_X] = C[B_X, D] · E[D]\n", "3:17",
          "dim D has no size", "D", "add it to dims")


def test_same_index_twice_in_tensor() -> None:
    check("mesh X=4\nA[I] = B[I, I]\n", "2:13", "index I appears twice in B[I, I]", "I", "rename one")


def test_dims_given_twice() -> None:
    check("mesh X=4\ndims B=8\ndims B=16\nA[B] = C[B]\n", "3:6", "dim B is given twice", "B=16", "one size")


def test_dims_name_with_underscore() -> None:
    check("mesh X=4\ndims d_model=8\nA[d] = C[d]\n", "2:6",
          "cannot be a dim name", "d_model=8", "without `_`")


# --- 4. one tensor, two shardings --------------------------------------------------------

def test_input_read_with_two_shardings() -> None:
    err = check("mesh X=4\nA[I] = B[I, J] · C[J]\nD[I] = B[I, J_X] · C[J_X]\n", "3:8",
                "B is read as B[I, J_X] here but read as B[I, J] on line 2",
                "B[I, J_X]", "write B[I, J] here")
    assert "B2[I, J_X] = B[I, J]" in (err.fix or "")


def test_intermediate_read_unlike_its_definition() -> None:
    check("mesh X=4, Y=2\nA[I_X]{U_Y} = B[I_X, J_Y] · C[J_Y]\nD[I] = A[I_X]\n", "3:8",
          "A is read as A[I_X] here but defined as A[I_X]{U_Y} on line 2", "A[I_X]", "one sharding")


def test_same_tensor_other_index_order() -> None:
    check("mesh X=4\nA[D] = W[D, F] · V[F]\nE[F] = W[F, D] · V[D]\n", "3:8", "read as W[F, D]",
          "W[F, D]", "write W[D, F] here")


def test_two_shardings_in_one_statement() -> None:
    check("mesh X=4\nA[I] = B[I_X] · B[I]\n", "2:17", "read as B[I] here", "B[I]", "one sharding")


# --- 5. result indices ----------------------------------------------------------------

def test_result_index_in_no_operand() -> None:
    check("mesh X=4\nA[I, K_X] = B[I, J] · C[J]\n", "2:6", "result index K of A is not in any operand", "K_X",
          "must come from an operand")


def test_reshard_must_keep_indices() -> None:
    check("mesh X=4\nA[I, J] = B[I]\n", "2:6", "not in the tensor it copies", "J", "come from an operand")
    check("mesh X=4\nA[I] = B[I, J_X]\n", "2:13",
          "A drops index J of B", "J_X", "give A the indices of B (I, J)")


def test_free_index_summed() -> None:
    check("mesh X=4\nA[I] = B[I, J] · C[K, I]\n", "2:13",
          "index J of B is in no other operand and not in the result",
          "J", "add J to the result A")


def test_free_index_summed_inside_call() -> None:
    check("mesh X=4\nA[I] = relu(B[I, J])\n", "2:18", "index J of B", "J", "does not sum over free indices")


# --- 6. definitions ---------------------------------------------------------------------

def test_read_before_definition() -> None:
    check("mesh X=4\nA[I] = T[I] · B[I]\nT[I] = C[I]\n", "2:8",
          "T is read before it is defined (by a later statement)",
          "T[I]", "move the statement defining T above")


def test_read_own_result() -> None:
    check("mesh X=4\nA[I] = A[I] · B[I]\n", "2:8",
          "read before it is defined (by this statement)", "A[I]", "rename")


def test_defined_twice() -> None:
    check("mesh X=4\nA[I] = B[I]\nA[I] = C[I]\n", "3:1",
          "tensor A is defined twice (first on line 2)", "A[I]",
          "another name")


# --- 7. syntax ---------------------------------------------------------------------------

def test_unclosed_bracket() -> None:
    check("mesh X=4\nA[I_X = B[I]\n", "2:7", "syntax error: unexpected `=`", "=", "expected `,` or `]`")


def test_missing_operator() -> None:
    check("mesh X=4\nA[I] = B[I] C[I]\n", "2:13", "unexpected `C`", "C", "a contraction operator")


def test_missing_result() -> None:
    err = error("mesh X=4\nB[I] · C[I]\n")
    assert err.span is not None and (err.span.line, err.span.column) == (2, 12)
    assert "`->`" in (err.fix or "") and "end of line" in err.message


def test_a_line_missing_its_word_names_the_lines_words() -> None:
    """A bare word every settings line reads was named after the `hardware` line's: `grad_reduce` alone
    expected "a hardware name such as tpu-v5p"; `grad_reduce in` "a name"."""
    body = "\nA[I] = B[I]\n"
    err = check("mesh X=4\ngrad_reduce" + body, "2:12", "unexpected end of line", "", "after-backward")
    assert "hardware" not in (err.fix or "") and "`in` and a type" in (err.fix or "")
    check("mesh X=4\ngrad_reduce after-backward in" + body, "2:30", "end of line", "", "a type, one of bf16, f32")
    assert "hardware" not in (check("mesh X=4\ntopology" + body, "2:9", "end of line", "", "4x4x4").fix or "")
    check("mesh X=4\nschedule" + body, "2:9", "end of line", "", "1f1b")
    check("mesh X=4\nhardware" + body, "2:9", "end of line", "", "a hardware name such as tpu-v5p")


def test_bad_character() -> None:
    check("mesh X=4\nA[I] = $B[I]\n", "2:8", "unexpected character `$`", "$", "expected")


def test_axes_run_with_digits() -> None:
    check("mesh X1=4\nA[I_X1] = B[I]\n", "2:3", "one-letter axis names", "I_X1", "I_{X1}")


def test_bad_unreduced_mark() -> None:
    check("mesh X=4\nA[I]{R_X} = B[I]\n", "2:5", "not an unreduced mark", "{R_X}", "{U_X}")


def test_header_errors() -> None:
    check("mesh X=4 Y=2\nA[I] = B[I]\n", "1:10", "unexpected `Y`", "Y", "`,`")
    check("mesh X=4\nmesh Y=2\nA[I] = B[I]\n", "2:1",
          "`mesh` is given twice (first on line 1)", "mesh", "keep one")
    check("mesh X=4\ndtype bf32\nA[I] = B[I]\n", "2:7", "unknown dtype `bf32`", "bf32", "bf16, f32, f16, f8")
    check("mesh X=2.5\nA[I] = B[I]\n", "1:8", "not a whole number", "2.5", "whole number")
    check("mesh X=4 over wan\nA[I] = B[I]\n", "1:15", "unknown network `wan`", "wan", "over dcn")


def test_missing_mesh_and_empty_spec() -> None:
    check("A[I] = B[I]\n", "1:1", "no `mesh` line", "A", "mesh X=16, Y=4")
    check("mesh X=4\n", "1:1", "the spec has no statements", "mesh", "add one")


def test_error_at_end_of_text_without_newline() -> None:
    err = error("mesh X=4\nA[I] = B[I] ·")
    assert err.span is not None and err.span.line == 2 and err.span.column == 14


# --- 8. the rest -------------------------------------------------------------------------

def test_unknown_function() -> None:
    check("mesh X=4\nA[I] = softplus(B[I])\n", "2:8", "unknown function `softplus`", "softplus",
          "gelu")


def test_function_of_partial_sums() -> None:
    check("mesh X=4\nA[I]{U_X} = gelu(B[I, J_X] · C[J_X])\n", "2:5",
          "a function (gelu) of partial sums", "{U_X}", "drop the {U_...} suffix")


def test_partial_sums_need_a_sum() -> None:
    check("mesh X=4\nA[I]{U_X} = B[I] · C[I]\n", "2:5", "nothing is summed", "{U_X}", "drop X")
    check("mesh X=4\nA[I]{U_X} = B[I]\n", "2:5", "nothing is summed", "{U_X}", "drop X")
    parse("mesh X=4\nA[I]{U_X} = B[I]{U_X}\nC[I]{U_X} = A[I]{U_X} · D[I]\n")  # partial sums pass through


def test_param_not_in_spec() -> None:
    check("mesh X=4\nparam W, Q\nA[I] = W[I]\n", "2:10", "param Q is not a tensor of the spec", "Q", "W")


def test_param_defined_by_statement() -> None:
    check("mesh X=4\nparam A\nA[I] = W[I]\n", "2:7", "param A is computed by a statement", "A", "remove A")


def test_const_errors() -> None:
    body = "Out[B_X, F] = Tok[B_X, D] · W[D, F]\n"
    check("mesh X=2\nconst Tok, Tok\n" + body, "2:12", "const Tok is listed twice", "Tok", "list Tok once")
    check("mesh X=2\nconst Out\n" + body, "2:7", "const Out is computed by a statement", "Out",
          "remove Out from `const`")
    check("mesh X=2\nparam W\nconst W\n" + body, "3:7", "W is both a param and const", "W", "remove W")
    check("mesh X=2\nconst Nope\n" + body, "2:7", "const Nope is not a tensor of the spec", "Nope", "Tok, W")
    check("mesh X=2\nconst\n" + body, "2:6", "unexpected end of line", "", "a name")


def test_mesh_axis_named_like_a_dim() -> None:
    """`mesh D=2` with a dim D: the volume 2*D*F/D would cancel the dim (issue: costed wrong)."""
    check("mesh D=2\ndims B=8, D=8, F=6\nOut[B_D, F] = In[B_D, D] · W[D, F]\n", "1:6",
          "D names both a mesh axis and a dim", "D=2", "rename the mesh axis (e.g. X)")
    check("mesh X=2, F=4\nOut[B_X, F] = In[B_X, D] · W[D, F]\n", "1:11", "F names both", "F=4", "e.g. Y")


def test_layers_not_a_dim() -> None:
    check("mesh X=4\nlayers L\nA[I] = W[I]\n", "2:1", "L is not a dim with a size", "layers L", "dims L=40")


def test_mesh_axis_twice() -> None:
    check("mesh X=4, X=2\nA[I] = W[I]\n", "1:11", "mesh axis X is given twice", "X=2", "different name")


def test_deep_nesting() -> None:
    check("mesh X=4\nA[I] = " + "(" * 60 + "B[I]" + ")" * 60 + "\n", "2:56", "nested more than", "(", "split")


def test_chain_that_sums_inside_one_operand() -> None:
    # A·C contracts B; E's B would then have to be summed on its own: the parser says so, not the planner
    check("mesh X=2\nT[] = A[B] · C[B] · E[B]\n", "2:7", "index B is summed over inside one operand",
          "A[B] · C[B] · E[B]", "write this step as its own statement")
