"""The recipe schema's field helpers: `doc` (a field with its help text and allowed values), `Range` (a
number's), with the ranges most keys share, and `Choices` (a name's, from a registry). schema.py builds the
recipe format from them, and each method's module (methods/) its own section."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take: from `low` to `high` (either may be open-ended), plus `also`
    (values with a special meaning outside the range, e.g. -1 for "no limit"). Floats must be finite."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # `low` itself is not allowed
    high_open: bool = False  # `high` itself is not allowed
    also: tuple[float, ...] = ()
    why: str = ""  # said after the bounds in an error

    def __str__(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'above' if self.low_open else 'at least'} {_number(self.low)}")
        if self.high is not None:
            parts.append(f"{'below' if self.high_open else 'at most'} {_number(self.high)}")
        text = " and ".join(parts) or "any number"
        return " or ".join([*(_number(v) for v in self.also), text])

    def problem(self, value: float) -> str | None:
        """Why `value` is out of range (None when it is fine)."""
        if value in self.also:
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number ({self}), got {value!r}"
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if not (too_low or too_high):
            return None
        why = f" ({self.why})" if self.why else ""
        return f"must be {self}{why}, got {value!r}"


@dataclass(frozen=True)
class Choices:
    """The names a key's text may take, asked of a registry when a recipe is checked (so a name registered
    after this module loaded is taken: benchmark_metrics.register_metric)."""

    names: Callable[[], Iterable[str]]

    def __str__(self) -> str:
        return "one of " + " | ".join(self.names())

    def problem(self, value: str) -> str | None:
        """Why `value` is none of the names, with the nearest one (None when it is one)."""
        names = list(self.names())
        if value in names:
            return None
        near = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
        return f"must be {self}, got {value!r}" + (f"; did you mean `{near[0]}`?" if near else "")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


AT_LEAST_1 = Range(1)
AT_LEAST_0 = Range(0)
ABOVE_0 = Range(0, low_open=True)
SEED = Range(0, 2**32 - 1, why="numpy seeds are 32-bit")


def doc(text: str, default=None, factory=None, range: Range | Choices | None = None):
    """A dataclass field carrying its help text and its allowed values, a number's range or a name's choices
    (both shown by `--schema`; the values are checked when a recipe is loaded)."""
    metadata = {"help": text, "range": range}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def longest_in_tokens(what: str, longer: str, otherwise: str):
    """A method's length limit, off (null) by default: what a row may hold at most, in tokens; a longer row
    is refused or skipped, never cut (cutting would drop image tokens or the answer)."""
    return doc(
        f"longest {what} in tokens, image tokens included; a longer {longer} is a data error, never cut; "
        f"null: {otherwise}",
        None,
        range=AT_LEAST_1,
    )
