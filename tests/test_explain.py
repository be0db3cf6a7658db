"""``shardc explain``: plain jax programs written here, read back as specs, their collectives beside the plan.

Each program builds its mesh over the 8 emulated CPU devices (conftest) and is compiled, not run.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

import shardc
from shardc.explanation.explain_report import explain, render_explanation
from tests.test_cli import fails_clearly, run_main

pytestmark = pytest.mark.slow


def _mesh(shape: tuple[int, int]) -> Any:
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _arg(mesh: Any, shape: tuple[int, ...], *spec: Any) -> Any:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(*spec)))


def megatron_mlp() -> tuple[Any, tuple[Any, ...]]:
    """Megatron's MLP: the hidden dim over `model`, so one AllReduce after the second matmul."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def mlp(x: Any, w1: Any, w2: Any) -> Any:
        h = jax.nn.gelu(jnp.einsum("bd,df->bf", x, w1))
        return jax.nn.relu(h) @ w2  # the AllReduce's line

    return jax.jit(mlp), (_arg(mesh, (16, 8), "data", None), _arg(mesh, (8, 32), None, "model"),
                          _arg(mesh, (32, 8), "model", None))


def cross_attention_layer() -> tuple[Any, tuple[Any, ...]]:
    """A decoder layer's cross-attention (sigmoid attention) and MLP, heads and MLP over `model`; the
    residual stream is constrained to sequence parallelism (its length over `model`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh((2, 4))

    def layer(x: Any, mem: Any, wq: Any, wk: Any, wv: Any, wo: Any, w1: Any, w2: Any) -> Any:
        q = jnp.einsum("bsd,dnh->bsnh", x, wq)
        k = jnp.einsum("btd,dnh->btnh", mem, wk)
        v = jnp.einsum("btd,dnh->btnh", mem, wv)
        p = jax.nn.sigmoid(jnp.einsum("bsnh,btnh->bnst", q, k))
        y = x + jnp.einsum("bsnh,nhd->bsd", jnp.einsum("bnst,btnh->bsnh", p, v), wo)
        y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P("data", "model", None)))
        return y + jnp.einsum("bsf,fd->bsd", jax.nn.gelu(jnp.einsum("bsd,df->bsf", y, w1)), w2)

    b, s, t, d, n, h, f = 4, 8, 12, 16, 8, 2, 32
    return jax.jit(layer), (_arg(mesh, (b, s, d), "data"), _arg(mesh, (b, t, d), "data"),
                            _arg(mesh, (d, n, h), None, "model"), _arg(mesh, (d, n, h), None, "model"),
                            _arg(mesh, (d, n, h), None, "model"), _arg(mesh, (n, h, d), "model"),
                            _arg(mesh, (d, f), None, "model"), _arg(mesh, (f, d), "model", None))


def _line_of(fn: Any, text: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    return f"{inspect.getsourcefile(fn)}:{start + next(i for i, line in enumerate(lines) if text in line)}"


def test_megatrons_mlp_is_read_as_its_spec_and_needs_what_the_plan_needs() -> None:
    fn, args = megatron_mlp()
    e = explain(fn, *args)
    assert "Y1[B_{data}, F_{model}] = x[B_{data}, D] · w1[D, F_{model}]" in e.spec
    assert "gelu(Y1" in e.spec and "relu(H1" in e.spec
    assert [(c.kind, c.axes, c.bytes) for c in e.xla] == [("AllReduce", "model", 4 * 8 * 4)]
    assert e.xla[0].line == _line_of(megatron_mlp, "the AllReduce's line")
    assert [(c.kind, c.axes, c.bytes) for c in e.plan] == [("AllReduce_{model}", "model", 4 * 8 * 4)]
    assert not e.not_needed and not e.differently and e.xla_comm_s == pytest.approx(e.plan_comm_s)
    assert e.xla_memory["argument"] > 0
    json.dumps(e.to_json())


def test_tensors_held_in_another_type_get_dtype_lines_and_their_bytes() -> None:
    """A bf16 program with an f32 output matmul: the spec says `dtype bf16` and names the f32 tensors, and
    the plan prices the AllReduce of the f32 product at 4 bytes an element (2 under the spec's type)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh((4, 2))

    def arg(shape: tuple[int, ...], dtype: Any, *spec: Any) -> Any:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))

    def mlp(x: Any, w1: Any, w2: Any) -> Any:
        h = jax.nn.gelu(jnp.einsum("bd,df->bf", x, w1))
        return h.astype(jnp.float32) @ w2

    e = explain(jax.jit(mlp), arg((16, 8), jnp.bfloat16, "data", None), arg((8, 32), jnp.bfloat16, None, "model"),
                arg((32, 8), jnp.float32, "model", None))
    assert "dtype bf16\ndtype f32 Y2, w2\n" in e.spec
    assert [(c.kind, c.bytes) for c in e.xla] == [("AllReduce", 4 * 8 * 4)]
    assert [(c.kind, c.bytes) for c in e.plan] == [("AllReduce_{model}", 4 * 8 * 4)]


