"""Byte counts as a person reads them in a message."""

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def readable_bytes(count: float) -> str:
    """In the largest binary unit that leaves at least 1 of it: "512 B", "64.0 KiB", "1.8 MiB", "5.9 GiB"."""
    for unit in UNITS[:-1]:
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} {UNITS[-1]}"
