"""Plain-text tables for people: sizes in MiB with the bytes beside them."""
from lab_helpers.core.numbers import GIB, MIB


def format_bytes(count: int) -> str:
    """'33.16 MiB (34772480 B)': MiB under 1 GiB, GiB from there, with the exact bytes."""
    if count >= GIB:
        return f"{count / GIB:.2f} GiB ({count} B)"
    return f"{count / MIB:.2f} MiB ({count} B)"


def phase_label(record) -> str:
    """'decode #255': a phase record's name, with its index where it has one."""
    return record["phase"] if record.get("index") is None else f"{record['phase']} #{record['index']}"


def rank_groups(ranks: list) -> list:
    """[(rank numbers, phases)]: consecutive ranks with identical phases shown once."""
    groups = []
    for rank in ranks:
        if groups and groups[-1][1] == rank["phases"]:
            groups[-1][0].append(rank["rank"])
        else:
            groups.append(([rank["rank"]], rank["phases"]))
    return groups


def ranks_label(numbers: list) -> str:
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {numbers[0]} to {numbers[-1]} (each)"


def text_table(header, rows) -> str:
    """Columns aligned with two spaces: the first to the left, the others to the right."""
    cells = [list(map(str, header))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)
