"""Drop collectives the program would not run: contained in another's result, or unread.

The phases plan one einsum at a time, so a tensor needed in two layouts can be
moved twice: ``AllToAll dT[B, D_X] -> dT[B_X, D]`` for one einsum and then
``AllGather dT[B, D_X] -> dT[B, D]`` for the next.  The gathered value holds
every block the AllToAll fetched; XLA sees that and drops the AllToAll, so the
plan would promise a collective the program never runs.  This pass does the
same on the plan: when a later collective's source is already available where
an earlier collective runs, and the earlier result is the later one sliced (each
dim's axes extend the later result's, partial sums alike), the later collective
moves up and the earlier one becomes free slices.

    earlier   AllToAll_X dT[B, D_X] -> dT[B_X, D]       AllGather_X dT[B, D_X] -> dT[B, D]
    later     AllGather_X dT[B, D_X] -> dT[B, D]   =>   slice_X dT[B, D] -> dT[B_X, D]

An AllToAll whose result only an AllGather reads folds into one AllGather from
the AllToAll's source, when that is a gather (every dim of the end keeps a
prefix of the source's axes): the moved blocks are gathered where they are.

    AllToAll_X   A[B_X, D_Y] -> A[B, D_YX]     =>   AllGather_XY A[B_X, D_Y] -> A[B, D]
    AllGather_YX A[B, D_YX] -> A[B, D]

A collective that moves the same data as an earlier one, the same way, is that one's
result under a new name: its source is a copy of the earlier's, or a local einsum of the
same operands into the same layout.  XLA's common-subexpression pass merges them.

    Copy        O1[E, S_X] = A[S_X, E]              Copy        O1[E, S_X] = A[S_X, E]
    AllGather_X O1[E, S_X] -> O1[E, S]         =>   AllGather_X O1[E, S_X] -> O1[E, S]
    Copy        O2[E, S_X] = A[S_X, E]              alias       O2[E, S_X] is O1[E, S_X]
    AllGather_X O2[E, S_X] -> O2[E, S]              alias       O2[E, S] is O1[E, S]

The repeated einsum (or copy) is the earlier one's result too: no FLOPs, no traffic, no memory.

Under recomputation the backward runs the recomputed forward steps first
(:func:`share_recomputed`): a backward step that repeats one of them on the same data (a norm's
backward makes its row statistics again from the input the recompute has just normalised, and
all-reduces them again) is that step's result, as XLA merges them.
"""

from __future__ import annotations

import bisect

from shardc.ir.localops import ALIAS
from shardc.ir.plan import Op, Step
from shardc.ir.spec import Dim, TensorRef

__all__ = ["fold_redundant", "settle_intermediates", "share_recomputed"]


def fold_redundant(steps: tuple[Step, ...], keep: frozenset[TensorRef]) -> tuple[Step, ...]:
    """``steps`` with every collective that another collective's result makes free turned into slices.

    Then moves whose result nothing reads are dropped, unless they make a value in
    ``keep`` (what the phase hands on: declared results, residuals, gradients).
    XLA deletes such dead collectives too, so a plan that kept them would promise
    collectives the program never runs.
    """
    out = list(steps)
    while _fold_once(out) or _fold_all_to_all(out, keep):
        pass
    _share_copied(out)
    return tuple(_drop_dead_moves(out, keep))


def settle_intermediates(steps: tuple[Step, ...], declared: dict[str, TensorRef],
                         results: frozenset[str]) -> dict[str, TensorRef]:
    """``declared`` with each intermediate (a name not in ``results``, the spec's own) the value ``steps`` last
    make of it, where they no longer make the one its node recorded: a sum read the intermediate as it was
    held (an embedding's partial sums, reduced once after the sum), so the move to the recorded value was unread
    and :func:`fold_redundant` dropped it."""
    made: dict[str, TensorRef] = {}
    for step in steps:
        made[step.dst.name] = step.dst
    every = {_identity(step.dst) for step in steps}
    return {name: made[name] if name not in results and name in made and _identity(ref) not in every else ref
            for name, ref in declared.items()}


