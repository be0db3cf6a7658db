"""The attention family: ``attention(Q, K, V over T[, causal])``, fused (FlashAttention), registered once.

``O[B, S, N, H] = attention(Q[B, S, N, H], K[B, T, N, H], V[B, T, N, H] over T, causal)`` is
``softmax(Q·K / sqrt(H) over T) · V`` computed as FlashAttention computes it (Dao et al. 2022;
FlashAttention-2, Dao 2023): a loop over blocks of keys with an online softmax, so no S x T
tensor is ever held.  The forward keeps the output and each row's logsumexp (float32, 4 bytes an
element, as the kernels keep it); the backward makes each block's probabilities again from Q, K
and that logsumexp, so the residuals are Q, K, V, O and the logsumexp.  Each index's role
(batch, heads, a group's query heads, the key index) is :mod:`shardc.spec.attention_call`'s:
grouped-query and multi-query attention are K and V with fewer head indices than Q.  A second (query,
key) pair, ``attention(Qn, Kn, V, Qr, Kr over T, causal)``, adds ``Qr·Kr`` to every score (Multi-head
Latent Attention's decoupled rotary part, DeepSeek-V2, arXiv 2405.04434, section 2.1.3: the key Kr
shared by the heads it lacks) and scales by ``1 / sqrt(H + J)``: the kernel of the concatenated heads
``[Qn, Qr]`` and ``[Kn, Kr]``, as the implementations run it; Qr and Kr are further operands, kept as
residuals, their gradients further results of the backward's kernel (dKr summed over the heads).

Planned in the result's layout on the batch, head and query indices, K and V whole along T:
where only batch and head indices are sharded, each device runs the kernel on its heads of its
sequences, without communication.  The queries S sharded is context parallelism: in its all-gather
form (the LLaMA 3 paper's, Dubey et al. 2024): K and V are gathered along T (they may be held
sharded along it) and each device runs its block of queries against every key, its causal mask
offset by its block's global position.  The blocks are contiguous, not load-balanced, so under a
causal mask the last of n devices runs (2n - 1) / 2n of its blocks and sets the time; where the plan
holds the sequence in zig-zag chunks it runs balanced (:mod:`shardc.ops.balanced_gather`).  Where S is
sharded the planner also costs S's axes moved onto a head or batch index (an AllToAll of Q, K and
V in and of the output out, as Ulysses does, Jacobs et al. 2023: whole sequences, balanced) and
runs the form of least time, forward and backward; ``--explain`` lists them.  The third form is
ring attention (:mod:`shardc.ops.ring_attention`: K and V passed around the ring of S's axes with
ppermute, the transfers hidden under each step's block of attention where it is long enough, and,
causal, zig-zag chunks that balance the load; not with a second pair, whose Kr it does not pass); a
sharded head dim is an error.  dK and dV sum
over the query indices a key/value head serves (a group's query heads R, and S where sharded), so
where those are sharded they are partial sums, reduced as any gradient is (onto K's and V's
sharding along T: a ReduceScatter); the ring brings them home whole over its axes.

FLOPs, the kernel's time and its HBM traffic are :mod:`shardc.ops.attention_cost`'s.
Lowered as one call of :func:`shardc.lowering.runtime.attention` (or ``attention_grads``; the ring's
``ring_attention`` and ``ring_attention_grads``) a step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

from shardc.errors import ShardcError
from shardc.ir.localops import ATTENTION_PARTS, Attention
from shardc.ir.plan import Alternative, Choice, Op, Step
from shardc.ir.spec import Call, DType, Expr, TensorRef
from shardc.names import fresh
from shardc.ops.attention_cost import attention_flops, further_result, kernel_seconds, kernel_traffic
from shardc.ops.attention_reference import forward, grad_magnitude, magnitude, vjp
from shardc.ops.balanced_gather import balanced_gather
from shardc.ops.products import einsum_letters
from shardc.ops.registry import Builder, Family, Namer, Reference, register
from shardc.ops.ring_attention import LSE_BYTES, ring_layouts, transfers
from shardc.sharding.layout import CostContext, Value
from shardc.sharding.search import reshard
from shardc.spec.attention_call import CAUSAL, Roles, roles
from shardc.spec.walk import chain_indices
from shardc.steptime import hidden_from, ring_time
from shardc.units import fmt_seconds

if TYPE_CHECKING:
    from shardc.ops.registry import BackwardPass, Node
    from shardc.sharding.phase import Phase

__all__ = ["ATTENTION", "emit"]

Array = Any
GRADIENTS = ATTENTION_PARTS[2:]  # dQ, dK, dV, and dQr, dKr: a gradient of each operand in order


def _call_roles(call: Call, operands: tuple[tuple[str, ...], ...]) -> Roles:
    """The roles of a call's operands' indices (Q, K, V, and Qr, Kr where given)."""
    q, k, v, *pair = operands
    return roles(q, k, v, call.over, call.span, *pair)


def _query(call: Call, r: Roles) -> str | None:
    """The query position a causal mask compares with the key's (None: not causal)."""
    return r.query if CAUSAL in call.names else None


