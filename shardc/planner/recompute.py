"""Activation recomputation: which forward values the backward keeps, and which it makes again.

``--recompute`` picks what the backward may read from memory:

* ``none``: every residual the save policy keeps (``Plan.residuals``, and the
  layer's inputs).
* ``full``: only what the forward started from (each layer's input; params are
  state, not activations), as Megatron-LM's full checkpointing keeps it
  (Korthikanti et al. 2022, section 4: 2sbh a layer, its input).
* ``selective``: everything but the attention-score region (Korthikanti et al.
  2022, section 4.3: the QK^T result, softmax, softmax dropout), which is cheap
  to recompute and large (5as/h of the 34 + 5as/h).
* ``dots``: the output of every matmul with a weight (an einsum reading a param,
  and what a collective makes of it), as JAX's
  ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable`` and MaxText's
  ``minimal`` remat policy keep them: norms, activations and the attention
  scores are recomputed.  ``dots-except:W_gate,W_up`` also recomputes the matmuls
  reading the named params, as MaxText's ``save_dot_except_mlpwi`` does for the
  MLP's input projections.  ``dots-alternate`` reruns every second matmul with a weight of each
  layer, in forward order (:func:`_alternate`), as torchtitan counts ``aten.mm``.
* ``+attention`` after a ``dots`` policy (``dots+attention``, ``dots-except:W_k,W_o,W_up+attention``)
  keeps each fused attention's output and row logsumexp too (:func:`_attention_outputs`), so its
  backward's kernel reads them and its forward is not rerun: torchtitan's op-level selective
  checkpointing (``selective_ac_option = "op"``) saves the outputs of ``aten.mm`` and of the SDPA
  flash/efficient kernels, every second ``mm`` of a layer excepted
  (torchtitan/parallelisms/parallelize_llama.py, ``_save_list``), which is ``dots-alternate+attention``.

A spec's ``recompute`` line names more values the backward makes again whatever the policy
(:func:`named_values`): every result of a function (``rmsnorm``), every product reading a param
(``W_uq``: an up-projection's output), or a tensor; a rename of one is its array, so it goes too.
DeepSeek-V3 recomputes its RMSNorms and MLA up-projections so ("DeepSeek-V3 Technical Report",
arXiv 2412.19437, section 3.2.3).

What is not kept is recomputed (:func:`recompute_steps`): the forward steps that
make the residuals the backward reads and does not keep, and the steps making
what those read, back to kept values, in forward order, as ``jax.checkpoint``
reruns them (a step whose result the backward never needs, even through another,
is not rerun: JAX partial-evaluates the checkpointed function and drops what no
residual needs, so a layer's output projection and its residual add are not rerun).
Their FLOPs and collectives run in the backward phase
(:mod:`shardc.timing`), so the planner's objective and ``shardc cost`` count them.

Under ``full`` and ``dots`` in a spec with a ``layers`` block, the policy checkpoints the layers:
the statements before and after the block (the embedding, the final norm, the logits and
the loss) keep what their backward reads, as the frameworks wrap only the layers (MaxText's
remat of its decoder layer, PaLM's rematerialized layers, Chowdhery et al. 2022 section 4:
"one fully sharded activation tensor is saved from each layer"; Megatron-LM's checkpointed
transformer layers), so the backward never reruns a layer to remake the last layer's output.
Where the framework is PyTorch (``fusion none``, ``fusion statement``), ``full`` reruns each
layer whole (``whole_layers``): ``torch.utils.checkpoint`` calls the layer's function again
and backpropagates from its outputs (Megatron-LM's CheckpointFunction), its output projection
and its collectives included (the layer's output itself is held as the next layer's input, so
its last residual add, one memory-bound pass, is not priced again).

The attention-score region is found structurally (:func:`attention_region`): it
starts at an einsum of two activations (no param) whose result keeps a free index
of each (``Q[B, S, N, H] · K[B, T, N, H] -> Sc[B, N, S, T]``), grows through the
nodes that read it and whose op family keeps them there
(:attr:`shardc.ops.registry.Family.scores`: ``softmax``, ``causal``, ``dropout``, a sum with
a mask, or any elementwise function), and must end at an einsum of two
activations that contracts one of the score's free indices (the attention times
V).  ``X · W`` with a param is never a score; ``P · V`` is not one either, as
nothing contracts its result with another activation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from shardc.collectives import Op
from shardc.errors import ShardcError, Span
from shardc.ir.localops import ALIAS, ATTENTION_PARTS, Attention
from shardc.ir.plan import Step
from shardc.ir.spec import Spec, TensorRef
from shardc.ops.registry import CONTRACT, Node, family_of
from shardc.planner.graph import Graph
from shardc.spec.walk import layer_inputs

__all__ = ["RECOMPUTE_MODES", "Policy", "attention_region", "block_outputs", "checkpoints", "keeps_layer_inputs",
           "policy", "recompute_steps", "named_values"]

RECOMPUTE_MODES = ("none", "selective", "full", "dots")
_EXCEPT = "dots-except:"
_ALTERNATE = "dots-alternate"
_KEEP = "+attention"


class Policy(NamedTuple):
    """A parsed ``--recompute``: its mode, the params whose matmuls ``dots-except:`` reruns, and whether
    ``+attention`` keeps each fused attention's output and row logsumexp."""

    mode: str
    rerun: frozenset[str]
    keeps_attention: bool = False
    alternate: bool = False  # dots-alternate: every second weight matmul of a layer rerun (:func:`_alternate`)


