"""``shardc export``: the jax module's text, MaxText's rule files and flax's rules, and clear errors.

The MaxText files are checked against the published format of MaxText's ``custom_mesh_and_rule``
files (``src/maxtext/configs/custom_mesh_and_rule/pure-fsdp.yml`` in
github.com/AI-Hypercomputer/maxtext: ``mesh_axes`` a flow list of axis names, ``data_sharding`` a list
of such lists, ``logical_axis_rules`` a list of ``[logical name, [mesh axes]]`` pairs) and against
golden files of this repository (``python tests/test_export.py`` rewrites them).  What jax makes of
the jax module is ``tests/test_export_jax.py``'s (it compiles).
"""

from __future__ import annotations

import ast
import math
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest

import shardc
from shardc.chip_choice import resolve_hardware
from shardc.export.jax_export import declared, inferred_result, jax_module, out_shardings, pspec_text
from shardc.export.logical import DEFAULT_NAMES, PHYSICAL, flax_rules, maxtext_yaml, parse_names
from shardc.ir.plan import Op, Plan, unfused
from shardc.ir.spec import TensorRef
from tests.example_reports import example_plan
from tests.test_cli import fails_clearly, run_main

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "export"
# (example, tool, --names): the FSDP+TP block, Megatron's layer, DP over a DCN axis beside FSDP, an MoE layer
CASES = [("fsdp_tp", "maxtext", ()), ("fsdp_tp", "flax", ()), ("gpt_layer_tp", "maxtext", ()),
         ("dp_dcn", "maxtext", ()), ("moe_layer", "maxtext", ("G=exp_group", "C=exp_capacity")),
         ("fsdp_tp", "jax", ())]


def planned(name: str, text: str | None = None) -> Plan:
    if text is None:
        return example_plan(name)  # shardc.plan of examples/<name>.shard, made once a test process
    return shardc.plan(shardc.parse(text, filename=f"examples/{name}.shard"))


def export(name: str, tool: str, names: tuple[str, ...]) -> str:
    plan = planned(name)
    if tool == "jax":
        return jax_module(plan)
    found = parse_names(names, plan)
    return maxtext_yaml(plan, found) if tool == "maxtext" else flax_rules(plan, found)


def _golden(name: str, tool: str) -> Path:
    return GOLDEN / f"{name}.{ {'maxtext': 'yml', 'flax': 'flax.txt', 'jax': 'jax.txt'}[tool]}"


@pytest.mark.parametrize(("name", "tool", "names"), CASES)
def test_exports_match_their_golden_files(name: str, tool: str, names: tuple[str, ...]) -> None:
    assert export(name, tool, names) == _golden(name, tool).read_text(encoding="utf-8")


def maxtext_keys(text: str) -> dict[str, object]:
    """The YAML's top-level keys, each value read as the flow literal MaxText's files write."""
    values: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        if line and not line[0].isspace() and ":" in line and line[0] != "]":
            key, _, rest = line.partition(":")
            values[key] = rest
        elif key is not None:
            values[key] += "\n" + line
    return {k: ast.literal_eval(v.strip()) for k, v in values.items()}


@pytest.mark.parametrize(("name", "names"), [(n, names) for n, tool, names in CASES if tool == "maxtext"])
def test_maxtext_files_have_the_rule_file_format(name: str, names: tuple[str, ...]) -> None:
    plan = planned(name)
    keys = maxtext_keys(export(name, "maxtext", names))
    axes = keys["mesh_axes"]
    assert isinstance(axes, list) and axes and set(axes) <= set(PHYSICAL) and len(set(axes)) == len(axes)
    sharding = keys["data_sharding"]
    assert isinstance(sharding, list) and len(sharding) == 1 and set(sharding[0]) <= set(axes)
    rules = keys["logical_axis_rules"]
    assert isinstance(rules, list)
    for logical, mesh_axes in rules:
        assert isinstance(logical, str) and isinstance(mesh_axes, list) and set(mesh_axes) <= set(axes)
    # each axis's size: ICI within a slice times DCN across, together the spec's devices
    sizes = [keys[f"{net}_{'pipeline' if a == 'stage' else a}_parallelism"] for a in axes for net in ("ici", "dcn")]
    assert math.prod(sizes) == plan.spec.mesh.devices  # type: ignore[arg-type]