def _window(phase: Phase, call: Call) -> int | None:
    """The call's sliding window; None where it has none or the window spans every key (W >= T: the causal
    mask alone, planned and costed as one)."""
    w = call.window
    return None if w is None or (phase.sized and w >= phase.ctx.dim_size(call.over or "")) else w


# --- the graph node --------------------------------------------------------------------------

def _operands(builder: Builder, call: Call, result: str, indices: tuple[str, ...]) -> tuple[tuple[str, ...],
                                                                                        tuple[str, ...]]:
    """Q, K and V (and Qr, Kr), each computed towards its own indices, and the row logsumexp (Q's indices
    less H)."""
    args = tuple(builder.argument(arg, result, chain_indices(arg, ())) for arg in call.args)
    lse = fresh(f"{result}_lse", builder.names)
    builder.indices[lse] = _call_roles(call, tuple(builder.indices[a] for a in args)).rows
    return args, (lse,)


def _aux_bytes(node: Node) -> dict[str, int]:
    return dict.fromkeys(node.aux, LSE_BYTES)


# --- planning ----------------------------------------------------------------------------------

def _refuse(r: Roles, axes: dict[str, tuple[str, ...]], span: Any) -> None:
    """A sharded head dim is contracted whole by the kernel, so it is not planned: say so."""
    for index in (r.head, r.value_head, *r.qr[-1:]):
        if axes.get(index):
            raise ShardcError(f"attention with its head dim {index} sharded: the kernel contracts it whole",
                              span, fix=f"keep {index} whole inside attention; shard the heads (N or G) instead")


def _declared_axes(node: Node, target: Value | None) -> dict[str, tuple[str, ...]]:
    """The axes each index is sharded over where the spec says so: the result, and Q, K, V as written."""
    axes: dict[str, tuple[str, ...]] = {}
    assert node.call is not None
    for arg in node.call.args:
        if isinstance(arg, TensorRef):
            axes.update({d.name: d.axes for d in arg.dims if d.axes})
    if target is not None:
        axes.update({i: a for i, a in zip(node.indices, target.layout, strict=True) if a})
    return axes


def _layouts(phase: Phase, node: Node, target: Value | None,
             declared: dict[str, TensorRef]) -> tuple[Roles, dict[str, tuple[str, ...]]]:
    """The roles, and the axes of each index inside the kernel: the result's (else Q's as held) on the
    batch, head and query indices, none on the keys T and the head dims (K and V gathered along T)."""
    q = node.operands[0]
    assert node.call is not None
    r = _call_roles(node.call, tuple(phase.indices[x] for x in node.operands))
    _refuse(r, _declared_axes(node, target), node.statement.span)
    if target is not None:
        by_index = dict(zip(node.indices, target.layout, strict=True))
    else:
        by_index = dict(zip(r.q, phase.natural(q, declared.get(q)).layout, strict=True))
    whole = {r.head, r.value_head, r.key, *r.qr[-1:]}
    axes = {i: () if i in whole else by_index.get(i, ()) for i in (*r.q, r.key, r.value_head, *r.qr[-1:])}
    return r, axes


def _value(indices: tuple[str, ...], axes: dict[str, tuple[str, ...]], unreduced: tuple[str, ...] = ()) -> Value:
    return Value(tuple(axes[i] for i in indices), unreduced)


