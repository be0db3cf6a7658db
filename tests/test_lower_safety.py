"""Lowering takes nothing raw: hostile names and file names, many indices, broken plans, -o over the spec."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import shardc
from shardc.cli.main import main
from shardc.errors import InternalError, ShardcError
from shardc.ir.plan import Op
from shardc.lowering import template
from shardc.lowering.codegen import generate
from shardc.lowering.load import lowered_mesh, lowered_sizes

HOSTILE_FILE = 'x"""; __import__("os").system("touch PWNED"); """.shard'
# keywords, builtins, the generated module's own globals, and a name that cannot be assigned
HOSTILE_SPEC = """\
mesh X=2
dims B=4, D=6, F=8
param make_mesh, forward
jax[B_X, F] = def[B_X, D] · make_mesh[D, F]
jnp[B_X, F] = gelu(jax[B_X, F])
list[B_X, D] = jnp[B_X, F] · forward[F, D]
__debug__[B_X, D] = tanh(list[B_X, D])
"""


def _import(path: Path) -> object:
    spec = importlib.util.spec_from_file_location("hostile_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_hostile_names_and_file_name_lower_import_and_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / HOSTILE_FILE).write_text(HOSTILE_SPEC)
    out = tmp_path / "hostile_module.py"
    assert main(["lower", HOSTILE_FILE, "-o", str(out)]) == 0
    source = out.read_text()
    ast.parse(source)  # compiles: the docstring is closed only where shardc closes it
    module: object = _import(out)
    assert not (tmp_path / "PWNED").exists()
    rng = np.random.default_rng(0)
    shapes = {"def": (4, 6), "make_mesh": (6, 8), "forward": (8, 6)}
    inputs = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    results = module.forward(inputs)  # type: ignore[attr-defined]
    want = np.tanh(np.asarray(shardc.ops.elementwise.function("gelu").forward(
        inputs["def"] @ inputs["make_mesh"], np)) @ inputs["forward"])
    np.testing.assert_allclose(np.asarray(results["__debug__"]), want, rtol=1e-4, atol=1e-5)
    grads = module.grad(inputs, {"d__debug__": np.ones((4, 6), np.float32)})  # type: ignore[attr-defined]
    assert {"dmake_mesh", "dforward"} <= set(grads)
    assert not (tmp_path / "PWNED").exists()


def _function_locals(source: str) -> set[str]:
    """The names the module's functions bind: their parameters and the variables they assign."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            names |= {a.arg for a in node.args.args}
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def _globals_of(text: str) -> list[str]:
    """The globals of the module ``text`` lowers to that a spec can name a tensor after."""
    plan = shardc.plan(shardc.parse(text))
    mesh = lowered_mesh(plan, None)
    names = template.defined_names(generate(plan, mesh, lowered_sizes(plan, None, mesh)).source)
    return sorted(n for n in names if n.isidentifier() and not n.startswith("_"))


def test_no_variable_of_a_generated_module_shadows_one_of_its_globals() -> None:
    spec = shardc.parse(HOSTILE_SPEC)
    plan = shardc.plan(spec)
    mesh = lowered_mesh(plan, None)
    source = generate(plan, mesh, lowered_sizes(plan, None, mesh)).source
    assert {"jax", "jnp", "P", "PROGRAM", "forward", "route_topk", "keep_mask", "MICROBATCH"} <= (
        template.defined_names(source))
    assert not _function_locals(source) & template.defined_names(source)


SMALL = "mesh X=2\ndims B=4, D=6\nOut[B_X, D] = gelu(In[B_X, D])\n"


@pytest.mark.slow
def test_tensors_named_like_every_global_of_the_module_lower_and_verify() -> None:
    """A tensor named like a helper (``route_topk``) or a table (``PROGRAM``) once shadowed it."""
    from shardc.verification.verify import verify

    names = _globals_of(SMALL)
    lines = ["mesh X=2", "dims B=4, D=6"]
    pairs = zip(["In", *names[:-1]], names, strict=True)
    lines += [f"{name}[B_X, D] = tanh({before}[B_X, D])" for before, name in pairs]
    report = verify(shardc.plan(shardc.parse("\n".join(lines) + "\n")), devices=2)
    assert report.ok and set(names) <= {r.tensor for r in report.values}


@pytest.mark.slow
def test_a_tensor_named_like_the_routing_helper_verifies() -> None:
    from shardc.verification.verify import verify

    text = ("mesh X=2\ndims G=4, S=8, E=4, C=4, D=6\ndtype f32\nparam W_r\n"
            "Gate[G_X, S, E] = softmax(X[G_X, S, D] · W_r[D, E] over E)\n"
            "route_topk[G_X, S, E, C] = route(Gate[G_X, S, E], S, C, 2 over E)\n"
            "Out[G_X, S, E, C] = Gate[G_X, S, E] * route_topk[G_X, S, E, C]\n")
    assert verify(shardc.plan(shardc.parse(text)), devices=2).ok


def test_a_tensor_name_made_in_python_is_mangled_into_an_identifier() -> None:
    spec = shardc.parse("mesh X=2\nOut[B_X, F] = In[B_X, D] · W[D, F]\n")
    odd = dataclasses.replace(spec, filename='a"""\nimport os\n"""')
    plan = shardc.plan(odd)
    mesh = lowered_mesh(plan, None)
    source = generate(plan, mesh, None, title='t"""\\').source
    tree = ast.parse(source)
    assert ast.get_docstring(tree) is not None and "import os" not in [
        ast.unparse(n) for n in tree.body if isinstance(n, ast.Import)]