def test_a_transformer_layer_with_a_constraint() -> None:
    fn, args = cross_attention_layer()
    e = explain(fn, *args)
    spec = shardc.parse(e.spec)  # the spec is the language's, and plans
    assert "sigmoid(" in e.spec and "gelu(" in e.spec
    constrained = next(s.result for s in spec.statements if s.result.name == "R1")
    assert [d.axes for d in constrained.dims] == [("data",), ("model",), ()]
    assert e.xla and all(c.line.startswith(f"{__file__}:") for c in e.xla)
    text = render_explanation(e)
    assert "collectives shardc would not need:" in text and "XLA's memory a device" in text


def transposed_layout() -> tuple[Any, tuple[Any, ...]]:
    """A result constrained to the transpose of the layout its operands give (rows over `model`, columns
    over `data`), after the input itself is constrained to another layout: XLA reshards through
    collective-permutes and a partial gather, shardc plans the einsum into the constrained layout."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh((4, 2))

    def f(x: Any, w: Any) -> Any:
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data", "model")))
        y = jnp.einsum("bd,df->bf", x, w)
        return jnp.tanh(jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P("model", "data"))))

    return jax.jit(f), (_arg(mesh, (16, 8), "data", None), _arg(mesh, (8, 24), None, "model"))


def test_a_resharded_program_is_put_beside_the_plan() -> None:
    fn, args = transposed_layout()
    e = explain(fn, *args)
    spec = shardc.parse(e.spec)
    made = {s.result.name: s.result for s in spec.statements}
    # the input's constraint is a copy of it (a reshard), the result's is the einsum's own sharding
    assert "C1[B_{data}, D_{model}] = x[B_{data}, D]" in e.spec
    assert [d.axes for d in made["Y1"].dims] == [("model",), ("data",)]
    assert any(c.kind == "collective-permute" and c.seconds is None for c in e.xla)  # no plan step is one
    assert e.not_needed and all(c.line.startswith(f"{__file__}:") for c in e.xla)
    assert e.shardc_memory > 0


def test_a_bias_a_gate_and_a_reduction() -> None:
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def f(x: Any, w: Any, b: Any, g: Any) -> Any:
        y = jnp.einsum("bd,df->bf", x, w) + b
        return jnp.sum(jax.nn.silu(y) * g, axis=1)

    e = explain(jax.jit(f), _arg(mesh, (16, 8), "data", None), _arg(mesh, (8, 24), None, "model"),
                _arg(mesh, (24,), "model"), _arg(mesh, (16, 24), "data", "model"))
    spec = shardc.parse(e.spec)
    texts = [str(s.expr) for s in spec.statements]
    assert any(t.endswith("+ b[F_{model}]") for t in texts), texts  # the bias broadcast, as the language adds it
    assert any(t.startswith("silu(") for t in texts) and any(" * g[B_{data}, F_{model}]" in t for t in texts)
    assert any(t.startswith("sum(") and t.endswith("over F)") for t in texts), texts


def test_self_attention_reads_its_input_twice_through_renames() -> None:
    """Queries and keys from one x (its S on both sides of Q·K), a softmax over the keys (traced as a
    max, an exp, a sum and a division: one `softmax` of the language), then the probabilities times
    values (contracting T with V's S): each is read through a rename, as a spec writes self-attention."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def f(x: Any, wq: Any, wk: Any, wv: Any) -> Any:
        q, k, v = (jnp.einsum("bsd,dnh->bsnh", x, w) for w in (wq, wk, wv))
        p = jax.nn.softmax(jnp.einsum("bsnh,btnh->bnst", q, k), axis=-1)
        return jnp.einsum("bnst,btnh->bsnh", p, v)

    weight = _arg(mesh, (16, 8, 2), None, "model")
    e = explain(jax.jit(f), _arg(mesh, (4, 8, 16), "data"), weight, weight, weight)
    spec = shardc.parse(e.spec)
    renames = [s for s in spec.statements if s.result.name.startswith("C")]
    assert len(renames) == 2 and all("T" in [d.name for d in s.result.dims] for s in renames), e.spec
    scores = next(s.result for s in spec.statements if "T" in [d.name for d in s.result.dims]
                  and "S" in [d.name for d in s.result.dims])
    assert [d.name for d in scores.dims] == ["B", "N", "S", "T"]
    assert any(str(s.expr).startswith("softmax(") and str(s.expr).endswith("over T)") for s in spec.statements)
    assert not e.xla  # heads over `model`, the batch over `data`: XLA needs no collective
    assert shardc.cost(shardc.plan(spec)).step.step_s > 0


def test_an_rmsnorm_in_either_form_is_one_function_and_its_statistic_reduced_over_the_model_axis() -> None:
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def f(x: Any, w: Any) -> Any:
        y = jnp.einsum("bd,df->bf", x, w)
        a = y * jax.lax.rsqrt(jnp.mean(y**2, axis=-1, keepdims=True) + 1e-6)
        b = y / jnp.sqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + 1e-6)
        return a + b

    e = explain(jax.jit(f), _arg(mesh, (8, 16), "data"), _arg(mesh, (16, 8), None, "model"))
    norms = [s for s in shardc.parse(e.spec).statements if str(s.expr).startswith("rmsnorm(")]
    assert len(norms) == 2 and all(str(s.expr).endswith("over F)") for s in norms), e.spec
    # F over `model`: each norm's mean of squares is a partial sum, AllReduced, in XLA's program and the plan
    assert [c.kind for c in e.plan] == ["AllReduce_{model}"] * 2 and len(e.xla) == 2


