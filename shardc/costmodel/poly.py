"""Exact sums of monomials with rational coefficients, and their ratios: the algebra of cost formulas.

Every figure of the cost model is a sum of monomials in the dims, the mesh sizes
and the hardware figures (``2*B*D*F/(X*Y)``, ``4*B*D/X + 8*D*F/Y``), and a
threshold is the ratio of two such sums.  That algebra is closed and small:
:class:`Poly` adds, multiplies and divides by a monomial; :class:`Ratio` cancels
the common monomial and numeric factors of a quotient and prints it factored
(``2*B*F/(B*Y + 2*F*X)``).  Printing follows the usual computer-algebra notation
(factors by name, terms in lexicographic order of their exponents), so the
formulas read as sympy would print them, without sympy's half-second import.

>>> b, x = Poly.symbol("B"), Poly.symbol("X")
>>> str(2 * b / x + 3 * b / x), str(Ratio(4 * b, 2 * b * x + 6 * b).cancelled())
('5*B/X', '2/(X + 3)')
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["Key", "Poly", "Ratio"]

Key = tuple[tuple[str, int], ...]  # a monomial's symbols and powers, sorted by name, no zero power
Number = int | Fraction


def _mul_keys(a: Key, b: Key) -> Key:
    powers = dict(a)
    for name, power in b:
        powers[name] = powers.get(name, 0) + power
    return tuple(sorted((k, v) for k, v in powers.items() if v))


def _order(key: Key, names: tuple[str, ...]) -> tuple[int, ...]:
    powers = dict(key)
    return tuple(powers.get(n, 0) for n in names)


@dataclass(frozen=True)
class Poly:
    """A sum of monomials ``coeff * prod(name ** power)``; powers may be negative (``2*D*F/Y``)."""

    terms: tuple[tuple[Key, Fraction], ...] = ()

    @staticmethod
    def of(terms: Mapping[Key, Fraction] | Iterable[tuple[Key, Fraction]]) -> Poly:
        """Like terms combined, zero terms dropped, in a canonical order."""
        combined: dict[Key, Fraction] = {}
        for key, coeff in terms.items() if isinstance(terms, Mapping) else terms:
            combined[key] = combined.get(key, Fraction(0)) + coeff
        return Poly(tuple(sorted((k, c) for k, c in combined.items() if c)))

    @staticmethod
    def number(value: Number) -> Poly:
        return Poly.of([((), Fraction(value))])

    @staticmethod
    def symbol(name: str, power: int = 1) -> Poly:
        return Poly.of([(((name, power),), Fraction(1))])

    @staticmethod
    def monomial(coeff: Number, powers: Key) -> Poly:
        return Poly.of([(tuple(sorted(p for p in powers if p[1])), Fraction(coeff))])

    # arithmetic --------------------------------------------------------------------------------
    def __add__(self, other: Poly | Number) -> Poly:
        other = _poly(other)
        return Poly.of([*self.terms, *other.terms])

    __radd__ = __add__

    def __neg__(self) -> Poly:
        return Poly(tuple((k, -c) for k, c in self.terms))

    def __sub__(self, other: Poly | Number) -> Poly:
        return self + -_poly(other)

    def __rsub__(self, other: Number) -> Poly:
        return _poly(other) - self

    def __mul__(self, other: Poly | Number) -> Poly:
        other = _poly(other)
        return Poly.of([(_mul_keys(ka, kb), ca * cb) for ka, ca in self.terms for kb, cb in other.terms])

    __rmul__ = __mul__

    def __truediv__(self, other: Poly | Number) -> Poly:
        """Division by a number or a single monomial (anything else is a :class:`Ratio`)."""
        other = _poly(other)
        if len(other.terms) != 1:
            raise ZeroDivisionError("a Poly divides only by a nonzero monomial; use Ratio")
        key, coeff = other.terms[0]
        inverse = tuple((n, -p) for n, p in key)
        return self * Poly(((inverse, 1 / coeff),))

    # inspection ---------------------------------------------------------------------------------
    @property
    def is_zero(self) -> bool:
        return not self.terms

    @property
    def is_monomial(self) -> bool:
        return len(self.terms) == 1

    @property
    def is_number(self) -> bool:
        return all(not key for key, _ in self.terms)

    @property
    def free_symbols(self) -> frozenset[str]:
        return frozenset(name for key, _ in self.terms for name, _ in key)

    def powers(self) -> dict[str, int]:
        """The symbols and powers of a monomial."""
        assert self.is_monomial, self
        return dict(self.terms[0][0])

    def coefficient(self) -> Fraction:
        """The number of a monomial (0 for the zero Poly)."""
        return self.terms[0][1] if self.terms else Fraction(0)

    def evaluate(self, values: Mapping[str, float]) -> float:
        """The value at ``values`` (every free symbol must be given)."""
        total = 0.0
        for key, coeff in self.terms:
            term = coeff.numerator / coeff.denominator
            for name, power in key:
                term *= float(values[name]) ** power
            total += term
        return total

    def collect(self, name: str) -> dict[int, Poly]:
        """The coefficients of each power of ``name`` (``{1: slope, 0: offset}`` when linear)."""
        parts: dict[int, list[tuple[Key, Fraction]]] = {}
        for key, coeff in self.terms:
            power = dict(key).get(name, 0)
            rest = tuple(p for p in key if p[0] != name)
            parts.setdefault(power, []).append((rest, coeff))
        return {p: Poly.of(t) for p, t in parts.items()}

    def content(self) -> tuple[Fraction, Key]:
        """The number and the monomial that divide every term (the number makes the rest coprime integers,
        and the first printed term positive)."""
        if not self.terms:
            return Fraction(1), ()
        names = sorted(self.free_symbols)
        low = tuple((n, min(dict(k).get(n, 0) for k, _ in self.terms)) for n in names)
        numer = math.gcd(*(c.numerator for _, c in self.terms))
        denom = math.lcm(*(c.denominator for _, c in self.terms))
        number = Fraction(numer, denom)
        if self._ordered()[0][1] < 0:
            number = -number
        return number, tuple(p for p in low if p[1])

    def _ordered(self) -> list[tuple[Key, Fraction]]:
        names = tuple(sorted(self.free_symbols))
        return sorted(self.terms, key=lambda t: _order(t[0], names), reverse=True)

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        text = ""
        for i, (key, coeff) in enumerate(self._ordered()):
            term = _product(abs(coeff), key)
            if i == 0:
                text = ("-" if coeff < 0 else "") + term
            else:
                text += (" - " if coeff < 0 else " + ") + term
        return text


def _poly(value: Poly | Number) -> Poly:
    return value if isinstance(value, Poly) else Poly.number(value)


def _factor(name: str, power: int) -> str:
    return name if power == 1 else f"{name}**{power}"


def _product(coeff: Fraction, key: Key, num_extra: str = "", den_extra: str = "") -> str:
    """``3*B*(F + X)/(2*X*(B + Y))``: a nonnegative number times symbols, with optional sum factors."""
    num = [_factor(n, p) for n, p in key if p > 0] + ([f"({num_extra})"] if num_extra else [])
    den = [_factor(n, -p) for n, p in key if p < 0] + ([f"({den_extra})"] if den_extra else [])
    if coeff.numerator != 1 or not num:
        num.insert(0, str(coeff.numerator))
    if coeff.denominator != 1:
        den.insert(0, str(coeff.denominator))
    text = "*".join(num)
    if len(den) == 1:
        return f"{text}/{den[0]}"
    return f"{text}/({'*'.join(den)})" if den else text


@dataclass(frozen=True)
class Ratio:
    """``num / den``, two :class:`Poly`; :meth:`cancelled` gives the reduced form that prints."""

    num: Poly
    den: Poly

    def cancelled(self) -> Ratio:
        """Negative powers cleared, common monomial and numeric factors cancelled, equal sums cancelled.

        What remains is ``number * monomial * P / Q`` with P, Q sums of coprime integer
        coefficients and no common monomial factor; a common factor of P and Q that is
        itself a sum is cancelled only when P and Q are equal (the case that arises).
        """
        if self.den.is_zero:
            raise ZeroDivisionError("a Ratio with a zero denominator")
        if self.num.is_zero:
            return Ratio(Poly(), Poly.number(1))
        n_num, k_num = self.num.content()
        n_den, k_den = self.den.content()
        p = self.num / Poly.monomial(n_num, k_num)
        q = self.den / Poly.monomial(n_den, k_den)
        if p == q:
            p = q = Poly.number(1)
        mono = Poly.monomial(n_num / n_den, k_num) / Poly.monomial(1, k_den)
        top = Poly.monomial(mono.coefficient(), tuple((n, e) for n, e in mono.powers().items() if e > 0))
        bottom = Poly.monomial(1, tuple((n, -e) for n, e in mono.powers().items() if e < 0))
        return Ratio(top * p, bottom * q)

    @property
    def is_zero(self) -> bool:
        return self.num.is_zero

    @property
    def is_monomial(self) -> bool:
        return self.num.is_monomial and self.den.is_monomial

    def as_poly(self) -> Poly:
        """A monomial ratio as one (Laurent) monomial."""
        return self.num / self.den

    @property
    def free_symbols(self) -> frozenset[str]:
        return self.num.free_symbols | self.den.free_symbols

    def evaluate(self, values: Mapping[str, float]) -> float:
        return self.num.evaluate(values) / self.den.evaluate(values)

    def __str__(self) -> str:
        r = self.cancelled()
        if r.num.is_zero:
            return "0"
        if r.is_monomial:
            return str(r.as_poly())
        n_num, k_num = r.num.content()
        n_den, k_den = r.den.content()
        p, q = r.num / Poly.monomial(n_num, k_num), r.den / Poly.monomial(n_den, k_den)
        coeff = n_num / n_den
        key = _mul_keys(k_num, tuple((n, -e) for n, e in k_den))
        text = _product(abs(coeff), key, "" if p.is_number else str(p), "" if q.is_number else str(q))
        return ("-" if coeff < 0 else "") + text
