"""The training-state accountings: adam10, adam16, mixed18, mixed14, bf16opt20, each named in the report and in JSON."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardc
from shardc.accountings import ACCOUNTINGS, update_bytes
from shardc.costmodel.formulas import evaluate
from shardc.costmodel.memory import state_formula
from shardc.costmodel.symbolic import cost_formulas
from tests.test_cli import shardc_cli

ROOT = Path(__file__).resolve().parent.parent
SPEC = ("mesh X=4, Y=2\ndims B=4096, D=1024, F=4096\n"
        "Tmp[B_X, F_Y] = In[B_X, D] · W_in[D, F_Y]\nOut[B_X, D] = Tmp[B_X, F_Y] · W_out[F_Y, D]\n")


def test_the_accountings_count_10_16_18_14_and_20_bytes() -> None:
    totals = {name: sum(row[:3]) for name, row in ACCOUNTINGS.items()}
    assert totals == {"adam10": 10, "adam16": 16, "mixed18": 18, "mixed14": 14, "bf16opt20": 20}
    assert ACCOUNTINGS["bf16opt20"][:3] == (2, 6, 12)  # BF16_Optimizer: bf16 grad + its fp32 buffer, 12 sharded
    assert ACCOUNTINGS["mixed14"][:3] == (2, 4, 8)  # DeepSeek-V3's: 2 + 4 + 4 (master) + 2 + 2 (bf16 m, v)
    assert ACCOUNTINGS["mixed18"][:3] == (2, 4, 12)  # fp32 gradient accumulation: 2 + 4 + 4 + 4 + 4
    assert ACCOUNTINGS["adam16"][:3] == (2, 2, 12)  # the ZeRO paper's 2 + 2 + K, K = 12


@pytest.mark.parametrize("name", sorted(ACCOUNTINGS))
def test_each_accounting_counts_its_bytes_per_local_param_and_is_named(name: str) -> None:
    report = shardc.cost(shardc.plan(shardc.parse(SPEC + f"optimizer {name}\n")))  # the spec's line names it
    m = report.memory
    p, g, o, _ = ACCOUNTINGS[name]
    local = 2 * 1024 * 4096 / 2  # both params are sharded over Y only
    assert m.params == local
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == (p * local, g * local, o * local)
    assert m.accounting == name and f"({name}:" in report.render()
    assert report.to_json()["memory"]["accounting"] == name  # type: ignore[index]


def test_an_f16_spec_names_its_params_and_gradients_fp16() -> None:
    # a held-out run (GPT-NeoX-20B, fp16 under DeepSpeed) printed "adam16: ... bf16 param + bf16 grad"
    text = shardc.cost(shardc.plan(shardc.parse("dtype f16\n" + SPEC + "optimizer adam16\n"))).render()
    assert "(adam16: 16 bytes/param: fp16 param + fp16 grad + fp32 master, m, v" in text
    plain = shardc.cost(shardc.plan(shardc.parse(SPEC + "optimizer mixed14\n"))).render()
    assert "bf16 param + fp32 grad + fp32 master + bf16 m, v" in plain  # bf16 specs and the state's types as written


def test_bf16_optimizer_keeps_both_gradients_whole_under_zero_1_and_shards_the_rest() -> None:
    # DeepSpeed's BF16_Optimizer on a ZeRO-1 spec, by hand: W_in[D, F_Y] and W_out[F_Y, D] hold 1024 x 4096 / 2
    # elements each a device; the bf16 gradient (2) and the fp32 buffer (4), zeros_like the whole flat group,
    # are whole; the fp32 master, m and v (12) are the partition of X's 4 ranks
    spec = shardc.parse(SPEC.replace("dims", "zero 1 over X\ndims"))
    m = shardc.cost(shardc.plan(replace(spec, optimizer="bf16opt20"))).memory
    local = 2 * 1024 * 4096 / 2
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == (2 * local, 6 * local, 12 * local / 4)
    assert m.grad_bytes - shardc.cost(shardc.plan(spec), optimizer="mixed18").memory.grad_bytes == 2 * local


@pytest.mark.parametrize("fused", [True, False])
def test_bf16_optimizers_update_reads_the_fp32_gradient_only(fused: bool) -> None:
    # its step hands Adam the fp32 gradient partition, so its update moves what mixed18's does: fused, the bf16
    # param read and written (2 + 2), the fp32 gradient read (4), master, m and v read and written (24)
    assert update_bytes("bf16opt20", fused) == update_bytes("mixed18", fused)
    assert update_bytes("bf16opt20", True) == 2 + 2 + 4 + 24


def test_an_unknown_accounting_is_an_error_naming_them() -> None:
    with pytest.raises(shardc.ShardcError) as err:
        shardc.cost(shardc.plan(shardc.parse(SPEC)), optimizer="sgd")
    assert all(name in err.value.fix for name in ACCOUNTINGS)


def test_cli_takes_mixed18_and_reports_it_in_json(tmp_path: Path) -> None:
    path = tmp_path / "mlp.shard"
    path.write_text(SPEC, encoding="utf-8")
    done = shardc_cli("cost", str(path), "--optimizer", "mixed18", "--json")
    done.check_returncode()
    memory = json.loads(done.stdout)["memory"]
    assert memory["accounting"] == "mixed18"
    assert memory["grad_bytes"] == 4 * memory["params_per_device"]
    assert memory["param_bytes"] + memory["grad_bytes"] + memory["optimizer_bytes"] == \
        18 * memory["params_per_device"]


def test_state_formula_is_the_symbolic_form_of_the_numbers() -> None:
    symbolic = shardc.plan(shardc.parse(SPEC.replace("dims B=4096, D=1024, F=4096\n", "")))
    report = cost_formulas(symbolic, optimizer="mixed18")
    assert report.state == ("mixed18", "4*D*F/Y", "8*D*F/Y", "24*D*F/Y")  # two params of D*F/Y each
    assert "params 4*D*F/Y, grads 8*D*F/Y, optimizer 24*D*F/Y" in report.render()
    assert report.to_json()["memory"]["grad_bytes_expr"] == "8*D*F/Y"  # type: ignore[index]


@given(st.sampled_from(sorted(ACCOUNTINGS)), st.sampled_from(["D_X, F_Y", "D, F_Y", "D_Y, F", "D, F", "D_XY, F"]),
       st.integers(1, 3))
def test_state_bytes_are_the_accounting_times_local_params(name: str, sharding: str, layers: int) -> None:
    spec = shardc.parse(f"mesh X=4, Y=2\ndims B=64, D=64, F=32\nlayers {layers}\nconst In\n"
                        f"Out[B_X, F] = In[B_X, D] · W[{sharding}]\n")
    p = shardc.plan(replace(spec, optimizer=name))
    m = shardc.cost(p).memory
    devices = {"D_X, F_Y": 8, "D, F_Y": 2, "D_Y, F": 2, "D, F": 1, "D_XY, F": 8}[sharding]
    local = layers * 64 * 32 / devices
    assert m.params == local and m.params_total == layers * 64 * 32
    assert m.param_bytes + m.grad_bytes + m.optimizer_bytes == sum(ACCOUNTINGS[name][:3]) * local
    sizes = {"B": 64, "D": 64, "F": 32, "X": 4, "Y": 2}
    values = [evaluate(e, sizes) for e in state_formula(p, name, layers)]
    assert values == [m.param_bytes, m.grad_bytes, m.optimizer_bytes]
