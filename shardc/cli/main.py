"""The ``shardc`` command: parses arguments, runs a pass, formats its output.

Each subcommand lives in its own module with ``register(subparsers, name)``,
which adds its parser and sets ``func`` to a ``run(args) -> int``.  Modules are
imported only when their command runs, so ``shardc plan`` never pays for jax
(and ``shardc --help`` for nothing but argparse).

Exit status, for every command: 0 success, 1 a check failed (``verify``) or an
internal error (a bug in shardc: a plan the plan checker rejects, or any
unexpected exception), 2 a usage or spec error, or a budget exceeded (130 when
interrupted).  A :class:`ShardcError` is printed as a diagnostic, never a
traceback; so is running out of memory, and an internal error is printed as one
``internal error`` line asking for a report (``SHARDC_TRACEBACK=1`` shows the
traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from shardc import __version__
from shardc.errors import InternalError, ShardcError, clip
from shardc.ir.spec import ATTENTION_KERNELS, FUSIONS, GRAD_REDUCES, PARAM_GATHERS, DType

__all__ = ["COMMANDS", "build_parser", "full_parser", "main", "check_hardware_flag", "add_topology",
           "add_model_flags", "configure_chip", "add_common"]

# command name -> (module defining register(), one-line help); the help lines live here so
# ``shardc --help`` imports no command module.
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("shardc.cli.plan_cmd", "infer the collectives of forward and backward"),
    "cost": ("shardc.cli.cost_cmd", "cost a plan: time, roofline, memory, thresholds"),
    "layouts": ("shardc.cli.layouts_cmd", "rank the mesh layouts of a spec on a number of chips"),
    "hardware": ("shardc.cli.cost_cmd", "list the hardware presets"),
    "lower": ("shardc.cli.lower_cmd", "write the plan as a JAX shard_map module"),
    "verify": ("shardc.cli.lower_cmd", "run the lowered plan and check values and HLO"),
    "compare": ("shardc.cli.lower_cmd", "put the plan beside XLA's partitioner"),
    "export": ("shardc.cli.export_cmd", "write the plan's shardings for jax, MaxText or flax"),
    "explain": ("shardc.cli.explain_cmd", "a jitted jax program's collectives beside shardc's plan"),
    "calibrate": ("shardc.cli.calibrate_cmd", "measure this chip and write a hardware file"),
}

_EPILOG = ("Run `shardc COMMAND --help` for a command's flags.  Exit status: 0 ok, 1 a check failed or an "
           "internal error (a bug in shardc), 2 an error in the spec or the flags.")


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The parser with ``command``'s flags registered (the others as names only)."""
    parser = _top_parser()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).register(sub, name)
        else:
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def full_parser() -> argparse.ArgumentParser:
    """The parser with every command's flags (for documentation and its tests)."""
    parser = _top_parser()
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, _) in COMMANDS.items():
        importlib.import_module(module).register(sub, name)
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors echo a long value clipped (argparse repeats it whole: a
    5000-character ``--save`` value made a 5000-character line); the subcommands' parsers are of its class."""

    def error(self, message: str) -> NoReturn:
        super().error(re.sub(r"\S{101,}", lambda m: clip(m.group(0), 100), message))