def test_more_than_52_indices_in_a_plan_lower() -> None:
    """Letters are given per einsum: 54 index names in all, 3 in each einsum."""
    lines = ["mesh X=1"] + [f"T{k}[P{k}, Q{k}] = A{k}[P{k}, R{k}] · B{k}[R{k}, Q{k}]" for k in range(18)]
    plan = shardc.plan(shardc.parse("\n".join(lines) + "\n"))
    mesh = lowered_mesh(plan, None)
    source = generate(plan, mesh, None).source
    compile(source, "<lowered>", "exec")
    assert source.count("jnp.einsum(") >= 18


def test_one_einsum_of_more_than_52_indices_is_a_clear_error() -> None:
    wide = ", ".join(f"I{k}" for k in range(52))
    plan = shardc.plan(shardc.parse(f"mesh X=1\nOut[{wide}, J] = A[{wide}] · W[J]\n"))
    with pytest.raises(ShardcError, match="53 distinct indices"):
        generate(plan, lowered_mesh(plan, None), None)


def test_lower_refuses_to_overwrite_the_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "x.shard"
    text = "mesh X=2\nOut[B_X, F] = In[B_X, D] · W[D, F]\n"
    spec.write_text(text)
    assert main(["lower", str(spec), "-o", str(spec)]) == 2
    assert spec.read_text() == text
    assert "is the spec itself" in capsys.readouterr().err
    assert main(["lower", str(spec), "-o", str(tmp_path / "." / "x.shard")]) == 2
    assert spec.read_text() == text


def _broken(plan: shardc.ir.plan.Plan) -> shardc.ir.plan.Plan:  # type: ignore[name-defined]
    """The plan without its first collective: a later step reads a value nothing makes."""
    steps = list(plan.forward)
    k = next(i for i, s in enumerate(steps) if s.is_collective)
    return dataclasses.replace(plan, forward=tuple(steps[:k] + steps[k + 1:]))


@pytest.mark.parametrize("command", ["plan", "lower", "verify"])
def test_commands_run_the_plan_checker(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from shardc.cli import lower_cmd, plan_cmd
    from shardc.planner import planner

    spec = tmp_path / "fsdp.shard"
    spec.write_text("mesh X=2\ndims B=8, D=4, F=6\nOut[B_X, F] = In[B_X, D] · W[D_X, F]\n")
    real = planner.plan
    for module in (plan_cmd, lower_cmd):  # the planner as each command calls it
        monkeypatch.setattr(module, "plan", lambda *a, **k: _broken(real(*a, **k)))
    assert main([command, str(spec)]) == 1
    err = capsys.readouterr().err
    assert "internal error: the planner made a broken plan" in err and "Traceback" not in err


def test_the_api_runs_the_plan_checker_too() -> None:
    plan = shardc.plan(shardc.parse("mesh X=2\ndims B=8, D=4, F=6\nOut[B_X, F] = In[B_X, D] · W[D_X, F]\n"))
    assert any(s.op is Op.ALL_GATHER for s in plan.forward)
    from shardc.verification.verify import verify

    with pytest.raises(InternalError):
        verify(_broken(plan))


def test_a_dim_not_divisible_by_its_shards_is_refused_clearly() -> None:
    """shard_map needs even blocks; lowering refuses uneven sizes rather than pad (verify picks even ones)."""
    plan = shardc.plan(shardc.parse("mesh X=2\ndims B=8, D=4, F=6\nOut[B_X, F] = In[B_X, D] · W[D, F]\n"))
    with pytest.raises(ShardcError, match="not divisible"):
        shardc.lower(plan, sizes={"B": 5, "D": 4, "F": 6})
    from shardc.verification.verify import verify

    with pytest.raises(ShardcError, match="not divisible"):
        verify(plan, sizes={"B": 5})


@pytest.mark.slow
def test_a_spec_whose_dims_do_not_divide_lowers_to_a_module_that_runs_at_sizes_that_do() -> None:
    """The book's D=5120 over 4096 chips: the module is shape-generic, written without the spec's sizes."""
    from shardc.lowering.api import module_source
    from shardc.lowering.load import load_module

    spec = shardc.parse("mesh X=2\ndims B=8, D=4, F=6\nOut[B_X, F] = In[B_X, D] · W[D, F]\n")
    plan = shardc.plan(spec)
    uneven = dataclasses.replace(spec, dims=(("B", 5), ("D", 4), ("F", 6)))  # as planned with B=5
    source, note = module_source(dataclasses.replace(plan, spec=uneven, sizes=(("B", 5), ("D", 4), ("F", 6),
                                                                             ("X", 2))))
    assert note is not None and "B=5 is not divisible" in note
    module = load_module(source, "uneven")
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(module.forward({"In": x, "W": w})["Out"]), x @ w, rtol=1e-5, atol=1e-5)


def test_an_unexpected_exception_in_verify_is_an_internal_error_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from shardc.cli import lower_cmd
    spec = tmp_path / "tp.shard"
    spec.write_text("mesh X=2\nOut[B_X, F] = In[B_X, D] · W[D, F]\n")

    def boom(*args: object, **kwargs: object) -> None:
        raise ValueError("XLA said no\nsecond line")

    monkeypatch.setattr(lower_cmd, "verify", boom)
    monkeypatch.delenv("SHARDC_TRACEBACK", raising=False)
    assert main(["verify", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "internal error: ValueError: XLA said no" in err and "Traceback" not in err