def _flag_error(text: str, at: int, length: int, what: str, fix: str) -> ShardcError:
    """An error pointing at ``text[at:at + length]`` of the ``--recompute`` value."""
    return ShardcError(what, Span(1, at + 1, max(length, 1), "--recompute", text), fix=fix)


def policy(text: object, params: Iterable[str] | None = None) -> Policy:
    """``--recompute``'s mode and, for ``dots-except:A,B``, the params whose matmuls are rerun
    (each checked against ``params``, where given); a ``dots`` policy may end in ``+attention``."""
    fix = ("use one of: " + ", ".join(RECOMPUTE_MODES) + f", {_ALTERNATE}, or {_EXCEPT}PARAM,... (e.g. "
           f"{_EXCEPT}W_gate,W_up), a dots policy optionally followed by {_KEEP}")
    if not isinstance(text, str):
        raise ShardcError(f"recompute is a {type(text).__name__}: must be a string", fix=fix)
    body, keep = (text[:-len(_KEEP)], True) if text.endswith(_KEEP) else (text, False)
    if keep and body in RECOMPUTE_MODES and body != "dots":
        raise _flag_error(text, 0, len(body), f"recompute {text[:80]!r}: {_KEEP} follows a dots policy only",
                          f"write dots{_KEEP}, {_ALTERNATE}{_KEEP} or {_EXCEPT}PARAM,...{_KEEP}")
    if body in RECOMPUTE_MODES:
        return Policy(body, frozenset(), keep)
    if body == _ALTERNATE:
        return Policy("dots", frozenset(), keep, alternate=True)
    if not body.startswith(_EXCEPT):
        raise _flag_error(text, 0, len(body), f"unknown recompute mode {text[:80]!r}", fix)
    names = body[len(_EXCEPT):].split(",")
    known = set(names if params is None else params)
    at = len(_EXCEPT)
    for name in names:
        if name.strip() not in known or not name.strip():
            raise _flag_error(text, at, len(name), f"recompute {text[:80]!r}: {name.strip()!r} is not a param of "
                              "the spec", "name params the spec declares: " + ", ".join(sorted(known)[:20]))
        at += len(name) + 1
    return Policy("dots", frozenset(n.strip() for n in names), keep)


def keeps_layer_inputs(recompute: str) -> bool:
    """Whether the policy reruns each layer from its input, kept once a layer as its checkpoint (``full``,
    and ``dots``, as a remat policy under ``jax.lax.scan`` keeps the carry)."""
    return policy(recompute)[0] in ("full", "dots")