def test_a_reduction_over_two_dims_is_two_reductions() -> None:
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))

    def f(x: Any, w: Any) -> Any:
        return jnp.sum(jnp.tanh(jnp.einsum("bsd,df->bsf", x, w)), axis=(1, 2))

    e = explain(jax.jit(f), _arg(mesh, (8, 4, 16), "data"), _arg(mesh, (16, 8), None, "model"))
    sums = [str(s.expr) for s in shardc.parse(e.spec).statements if str(s.expr).startswith("sum(")]
    assert len(sums) == 2 and sums[0].endswith("over S)") and sums[1].endswith("over F)"), e.spec
    assert [c.kind for c in e.plan] == ["AllReduce_{model}"] and len(e.xla) == 1  # the sum over F's shards


def test_a_partial_all_reduced_a_reduction_later_pairs_with_the_plans() -> None:
    """``x.sum()``, ``x.max()`` and a scalar loss of a batch over `data`: XLA reduces to a scalar on each
    device and all-reduces that (4 B).  The plan hands a sum's partial sums on through the next sum and
    all-reduces the scalar too; a max is no sum, so the plan all-reduces the maximum over the batch (16 B)
    before the next: one partial's one AllReduce on both sides, neither listed as unneeded or done otherwise.
    Each row is timed over the plan's torus spans, as the totals are (8 chips of a v5p: 3 hops, not a
    ring's 4)."""
    import jax
    import jax.numpy as jnp

    mesh = _mesh((8, 1))
    x = _arg(mesh, (16, 4), "data", None)
    for fn, args, planned in ((lambda x: x.sum(), (x,), ("M2", 4)), (lambda x: x.max(), (x,), ("M1", 16)),
                              (lambda x, w: jnp.mean((x @ w) ** 2), (x, _arg(mesh, (4, 4))), ("M2", 4))):
        e = explain(jax.jit(fn), *args)
        assert [(c.kind, c.tensor, c.bytes) for c in e.xla] == [("AllReduce", "M2", 4)], e.spec
        assert [(c.kind, c.tensor, c.bytes) for c in e.plan] == [("AllReduce_{data}", *planned)], e.spec
        assert not e.not_needed and not e.differently
        assert e.xla[0].seconds == e.plan[0].seconds == pytest.approx(e.plan_comm_s) == pytest.approx(e.xla_comm_s)
    # the batch over (model, data): XLA's group named `model,data`, the plan's `data,model`, one group of devices
    e = explain(jax.jit(lambda x: x.sum()), _arg(_mesh((4, 2)), (16, 4), ("model", "data"), None))
    assert [c.axes for c in e.xla] == ["model,data"] and [c.axes for c in e.plan] == ["data,model"]
    assert not e.not_needed and not e.differently


