"""``shardc explain``: a user's jitted jax program read as a spec, its collectives beside shardc's plan.

Unlike parse, plan and cost, this front end imports jax at module level: it reads jax's own programs.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from shardc.explain.explain_report import Explanation
from shardc.explain.explain_report import explain as _explain
from shardc.hardware import check_hardware_arg

__all__ = ["explain_program"]


def explain_program(fn: Any, *args: Any, hardware: str | None = None) -> Explanation:
    """What ``shardc.explain`` does: check ``hardware``, then explain ``fn`` on ``args``."""
    check_hardware_arg(hardware)
    return _explain(fn, *args, hardware=hardware)


class _CallablePackage(types.ModuleType):
    """Importing this package binds ``shardc.explain`` to it (Python sets a package's submodules as
    its attributes), hiding the function ``shardc.explain``: so calling the package is that function,
    and ``shardc.explain(fn, *args)`` works however often it is called and whatever imported it first."""

    def __call__(self, fn: Any, *args: Any, hardware: str | None = None) -> Explanation:
        return explain_program(fn, *args, hardware=hardware)


sys.modules[__name__].__class__ = _CallablePackage
