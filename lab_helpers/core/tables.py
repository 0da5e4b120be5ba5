"""Plain-text tables for people: sizes in MiB with the bytes beside them."""
from lab_helpers.core.numbers import GIB, MIB


def format_bytes(count: int) -> str:
    """'33.16 MiB (34772480 B)': MiB under 1 GiB, GiB from there, with the exact bytes."""
    if count >= GIB:
        return f"{count / GIB:.2f} GiB ({count} B)"
    return f"{count / MIB:.2f} MiB ({count} B)"


def text_table(header, rows) -> str:
    """Columns aligned with two spaces: the first to the left, the others to the right."""
    cells = [list(map(str, header))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