def checkpoints(inputs: Iterable[str], spec: Spec, recompute: str) -> tuple[str, ...]:
    """The values a plan's recomputation starts from, as the spec declares them: its inputs and, where the policy
    reruns each layer from its input (:func:`keeps_layer_inputs`), the layers' inputs."""
    return (*inputs, *(layer_inputs(spec) if keeps_layer_inputs(recompute) else ()))


def _dot_outputs(forward: tuple[Step, ...], params: frozenset[str], rerun: frozenset[str]) -> set[TensorRef]:
    """The outputs of the matmuls that read a param not in ``rerun``, and what collectives make of them."""
    found: set[TensorRef] = set()
    for step in forward:
        names = {o.name for o in step.operands}
        if step.op is Op.EINSUM and names & params and not names & rerun:
            found.add(_norm(step.dst))
        elif step.is_collective and step.src is not None and _norm(step.src) in found:
            found.add(_norm(step.dst))
    return found


def _alternate(forward: tuple[Step, ...], params: frozenset[str]) -> frozenset[str]:
    """The params read by every second weight matmul of a layer, in forward order (the 2nd, 4th, ...; the count
    starting again in each ``layers`` block; the steps outside them are not checkpointed): torchtitan's op-level
    selective checkpointing counts each ``aten.mm`` a checkpointed block runs and recomputes every second one
    (``_custom_policy``, torchtitan/parallelisms/parallelize_llama.py).  A matmul of two activations (attention's
    scores, inside a fused kernel there) is no weight's ``mm`` and is not counted."""
    order: dict[int, list[str]] = {}
    for step in forward:
        found = order.setdefault(step.block, [])
        weighted = step.op is Op.EINSUM and {o.name for o in step.operands} & params
        if weighted and not step.once and step.tensor not in found:
            found.append(step.tensor)
    second = {t for found in order.values() for t in found[1::2]}
    return frozenset(o.name for s in forward if s.op is Op.EINSUM and s.tensor in second for o in s.operands
                     if o.name in params)


def _attention_outputs(forward: tuple[Step, ...]) -> set[TensorRef]:
    """What ``+attention`` keeps: each fused attention kernel's output and row logsumexp (its forward's two
    parts), the results of ``aten._scaled_dot_product_flash_attention`` that torchtitan's op-level selective
    checkpointing saves (``_save_list``, torchtitan/parallelisms/parallelize_llama.py), so the backward's kernel
    reads them and the attention forward is not rerun."""
    made = ATTENTION_PARTS[:2]  # "out", "lse"
    return {_norm(s.dst) for s in forward if isinstance(s.fn, Attention) and s.fn.part in made}


def block_outputs(forward: tuple[Step, ...]) -> set[TensorRef]:
    """The values a ``layers`` block makes that a step outside it reads: the last layer's output, which the
    statements after the block start from (each other layer's is the next one's input, its checkpoint)."""
    inside = {_norm(s.dst) for s in forward if not s.once}
    return {r for s in forward if s.once for r in map(_norm, s.reads) if r in inside}


def _norm(ref: TensorRef) -> TensorRef:
    return TensorRef(ref.name, ref.dims, ref.unreduced)


def _is_score(node: Node, graph: Graph) -> bool:
    """An einsum of two activations whose result keeps a free index of each operand."""
    if node.family is not family_of(CONTRACT) or len(node.operands) != 2:
        return False
    if any(o in graph.params for o in node.operands):
        return False
    a, b = (set(graph.indices[o]) for o in node.operands)
    out = set(node.indices)
    return bool((a - b) & out) and bool((b - a) & out)


def attention_region(graph: Graph) -> frozenset[str]:
    """The tensors of every attention-score region of the graph (see the module docstring)."""
    found: set[str] = set()
    for start in graph.nodes:
        if not _is_score(start, graph):
            continue
        a, b = (set(graph.indices[o]) for o in start.operands)
        free = (a ^ b) & set(start.indices)
        region = {start.result}
        closed = False
        for node in graph.nodes:
            if not set(node.operands) & region or node.result in region:
                continue
            if node.family.scores(node):  # another operand (a mask, a bias) is read, not recomputed
                region.add(node.result)
                region.update(node.aux)  # what it makes on the way: a dropout's keep-mask (a hash: the same again)
            elif (node.family is family_of(CONTRACT) and len(node.operands) == 2
                  and not any(o in graph.params for o in node.operands)
                  and free - set(node.indices)):
                closed = True  # the attention times V contracts a free index of the scores
        if closed:
            found |= region
    return frozenset(found)


