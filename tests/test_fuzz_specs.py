"""Mutated example specs through parse, plan and cost: a result or a ShardcError, never another exception.

The examples are cut into tokens (names, numbers, punctuation, spaces) and edited: tokens
inserted, deleted or replaced, from the file's own tokens and from hostile ones (a name
``a```, ``Ω``, U+2028, a number of 50 digits, 0 or a negative size, ``nan``); a mesh axis,
dim or tensor renamed to a hostile name everywhere; every size replaced; the file made very
long.  ``tests/test_fuzz.py`` fuzzes the parser alone over generated text; these runs carry
what parses on through the planner and the cost model, within a CPU budget each.
"""

from __future__ import annotations

import re
import time

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from small_examples import SMALL

import shardc
from shardc.errors import ShardcError

TEXTS = {p.name: p.read_text(encoding="utf-8") for p in SMALL}
TOKEN = re.compile(r"[A-Za-z0-9_.]+|\s+|.", re.DOTALL)
HOSTILE_NAMES = ["a`", "a\\", "Ω", "a\u2028", "\u2028", "9a", "_", "x" * 300, "pipeline", "mesh", "over", "dcn",
                 "layers", "B_X", "é"]
HOSTILE_NUMBERS = ["0", "-1", "-8", "1", "3", "9" * 50, "1e400", "1e-3", "nan", "inf", "2.5", "1_", "0x10",
                   "\u0661\u0662"]
HOSTILE = HOSTILE_NAMES + HOSTILE_NUMBERS + ["{", "}", "[", "]", "(", ")", "=", ",", "·", "->", "\n", "#", "{U_X}",
                                             " over ", "\u2028", "\x00", "\t"]
BUDGET_S = 20.0


def outcome(text: str) -> str:
    """What parse, plan and cost make of ``text``: a ShardcError's pass, or "costed"."""
    try:
        spec = shardc.parse(text, filename="fuzz.shard")
    except ShardcError as err:
        assert str(err)
        return "parse error"
    try:
        plan = shardc.plan(spec)
    except ShardcError as err:
        assert str(err)
        return "plan error"
    try:
        shardc.cost(plan)
    except ShardcError as err:
        assert str(err)
        return "cost error"
    return "costed"


def check(text: str) -> None:
    start = time.process_time()
    event(outcome(text))
    assert time.process_time() - start < BUDGET_S


@st.composite
def token_edits(draw: st.DrawFn) -> str:
    """An example with up to 6 tokens inserted, deleted or replaced."""
    tokens = TOKEN.findall(TEXTS[draw(st.sampled_from(sorted(TEXTS)))])
    pool = st.sampled_from(sorted(set(tokens))) | st.sampled_from(HOSTILE)
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(tokens) - 1))
        edit = draw(st.sampled_from(["insert", "delete", "replace"]))
        if edit == "delete":
            del tokens[at]
        else:
            tokens[at:at + (edit == "replace")] = [draw(pool)]
    return "".join(tokens)


@st.composite
def renamed(draw: st.DrawFn) -> str:
    """An example with one of its names (an axis, a dim, a tensor) replaced everywhere by a hostile one."""
    text = TEXTS[draw(st.sampled_from(sorted(TEXTS)))]
    names = sorted({t for t in TOKEN.findall(text) if t[0].isalpha() and not t.startswith("#")})
    name = draw(st.sampled_from(names))
    new = draw(st.sampled_from(HOSTILE_NAMES))
    return re.sub(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])", lambda _: new, text)


@st.composite
def resized(draw: st.DrawFn) -> str:
    """An example with its sizes (a number after ``=``, or a ``layers`` or ``microbatches`` count) redrawn:
    small ones, and one or two hostile (0, negative, 50 digits, a float, 2**70)."""
    text = TEXTS[draw(st.sampled_from(sorted(TEXTS)))]
    size = re.compile(r"(?<=[=\s])\d[\d_.e]*(?=[,\s])")
    count = len(size.findall(text))
    hostile = set(draw(st.lists(st.integers(0, max(0, count - 1)), max_size=2)))
    numbers = iter([draw(st.sampled_from(HOSTILE_NUMBERS) | st.integers(-2, 1 << 70).map(str)) if k in hostile
                    else str(draw(st.integers(1, 64))) for k in range(count)])
    return size.sub(lambda _: next(numbers), text)


@st.composite
def long_files(draw: st.DrawFn) -> str:
    """An example's statements repeated under fresh names until the file is long (to 300 statements)."""
    text = TEXTS[draw(st.sampled_from(sorted(TEXTS)))]
    head, body = [], []
    for line in text.splitlines():
        (body if "=" in line and "[" in line else head).append(line)
    copies = draw(st.integers(1, 300 // max(1, len(body))))
    renamed_body = [re.sub(r"\b([A-Z][A-Za-z0-9]*)\[", rf"\g<1>c{k}[", line) for k in range(copies) for line in body]
    return "\n".join(head + renamed_body) + "\n"


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(token_edits())
def test_token_edits_of_the_examples(text: str) -> None:
    check(text)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(renamed())
def test_hostile_names_in_the_examples(text: str) -> None:
    check(text)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(resized())
def test_hostile_sizes_in_the_examples(text: str) -> None:
    check(text)


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(long_files())
def test_long_files(text: str) -> None:
    check(text)
