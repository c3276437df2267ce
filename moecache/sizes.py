"""Sizes as the flags write them (``--vram-budget 8GiB``, ``--moe-cache 12GB``): text -> bytes or MiB;
and bytes as a reader reads them (:func:`format_size`).

Pure functions; every bad value is a ValueError naming the flag and the accepted forms.
"""

from __future__ import annotations

import math

_UNITS = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
SIZE_HELP = "a size: 8GiB, 12GB, 12000MiB, 512M (MiB when no unit is given)"
UNITLESS_MIB_MAX = 1 << 20  # MiB: a plain number at least this large (1 TiB) is taken for a byte count and refused


def parse_size(text: str | None, flag: str) -> int:
    """``8GiB``, ``8G``, ``12GB``, ``12000MiB``, ``512M``, ``12000`` (MiB) -> bytes; None/empty -> 0.

    Raises:
        ValueError: naming the flag and the accepted forms (negative, non-finite or unknown units).
    """
    if text is None or not str(text).strip():
        return 0
    t = str(text).strip().lower().replace(" ", "")
    num = t.rstrip("kmgtib")
    unit = t[len(num):]
    scale = _UNITS.get(unit) if unit else 1 << 20
    try:
        value = float(num)
    except ValueError:
        value = float("nan")
    if scale is None or not math.isfinite(value) or value < 0 or value * scale >= 2**63:
        raise ValueError(f"{flag} {text!r}: expected {SIZE_HELP}")
    if not unit and value >= UNITLESS_MIB_MAX:  # a byte count written as before 0.1 (8589934592 = 8 PiB now)
        raise ValueError(f"{flag} {text!r}: a number without a unit is MiB, and {value:g} MiB is over "
                         f"{UNITLESS_MIB_MAX >> 10} GiB: give a unit ({SIZE_HELP}; plain numbers meant bytes before)")
    return int(value * scale)


def parse_moe_cache(text: str | int | None, flag: str = "--moe-cache") -> int | None:
    """``--moe-cache``: None (not given), -1 (fill free VRAM), 0 (off), or a size -> MiB per GPU."""
    if text is None:
        return None
    t = str(text).strip()
    if t in ("-1", "0"):
        return int(t)
    try:
        b = parse_size(t, flag)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected -1 (fill free VRAM), 0 (off) or {SIZE_HELP}") from None
    mib = b >> 20
    if mib < 1:
        raise ValueError(f"{flag} {text!r}: less than 1 MiB; give -1 (fill free VRAM), 0 (off) or {SIZE_HELP}")
    return mib


def format_size(n_bytes: int | float) -> str:
    """Bytes for a reader: two decimals in the largest binary unit (GiB, MiB, KiB) the value reaches,
    else bytes (a tiny model's tensors read "0.41 MiB", not "0.00 GiB")."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n_bytes >= 1 << shift:
            return f"{n_bytes / (1 << shift):.2f} {unit}"
    return f"{int(n_bytes)} B"
