"""Fuzzing: whatever the text, parse gives a Spec or a ShardcError, never another exception."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardc.errors import ShardcError
from shardc.ir.spec import Spec
from shardc.spec.overrides import apply_overrides
from shardc.spec.parser import parse
from shardc.testing import spec_texts, specs

# Characters and pieces the language is made of, so random text gets past the lexer often.
ALPHABET = "XYZBDFIJKU_W{}[](),=·@*×→->#\n \t0123456789.eE+abcdmnlosv"
PIECES = ["mesh ", "dims ", "dtype ", "param ", "hardware ", "layers ", "over dcn", "X=4", "B=1e3", "A[", "]",
          "B_X", "B_{data,model}", "{U_X}", " = ", " · ", " -> ", "gelu(", ")", ", ", "\n", "#", "S[]", "_",
          "{", "}"]


def outcome(text: str) -> Spec | ShardcError:
    """parse's result; any exception but ShardcError fails the test by propagating."""
    try:
        spec = parse(text, "fuzz.shard")
    except ShardcError as err:
        assert str(err)  # the rendering itself must not fail
        return err
    assert parse(str(spec)) == spec  # whatever parses also round-trips
    return spec


@given(st.text(max_size=200))
def test_any_text(text: str) -> None:
    outcome(text)


@given(st.text(alphabet=ALPHABET, max_size=120))
def test_text_of_spec_characters(text: str) -> None:
    outcome("mesh X=4, Y=2\n" + text)


@given(st.lists(st.sampled_from(PIECES), max_size=30))
def test_text_of_spec_pieces(pieces: list[str]) -> None:
    outcome("".join(pieces))


@st.composite
def mutated(draw: st.DrawFn) -> str:
    """A valid spec text with a few random edits: deletions, insertions, replacements, line swaps."""
    text = draw(spec_texts(max_statements=3))
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.integers(0, len(text)))
        edit = draw(st.sampled_from(["delete", "insert", "replace", "swap", "duplicate"]))
        if edit == "delete":
            text = text[:where] + text[where + draw(st.integers(1, 5)):]
        elif edit in ("insert", "replace"):
            piece = draw(st.sampled_from(PIECES) | st.text(alphabet=ALPHABET, min_size=1, max_size=3))
            text = text[:where] + piece + text[where + (edit == "replace"):]
        else:
            lines = text.split("\n")
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            if edit == "swap":
                lines[i], lines[j] = lines[j], lines[i]
            else:
                lines.insert(j, lines[i])
            text = "\n".join(lines)
    return text


@settings(max_examples=120)
@given(mutated())
def test_mutated_specs(text: str) -> None:
    outcome(text)


@given(specs(), st.dictionaries(st.sampled_from(["X", "Y", "data", "B", "D", "I", "L", "Q", "zz"]),
                                st.integers(-2, 64), max_size=3))
def test_overrides_never_crash(spec: Spec, sets: dict[str, int]) -> None:
    try:
        new = apply_overrides(spec, sets)
    except ShardcError as err:
        assert str(err)
    else:
        assert parse(str(new)) == new