def _top_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="shardc", epilog=_EPILOG,
        description="A compiler pass for sharding annotations: plan, cost and lower the collectives "
                    "of sharded einsums written in a .shard file.")
    parser.add_argument("--version", action="version", version=f"shardc {__version__}",
                        help="print the version and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if a in COMMANDS), None)
    try:
        parser = build_parser(command)
        args = parser.parse_args(args_list)
        if args.command is None:
            parser.print_help()
            return 2
        return int(args.func(args))
    except InternalError as err:
        print(err.render(), file=sys.stderr)
        return err.exit_code
    except ShardcError as err:
        print(err.render(), file=sys.stderr)
        return 2
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:
        print("shardc: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("error: out of memory\nfix: use smaller sizes or fewer points, or a machine with more memory",
              file=sys.stderr)
        return 2
    except RecursionError:
        print("error: the spec nests too deeply to process\nfix: split the expression over several statements",
              file=sys.stderr)
        return 2
    except Exception as err:  # a bug (in shardc, or jax and XLA under it): one line, not a traceback
        if os.environ.get("SHARDC_TRACEBACK"):
            raise
        first = (str(err).strip().splitlines() or [""])[0][:300]
        print(InternalError(f"internal error: {type(err).__name__}: {first}",
                            fix="this is a bug in shardc: please report it with the spec and the command "
                                "(SHARDC_TRACEBACK=1 shows the traceback)").render(), file=sys.stderr)
        return InternalError.exit_code


def _quiet_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so the interpreter's final flush stays silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def check_hardware_flag(args: argparse.Namespace) -> None:
    """An empty ``--hardware`` or ``--hardware-file`` is a mistake, not a request for the default."""
    for flag, value in (("--hardware", getattr(args, "hardware", None)),
                        ("--hardware-file", getattr(args, "hardware_file", None))):
        if value is not None and not value.strip():
            raise ShardcError(f"{flag} is empty", fix=f"name a preset (see `shardc hardware`), or drop {flag}")


def add_common(parser: argparse.ArgumentParser) -> None:
    """FILE and --set, shared by every command that reads a spec."""
    parser.add_argument("file", metavar="FILE", help="a .shard spec file (UTF-8)")
    parser.add_argument("--set", action="append", metavar="NAME=VALUE", default=[],
                        help="override a dim or a mesh axis size, e.g. --set B=1e6 (repeatable)")


def add_topology(parser: argparse.ArgumentParser) -> None:
    """``--topology``: the slice or cluster the mesh lies on, over the spec's ``topology`` line."""
    parser.add_argument("--topology", metavar="SHAPE",
                        help="the TPU slice the ICI axes lie on (4x4x4, 16x16) or the GPU cluster, NODESxGPUS "
                             "(48x8); default: the spec's `topology` line, else the chip's usual one")
def add_recompute(parser: argparse.ArgumentParser, detail: bool = False) -> None:
    """--recompute, shared by plan, cost and layouts (checked by the planner)."""
    more = ("none keeps what --save keeps; selective recomputes the attention-score region (Korthikanti et "
            "al. 2022); full keeps each layer's input; dots keeps every matmul-with-a-weight's output (JAX's "
            "dots_with_no_batch_dims_saveable, MaxText's minimal); dots-except:W_gate,W_up also recomputes "
            "the matmuls reading those params (MaxText's save_dot_except_mlpwi); dots-alternate every second "
            "weight matmul of a layer; +attention after a dots policy also keeps each fused attention's output "
            "and logsumexp (torchtitan's op-level selective checkpointing: dots-alternate+attention)") if detail else \
        "see `shardc plan --help`"
    parser.add_argument("--recompute", default="none", metavar="POLICY",
                        help=f"what the backward recomputes instead of keeping: {more}")


def add_collective_matmul(parser: argparse.ArgumentParser) -> None:
    """--collective-matmul / --no-collective-matmul, shared by plan, cost, layouts, lower and verify (on by
    default: the planner chooses the ring where the cost model says it is faster)."""
    parser.add_argument("--collective-matmul", action=argparse.BooleanOptionalAction, default=True,
                        help="run an einsum and the critical-path AllGather before it (or ReduceScatter after it) "
                             "over one axis as a ring of sends under its block matmuls, where that is faster "
                             "on the chip (collective matmul; the default); --no-collective-matmul keeps every "
                             "collective whole")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--model and --bucket-mb, shared by plan, cost and layouts."""
    parser.add_argument("--model", choices=("chip", "book"), default=None,
                        help="chip (default): matmuls at the rate the chip reaches, memory-bound steps over HBM, "
                             "critical-path collectives exposed; book: the book's assumptions (matmuls at peak, "
                             "memory-bound steps free, every collective overlapped)")
    parser.add_argument("--bucket-mb", type=float, default=None, metavar="MIB",
                        help="gradient reductions are issued in buckets of this many MiB, one latency a bucket "
                             "(default 25, PyTorch DDP's)")
    parser.add_argument("--fusion", choices=FUSIONS, default=None,
                        help="xla (default): elementwise chains and matmul epilogues fused as XLA fuses them; "
                             "none: one kernel an op, each reading its operands from HBM and writing its result "
                             "(PyTorch eager); statement: one hand-fused kernel a statement, no matmul epilogue "
                             "(PyTorch eager with fused kernels, as Megatron-LM's); over the spec's `fusion` line")
    parser.add_argument("--grad-reduce", choices=GRAD_REDUCES, default=None,
                        help="overlapped (default): gradient reductions issued under the backward as buckets fill "
                             "(PyTorch DDP, FSDP); after-backward: once the backward is done, exposed (Megatron-LM's "
                             "own DDP of 2021); 'after-backward over dcn': only their phase over the `over dcn` axes "
                             "after it (PaLM's cross-pod transfer); over the spec's `grad_reduce` line")
    parser.add_argument("--grad-reduce-dtype", choices=tuple(d.value for d in DType), default=None,
                        help="the type the params' gradients are reduced in (f32: FSDP's reduce_dtype float32 as "
                             "torchtitan runs it, Megatron-LM's fp32 main gradients under bf16); default: the "
                             "`optimizer` accounting's (bf16opt20: f32), else each param's own; over the spec's "
                             "`grad_reduce ... in T`")
    parser.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default=None,
                        help="the fused attention kernel run, at the rates measured of it on the chip (flash2: "
                             "FlashAttention-2, flash3, flash4); default: the chip's best; over the spec's "
                             "`attention_kernel` line")
    parser.add_argument("--param-gather", choices=PARAM_GATHERS, default=None,
                        help="exposed (default): ZeRO-1/2's param all-gathers after the step; overlapped: under the "
                             "next step's forward (Megatron-LM's --overlap-param-gather); over the spec's "
                             "`param_gather` line")
    parser.add_argument("--param-gather-dtype", choices=tuple(d.value for d in DType), default=None,
                        help="the type the params' all-gathers over the `zero` axes move (f8: torchao's float8 "
                             "all-gather under FSDP2, Megatron-LM's --fp8-param-gather), no wider than the params'; "
                             "default: each param's own; over the spec's `param_gather ... in T`")


def configure_chip(hw: Any, args: argparse.Namespace) -> Any:
    """The chip of ``hw`` under the command's --model, --bucket-mb, --fusion, --grad-reduce and
    --attention-kernel."""
    return hw.configured(getattr(args, "model", None), getattr(args, "bucket_mb", None),
                         getattr(args, "fusion", None), getattr(args, "grad_reduce", None),
                         getattr(args, "attention_kernel", None), getattr(args, "param_gather", None))
