"""``shardc lower``, ``shardc verify``, ``shardc compare``: the plan as JAX code, run and checked.

``lower`` only writes text (no jax import).  ``verify`` and ``compare`` run
jax; before its first import they plan, pick the devices the run needs (enough
for every mesh axis to be 2, or ``--devices``) and ask XLA for that many
emulated CPU devices (unless XLA_FLAGS already says how many), since the
environment must say so before jax starts.  A plan the plan checker rejects is
a shardc bug, reported (as every internal error, by ``shardc.cli.main``) with exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

from shardc.cli.main import add_collective_matmul, add_common
from shardc.cli.spec_args import read_spec
from shardc.costmodel.offload import OFFLOADS
from shardc.errors import ShardcError, clip
from shardc.files import write_text
from shardc.lowering.api import module_source
from shardc.lowering.sizes import devices_to_check, shrink_mesh
from shardc.lowering.template import WAITING_COLLECTIVES
from shardc.pipeline.boundary import check_lowerable
from shardc.planner.check import require_sound
from shardc.planner.planner import plan
from shardc.verification import progress
from shardc.verification.compare import compare, render_comparison
from shardc.verification.module_check import ModuleRejected
from shardc.verification.verify import check_device_count, render_report, verify

__all__ = ["register"]

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def register(sub: Any, name: str) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(name, help=_HELP[name], description=_HELP[name])
    add_common(parser)
    parser.add_argument("--save", choices=("default", "none", "all"), default="default",
                        help="residual policy of the plan (see `shardc plan --help`)")
    if name != "compare":
        add_collective_matmul(parser)
    if name == "lower":
        parser.add_argument("-o", "--output", metavar="MODULE.py", help="write here instead of stdout")
        parser.add_argument("--offload", choices=OFFLOADS, default="none",
                            help="place in the host's memory (pinned_host) the forward's residuals (activations), "
                                 "a ZeRO-1/2 plan's optimizer phase, run on the host (optimizer), or both, as "
                                 "`shardc cost --offload` costs them")
    else:
        parser.add_argument("--json", action="store_true", help="print the result as JSON")
        parser.add_argument("--devices", type=int, default=None,
                            help="devices to run on (emulated on a CPU; default: enough for every mesh "
                                 "axis to run at size 2, at least 8 when the mesh has them, at most 256)")
        if name == "verify":
            parser.add_argument("--progress", action="store_true",
                                help="say on stderr what verify is doing (planning, compiling, running, "
                                     "comparing) as it starts each part; the default when stderr is a terminal")
            parser.add_argument("--module", metavar="MOD.py", default=None,
                                help="verify this lowered module (as `shardc lower -o` wrote it, or edited) "
                                     "instead of lowering the plan again")
    parser.set_defaults(func={"lower": run_lower, "verify": run_verify, "compare": run_compare}[name])


_HELP = {
    "lower": "write the plan as a JAX shard_map module",
    "verify": "run the lowered plan and check values and HLO collectives against the plan",
    "compare": "put the plan's collectives beside XLA's partitioner (jit with NamedSharding)",
}


def _plan(args: argparse.Namespace) -> Any:
    """The plan ``shardc plan`` prints for the same arguments, checked."""
    result = plan(read_spec(args), save=args.save, collective_matmul=getattr(args, "collective_matmul", True))
    require_sound(result)
    check_lowerable(result)  # a pipeline reading an input its stages cannot be fed: a clear refusal
    return result



def _refuse_overwriting_the_spec(args: argparse.Namespace) -> None:
    same = os.path.realpath(args.output) == os.path.realpath(args.file)
    try:
        same = same or os.path.samefile(args.output, args.file)
    except OSError:
        pass  # the output does not exist yet
    if same:
        raise ShardcError(f"-o {args.output} is the spec itself: writing the module there would replace it",
                          fix="write the module elsewhere, e.g. -o " + _module_name(args.file))


def _module_name(path: str) -> str:
    stem = os.path.splitext(os.path.basename(path))[0]
    return (stem if stem.isidentifier() else "lowered") + ".py"


def run_lower(args: argparse.Namespace) -> int:
    if args.output:
        _refuse_overwriting_the_spec(args)
    planned = _plan(args)
    if planned.optimizer:
        print(f"note: `{planned.spec.zero}`: forward and grad run the spec without the zero line (whose "
              "backward reduces each gradient); its optimizer phase is optimizer_step(params, grads)",
              file=sys.stderr)
    kind = planned.spec.param_gather_dtype
    if kind is not None:  # the cost moves the gathers in it; the module does not cast (shardc.verification.report)
        print(f"note: `param_gather ... in {kind}`: the module gathers each param in its own type, not cast to "
              f"{kind} and back (the plan's gathers and `shardc cost` move {kind})", file=sys.stderr)
    source, note = module_source(planned, args.offload)
    if note:
        print(note, file=sys.stderr)
    if args.output:
        write_text(args.output, source, "-o")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(source, end="")
    return 0


def _flag_devices() -> int | None:
    """The emulated device count XLA_FLAGS already asks for, if any."""
    flags = os.environ.get("XLA_FLAGS", "")
    for word in flags.split():
        name, _, value = word.partition("=")
        if name == _DEVICE_FLAG and value.isdigit():
            return int(value)
    return None


def _devices(args: argparse.Namespace, plan: Any) -> int:
    """Check ``--devices`` (or choose it), then ask XLA for that many CPU devices."""
    if args.devices is not None:
        if len(str(args.devices)) > 12:  # not echoed whole: no count that long is meant
            raise ShardcError(f"--devices {clip(str(args.devices))}: not a device count", fix="give e.g. --devices 8")
        check_device_count(args.devices)
    devices = args.devices or devices_to_check(plan, _flag_devices())
    stage = plan.spec.mesh.pipeline_axis
    mesh = shrink_mesh([(a.name, a.size) for a in plan.spec.mesh.axes], devices, stage.name if stage else None)
    emulate_devices(math.prod(s for _, s in mesh))  # no more than the run uses: XLA starts faster
    return int(devices)


def emulate_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU devices (unless the flag is set) and for an intra-op pool with room for each
    device's collectives waiting at once (NPROC, unless set), before jax is up."""
    if "jax" in sys.modules:
        return
    if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}={count}".strip()
    os.environ.setdefault("NPROC", str(WAITING_COLLECTIVES * (_flag_devices() or count)))