class Form(NamedTuple):
    """A kernel layout to choose from: its text for ``--explain``, each index's axes, and the ring's axes
    (ring attention; empty: K and V whole on the device) with whether its chunks are zig-zag, and the axes
    of the zig-zag order a Ulysses form's whole sequence is held in."""

    text: str
    axes: dict[str, tuple[str, ...]]
    ring: tuple[str, ...] = ()
    zigzag: bool = False
    order: tuple[str, ...] = ()


def _forms(phase: Phase, r: Roles, axes: dict[str, tuple[str, ...]], causal: bool, window: bool = False) -> list[Form]:
    """The kernel layouts to choose from: ``axes`` (the all-gather form where the queries S are sharded),
    and, where they are, S's axes moved onto one of K's batch or head indices instead (Ulysses, Jacobs et
    al. 2023: an AllToAll of Q, K and V to heads sharded, whole sequences, and of the output back),
    where that index's length takes them whole, and T sharded as S with K and V around the ring (ring
    attention), where T's length takes S's axes."""
    seq = r.queries[0]
    forms = [Form(f"{seq} over {''.join(axes[seq])}, K and V gathered along {r.key} (all-gather)" if axes[seq]
                  else "local", axes)]
    # the sequence held in zig-zag chunks (and causal): Ulysses gathers it so, its mask on the true positions
    order = axes[seq] if phase.ctx.zigzag_held and causal else ()
    for i in reversed(r.batch) if axes[seq] else ():  # the heads (written after the batch) first
        devices = math.prod(phase.ctx.axis_sizes[a] for a in (*axes[i], *axes[seq]))
        if not phase.sized or phase.ctx.dim_size(i) % devices == 0:
            forms.append(Form(f"{seq}'s {''.join(axes[seq])} moved to {i} (AllToAll in and out, as Ulysses"
                              + (", in the held zig-zag order)" if order else ")"),
                              {**axes, seq: (), i: axes[i] + axes[seq]}, zigzag=bool(order), order=order))
    devices = math.prod(phase.ctx.axis_sizes[a] for a in axes[seq])
    if r.qr or window:  # the ring passes K and V only; a window wants a halo, not a ring (ring_attention)
        return forms
    if devices > 1 and (not phase.sized or phase.ctx.dim_size(r.key) % devices == phase.ctx.dim_size(seq) % devices
                        == 0):  # even blocks: the ring's causal positions are each block's index times its length
        size = (lambda name: phase.ctx.axis_sizes.get(name) or phase.ctx.dim_size(name)) if phase.sized else None
        forms += [Form(text, kernel, axes[seq], zigzag)
                  for text, kernel, zigzag in ring_layouts(axes, seq, r.key, size, causal)]
        if phase.ctx.zigzag_held:  # the sequence held in zig-zag chunks: the all-gather form balanced (LLaMA 3's)
            forms += [Form(text, kernel, zigzag=True)
                      for text, kernel in balanced_gather(axes, seq, r.key, size, causal)]
    return forms