def test_the_fsdp_tp_rules_are_the_books_layout() -> None:
    # FSDP over X: weights' embed dim and the batch over X; tensor parallel over Y: the MLP dim over Y
    rules = {k: v for k, v in maxtext_keys(export("fsdp_tp", "maxtext", ()))["logical_axis_rules"]}  # type: ignore
    assert rules == {"activation_batch": ["fsdp"], "activation_embed": ["tensor"], "activation_mlp": ["tensor"],
                     "embed": ["fsdp"], "mlp": ["tensor"]}
    flax: dict[str, object] = {}
    exec(export("fsdp_tp", "flax", ()), flax)  # noqa: S102 - our own generated text
    assert dict(flax["LOGICAL_AXIS_RULES"]) == {  # type: ignore[call-overload]
        "activation_batch": "X", "activation_embed": "Y", "activation_mlp": "Y", "embed": "X", "mlp": "Y"}


def test_a_dcn_axis_and_an_ici_axis_of_one_role_are_one_hybrid_axis() -> None:
    spec = "mesh R=2 over dcn, X=4\ndims B=64, D=16, F=32\nOut[B_RX, F] = In[B_RX, D] · W[D_X, F]\n"
    keys = maxtext_keys(maxtext_yaml(planned("hybrid", spec), {"R": "fsdp"}))
    assert keys["mesh_axes"] == ["fsdp"] and keys["data_sharding"] == [["fsdp"]]
    assert keys["ici_fsdp_parallelism"] == 4 and keys["dcn_fsdp_parallelism"] == 2


def test_names_rename_dims_and_axes() -> None:
    spec = "mesh X=4, Y=2\ndims B=64, M=16, Q=32\nOut[B_X, Q_Y] = In[B_X, M] · W[M_X, Q_Y]\n"
    plan = planned("renamed", spec)
    rules = dict(maxtext_keys(maxtext_yaml(plan, parse_names(["M=embed,Q=mlp", "Y=tensor_sequence"], plan)))[
        "logical_axis_rules"])  # type: ignore[arg-type]
    assert rules["embed"] == ["fsdp"] and rules["mlp"] == ["tensor_sequence"]
    assert rules["activation_mlp"] == ["tensor_sequence"]


def test_disagreeing_tensors_are_named() -> None:
    spec = "mesh X=4\ndims B=64, D=16, F=32, G=8\nH[B_X, F] = In[B_X, D] · W1[D, F]\nOut[B, G] = H[B_X, F] · W2[F, G]\n"
    text = flax_rules(planned("disagree", spec), {"G": "mlp2"})
    assert "sharded otherwise: Out: B" in text


