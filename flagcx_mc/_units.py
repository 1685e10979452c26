"""Byte sizes as people write them: ``4k``, ``64MiB``, ``1g`` in, ``4 KiB`` out (binary units)."""

from __future__ import annotations

__all__ = ["fmt_size", "parse_size"]

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """'4k' -> 4096, '64MiB' -> 64 MiB, '1g' -> 1 GiB, '512' or '512b' -> 512.

    Raises:
        ValueError: not a whole number with an optional k, m or g (KiB, MiB, GiB) unit.
    """
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _UNITS.get(value[-1:], 1)
    digits = value[:-1] if value[-1:] in _UNITS else value
    if not digits.strip().isdigit():
        raise ValueError(f"not a size: {text!r} (e.g. 4k, 64m, 1g)")
    return int(digits) * scale


def fmt_size(n: int) -> str:
    """4096 -> '4 KiB': the largest binary unit that divides ``n``, else bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"
