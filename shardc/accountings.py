"""The accountings of the training state, by name: bytes a param of param, gradient and optimizer state.

A table apart (no imports), so ``shardc cost --help`` lists them without loading the
cost pass; :mod:`shardc.costmodel.memory` counts with it.

* ``adam10``: a bf16 param and fp32 Adam m and v, the book's "data parallel fits
  about HBM/10 params"; gradients are not counted apart (they are reduced and
  applied as they are made).
* ``adam16``: adding a bf16 gradient and an fp32 master copy: the ZeRO paper's
  mixed-precision Adam (Rajbhandari et al. 2020: 2 + 2 + K bytes, K = 12).
* ``mixed18``: the gradient accumulated in fp32 (2 + 4 + 4 + 4 + 4: bf16 param,
  fp32 grad, fp32 master, m and v), as Megatron-LM's distributed optimizer and
  DeepSpeed count it.
* ``mixed14``: as ``mixed18`` with Adam's m and v in bf16 (2 + 4 + 4 + 2 + 2), as
  DeepSeek-V3 was trained ("DeepSeek-V3 Technical Report", arXiv 2412.19437, section
  3.3.4: BF16 first and second moments; the master weights and the gradients used
  for batch-size accumulation in FP32).
* ``bf16opt20``: DeepSpeed's ``BF16_Optimizer`` (2 + 2 + 4 + 4 + 4 + 4), as BLOOM was trained
  (microsoft/DeepSpeed, ``deepspeed/runtime/bf16_optimizer.py``): ``_setup_for_real_optimizer`` makes
  each param group's fp32 gradient buffer (``fp32_groups_gradients_flat``) ``zeros_like`` the group's whole
  flat bf16 params, not the rank's partition, while the fp32 master (``fp32_groups_flat_partition``), and so
  Adam's m and v, are the rank's partition only; the pipeline engine (``deepspeed/runtime/pipe/engine.py``,
  ``_exec_backward_pass``) clears the bf16 gradients before each microbatch's backward and adds them into
  the fp32 buffer after it with ``update_hp_grads(clear_lp_grads=False)``, so the bf16 gradients are held
  too.  Under ``zero 1`` the 2 + 4 gradient bytes stay whole and the 12 are sharded.
"""

from __future__ import annotations

__all__ = ["ACCOUNTINGS", "MASTER", "LOW_GRAD", "REDUCE_DTYPES", "chosen", "reduce_dtype", "described", "update_bytes"]

# name -> (param bytes, grad bytes, optimizer-state bytes, description)
ACCOUNTINGS: dict[str, tuple[int, int, int, str]] = {
    "adam10": (2, 0, 8, "10 bytes/param: bf16 param + fp32 Adam m, v"),
    "adam16": (2, 2, 12, "16 bytes/param: bf16 param + bf16 grad + fp32 master, m, v"),
    "mixed18": (2, 4, 12, "18 bytes/param: bf16 param + fp32 grad + fp32 master, m, v"),
    "mixed14": (2, 4, 8, "14 bytes/param: bf16 param + fp32 grad + fp32 master + bf16 m, v"),
    "bf16opt20": (2, 6, 12, "20 bytes/param: bf16 param + bf16 grad + fp32 grad accumulation + fp32 master, m, v "
                            "(DeepSpeed's BF16_Optimizer)"),
}

# Of the optimizer state above, the bytes of an fp32 master copy of the param (the rest is Adam's m and v, two
# moments of equal size): the copy the update acts on where there is one, written back to the param after it.
MASTER: dict[str, int] = {"adam10": 0, "adam16": 4, "mixed18": 4, "mixed14": 4, "bf16opt20": 4}

# Of the gradient bytes above, those of a bf16 copy held beside the fp32 accumulation, which the update never
# reads (BF16_Optimizer's step hands Adam the fp32 gradient partition only): none but for ``bf16opt20``.
LOW_GRAD: dict[str, int] = {"bf16opt20": 2}

