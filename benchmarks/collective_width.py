"""The collectives of a pipelined program's tick that no data path orders: how many one emulated device can be
waiting at together, each holding a worker of XLA's CPU intra-op pool (``shardc.cli.lower_cmd``'s NPROC).

    XLA_FLAGS=--xla_dump_to=DIR shardc verify SPEC
    python benchmarks/collective_width.py DIR/*jit__local.cpu_after_optimizations.txt

Reads the compiled HLO's loop body (the largest while body the entry computation runs), takes each collective
in it, and each conditional, call or loop whose computations hold one, and prints the most of them with no
data path between any two (Dilworth's width: their count less a maximum matching of the ordered pairs);
a conditional's branches are measured the same way and printed beside it.
"""

from __future__ import annotations

import re
import sys

COLLECTIVES = ("all-to-all(", "collective-permute(", "all-reduce(", "all-gather(", "reduce-scatter(")
_HEAD = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_CALLED = re.compile(r"(?:branch_computations=\{|body=|condition=|to_apply=|calls=)([^,}]+(?:, %[\w.\-]+)*)")


def computations(text: str) -> dict[str, list[str]]:
    """Each computation's instruction lines, by name (the entry's under its own name)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head:
            current = head.group(1)
            out[current] = []
        elif current is not None and _NAME.match(line):
            out[current].append(line.split(", metadata=")[0])
    return out


def called(line: str) -> list[str]:
    """The computations an instruction runs (a conditional's branches, a loop's body, a call's callee)."""
    return [n.strip().lstrip("%") for group in _CALLED.findall(line) for n in group.split(",") if n.strip()]


def holds_collective(comps: dict[str, list[str]], name: str, seen: set[str] | None = None) -> bool:
    """Whether computation ``name``, or one it runs, issues a collective."""
    seen = set() if seen is None else seen
    if name in seen or name not in comps:
        return False
    seen.add(name)
    return any(any(c in line for c in COLLECTIVES) or any(holds_collective(comps, n, seen) for n in called(line))
               for line in comps[name])


def width(comps: dict[str, list[str]], name: str) -> tuple[int, list[str]]:
    """The most collective-holding instructions of ``name`` no data path orders, and those instructions."""
    before: dict[str, set[str]] = {}
    nodes = []
    for line in comps[name]:
        node = _NAME.match(line).group(1)  # type: ignore[union-attr]
        operands = set(re.findall(r"%([\w.\-]+)", line.split("=", 1)[1])) & set(before)
        before[node] = set().union(*(before[o] | {o} for o in operands)) if operands else set()
        if any(c in line for c in COLLECTIVES) or any(holds_collective(comps, n) for n in called(line)):
            nodes.append(node)
    match: dict[str, str] = {}

    def augment(u: str, seen: set[str]) -> bool:
        for v in (v for v in nodes if u in before[v] and v not in seen):
            seen.add(v)
            if v not in match or augment(match[v], seen):
                match[v] = u
                return True
        return False

    return len(nodes) - sum(augment(u, set()) for u in nodes), nodes


def main() -> int:
    comps = computations(open(sys.argv[1]).read())
    entry = next(n for n in comps if n.startswith("main"))
    bodies = [m for line in comps[entry] if " while(" in line for m in re.findall(r"body=%?([\w.\-]+)", line)]
    body = max(bodies, key=lambda b: len(comps[b]))
    most, nodes = width(comps, body)
    print(f"{body}: {len(nodes)} instructions issue collectives, at most {most} with no data path between them")
    for line in comps[body]:
        if " conditional(" in line and _NAME.match(line).group(1) in nodes:  # type: ignore[union-attr]
            inner = [width(comps, b)[0] for b in called(line)]
            print(f"  {_NAME.match(line).group(1)}: its branches' widths {inner}")  # type: ignore[union-attr]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
