"""Runs of jaxpr equations that are one function of the spec language, found before the walk.

``jax.nn.softmax(x, axis)`` traces to ``exp(x - max(x)) / sum(exp(x - max(x)))`` (a reduce_max, its
broadcast back, a subtraction, an exp, a reduce_sum, its broadcast, a division); read equation by
equation it is a division of two arrays, which the language has no form for, but the whole run is
``softmax(X over I)``.  An RMSNorm, ``x * rsqrt(mean(x**2) + eps)`` (or ``x / sqrt(...)``), is a
product of x with a statistic of itself: the run is ``rmsnorm(X over I)``, and of ``x - mean(x)``
``layernorm(X over I)``, as is flax's LayerNorm, ``(x - mean(x)) * rsqrt(mean(x**2) - mean(x)**2 + eps)``.
The mean negative log
likelihood ``-mean(take_along_axis(log_softmax(logits), labels[..., None], axis=-1))`` (jax's
``log_softmax`` and ``take_along_axis`` are calls of their own) is ``cross_entropy(Logits, Labels)``,
as is optax's ``softmax_cross_entropy_with_integer_labels(logits, labels).mean()``, the mean of
``logsumexp(logits) - take_along_axis(logits, labels[..., None], axis=-1)[..., 0]``, and the mean of
``-sum(jax.nn.one_hot(labels, V) * log_softmax(logits), -1)`` (optax's ``softmax_cross_entropy`` of a
one-hot, as flax and nanoGPT-style code write it).
:func:`runs` finds each such run whose inner values nothing else reads.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from jax.extend import core as jex

__all__ = ["PRIMITIVE_MAPS", "Run", "function_of", "is_lookup", "mean_sums", "primitives", "runs"]

# the one-primitive maps of the language, by primitive: a run of only that primitive, or its last step
# (:func:`shardc.explanation.constants.write_run`), is that map; "reciprocal" is the name a run keeps for
# ``integer_pow`` of -1 and ``1 / x`` (:func:`shardc.explanation.constants.scaled`)
PRIMITIVE_MAPS = {"tanh": "tanh", "exp": "exp", "logistic": "sigmoid", "square": "square", "log": "log",
                  "sqrt": "sqrt", "rsqrt": "rsqrt", "abs": "abs", "sin": "sin", "cos": "cos", "neg": "negative",
                  "reciprocal": "reciprocal"}

_PASS = ("broadcast_in_dim", "stop_gradient", "max")  # what lies between the max and the subtraction


_STATISTIC = ("broadcast_in_dim", "div", "add", "mul", "rsqrt", "sqrt")  # mean(x**2) + eps, its root, ...


@dataclass(frozen=True)
class Run:
    """``out = function(source over axis)``, made by the equations ``run`` (the last makes ``out``)."""

    function: str
    source: Any
    axis: int
    run: tuple[Any, ...]
    ids: Any = None  # cross_entropy's labels
    scale: Any = None  # a norm's scale the run multiplies in (flax's RMSNorm): the norm times it


def _producers(eqns: list[Any]) -> dict[Any, Any]:
    return {v: eqn for eqn in eqns for v in eqn.outvars}


def _uses(eqns: list[Any], outvars: list[Any]) -> Counter[Any]:
    """How often each value is read; an equation whose results nothing reads (jax's ``sign`` of a
    logsumexp's sum, traced for its gradient) reads nothing."""
    read = {v for eqn in eqns for v in eqn.invars if not isinstance(v, jex.Literal)}
    read.update(v for v in outvars if not isinstance(v, jex.Literal))
    live = [eqn for eqn in eqns if any(v in read for v in eqn.outvars)]
    uses: Counter[Any] = Counter(v for eqn in live for v in eqn.invars if not isinstance(v, jex.Literal))
    uses.update(v for v in outvars if not isinstance(v, jex.Literal))
    return uses


def _array(eqn: Any) -> Any:
    """The one non-literal operand of ``eqn`` (None if it has another count)."""
    arrays = [v for v in eqn.invars if not isinstance(v, jex.Literal)]
    return arrays[0] if len(arrays) == 1 else None


def _max_of(var: Any, made: dict[Any, Any], run: list[Any]) -> tuple[Any, int] | None:
    """(x, axis) where ``var`` is reduce_max(x, axis), through broadcasts, a stop_gradient, a max with -inf."""
    eqn = made.get(var)
    while eqn is not None and eqn.primitive.name in _PASS:
        run.append(eqn)
        eqn = made.get(_array(eqn))
    if eqn is None or eqn.primitive.name != "reduce_max" or len(eqn.params["axes"]) != 1:
        return None
    run.append(eqn)
    return eqn.invars[0], eqn.params["axes"][0]


def _softmax(div: Any, made: dict[Any, Any]) -> Run | None:
    num, den = div.invars
    run: list[Any] = []
    exp, bcast = made.get(num), made.get(den)
    if exp is None or exp.primitive.name != "exp" or bcast is None or bcast.primitive.name != "broadcast_in_dim":
        return None
    total = made.get(bcast.invars[0])
    if total is None or total.primitive.name != "reduce_sum" or total.invars[0] is not num:
        return None
    sub = made.get(exp.invars[0])
    if sub is None or sub.primitive.name != "sub":
        return None
    found = _max_of(sub.invars[1], made, run)
    if found is None or found[0] is not sub.invars[0] or (found[1],) != tuple(total.params["axes"]):
        return None
    return Run("softmax", sub.invars[0], found[1], (*run, sub, exp, total, bcast, div))


def _rmsnorm(last: Any, made: dict[Any, Any]) -> Run | None:
    """``x * rsqrt(mean(x**2) + eps)`` or ``x / sqrt(...)``: the statistic's chain back to a sum of squares
    of x along one axis, each step of it a function of the statistic alone (and literals)."""
    x, stat = last.invars
    run: list[Any] = []
    scale, scaled = _scaled(stat, made)
    eqn = made.get(stat if scaled is None else scaled.invars[0])
    roots = 0
    while eqn is not None and eqn.primitive.name in _STATISTIC and _array(eqn) is not None:
        roots += eqn.primitive.name in ("rsqrt", "sqrt")
        run.append(eqn)
        eqn = made.get(_array(eqn))
    wanted = "rsqrt" if last.primitive.name == "mul" else "sqrt"
    if eqn is None or eqn.primitive.name != "reduce_sum" or len(eqn.params["axes"]) != 1 or roots != 1 \
            or not any(e.primitive.name == wanted for e in run):
        return None
    square = made.get(eqn.invars[0])
    shifted = made.get(x)  # flax's RMSNorm subtracts a zero mean: x - 0
    if shifted is not None and shifted.primitive.name == "sub" and _zero(shifted.invars[1], made) \
            and square is not None and square.invars[0] is shifted.invars[0]:
        run.insert(0, shifted)
        x = shifted.invars[0]
    # `(x - mu) / sqrt(mean((x - mu)**2) + eps)` traces x - mu twice: the square's is a twin of x
    twin = made.get(square.invars[0]) if square is not None and _twins(square.invars[0], x, made) else None
    if square is None or not ((square.primitive.name == "integer_pow" and square.params["y"] == 2)
                              or square.primitive.name == "square") or (square.invars[0] is not x and twin is None):
        return None
    tail = (scaled, last) if scaled is not None else (last,)
    head = (twin, square) if twin is not None else (square,)
    norm = Run("rmsnorm", x, eqn.params["axes"][0], (*head, eqn, *reversed(run), *tail), scale=scale)
    return (_centered(norm, made) if scale is None else None) or norm


def _twins(a: Any, b: Any, made: dict[Any, Any]) -> bool:
    """Whether ``a`` and ``b`` (not one variable) are made by one primitive of the same params from the
    same operands: the same value, computed twice."""
    ea, eb = made.get(a), made.get(b)
    return a is not b and ea is not None and eb is not None and ea.primitive is eb.primitive \
        and ea.params == eb.params and len(ea.invars) == len(eb.invars) \
        and all(u is v or (isinstance(u, jex.Literal) and isinstance(v, jex.Literal) and u.val == v.val)
                for u, v in zip(ea.invars, eb.invars, strict=True))


def _scaled(stat: Any, made: dict[Any, Any]) -> tuple[Any, Any]:
    """(scale, the product) where ``stat`` is ``rsqrt(...) * scale`` (flax's RMSNorm scales the
    statistic, not the result: ``x * (rsqrt(mean(x**2) + eps) * scale)``), else (None, None)."""
    product = made.get(stat)
    if product is None or product.primitive.name != "mul" or any(isinstance(v, jex.Literal) for v in product.invars):
        return None, None
    root = made.get(product.invars[0])
    if root is None or root.primitive.name != "rsqrt":
        return None, None
    return product.invars[1], product


def _zero(var: Any, made: dict[Any, Any]) -> bool:
    """Whether ``var`` is the constant 0 broadcast (through broadcasts alone)."""
    eqn = made.get(var)
    while eqn is not None and eqn.primitive.name == "broadcast_in_dim" and not isinstance(eqn.invars[0], jex.Literal):
        eqn = made.get(eqn.invars[0])
    return eqn is not None and eqn.primitive.name == "broadcast_in_dim" and isinstance(eqn.invars[0], jex.Literal) \
        and float(eqn.invars[0].val) == 0.0


def _centered(norm: Run, made: dict[Any, Any]) -> Run | None:
    """An rmsnorm of ``x - mean(x)`` over its own axis (the mean a sum, a division by a literal, its
    broadcast back) is ``layernorm(x over axis)``."""
    sub = made.get(norm.source)
    if sub is None or sub.primitive.name != "sub" or any(isinstance(v, jex.Literal) for v in sub.invars):
        return None
    x, mean = sub.invars
    chain: list[Any] = []
    eqn = made.get(mean)
    while eqn is not None and (eqn.primitive.name == "broadcast_in_dim" or (
            eqn.primitive.name == "div" and isinstance(eqn.invars[1], jex.Literal))):
        chain.append(eqn)
        eqn = made.get(eqn.invars[0])
    if [e.primitive.name for e in chain].count("div") != 1 or eqn is None or eqn.primitive.name != "reduce_sum" \
            or eqn.invars[0] is not x or tuple(eqn.params["axes"]) != (norm.axis,):
        return None
    return Run("layernorm", x, norm.axis, (eqn, *reversed(chain), sub, *norm.run))


def _made_by(var: Any, made: dict[Any, Any], *names: str) -> Any:
    """The equation making ``var`` where its primitive is one of ``names``, else None."""
    eqn = made.get(var)
    return eqn if eqn is not None and eqn.primitive.name in names else None


def _mean_of(var: Any, made: dict[Any, Any]) -> tuple[Any, Any, Any] | None:
    """(x, reduce_sum, div) where ``var`` is ``sum(x over one axis) / n`` with n a literal."""
    div = _made_by(var, made, "div")
    if div is None or not isinstance(div.invars[1], jex.Literal):
        return None
    total = _made_by(div.invars[0], made, "reduce_sum")
    if total is None or len(total.params["axes"]) != 1:
        return None
    return total.invars[0], total, div


def _squared(var: Any, made: dict[Any, Any]) -> Any:
    eqn = _made_by(var, made, "square", "integer_pow")
    return eqn if eqn is not None and (eqn.primitive.name == "square" or eqn.params["y"] == 2) else None


def _fast_layernorm(last: Any, made: dict[Any, Any]) -> Run | None:
    """flax's LayerNorm (``use_fast_variance``, its default): ``(x - mean(x)) * rsqrt(max(0, mean(x**2) -
    mean(x)**2) + eps)``, the root times the scale where it has one, is ``layernorm(x over axis)``."""
    centered, stat = last.invars
    scale, scaled = _scaled(stat, made)
    chain: list[Any] = []
    var: Any = stat if scaled is None else scaled.invars[0]
    for name in ("rsqrt", "add", "broadcast_in_dim", "max"):  # the root of eps + max(0, the variance)
        eqn = _made_by(var, made, name)
        if eqn is None or _array(eqn) is None:
            return None
        chain.append(eqn)
        var = _array(eqn)
    diff, sub = _made_by(var, made, "sub"), _made_by(centered, made, "sub")
    mean_sq = _squared(diff.invars[1], made) if diff is not None else None
    if diff is None or sub is None or mean_sq is None:
        return None
    of_squares, mean = _mean_of(diff.invars[0], made), _mean_of(mean_sq.invars[0], made)
    back = _made_by(sub.invars[1], made, "broadcast_in_dim")
    if of_squares is None or mean is None or back is None or back.invars[0] is not mean_sq.invars[0]:
        return None
    x, square = mean[0], _squared(of_squares[0], made)
    axis = tuple(mean[1].params["axes"])
    if square is None or square.invars[0] is not x or sub.invars[0] is not x \
            or tuple(of_squares[1].params["axes"]) != axis:
        return None
    tail = (scaled, last) if scaled is not None else (last,)
    run = (square, *mean[1:], *of_squares[1:], mean_sq, diff, *reversed(chain[2:]), back, sub,
           *reversed(chain[:2]), *tail)
    return Run("layernorm", x, axis[0], run, scale=scale)


def _call(eqn: Any, name: str) -> bool:
    return eqn is not None and eqn.primitive.name in ("pjit", "jit") and eqn.params.get("name") == name


def _cross_entropy(neg: Any, made: dict[Any, Any]) -> Run | None:
    """``-(sum(take_along_axis(log_softmax(x), labels[..., None], -1)) / tokens)`` (the picked values'
    last index read first or not): the run from the log_softmax call to the negation, over x's last axis."""
    div = made.get(neg.invars[0])
    if div is None or div.primitive.name != "div" or not isinstance(div.invars[1], jex.Literal):
        return None
    total: Any = made.get(div.invars[0])
    if total is None or total.primitive.name != "reduce_sum":
        return None
    take: Any = made.get(total.invars[0])
    squeeze = [take] if _squeeze(take) else []
    take = made.get(take.invars[0]) if squeeze else take
    if not _call(take, "take_along_axis") or not _call(made.get(take.invars[0]), "log_softmax"):
        return None
    logp, index = made[take.invars[0]], made.get(take.invars[1])
    if index is None or index.primitive.name != "broadcast_in_dim" or logp.outvars[0] is not take.invars[0]:
        return None
    labels, logits = index.invars[0], logp.invars[0]
    shape = tuple(labels.aval.shape)
    summed = len(shape) + 1 - len(squeeze)  # the tokens' indices, and the picked one where it is not read first
    if tuple(logits.aval.shape[:-1]) != shape or tuple(take.outvars[0].aval.shape) != (*shape, 1) \
            or float(div.invars[1].val) != math.prod(shape) or len(total.params["axes"]) != summed:
        return None
    return Run("cross_entropy", logits, len(shape), (logp, index, take, *squeeze, total, div, neg), labels)


def _squeeze(eqn: Any) -> bool:
    """Whether ``eqn`` reads a picked value's last index of one (``[..., 0]``, a ``_take`` call; ``.squeeze(-1)``)."""
    return eqn is not None and (_call(eqn, "_take") or eqn.primitive.name == "squeeze")


_LSE = frozenset({"reduce_max", "max", "is_finite", "broadcast_in_dim", "select_n", "stop_gradient", "sub", "exp",
                  "reduce_sum", "abs", "log", "add"})  # jax.nn.logsumexp's equations, inlined


def _picked(var: Any, made: dict[Any, Any]) -> tuple[Any, Any, list[Any]] | None:
    """(logits, labels, run) where ``var`` is ``take_along_axis(logits, labels[..., None], axis=-1)[..., 0]``
    (optax's label logits; the last index read by a ``_take`` call or a squeeze)."""
    last: Any = made.get(var)
    if not _squeeze(last):
        return None
    take: Any = made.get(last.invars[0])
    index = made.get(take.invars[1]) if _call(take, "take_along_axis") else None
    if index is None or index.primitive.name != "broadcast_in_dim":
        return None
    logits, labels = take.invars[0], index.invars[0]
    shape = tuple(labels.aval.shape)
    if tuple(logits.aval.shape[:-1]) != shape or tuple(var.aval.shape) != shape:
        return None
    return logits, labels, [index, take, last]


def _logsumexp_of(var: Any, logits: Any, made: dict[Any, Any]) -> list[Any] | None:
    """The equations of ``jax.nn.logsumexp(logits, axis=-1)`` making ``var`` (inlined: a max, exp of the
    shift, a sum over the last axis, its log; or a ``logsumexp`` call), reading logits and literals alone."""
    cone: dict[int, Any] = {}
    stack, last = [var], len(logits.aval.shape) - 1
    while stack:
        v = stack.pop()
        eqn = made.get(v)
        if v is logits or (eqn is not None and id(eqn) in cone):
            continue
        if eqn is None or not (eqn.primitive.name in _LSE or (_call(eqn, "logsumexp") and eqn.invars[0] is logits)):
            return None
        cone[id(eqn)] = eqn
        if eqn.primitive.name in _LSE:
            stack += [u for u in eqn.invars if not isinstance(u, jex.Literal)]
    sums = [e for e in cone.values() if e.primitive.name in ("reduce_sum", "reduce_max")]
    if any(tuple(e.params["axes"]) != (last,) or e.invars[0] is not logits and e.primitive.name == "reduce_max"
           for e in sums):
        return None
    names = {e.primitive.name for e in cone.values()}
    if not ({"exp", "log", "reduce_sum"} <= names or any(_call(e, "logsumexp") for e in cone.values())):
        return None
    return list(cone.values())


def _mean_nll(div: Any, made: dict[Any, Any]) -> Run | None:
    """optax's ``softmax_cross_entropy_with_integer_labels(logits, labels).mean()``: the mean over tokens
    of ``logsumexp(logits) - take_along_axis(logits, labels)``, the language's ``cross_entropy``."""
    total = made.get(div.invars[0])
    if not isinstance(div.invars[1], jex.Literal) or total is None or total.primitive.name != "reduce_sum":
        return None
    sub: Any = made.get(total.invars[0])
    picked = _picked(sub.invars[1], made) if sub is not None and sub.primitive.name == "sub" else None
    if picked is None:
        return None
    logits, labels, pick = picked
    lse = _logsumexp_of(sub.invars[0], logits, made)
    shape = tuple(labels.aval.shape)
    if lse is None or float(div.invars[1].val) != math.prod(shape) or len(total.params["axes"]) != len(shape):
        return None
    return Run("cross_entropy", logits, len(shape), (*lse, *pick, sub, total, div), labels)


def _one_hot_nll(last: Any, made: dict[Any, Any]) -> Run | None:
    """``-mean(sum(one_hot(labels, V) * log_softmax(logits), -1))`` in any order of its negation, sums and
    one division by the tokens (``-sum(...) / tokens``, optax's ``softmax_cross_entropy(...).mean()``):
    the run from the one-hot and log_softmax calls to ``last``, a scalar."""
    chain, eqn = [], last
    while eqn is not None and eqn.primitive.name in ("neg", "div", "reduce_sum") and _array(eqn) is not None \
            and (eqn.primitive.name != "div" or isinstance(eqn.invars[1], jex.Literal)):
        chain.append(eqn)
        eqn = made.get(_array(eqn))
    names = [e.primitive.name for e in chain]
    if eqn is None or eqn.primitive.name != "mul" or names.count("neg") != 1 or names.count("div") != 1 \
            or last.outvars[0].aval.shape != ():
        return None
    calls: list[Any] = sorted((made.get(v) for v in eqn.invars if not isinstance(v, jex.Literal)),
                              key=lambda e: not _call(e, "_one_hot"))
    if len(calls) != 2:
        return None
    if not (_call(calls[0], "_one_hot") and _call(calls[1], "log_softmax")):
        return None
    labels, logits = calls[0].invars[0], calls[1].invars[0]
    shape, divisor = tuple(labels.aval.shape), next(e for e in chain if e.primitive.name == "div").invars[1]
    if tuple(logits.aval.shape[:-1]) != shape or tuple(eqn.outvars[0].aval.shape) != tuple(logits.aval.shape) \
            or float(divisor.val) != math.prod(shape) or not _over_last(calls[1]):
        return None
    return Run("cross_entropy", logits, len(shape), (calls[0], calls[1], eqn, *reversed(chain)), labels)


def _over_last(call: Any) -> bool:
    """Whether a log_softmax call normalizes over its array's last axis (its sums' axes), the one-hot's."""
    inner = getattr(call.params["jaxpr"], "jaxpr", call.params["jaxpr"])
    last = (len(call.invars[0].aval.shape) - 1,)
    return all(tuple(e.params["axes"]) == last for e in inner.eqns if e.primitive.name in ("reduce_sum", "reduce_max"))


def _one_hot_lookup(dot: Any, made: dict[Any, Any]) -> Run | None:
    """``jax.nn.one_hot(ids, V) @ table[V, D]`` (the one-hot's classes contracted with the table's rows, no
    batch dims) is the table's rows at the ids: ``embed(ids, table)``, its run the one-hot call and the dot."""
    (contracted, _), (batch, _) = dot.params["dimension_numbers"]
    one_hot: Any = made.get(dot.invars[0])
    table = dot.invars[1]
    if not _call(one_hot, "_one_hot") or isinstance(table, jex.Literal) or len(table.aval.shape) != 2 or batch:
        return None
    ids = one_hot.invars[0]
    rank = len(ids.aval.shape)
    if tuple(one_hot.outvars[0].aval.shape) != (*ids.aval.shape, table.aval.shape[0]) \
            or dot.params["dimension_numbers"][0] != ((rank,), (0,)) or tuple(contracted) != (rank,):
        return None
    return Run("embed", table, 0, (one_hot, dot), ids)


def _match(eqn: Any, made: dict[Any, Any]) -> Run | None:
    if eqn.primitive.name in ("neg", "div") and not eqn.outvars[0].aval.shape:
        found = _one_hot_nll(eqn, made)
        if found is not None:
            return found
    if eqn.primitive.name == "dot_general":
        return _one_hot_lookup(eqn, made)
    if eqn.primitive.name == "neg":
        return _cross_entropy(eqn, made)
    if eqn.primitive.name == "div" and isinstance(eqn.invars[1], jex.Literal):
        return _mean_nll(eqn, made)
    if len(eqn.invars) != 2 or any(isinstance(v, jex.Literal) for v in eqn.invars):
        return None
    if eqn.primitive.name == "div":
        return _softmax(eqn, made) or _rmsnorm(eqn, made)
    return (_rmsnorm(eqn, made) or _fast_layernorm(eqn, made)) if eqn.primitive.name == "mul" else None


def runs(eqns: list[Any], outvars: list[Any]) -> dict[Any, Run]:
    """Each run of the equations ``eqns`` (a jaxpr's, or the part of them read) by its last equation,
    where the run's inner values are read by the run alone (a value read elsewhere too, by ``eqns`` or
    as one of ``outvars``, keeps its equations, and the run is read equation by equation)."""
    made, uses = _producers(eqns), _uses(eqns, outvars)
    found: dict[Any, Run] = {}
    for eqn in eqns:
        match = _match(eqn, made)
        if match is None:
            continue
        inner = [v for e in match.run[:-1] for v in e.outvars]
        reads = Counter(v for e in match.run for v in e.invars if not isinstance(v, jex.Literal))
        if all(uses[v] == reads[v] for v in inner):
            found[eqn] = match
    return found


def mean_sums(eqns: list[Any], outvars: list[Any]) -> dict[int, Any]:
    """``jnp.mean(x, axes)``: a reduce_sum that a division by the product of its dims' sizes alone reads.  By
    the id of each such reduce_sum and of its division, the reduce_sum: read as a mean over those dims, the
    division as that mean itself (read as a plain sum, the spec's value would be n times the program's)."""
    made, uses = _producers(eqns), _uses(eqns, outvars)
    found: dict[int, Any] = {}
    for div in eqns:
        if div.primitive.name != "div" or not isinstance(div.invars[1], jex.Literal):
            continue
        total = _made_by(div.invars[0], made, "reduce_sum")
        if total is None or uses[div.invars[0]] != 1:
            continue
        shape = total.invars[0].aval.shape
        if float(div.invars[1].val) == math.prod(shape[a] for a in total.params["axes"]):
            found[id(total)] = found[id(div)] = total
    return found


def is_lookup(gather: Any) -> bool:
    """Whether a ``gather`` takes whole rows of a 2-d table at integer ids, one id an index vector
    (``jnp.take(table, ids, axis=0)`` and ``table[ids]``, ids of any shape): an embedding lookup."""
    table, indices = gather.invars
    out = gather.outvars[0]
    numbers = gather.params["dimension_numbers"]
    return (len(table.aval.shape) == 2 and tuple(numbers.collapsed_slice_dims) == (0,)
            and tuple(numbers.start_index_map) == (0,) and not tuple(numbers.operand_batching_dims)
            and tuple(numbers.offset_dims) == (len(out.aval.shape) - 1,)
            and tuple(gather.params["slice_sizes"]) == (1, table.aval.shape[1])
            and indices.aval.shape[-1:] == (1,) and len(out.aval.shape) == len(indices.aval.shape))


def primitives(jaxpr: Any) -> frozenset[str]:
    found: set[str] = set()
    for eqn in getattr(jaxpr, "eqns", ()):
        found.add(eqn.primitive.name)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if isinstance(inner, jex.Jaxpr):
                found |= primitives(inner)
    return frozenset(found)


def function_of(ops: frozenset[str]) -> str:
    """The language's function for a run of elementwise primitives (identity when none fits)."""
    if "erf" in ops or ({"tanh", "mul", "add"} <= ops and ops & {"integer_pow", "pow"}):  # tanh(x) ** 2 is none
        return "gelu"
    if "logistic" in ops:
        return "silu" if "mul" in ops else "sigmoid"
    if ops & {"max"} and not ops & {"exp", "tanh"}:
        return "relu"
    for name in ("tanh", "exp"):
        if name in ops:
            return name
    if len(ops) == 1 and next(iter(ops)) in PRIMITIVE_MAPS:  # one primitive, the language's map of it (jnp.log)
        return PRIMITIVE_MAPS[next(iter(ops))]
    return "square" if ops <= {"mul", "integer_pow", "square"} and ops else "identity"