# The element type an accounting's framework data-parallel reduces the params' gradients in, where not the param's
# own: the default of a spec naming the accounting (`optimizer NAME`) and writing no `grad_reduce ... in T`
# (:func:`reduce_dtype`, read by the planner, shardc.planner.graph, so the gradients' AllReduce / ReduceScatter
# volumes, and the backward's writes of them, count it).
# ``bf16opt20``: DeepSpeed's pipeline engine under BF16_Optimizer all-reduces the optimizer's fp32 gradient
# buffer, not the bf16 gradients (microsoft/DeepSpeed, deepspeed/runtime/pipe/engine.py: ``_exec_reduce_grads``
# calls ``_bf16_reduce_grads``, which hands ``buffered_allreduce_fallback`` the optimizer's
# ``get_grads_for_reduction()``, "the optimizer's FP32 grads").  The other accountings name no framework's
# reduction (DeepSpeed's ZeRO-1/2 under bf16 reduces in bf16: deepspeed/runtime/engine.py,
# ``communication_data_type`` is bfloat16 where bf16 is on and the config sets none), so their gradients are
# reduced in the param's type unless the spec's `grad_reduce` line says another.
REDUCE_DTYPES: dict[str, str] = {"bf16opt20": "f32"}


def reduce_dtype(written: str | None, accounting: str | None) -> str | None:
    """The type the params' gradients are reduced in: the spec's ``grad_reduce ... in T`` (``written``) where
    set, else the ``accounting``'s (:data:`REDUCE_DTYPES`), else None (each param's own type).

    >>> reduce_dtype(None, "bf16opt20"), reduce_dtype("bf16", "bf16opt20"), reduce_dtype(None, "adam16")
    ('f32', 'bf16', None)
    """
    return written or REDUCE_DTYPES.get(accounting or "")


def chosen(written: str | None, given: str | None = None) -> str:
    """The accounting a cost counts with: ``given`` (``shardc cost --optimizer``, ``cost(optimizer=)``) where
    set, else the spec's ``optimizer`` line (``written``), else ``adam10``.

    >>> chosen(None), chosen("bf16opt20"), chosen("bf16opt20", "adam16")
    ('adam10', 'bf16opt20', 'adam16')
    """
    return given or written or "adam10"


def described(accounting: str, dtype: str) -> str:
    """The accounting's description for a spec whose 16-bit type is ``dtype``: the param and the gradient
    held in the spec's type (fp16 under DeepSpeed's or Megatron-LM's fp16 mixed precision, as GPT-NeoX-20B
    trained), the optimizer state's own types as written.

    >>> described("adam16", "f16")
    '16 bytes/param: fp16 param + fp16 grad + fp32 master, m, v'
    >>> described("mixed14", "bf16")
    '14 bytes/param: bf16 param + fp32 grad + fp32 master + bf16 m, v'
    """
    text = ACCOUNTINGS[accounting][3]
    if dtype != "f16":
        return text
    return text.replace("bf16 param", "fp16 param").replace("bf16 grad", "fp16 grad")


def update_bytes(accounting: str, fused: bool) -> int:
    """HBM bytes the optimizer's update moves per element of the training state it updates.

    Fused (one kernel, as XLA fuses the update's elementwise chain, or a hand-fused Adam kernel): it reads the
    param, the gradient (in the param's dtype where the accounting keeps none) and the state, and writes the
    param and the state.  Unfused (``fusion none``, PyTorch eager): the passes of ``torch.optim.AdamW``'s
    multi-tensor update, each kernel reading its operands and writing its result (pytorch/pytorch,
    torch/optim/adamw.py, ``_multi_tensor_adamw``): ``_foreach_lerp_`` of m toward the gradient, ``_foreach_mul_``
    and ``_foreach_addcmul_`` of v, ``_foreach_sqrt`` of v into a temporary of v's size, ``_foreach_div_`` and
    ``_foreach_add_`` on it (the bias correction, eps), and ``_foreach_addcdiv_`` of the updated tensor (the
    master where there is one) by m over it: 14 moment-sizes, the gradient twice, the updated tensor read and
    written; a master is then copied to the param (read, write).  Weight decay's pass is left out (none where
    the decay is 0)."""
    param, grad, state, _ = ACCOUNTINGS[accounting]
    grad = max(grad - LOW_GRAD.get(accounting, 0), param)
    if fused:
        return 2 * param + grad + 2 * state
    master = MASTER[accounting]
    moment = (state - master) // 2
    updated = master or param
    copy = master + param if master else 0
    return 14 * moment + 2 * grad + 2 * updated + copy