def _say_progress() -> Callable[[str], None]:
    """Print each part verify starts on stderr, with the seconds since the first."""
    start = time.monotonic()

    def say(what: str) -> None:
        print(f"verify: {what} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)

    return say


def run_verify(args: argparse.Namespace) -> int:
    told = args.progress or sys.stderr.isatty()
    with progress.shown(_say_progress()) if told else contextlib.nullcontext():
        return _run_verify(args)


def _run_verify(args: argparse.Namespace) -> int:
    progress.step("planning")
    plan = _plan(args)
    devices = _devices(args, plan)

    module = pathlib.Path(args.module) if args.module is not None else None
    try:
        report = verify(plan, devices=devices, module=module)
    except ModuleRejected as err:  # a module that cannot be run as the plan's fails the check
        print(err.render(), file=sys.stderr)
        return ModuleRejected.exit_code
    if args.json:
        print(json.dumps(report.to_json(), indent=2, allow_nan=False))
    else:
        print(render_report(report), end="")
    return 0 if report.ok else 1


def run_compare(args: argparse.Namespace) -> int:
    plan = _plan(args)
    devices = _devices(args, plan)

    result = compare(plan, devices=devices)
    if args.json:
        print(json.dumps(result.to_json(), indent=2, allow_nan=False))
    else:
        print(render_comparison(result), end="")
    return 0