def named_values(graph: Graph, names: Iterable[str]) -> frozenset[str]:
    """The tensors a ``recompute`` line names: each function's results, each param's products (the
    einsums reading it), each tensor itself."""
    found: set[str] = set()
    for name in names:
        if name in graph.params:
            found |= {n.result for n in graph.nodes if n.family is family_of(CONTRACT) and name in n.operands}
        else:
            found |= {n.result for n in graph.nodes if n.fn == name or (n.call is not None and n.call.func == name)}
            found |= {name} & set(graph.indices)
    return frozenset(found)


def _renamed(forward: tuple[Step, ...], names: frozenset[str]) -> frozenset[str]:
    """``names`` and every rename of one (an alias step's result: the same array)."""
    found = set(names)
    for step in forward:
        if step.fn == ALIAS and step.operands[0].name in found:
            found.add(step.tensor)
    return frozenset(found)


def recompute_steps(mode: str, forward: tuple[Step, ...], residuals: Iterable[TensorRef],
                    start: Iterable[TensorRef], region: frozenset[str],
                    params: frozenset[str] = frozenset(), rerun: frozenset[str] = frozenset(),
                    dropped: frozenset[str] = frozenset(), whole_layers: bool = False,
                    keeps_attention: bool = False, alternate: bool = False) -> tuple[Step, ...]:
    """The forward steps the backward reruns under ``mode``, in forward order.

    ``residuals`` are the forward values the backward reads, ``start`` the values the
    forward starts from (declared inputs and params), ``region`` the tensors
    ``selective`` recomputes; ``dots`` keeps the matmuls reading ``params``, but
    those reading ``rerun``; ``dropped`` (a ``recompute`` line's :func:`named_values`) are
    recomputed under any mode; ``keeps_attention`` (``+attention``) keeps under ``dots`` what the fused
    attention kernels make (:func:`_attention_outputs`); ``alternate`` (``dots-alternate``) reruns every second
    weight matmul of a layer (:func:`_alternate`) beside ``rerun``'s.  Under ``full`` and ``dots`` what the steps
    outside the ``layers`` block make is kept; ``whole_layers`` (PyTorch's checkpoint) reruns every step of
    the block under ``full``.
    """
    if mode == "none" and not dropped:
        return ()
    dropped = _renamed(forward, dropped)
    starts = {_norm(r) for r in start}
    kept = set(starts)
    wanted = [_norm(r) for r in residuals]
    if mode == "none":
        kept |= set(wanted)
    if mode == "selective":
        kept |= {r for r in wanted if r.name not in region}
        kept |= {_norm(r) for s in forward if s.tensor in region for r in s.reads if r.name not in region}
    if mode == "dots":
        rerun |= _alternate(forward, params) if alternate else frozenset()
        kept |= _dot_outputs(forward, params, rerun) | (_attention_outputs(forward) if keeps_attention else set())
    if mode in ("full", "dots"):  # only the layers are checkpointed: what the steps around the block make is kept
        kept |= {_norm(s.dst) for s in forward if s.once} | block_outputs(forward)
    kept = {r for r in kept if r.name not in dropped} | starts
    producer: dict[TensorRef, int] = {}
    for k, step in enumerate(forward):
        producer.setdefault(_norm(step.dst), k)
    chosen: set[int] = set()
    todo = [r for r in wanted if r not in kept]
    if whole_layers and mode == "full":  # torch.utils.checkpoint calls each layer's function again
        todo += [_norm(s.dst) for s in forward if not s.once and _norm(s.dst) not in kept]
    while todo:
        found = producer.get(todo.pop())
        if found is None or found in chosen:
            continue
        chosen.add(found)
        todo += [r for r in map(_norm, forward[found].reads) if r not in kept]
    return tuple(forward[k] for k in sorted(chosen))