def _form_seconds(phase: Phase, node: Node, r: Roles, form: Form, want: Value, tokens: float,
                  held: bool = False) -> tuple[float, int, str]:
    """A form's time, forward and backward: its moves twice (the backward moves their transposes: dO in,
    dQ, dK, dV out), its kernel's forward and backward (:func:`kernel_seconds`), and a
    ring's transfers its compute does not hide, forward and backward; its forward's collectives; and what
    of its communication stays exposed, for ``--explain``: the moves all (the kernel waits for them), a
    ring's what its steps do not hide, with the block length from which they do; the moves' the
    sequence's length a device (``tokens`` now) from which the kernel's compute outlasts them
    (:func:`shardc.steptime.hidden_from`).  ``held``: a zig-zag ring priced as the plan holding the sequence in
    its order runs it, without reordering its blocks (:mod:`shardc.planner.zigzag_order`)."""
    ctx, axes = phase.ctx, form.axes
    moved, count = 0.0, 0
    moves = [reshard(ctx, name, indices, phase.held[name], _value(indices, axes))
             for name, indices in zip(node.operands, r.operands, strict=True)]
    refs = [phase.ref(name, _value(indices, axes)) for name, indices in zip(node.operands, r.operands, strict=True)]
    out = _value(node.indices, axes)
    if want != out:
        moves.append(reshard(ctx, node.result, node.indices, (out,), want))
    for cost, made in moves:  # a microbatch's: reshard charges a training step's (CostContext.repeats)
        moved, count = moved + cost[0] / ctx.repeats, count + len(made)
    assert node.call is not None
    fn = Attention("out", r.key, _query(node.call, r), ring=form.ring, zigzag=form.zigzag, held=held and form.zigzag,
                   rope=bool(r.qr), order=form.order, window=_window(phase, node.call))
    kernel = Step(Op.ELEMENTWISE, node.result, phase.ref(node.result, out), operands=tuple(refs), fn=fn)
    size = lambda name: ctx.axis_sizes.get(name) or ctx.dim_size(name)  # noqa: E731
    lse = phase.ref(node.aux[0], _value(r.rows, axes))  # the backward's kernel reads O, the logsumexp and dO too
    grads = Step(Op.ELEMENTWISE, node.result, kernel.dst, operands=(*refs, kernel.dst, lse, kernel.dst),
                 fn=replace(fn, part="dq"))
    dtypes = {s: ctx.matmul_dtype(r.name for r in s.operands) for s in (kernel, grads)}  # as cost prices them
    compute = kernel_seconds(kernel, size, ctx.hardware, dtypes[kernel])
    backward = kernel_seconds(grads, size, ctx.hardware, dtypes[grads])
    kernels = ((kernel, compute), (grads, backward))  # the forward's ring and the backward's
    exposed, hidden = _ring_exposed(ctx, kernels, size, dtypes) if form.ring else (0.0, "")
    if moved > 0 and not form.ring:
        hidden = (f"; the kernel's compute outlasts its moves from "
                  f"{hidden_from(tokens, 2 * moved, compute + backward):,.0f} tokens a device")
    note = f"exposed communication {fmt_seconds(2 * moved + exposed)}{hidden}"
    return (2 * moved + (compute + backward) * ctx.compute_weight + exposed) * ctx.repeats, count, note


def _ring_exposed(ctx: CostContext, kernels: tuple[tuple[Step, float], ...], size: Callable[[str], int],
                  dtypes: dict[Step, str]) -> tuple[float, str]:
    """The seconds of a ring's K/V sends its kernels (forward and backward, each with its time) do not hide, and
    the block length from which a ring step hides its send, for ``--explain``."""
    sizes = {**ctx.axis_sizes, **(ctx.sizes or {})}
    exposed, hidden = 0.0, ""
    for step, seconds in kernels:
        ring = transfers(step, size, DType(dtypes[step]).nbytes)
        assert ring is not None
        times = ring_time(ring, seconds, ctx.mesh, sizes, ctx.hardware, ctx.links)
        exposed += times.exposed_s
        hidden = hidden or f"; a ring step hides its K/V send from {times.hidden_from:,.0f} tokens a device"
    return exposed, hidden


def _choose(phase: Phase, node: Node, r: Roles, axes: dict[str, tuple[str, ...]], want: Value,
            label: str) -> Form:
    """The form of least time (the first without sizes), listed for ``--explain``."""
    assert node.call is not None
    forms = _forms(phase, r, axes, _query(node.call, r) is not None, _window(phase, node.call) is not None)
    if len(forms) == 1 or not phase.sized:
        return forms[0]
    ctx = phase.ctx
    tokens = ctx.dim_size(r.key) / math.prod(ctx.axis_sizes[a] for a in axes[r.query])  # the sequence a device
    figures = [_form_seconds(phase, node, r, f, want, tokens, held=ctx.zigzag_held) for f in forms]
    times = [t for t, _, _ in figures]
    best = min(range(len(forms)), key=lambda k: times[k])
    if phase.ctx.explain:
        reason = f"least time, forward and backward ({times[best]:.3g} s)"
        zigzag = [k for k, f in enumerate(forms) if f.zigzag and f.ring]
        if ctx.zigzag_held and zigzag:  # the permuted price beside the held one
            permuted = _form_seconds(phase, node, r, forms[zigzag[0]], want, tokens)[0]
            reason += (f", a zig-zag ring as the plan holding the sequence in its order runs it: "
                       f"{times[zigzag[0]]:.3g} s held, {permuted:.3g} s with its blocks reordered at each call")
        held = None
        if any(f.zigzag for f in forms) and not ctx.zigzag_held:  # the plan may hold the zig-zag order: priced so too
            again = [_form_seconds(phase, node, r, f, want, tokens, held=True) for f in forms]
            held = Choice(phase.name, label, _alternatives(forms, again, best),
                          f"least time, forward and backward, with zig-zag blocks reordered at each call "
                          f"({times[best]:.3g} s); the plan holds the sequence in zig-zag order, so "
                          f"{again[best][0]:.3g} s")
        phase.choices.append(Choice(phase.name, label, _alternatives(forms, figures, best), reason, held))
    return forms[best]


