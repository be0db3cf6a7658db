"""shardc: a compiler pass for sharding annotations.

Read a spec, plan its collectives, cost them, lower them to JAX::

    >>> import shardc
    >>> spec = shardc.parse("mesh X=4\\nOut[B_X, F] = In[B_X, D] · W[D, F]\\n")
    >>> print(shardc.plan(spec).forward[0].op)
    einsum

``parse``, ``plan`` and ``cost`` never import jax; ``lower`` imports jax on
first use.  ``shardc --version`` prints :data:`__version__`, the one place the
version is written (the wheel's metadata reads it from here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shardc.errors import ShardcError

if TYPE_CHECKING:
    from shardc.costmodel.cost_report import CostReport
    from shardc.explanation.explain_report import Explanation
    from shardc.ir.plan import Plan
    from shardc.ir.spec import Spec
    from shardc.lowering.api import Lowered
    from shardc.lowering.pipeline_lowering import PipelineLowered

__all__ = ["ShardcError", "parse", "plan", "cost", "lower", "explain"]
__version__ = "0.1.0"


def parse(text: str, filename: str | None = None) -> Spec:
    """Parse and check spec text (at most 1 MiB, as a file); raises :class:`ShardcError` pointing at the mistake."""
    from shardc.arguments import check_text
    from shardc.spec.parser import parse as _parse

    return _parse(check_text(text, filename), filename=filename)


def plan(spec: Spec, save: str = "default", **options: Any) -> Plan:
    """Infer every collective of the forward and backward pass of ``spec``.

    ``model="book"`` plans under the book's assumptions (matmuls at peak, memory-bound steps free,
    every collective overlapped); ``bucket_mb`` sizes the gradient buckets (25 MiB).  ``fit_memory=True``
    (as ``shardc plan`` and ``shardc cost`` plan) or a ``memory_limit`` in bytes makes the plan the fastest
    whose memory a device (as :func:`cost` counts it, with ``optimizer`` and ``offload`` as there) fits the
    limit, the chip's HBM by default (``shardc.planner.memory_fit``); without, the fastest.
    """
    from shardc.planner.planner import plan as _planner

    fit = options.pop("fit_memory", False) or options.get("memory_limit") is not None
    _plan: Callable[..., Plan] = _planner
    if fit:  # the memory is the cost layer's count: imported only when weighed
        from shardc.costmodel.fitting import fitting_plan

        _plan = fitting_plan
    _check_plan_args(spec, save, options)
    model, bucket_mb = options.pop("model", None), options.pop("bucket_mb", None)
    if model is not None or bucket_mb is not None:
        from shardc.chip_choice import resolve_hardware

        chip = resolve_hardware(options.get("hardware"), None, spec)
        options["hardware"] = chip.configured(model, bucket_mb)
    return _plan(spec, save=save, **options)


def cost(plan: Plan, hardware: str | None = None, sizes: dict[str, int] | None = None,
         **options: Any) -> CostReport:
    """Cost a plan on a hardware preset (see ``shardc hardware``).

    ``hardware=None`` takes the chip the plan was made for (the spec's ``hardware``
    line, else tpu-v5p).  ``model="book"`` costs with the book's assumptions, ``"chip"`` at
    the rates the chip reaches; ``bucket_mb`` sizes the gradient buckets.  Every dim needs a size;
    ``shardc.costmodel.symbolic.cost_formulas(plan)`` gives the figures as formulas without them.
    """
    from shardc import arguments as a
    from shardc.costmodel.cost_report import cost as _cost
    from shardc.hardware import check_hardware_arg
    from shardc.ir.plan import Plan as _Plan

    a.check_instance(plan, _Plan, "plan", "a Plan (from shardc.plan)")
    check_hardware_arg(hardware)
    a.check_sizes(sizes)
    a.check_spans_arg(options.get("spans"))
    a.check_fraction(options.get("mfu"), "mfu")
    for key in ("optimizer", "hardware_file"):
        if options.get(key) is not None:
            a.check_choice(options[key], key)
    return _cost(plan, hardware=hardware, sizes=sizes, **options)


def lower(plan_or_spec: Plan | Spec, sizes: dict[str, int] | None = None,
          **options: Any) -> Lowered | PipelineLowered:
    """Lower a plan (or a spec, planned with defaults) to JAX shard_map code; imports jax.

    A spec with a pipeline axis lowers to its pipeline over the stage axis, as ``shardc lower`` writes it.
    """
    from shardc.arguments import check_instance, check_sizes
    from shardc.ir.plan import Plan as _Plan
    from shardc.ir.spec import Spec as _Spec

    check_instance(plan_or_spec, _Plan | _Spec, "plan_or_spec", "a Plan or a Spec")
    check_sizes(sizes)
    if isinstance(plan_or_spec, _Spec):
        _check_plan_args(plan_or_spec, options.get("save", "default"), options)
    from shardc.lowering.api import lower as _lower

    spec = plan_or_spec.spec if isinstance(plan_or_spec, _Plan) else plan_or_spec
    if spec.mesh.pipeline_axis is not None:
        from shardc.lowering.pipeline_lowering import lower_pipeline
        from shardc.pipeline.boundary import check_lowerable
        from shardc.planner.check import require_sound

        pipelined = plan_or_spec if isinstance(plan_or_spec, _Plan) else plan(spec, **options)
        require_sound(pipelined)
        check_lowerable(pipelined)
        return lower_pipeline(pipelined, sizes)
    return _lower(plan_or_spec, sizes=sizes, **options)


def explain(fn: Any, *args: Any, hardware: str | None = None) -> Explanation:
    """A jitted jax function on its arguments (arrays or ShapeDtypeStructs with shardings) read as a spec,
    its compiled collectives (tensor, axes, bytes, time, source line) beside shardc's plan; imports jax."""
    from shardc.explanation.explain_report import explain as _explain
    from shardc.hardware import check_hardware_arg

    check_hardware_arg(hardware)
    return _explain(fn, *args, hardware=hardware)


def _check_plan_args(spec: object, save: object, options: dict[str, Any]) -> None:
    from shardc import arguments as a
    from shardc.hardware import check_hardware_arg
    from shardc.ir.spec import Spec as _Spec

    a.check_instance(spec, _Spec, "spec", "a Spec (from shardc.parse)")
    a.check_choice(save, "save")
    for key in ("strategy", "recompute"):
        if key in options:
            a.check_choice(options[key], key)
    check_hardware_arg(options.get("hardware"))
    a.check_spans_arg(options.get("spans"))