def test_a_mean_is_read_as_a_mean_with_the_programs_values() -> None:
    """``jnp.mean`` traces to a sum divided by the count: read as a mean (over each dim it reduces, a mean of
    means), not a plain sum n times the program's value; the spec's reference gives the program's value."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from shardc.lowering.reference import forward

    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    for fn in (lambda x: jnp.mean(x, axis=0), lambda x: x.mean()):
        e = explain(jax.jit(fn), _arg(_mesh((8, 1)), (16, 4), "data", None))
        spec = shardc.parse(e.spec)
        assert {str(s.expr).split("(")[0] for s in spec.statements if s.result.name.startswith("M")} == {"mean"}
        assert np.allclose(forward(spec, {"x": x})[spec.statements[-1].result.name], fn(x)), e.spec
    # another number is the language's scale (tests/test_explain_scales.py), not read into the mean
    e = explain(jax.jit(lambda x: x.sum(0) * 0.5), _arg(_mesh((8, 1)), (16, 4), "data", None))
    spec = shardc.parse(e.spec)
    assert str(spec.statements[-1].expr).startswith("scale("), e.spec
    assert np.allclose(forward(spec, {"x": x})[spec.statements[-1].result.name], x.sum(0) * 0.5), e.spec


def test_a_partial_passes_only_reductions_of_its_own_kind() -> None:
    """A partial sum passes sums and means, a partial maximum maxima: a max after a sum ends the sum's
    chain (an AllReduce after it is another one), and starts its own."""
    from shardc.explanation.explain_report import _chained, _partial_links

    spec = "mesh d=8\ndims B=16, S=4, T=2\nM1[S, T] = sum(x[B_d, S, T] over B)\nM2[T] = mean(M1[S, T] over S)\n" \
           "M3[T] = max(M1[S, T] over S)\nM4[] = sum(M2[T] over T)\nM5[] = max(M3[T] over T)\n"
    links = _partial_links(shardc.plan(shardc.parse(spec)))
    assert links == {"x": {"M1", "M2", "M4"}, "M1": {"M2", "M4"}, "M2": {"M4"}, "M3": {"M5"}}
    assert _chained("M1", "M4|L1", links) and _chained("M4", "M1", links) and _chained("M3", "M5", links)
    assert not _chained("M1", "M3", links) and not _chained("M1", "M5", links)


def test_an_op_the_language_lacks_is_a_clear_error() -> None:
    import jax
    import jax.numpy as jnp

    mesh = _mesh((4, 2))
    fn = jax.jit(lambda x, w: jnp.cumsum(x @ w, axis=0))
    with pytest.raises(shardc.ShardcError, match="the program has `cumsum` at"):
        explain(fn, _arg(mesh, (16, 8), "data", None), _arg(mesh, (8, 4), None, None))


def test_the_command_writes_json_and_the_spec(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    program = tmp_path / "model.py"
    program.write_text(inspect.getsource(_mesh) + inspect.getsource(_arg) + inspect.getsource(megatron_mlp)
                       .replace("megatron_mlp", "program"), encoding="utf-8")
    program.write_text("from __future__ import annotations\nfrom typing import Any\n" + program.read_text("utf-8"),
                       encoding="utf-8")
    out_spec = tmp_path / "mlp.shard"
    status, out, err = run_main(capsys, "explain", f"{program}:program", "--json", "--spec-out", str(out_spec))
    assert status == 0, err
    data = json.loads(out)
    assert data["spec"] == out_spec.read_text(encoding="utf-8") and data["xla"][0]["kind"] == "AllReduce"
    status, out, _ = run_main(capsys, "plan", str(out_spec))
    assert status == 0 and "AllReduce" in out
    fails_clearly(capsys, "explain", f"{program}:nothing", says="has no function nothing")
    fails_clearly(capsys, "explain", "missing.py:program", says="no file missing.py")


def test_the_readme_snippet_runs_as_written(tmp_path: Path) -> None:
    import os
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"^```python\n(.*?)^```", readme, re.S | re.M) if "shardc.explain(" in b)
    script = tmp_path / "explain_snippet.py"
    script.write_text(block, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "x[B_{data}, D] · w1[D, F_{model}]" in done.stdout
    assert "[('AllReduce', 'model')] [('AllReduce_{model}', 'model')]" in done.stdout


def test_shardc_explain_stays_callable_once_its_package_is_imported() -> None:
    """Importing a package binds it as its parent's attribute: the front end's, once named ``explain``, then
    hid the function ``shardc.explain`` (this module imports the package above), so its second call failed
    with 'module is not callable'.  Named ``explanation``, it hides nothing: every call explains."""
    fn, args = megatron_mlp()
    assert callable(shardc.explain)
    with pytest.raises(shardc.ShardcError, match="hardware"):
        shardc.explain(fn, *args, hardware=" ")
    first, again = shardc.explain(fn, *args), shardc.explain(fn, *args)
    assert first.spec == again.spec and "w1[D, F_{model}]" in first.spec