def _alternatives(forms: list[Form], figures: list[tuple[float, int, str]], best: int) -> tuple[Alternative, ...]:
    return tuple(Alternative(f.text, t, note, n, k == best)
                 for k, (f, (t, n, note)) in enumerate(zip(forms, figures, strict=True)))


def _plan(phase: Phase, node: Node, declared: dict[str, TensorRef], target: Value | None, label: str) -> None:
    """Q, K and V moved to the kernel's layout (the result's, or with the sequence's axes on the heads, whichever
    is faster), then the kernel's two steps: the output, then the row logsumexp it makes on the way; the output
    moved to the result's layout (without one declared, where the queries were)."""
    if target is not None and target.unreduced:
        raise ShardcError(f"{node.result} is attention, not a partial sum", node.statement.span,
                          fix="drop the {U_...} suffix")
    r, given = _layouts(phase, node, target, declared)
    want = target if target is not None else _value(node.indices, given)
    form = _choose(phase, node, r, given, want, label)
    axes = form.axes
    assert node.call is not None
    operands = []
    for name, indices in zip(node.operands, r.operands, strict=True):
        value = _value(indices, axes)
        _, moves = reshard(phase.ctx, name, indices, phase.held[name], value)
        phase.moves(name, moves)
        operands.append(phase.ref(name, value))
    (lse,) = node.aux
    query = _query(node.call, r)
    out, rows = _value(node.indices, axes), _value(r.rows, axes)
    fn = Attention("out", r.key, query, ring=form.ring, zigzag=form.zigzag, rope=bool(r.qr), order=form.order,
                   window=_window(phase, node.call))
    phase.emit(Step(Op.ELEMENTWISE, node.result, phase.ref(node.result, out), operands=tuple(operands), fn=fn), out)
    phase.emit(Step(Op.ELEMENTWISE, lse, phase.ref(lse, rows), operands=tuple(operands),
                    fn=replace(fn, part="lse", kernel=False)), rows)
    if want != out:
        _, moves = reshard(phase.ctx, node.result, node.indices, (out,), want)
        phase.moves(node.result, moves)
    declared.setdefault(node.result, phase.ref(node.result, want))


def _forward_step(bw: BackwardPass, node: Node, part: str) -> Step:
    """The forward's step of ``node`` making ``part`` (its layouts are the backward's)."""
    tensor = node.result if part == "out" else node.aux[0]
    return next(s for s in reversed(bw.forward.steps) if s.tensor == tensor and isinstance(s.fn, Attention)
                and s.fn.part == part)


