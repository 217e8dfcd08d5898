"""The range a numeric option may take, and the one way every command says a value is outside it: the flag, the
interval in the user's unit, the value as given. NaN compares false with everything, so each bound is checked
as "inside" rather than "not outside"; infinity is never inside (a bound of inf means "any finite value")."""
from __future__ import annotations

import math
from dataclasses import dataclass

from powerinfer_tools.core.errors import UserError


@dataclass(frozen=True)
class Range:
    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    unit: str = ""   # " GiB", " MiB": the unit the flag is given in

    def __str__(self) -> str:
        def number(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"
        high, closed = ("inf", False) if math.isinf(self.high) else (number(self.high), not self.high_open)
        return f"{'(' if self.low_open else '['}{number(self.low)}, {high}{']' if closed else ')'}{self.unit}"

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return math.isfinite(value) and above and below

    def check(self, flag: str, value):
        """`value` when it is inside (None passes: the option was not given); UserError otherwise."""
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and not self.contains(float(v)):
                raise UserError(f"{flag} must be a number in {self}, not {float(v):g}")
        return value
