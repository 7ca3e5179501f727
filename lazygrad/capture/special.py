"""The log-gamma function and its derivatives (`lgamma`, `digamma`, `polygamma(1, x)`), written
with ops ONNX has: it has none of them, and distributions' log-probabilities need them (the
Student-t, Gamma, Beta, Dirichlet, Poisson and negative binomial likelihoods of time-series and
count models, computed in the model: they ran in parts).

Each is the function itself, lowered at trace time below autograd (`lowerings.TABLE`), so the
gradients stay torch's formulas: `lgamma`'s is `digamma`, whose is `polygamma(1, x)`, each
lowered here in its turn. Each is computed in float64 whatever its input's float type (and cast
back): the recurrence that lifts a small argument to where the asymptotic series holds
subtracts nearly equal numbers near the zeros of `lgamma` (1 and 2) and of `digamma` (1.46),
which in float32 would leave 1e-6 where torch's kernels are exact to a rounding. Negative
arguments go through the reflection formulas, with the sine of pi x taken from x's fraction so
that it stays exact for large x; the poles are torch's values (+inf for `lgamma`; for `digamma`
-inf at +0, +inf at -0, NaN at the negative integers; +inf for `polygamma(1, x)`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

aten = torch.ops.aten

# Where every series below holds to float64's rounding (the first term left out is below
# 1e-15 of the result at 10); smaller arguments are lifted by the recurrences.
_LIFT = 10

# Stirling's series of lgamma(z) - ((z - 1/2) log z - z + log(2 pi) / 2), in powers of 1/z:
# B_2n / (2n (2n - 1)) for n = 1..6.
_LGAMMA_SERIES = (1 / 12, -1 / 360, 1 / 1260, -1 / 1680, 1 / 1188, -691 / 360360)
# digamma(z) - (log z - 1 / (2z)): -B_2n / (2n z^2n) for n = 1..6, in powers of 1/z^2.
_DIGAMMA_SERIES = (-1 / 12, 1 / 120, -1 / 252, 1 / 240, -1 / 132, 691 / 32760)
# polygamma(1, z) - (1/z + 1 / (2 z^2)): B_2n / z^(2n+1) for n = 1..7.
_TRIGAMMA_SERIES = (1 / 6, -1 / 30, 1 / 42, -1 / 30, 5 / 66, -691 / 2730, 7 / 6)


def lgamma(self: torch.Tensor) -> torch.Tensor:
    """log |Gamma(x)|."""
    x, back = _wide(self)
    negative = aten.lt.Scalar(x, 0)
    z = aten.where.self(negative, aten.rsub.Scalar(x, 1), x)  # reflected: 1 - x >= 1
    lifted, small = _lifted(z)
    series = _polynomial(aten.reciprocal.default(lifted), _LGAMMA_SERIES, step=2, first=1)
    value = aten.add.Tensor(
        aten.sub.Tensor(aten.mul.Tensor(aten.sub.Tensor(lifted, 0.5), aten.log.default(lifted)),
                        lifted),
        aten.add.Tensor(series, 0.5 * math.log(2 * math.pi)))
    # The recurrence: lgamma(z) = lgamma(z + n) - log(z (z + 1) ... (z + n - 1)).
    product = _product(z)
    value = aten.where.self(small, aten.sub.Tensor(value, aten.log.default(product)), value)
    # Reflection: lgamma(x) = log(pi / |sin(pi x)|) - lgamma(1 - x).
    reflected = aten.sub.Tensor(
        aten.neg.default(aten.log.default(aten.div.Tensor(_sin_pi(x), math.pi))), value)
    value = aten.where.self(negative, reflected, value)
    value = aten.where.self(_pole(x), _constant(value, math.inf), value)
    value = aten.where.self(aten.isinf.default(x), _constant(value, math.inf), value)
    # Its zeros exactly, as torch's kernel gives them (the series leaves a rounding or two).
    ones = aten.logical_or.default(aten.eq.Scalar(x, 1), aten.eq.Scalar(x, 2))
    return back(aten.where.self(ones, _constant(value, 0.0), value))


def digamma(self: torch.Tensor) -> torch.Tensor:
    """The derivative of `lgamma`."""
    x, back = _wide(self)
    negative = aten.lt.Scalar(x, 0)
    z = aten.where.self(negative, aten.rsub.Scalar(x, 1), x)
    lifted, small = _lifted(z)
    inverse = aten.reciprocal.default(lifted)
    series = _polynomial(aten.mul.Tensor(inverse, inverse), _DIGAMMA_SERIES, step=1, first=1)
    value = aten.add.Tensor(
        aten.sub.Tensor(aten.log.default(lifted), aten.mul.Tensor(inverse, 0.5)), series)
    # The recurrence: digamma(z) = digamma(z + n) - sum of 1 / (z + k), k < n.
    value = aten.where.self(
        small, aten.sub.Tensor(value, _sum(z, aten.reciprocal.default)), value)
    # Reflection: digamma(x) = digamma(1 - x) - pi / tan(pi x).
    angle = _pi_offset(x)
    cotangent = aten.div.Tensor(aten.cos.default(angle), aten.sin.default(angle))
    reflected = aten.sub.Tensor(value, aten.mul.Tensor(cotangent, math.pi))
    value = aten.where.self(negative, reflected, value)
    value = aten.where.self(aten.logical_and.default(negative, _integral(x)),
                            _constant(value, math.nan), value)
    # At 0 the sign of the zero picks the side (1 / x is its infinity): +0 -> -inf, -0 -> +inf.
    signed = aten.neg.default(aten.reciprocal.default(x))
    return back(aten.where.self(aten.eq.Scalar(x, 0), signed, value))


def polygamma(n: int, self: torch.Tensor) -> torch.Tensor:
    """`polygamma(1, x)`, the derivative of `digamma`; other orders stay the op (untranslated:
    the model runs in parts, named)."""
    if n != 1:
        return NotImplemented
    x, back = _wide(self)
    negative = aten.lt.Scalar(x, 0)
    z = aten.where.self(negative, aten.rsub.Scalar(x, 1), x)
    lifted, small = _lifted(z)
    inverse = aten.reciprocal.default(lifted)
    squared = aten.mul.Tensor(inverse, inverse)
    series = aten.mul.Tensor(
        _polynomial(squared, _TRIGAMMA_SERIES, step=1, first=0), aten.mul.Tensor(squared, inverse))
    value = aten.add.Tensor(aten.add.Tensor(inverse, aten.mul.Tensor(squared, 0.5)), series)
    # The recurrence: polygamma(1, z) = polygamma(1, z + n) + sum of 1 / (z + k)^2, k < n.
    value = aten.where.self(small, aten.add.Tensor(
        value, _sum(z, lambda term: aten.reciprocal.default(aten.mul.Tensor(term, term)))), value)
    # Reflection: polygamma(1, x) = pi^2 / sin^2(pi x) - polygamma(1, 1 - x).
    sine = _sin_pi(x)
    reflected = aten.sub.Tensor(
        aten.mul.Tensor(aten.reciprocal.default(aten.mul.Tensor(sine, sine)), math.pi**2), value)
    value = aten.where.self(negative, reflected, value)
    return back(aten.where.self(_pole(x), _constant(value, math.inf), value))


def _wide(self: torch.Tensor) -> tuple[torch.Tensor, object]:
    """`self` in float64 (an integer tensor becomes the float type torch's op returns), and
    the cast back to that type."""
    dtype = self.dtype if self.is_floating_point() else torch.get_default_dtype()
    wide = aten._to_copy.default(self, dtype=torch.float64) if self.dtype != torch.float64 \
        else self

    def back(value: torch.Tensor) -> torch.Tensor:
        return value if dtype == torch.float64 else aten._to_copy.default(value, dtype=dtype)

    return wide, back


def _lifted(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z + _LIFT where z is below it (those where `small`), else z."""
    small = aten.lt.Scalar(z, _LIFT)
    return aten.where.self(small, aten.add.Tensor(z, _LIFT), z), small


def _product(z: torch.Tensor) -> torch.Tensor:
    """z (z + 1) ... (z + _LIFT - 1): below 19!/9!, 3e11, where it is read (z < _LIFT)."""
    return _fold(z, lambda term: term, aten.mul.Tensor)


def _sum(z: torch.Tensor, term: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """term(z) + term(z + 1) + ... + term(z + _LIFT - 1)."""
    return _fold(z, term, aten.add.Tensor)


def _fold(z: torch.Tensor, term: Callable[[torch.Tensor], torch.Tensor],
          combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    total = term(z)
    for k in range(1, _LIFT):
        total = combine(total, term(aten.add.Tensor(z, k)))
    return total


def _polynomial(power: torch.Tensor, coefficients: tuple[float, ...], step: int,
                first: int) -> torch.Tensor:
    """sum of coefficients[i] * power^(first + step * i), by Horner's rule in power^step."""
    stride = power if step == 1 else aten.mul.Tensor(power, power)
    total = aten.full_like.default(power, coefficients[-1])
    for coefficient in reversed(coefficients[:-1]):
        total = aten.add.Tensor(aten.mul.Tensor(total, stride), coefficient)
    return total if first == 0 else aten.mul.Tensor(total, power)


def _pi_offset(x: torch.Tensor) -> torch.Tensor:
    """pi (x - n), n the integer nearest x: the sine of pi x up to its sign, and its
    tangent, from an angle of at most pi / 2. x - n is exact, so these keep their digits near
    the integers (pi x itself, or x's fraction 1 - 1e-8 for x = -1e-8, would not)."""
    return aten.mul.Tensor(aten.sub.Tensor(x, aten.round.default(x)), math.pi)


def _sin_pi(x: torch.Tensor) -> torch.Tensor:
    """|sin(pi x)|."""
    return aten.abs.default(aten.sin.default(_pi_offset(x)))


def _constant(like: torch.Tensor, value: float) -> torch.Tensor:
    return aten.scalar_tensor.default(value, dtype=like.dtype, device=like.device)


def _integral(x: torch.Tensor) -> torch.Tensor:
    return aten.eq.Tensor(x, aten.floor.default(x))


def _pole(x: torch.Tensor) -> torch.Tensor:
    """x is 0 or a negative integer (not -inf)."""
    return aten.logical_and.default(aten.logical_and.default(aten.le.Scalar(x, 0), _integral(x)),
                                    aten.isfinite.default(x))


TABLE = {
    aten.lgamma.default: lgamma,
    aten.digamma.default: digamma,
    aten.polygamma.default: polygamma,
}