def _backward(bw: BackwardPass, node: Node, grad: str) -> None:
    """dQ, dK and dV from the kernel's residuals (Q, K, V, O and the row logsumexp, kept whatever the save
    policy, as FlashAttention keeps them) and dO in O's layout; dK and dV partial over the axes of the query
    heads a key/value head serves (R), reduced as any gradient's contributions are."""
    wanted = [x for x in node.operands if x in bw.needs]
    if not wanted:
        return
    phase = bw.phase
    out, lse = _forward_step(bw, node, "out"), _forward_step(bw, node, "lse")
    for ref in (*out.operands, out.dst, lse.dst):
        phase.hold(ref.name, Value.of(ref))
    o_value = Value.of(out.dst)
    _, moves = reshard(phase.ctx, grad, node.indices, phase.held[grad], o_value)
    phase.moves(grad, moves)
    reads = (*out.operands, out.dst, lse.dst, phase.ref(grad, o_value))
    assert isinstance(out.fn, Attention)
    rows = out.operands[0].dims[:-1]
    for x, ref, part in zip(node.operands, out.operands, GRADIENTS, strict=False):
        if x not in wanted:
            continue
        # a gradient sums over Q's row indices its operand lacks (K's and V's the query heads R, S where
        # sharded; Kr's the heads too): partial over their axes, but a ring's, which brings dK and dV home whole
        spread = tuple(sorted(a for d in rows if d.name not in ref.indices for a in d.axes if a not in out.fn.ring))
        value = Value(ref.layout, spread)
        dst = bw.part_name(x)
        phase.emit(Step(Op.ELEMENTWISE, dst, phase.ref(dst, value), operands=reads,
                        fn=replace(out.fn, part=part, kernel=x == wanted[0], held=False)), value)
        bw.settle(x, dst, value)


# --- lowering ----------------------------------------------------------------------------------

def emit(step: Step, var: Namer, sizes: dict[str, int] | None = None) -> str:
    """One call of the runtime's blockwise kernel, its result picked (any sizes)."""
    assert isinstance(step.fn, Attention)
    n = step.fn.inputs
    q, k, v = step.operands[:3]
    pair = step.operands[3:n]  # Qr and Kr: their letters after O's
    out = step.operands[n] if len(step.operands) > n else step.dst
    letters = einsum_letters((q, k, v, out, *pair))
    subs = tuple("".join(letters[i] for i in ref.indices) for ref in (q, k, v, out, *pair))
    if step.fn.part == "lse":  # the output's letters (Q's rows, V's head), so the call is the output step's
        subs = (*subs[:3], subs[0][:-1] + subs[2][-1], *subs[4:])
    query = "None"
    if step.fn.query is not None:  # S's letter and the axes sharding it: the causal mask's global positions
        query = repr((letters[step.fn.query], q.dims[q.indices.index(step.fn.query)].axes,
                      *(() if step.fn.window is None else (step.fn.window,))))  # and the sliding window
    flags = f"{subs!r}, {letters[step.fn.key]!r}, {query}"
    kernel = "attention_rope" if step.fn.rope else "attention"
    if step.fn.ring:  # the ring's axes (K's along T, as Q's along S) and whether its chunks are zig-zag
        kernel, flags = "ring_attention", f"{flags}, {step.fn.ring!r}, {step.fn.zigzag!r}"
        flags += ", held=True" if step.fn.held else ""  # the plan holds the sequence in zig-zag order
    elif step.fn.zigzag:  # the sequence held in zig-zag chunks over these axes: the mask's true positions
        flags += f", zigzag={step.fn.order or q.dims[q.indices.index(step.fn.query)].axes!r}"
    if step.fn.part in ("out", "lse"):
        pick = 0 if step.fn.part == "out" else 1
        return f"{kernel}({', '.join(var(ref) for ref in step.operands[:n])}, {flags})[{pick}]"
    args = ", ".join(var(ref) for ref in step.operands)
    return f"{kernel}_grads({args}, {flags})[{GRADIENTS.index(step.fn.part)}]"


# --- whole arrays: the reference (:mod:`shardc.ops.attention_reference`) ------------------------

def _arguments(call: Call, keep: tuple[str, ...]) -> tuple[tuple[Expr, tuple[str, ...]], ...]:
    return tuple((arg, chain_indices(arg, ())) for arg in call.args)


def _indices(call: Call, operands: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    return _call_roles(call, operands).out


ATTENTION = register(Family(
    name="attention", calls=frozenset({"attention"}), ops=(Attention,), plan=_plan, backward=_backward, emit=emit,
    # a softmax of Q·K: verify feeds it unit-size queries, so the softmax is neither flat nor one-hot
    reference=Reference(forward, vjp, magnitude, grad_magnitude, _arguments, _indices,
                        nonlinear=lambda func: True),
    operands=_operands, aux_bytes=_aux_bytes, traffic=kernel_traffic, flops=attention_flops, seconds=kernel_seconds,
    ring=transfers, fusible=False, further=further_result))