def test_errors_are_clean(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    moe = str(ROOT / "examples" / "moe_layer.shard")
    fails_clearly(capsys, "export", moe, "--to", "maxtext", says="no logical name for the dims C, G")
    fails_clearly(capsys, "export", moe, "--to", "flax", "--names", "G=exp group", says="--names expects NAME=LOGICAL")
    fails_clearly(capsys, "export", moe, "--to", "flax", "--names", "Z=exp", says="not a dim or mesh axis")
    fails_clearly(capsys, "export", moe, "--to", "maxtext", "--names", "X=model,G=g,C=c", says="no mesh axis 'model'")
    fails_clearly(capsys, "export", moe, "--to", "jax", "--names", "G=g", says="--names applies to")
    two = tmp_path / "two.shard"
    two.write_text("mesh X=2, Y=2\ndims B=64, D=16, F=8\nOut[B_XY, F] = In[B_XY, D] · W[D, F]\n", encoding="utf-8")
    fails_clearly(capsys, "export", str(two), "--to", "maxtext", says="both map to MaxText's 'data' axis")
    fails_clearly(capsys, "export", str(two), "--to", "maxtext", "-o", str(two), says="is the spec itself")
    status, _, err = run_main(capsys, "export", str(two), "--to", "maxtext", "--names", "Y=fsdp",
                              "-o", str(tmp_path / "out.yml"))
    assert status == 0 and "wrote" in err and "'fsdp'" in (tmp_path / "out.yml").read_text(encoding="utf-8")


def test_the_default_names_are_maxtexts() -> None:
    # base.yml's logical names (src/MaxText/configs/base.yml, logical_axis_rules), weights' and activations'
    maxtext = {"embed", "mlp", "heads", "kv_heads", "vocab", "exp", "kv", "activation_batch", "activation_length",
               "activation_embed", "activation_mlp", "activation_heads", "activation_kv_heads", "activation_vocab",
               "activation_exp", "activation_kv"}
    weights = {n for n in DEFAULT_NAMES.values() if n not in ("batch", "length")}
    assert weights | {"activation_" + n for n in DEFAULT_NAMES.values()} <= maxtext


def test_the_readme_example_is_what_export_prints(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"^  \$ (shardc export .*?)\n(.*?)^  ```", readme, re.S | re.M)
    assert block is not None
    monkeypatch.chdir(ROOT)
    status, out, _ = run_main(capsys, *shlex.split(block.group(1))[1:])
    assert status == 0 and out == textwrap.dedent(block.group(2))


# the jax module's text -----------------------------------------------------------------------------

def test_the_jax_module_lists_every_declared_tensor_and_gradient() -> None:
    book = resolve_hardware("h100").configured("book")  # Megatron's layer is the book's model's plan
    plan = shardc.plan(shardc.parse((ROOT / "examples" / "gpt_layer_tp.shard").read_text(encoding="utf-8")),
                       hardware=book)
    module: dict[str, object] = {}
    exec(compile(jax_module(plan), "<export>", "exec"), module)  # noqa: S102 - imports jax, builds P()s only
    from jax.sharding import PartitionSpec as P

    def expected(ref: TensorRef) -> P:
        return P(*[d.axes[0] if len(d.axes) == 1 else (d.axes or None) for d in ref.dims],
                 unreduced=set(ref.unreduced))

    assert module["SHARDINGS"] == {ref.name: expected(ref) for _, ref in declared(plan)}
    assert module["GRAD_SHARDINGS"] == {g.name: expected(g) for g in plan.grads}
    # Megatron's layer: the attention output and the MLP output are partial sums over Y
    assert set(module["OUT_SHARDINGS"]) == {"A", "M"}  # type: ignore[arg-type]
    assert module["OUT_SHARDINGS"]["M"] == P(None, None, None, unreduced={"Y"})  # type: ignore[index]


def test_out_sharding_is_given_exactly_where_explicit_mode_would_not_infer_the_plans() -> None:
    plan = planned("fsdp_tp")
    listed = [step for _, step in out_shardings(plan.forward + plan.backward)]
    einsums = list(dict.fromkeys(part for s in plan.forward + plan.backward for part in unfused(s)))
    assert len(einsums) > len(plan.forward + plan.backward)  # collective matmuls: their einsums are a user's
    for step in einsums:
        if step.op is Op.EINSUM:
            guess = inferred_result(step)
            same = guess is not None and guess.layout == step.dst.layout and not step.dst.unreduced
            assert (step in listed) != same, step


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.shard")), ids=lambda p: p.stem)
def test_every_example_exports_a_python_module(path: Path) -> None:
    plan = planned(path.stem)
    tree = ast.parse(jax_module(plan))
    assigned = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name)}
    assert {"AXIS_SIZES", "SHARDINGS", "GRAD_SHARDINGS", "OUT_SHARDINGS", "BACKWARD_OUT_SHARDINGS"} <= assigned


def test_names_reach_the_module_through_repr() -> None:
    spec = shardc.parse("mesh X=4\ndims B=64, D=16, F=32\nOut[B_X, F] = In[B_X, D] · W[D, F]\n",
                        filename="it's\n\"\"\"odd\".shard")
    text = jax_module(shardc.plan(spec))
    ast.parse(text)  # the file name is a repr in a comment: no line break, no quote ends a string
    assert "\n\"\"\"odd" not in text and pspec_text(declared(shardc.plan(spec))[0][1]) == "P('X', None)"


if __name__ == "__main__":
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        _golden(case[0], case[1]).write_text(export(*case), encoding="utf-8")
    print(f"wrote {len(CASES)} files in {GOLDEN}", file=sys.stderr)


@pytest.mark.parametrize(("mesh", "zero", "roles"), [
    ("mesh X=8", "zero 3 over X", {"X": "fsdp"}),  # FSDP of weights written whole: MaxText's pure-fsdp.yml
    ("mesh X=4, C=2", "zero 3 over X, C", {"X": "fsdp", "C": "context"})])
def test_a_zero_3_axis_is_maxtexts_fsdp_axis_whichever_dims_it_shards(mesh: str, zero: str,
                                                                       roles: dict[str, str]) -> None:
    """A ZeRO-3 spec writes its weights whole and the line shards some on their model dims (W_out[F_X, D]); the
    axis was exported as MaxText's 'tensor', and two such axes clashed.  An axis that also shards the sequence
    (context parallelism) is MaxText's 'context', whose rules shard the weights too."""
    seq = "S_C" if "C" in mesh else "S"
    text = (f"{mesh}\n{zero}\ndims B=16, S=32, D=64, F=128\nparam W_in, W_out\n"
            f"H[B_X, {seq}, F] = In[B_X, {seq}, D] · W_in[D, F]\nO[B_X, {seq}, D] = H[B_X, {seq}, F] · W_out[F, D]\n")
    keys = maxtext_keys(maxtext_yaml(planned("zero3", text), {}))
    assert keys["mesh_axes"] == list(roles.values()) and keys["data_sharding"] == [["fsdp"]]