def _identity(ref: TensorRef) -> tuple[object, ...]:
    return ref.name, ref.dims, frozenset(ref.unreduced)


def _share_copied(out: list[Step]) -> None:
    """A collective repeating one already run on the same data is the same data moved again.

    ``T2[B]{U_Z} = W1[B]{U_Z}`` (a copy) then both reduced: XLA runs the reduction once,
    so the later one becomes an alias of the earlier's result (a new name, no step of data).
    Two local einsums of the same data into the same indices and layout make the same data
    too (``O1[E, S_X] = A[S_X, E]`` and ``O2[E, S_X] = A[S_X, E]``, each then gathered):
    XLA's common-subexpression pass merges them, then the collectives of their results.
    """
    # Same data only within a region: outside a `layers` block a step runs once, inside one once a
    # layer on that layer's data, so a name read in two regions is two values (and the keys hold the region).
    roots: dict[int | None, dict[TensorRef, TensorRef]] = {}  # a region's values -> the first alike
    made: dict[tuple[object, ...], TensorRef] = {}  # a local einsum's inputs and result layout -> its result
    done: dict[tuple[object, ...], TensorRef] = {}
    for k, step in enumerate(out):
        root = roots.setdefault(step.region, {})
        if step.op in (Op.COPY, Op.ELEMENTWISE) and (step.op is Op.COPY or step.fn == ALIAS) \
                and len(step.operands) == 1 and _same_data(step.operands[0], step.dst):
            root[step.dst] = root.get(step.operands[0], step.operands[0])
        elif step.op in (Op.COPY, Op.EINSUM):
            first = _share_einsum(step, root, made)
            if first is not None:  # XLA computes it once: the later one is the earlier's result renamed
                out[k] = Step(Op.ELEMENTWISE, step.tensor, step.dst, operands=(first,), fn=ALIAS, once=step.once,
                              block=step.block, note="the same einsum of the same data as an earlier one")
        if not step.is_collective or step.src is None:
            continue
        key = (root.get(step.src, step.src), step.op, step.axes, step.dim, step.dim2, step.region)
        earlier = done.get(key)
        if earlier is not None and _same_data(earlier, step.dst):
            out[k] = Step(Op.ELEMENTWISE, step.tensor, step.dst, operands=(earlier,), fn=ALIAS, ahead=step.ahead,
                          once=step.once, block=step.block,
                          note="the same data an earlier collective moved the same way")
            root[step.dst] = root.get(earlier, earlier)
            continue
        done.setdefault(key, step.dst)


def _share_einsum(step: Step, root: dict[TensorRef, TensorRef],
                  made: dict[tuple[object, ...], TensorRef]) -> TensorRef | None:
    """Root a local einsum's result at an earlier one's of the same data in the same layout, and
    return that earlier result (None when it is the first).

    A local einsum (a copy too) is the one its indices name (``se->es``), so the data of
    its operands and its result's indices, layout and partial sums fix its result.  A root
    holds its values' data in their order, so einsums of the same roots are one einsum.
    """
    dst = step.dst
    key = (step.op, tuple(root.get(o, o) for o in step.operands), step.shapes, dst.indices, dst.layout,
           dst.unreduced, step.region)
    first = made.setdefault(key, dst)
    if first == dst:
        return None
    root[dst] = root.get(first, first)
    return first


def _same_data(a: TensorRef, b: TensorRef) -> bool:
    """Two values of one array: the same indices in the same order, laid out alike."""
    return a.indices == b.indices and a.layout == b.layout and a.unreduced == b.unreduced


