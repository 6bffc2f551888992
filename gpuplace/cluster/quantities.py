"""Kubernetes resource quantities ("20Gi", "500m", "10G") in gpuplace's units.

Parsing is the official client's (`kubernetes.utils.quantity.parse_quantity`);
this module only converts and rounds, always up, so a request is never shrunk.
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation

from kubernetes.utils.quantity import parse_quantity

MIB = 1024 * 1024
MAX_QUANTITY_CHARS = 64
"""Longer strings are refused before parsing (a 2,000-character value is no quantity)."""


class QuantityError(ValueError):
    """A string that is not a Kubernetes quantity; the message quotes it (truncated)."""


def parse(value: str | int | float) -> Decimal:
    if isinstance(value, str) and len(value) > MAX_QUANTITY_CHARS:
        raise QuantityError(f"{value[:20]}… is not a quantity (longer than {MAX_QUANTITY_CHARS})")
    try:
        parsed = parse_quantity(value)  # type: ignore[no-untyped-call]
    except (ValueError, InvalidOperation, TypeError) as error:
        shown = str(value)[:MAX_QUANTITY_CHARS]
        raise QuantityError(f"{shown!r} is not a Kubernetes quantity") from error
    if not isinstance(parsed, Decimal) or not parsed.is_finite():
        raise QuantityError(f"{str(value)[:MAX_QUANTITY_CHARS]!r} is not a finite quantity")
    return parsed


def to_mib(value: str | int | float) -> tuple[int, bool]:
    """Bytes quantity → whole MiB rounded up, and whether it was rounded."""
    parsed = parse(value)
    mib = parsed / MIB
    whole = math.ceil(mib)
    return whole, Decimal(whole) != mib


def to_milli(value: str | int | float) -> int:
    """CPU quantity → millicores, rounded up."""
    return math.ceil(parse(value) * 1000)
