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
"""

from __future__ import annotations

__all__ = ["ACCOUNTINGS"]

# name -> (param bytes, grad bytes, optimizer-state bytes, description)
ACCOUNTINGS: dict[str, tuple[int, int, int, str]] = {
    "adam10": (2, 0, 8, "10 bytes/param: bf16 param + fp32 Adam m, v"),
    "adam16": (2, 2, 12, "16 bytes/param: bf16 param + bf16 grad + fp32 master, m, v"),
    "mixed18": (2, 4, 12, "18 bytes/param: bf16 param + fp32 grad + fp32 master, m, v"),
    "mixed14": (2, 4, 8, "14 bytes/param: bf16 param + fp32 grad + fp32 master + bf16 m, v"),
}