def _fold_all_to_all(out: list[Step], keep: frozenset[TensorRef]) -> bool:
    """An AllToAll read only by an AllGather, folded with it into one AllGather (see above)."""
    readers = _readers(out)
    for i, first in enumerate(out):
        if first.op is not Op.ALL_TO_ALL or first.src is None or first.dst in keep:
            continue
        steps = readers.get(first.dst, [])
        later = bisect.bisect_right(steps, i)  # the readers after the AllToAll
        if len(steps) - later != 1 or out[steps[later]].op is not Op.ALL_GATHER:
            continue
        j = steps[later]
        gather = _gather(first.tensor, first.src, out[j])
        if gather is not None:
            out[j] = gather
            del out[i]
            return True
    return False


def _readers(steps: list[Step]) -> dict[TensorRef, list[int]]:
    """Each value -> the steps that read it, in order: one pass, so a fold is linear in the steps."""
    readers: dict[TensorRef, list[int]] = {}
    for j, step in enumerate(steps):
        for ref in step.reads_with_shapes:
            at = readers.setdefault(ref, [])
            if not at or at[-1] != j:  # a step reading a value twice reads it once
                at.append(j)
    return readers


def _gather(tensor: str, src: TensorRef, late: Step) -> Step | None:
    """One AllGather taking ``src`` to ``late``'s result, or None if that is no gather."""
    dst = late.dst
    if src.unreduced != dst.unreduced or src.indices != dst.indices:
        return None
    lost = []
    for have, want in zip(src.layout, dst.layout, strict=True):
        if have[:len(want)] != want:
            return None
        lost.append(have[len(want):])
    changed = [d for d, axes in enumerate(lost) if axes]
    if not changed:
        return None
    axes = tuple(a for part in lost for a in part)
    dim = changed[0] if len(changed) == 1 else None  # several dims: one gather of them all
    return Step(Op.ALL_GATHER, tensor, dst, src, axes, dim=dim, volume=late.volume, ahead=late.ahead,
                note="an AllToAll and this AllGather folded into one")


def _drop_dead_moves(steps: list[Step], keep: frozenset[TensorRef]) -> list[Step]:
    out: list[Step] = []
    read: set[TensorRef] = set(keep)
    for step in reversed(steps):  # last first, so a chain of dead moves goes at once
        if (step.is_collective or step.op is Op.SLICE) and step.dst not in read:
            continue
        out.append(step)
        read.update(step.operands + step.shapes)
        if step.src is not None:
            read.add(step.src)
    return out[::-1]


def _fold_once(out: list[Step]) -> bool:
    index = _Index(out)
    for i, step in enumerate(out):
        if not step.is_collective:
            continue
        held = index.held(i)
        if held is not None:  # already made earlier: slice it
            out[i:i + 1] = _slices(step, held)
            return True
        j = index.container(i)
        if j is not None:  # made later from a value ready now: make it now, slice it
            late = out.pop(j)
            out[i:i + 1] = [late, *_slices(step, late.dst)]
            return True
    return False


class _Index:
    """Each tensor's steps, and where each value is first made: one pass, linear to build."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = steps
        self.of: dict[str, list[int]] = {}
        self.first: dict[TensorRef, int] = {}
        self.computed: set[str] = set()  # tensors a step makes, not only moves
        for k, step in enumerate(steps):
            self.of.setdefault(step.tensor, []).append(k)
            self.first.setdefault(step.dst, k)
            if not step.is_collective and step.op is not Op.SLICE:
                self.computed.add(step.tensor)

    def held(self, i: int) -> TensorRef | None:
        """A value an earlier step made of which step ``i``'s result is a slice, in step ``i``'s part of the
        program (:meth:`together`)."""
        for k in self.of[self.steps[i].tensor]:
            if k >= i:
                return None
            if self.together(k, i) and _slices_to(self.steps[k].dst, self.steps[i].dst):
                return self.steps[k].dst
        return None

    def container(self, i: int) -> int | None:
        """A later collective whose result contains step ``i``'s and whose source is ready at ``i``, run as
        often as step ``i`` (so moving it up runs it no more and no less often)."""
        early = self.steps[i]
        for j in self.of[early.tensor]:
            late = self.steps[j]
            if (j > i and late.is_collective and late.src is not None and self.together(i, j)
                    and _slices_to(late.dst, early.dst) and self.ready(late.src, i, j)):
                return j
        return None

    def together(self, k: int, i: int) -> bool:
        """Whether step ``k``'s value is step ``i``'s to take: both run in the same part of the program (both
        outside the ``layers`` blocks or both in one), or the tensor is one no step computes (a param or an
        input, the same for every layer).  A layer takes no activation made before its block (that is the
        first layer's input, where each later layer reads what the one before hands it: the block's input
        gathered from its D_Y layout, say), and the statements after the block none a layer made on the way
        (they read what the last layer hands on, in its declared layout, as a pipeline's last stage gets it)."""
        return self.steps[k].region == self.steps[i].region or self.steps[i].tensor not in self.computed

    def ready(self, value: TensorRef, i: int, j: int) -> bool:
        """``value`` exists before step ``i``: made earlier, or a phase input (made by no step before ``j``)."""
        first = self.first.get(value)
        return first is None or first < i or first >= j


def _slices_to(big: TensorRef, small: TensorRef) -> bool:
    """``small`` is ``big`` sliced: the same partial sums, each dim's axes extending ``big``'s."""
    if big.unreduced != small.unreduced or big.indices != small.indices:
        return False
    extra: set[str] = set()
    for b, s in zip(big.dims, small.dims, strict=True):
        if s.axes[:len(b.axes)] != b.axes:
            return False
        extra.update(s.axes[len(b.axes):])
    return not extra & {a for d in big.dims for a in d.axes}


def _slices(step: Step, big: TensorRef) -> list[Step]:
    """Free slices from ``big`` to ``step``'s result, one axis at a time at the minor end of a dim, in its place:
    ahead, once (outside a ``layers`` block) and in its block as it was."""
    tensor, small = step.tensor, step.dst
    steps = []
    current = big
    for d, (b, s) in enumerate(zip(big.dims, small.dims, strict=True)):
        for axis in s.axes[len(b.axes):]:
            dims = list(current.dims)
            dims[d] = Dim(dims[d].name, dims[d].axes + (axis,))
            nxt = TensorRef(current.name, tuple(dims), current.unreduced)
            steps.append(Step(Op.SLICE, tensor, nxt, current, (axis,), dim=d, ahead=step.ahead, once=step.once,
                              block=step.block, note="free: another collective's result holds it"))
            current = nxt
    assert current == small
    return steps



def share_recomputed(again: tuple[Step, ...], backward: tuple[Step, ...]) -> tuple[Step, ...]:
    """``backward`` with each step that repeats a recomputed one (``again``, run just before it) on the
    same data turned into an alias of that step's result (see the module docstring)."""
    root: dict[TensorRef, TensorRef] = {}
    seen: dict[tuple[object, ...], TensorRef] = {}
    for step in again:
        seen.setdefault(_same_step(step, root), step.dst)
    out = []
    for step in backward:
        first = seen.get(_same_step(step, root))
        if first is not None and _same_data(first, step.dst) and step.dst != first:
            root[step.dst] = root.get(first, first)
            out.append(Step(Op.ELEMENTWISE, step.tensor, step.dst, operands=(first,), fn=ALIAS, ahead=step.ahead,
                            once=step.once, block=step.block,
                            note="the same step on the same data as a recomputed one"))
        else:
            out.append(step)
    return tuple(out)


def _same_step(step: Step, root: dict[TensorRef, TensorRef]) -> tuple[object, ...]:
    """What fixes a step's result: its operation on its operands' (rooted) data, into its result's layout."""
    data = tuple(root.get(r, r) for r in step.operands)
    src = None if step.src is None else root.get(step.src, step.src)
    return (step.op, str(step.fn), data, step.shapes, src, step.axes, step.dim, step.dim2, step.dst.indices,
            step.dst.layout, step.dst.unreduced, step.once, step.collective)
