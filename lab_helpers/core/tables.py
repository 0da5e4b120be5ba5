"""Plain-text tables for people: sizes in MiB with the bytes beside them."""
import textwrap

from lab_helpers.core.numbers import GIB, MIB

# One screen's width: a table wider than this is split into tables of fewer columns, a longer line of
# text is wrapped (a terminal would otherwise fold them where the words do not break)
LINE_WIDTH = 120


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


def text_table(header, rows, width=None, keep: int = 1, left: bool = False, bands=None) -> str:
    """Columns aligned with two spaces: the first to the left, the others to the right (all to the left
    with `left`). With `width`, a table wider than it is split into tables of fewer columns, one under the
    other after an empty line, each starting with the first `keep` columns (what names a row); `bands`,
    lists of the other columns' indices, keeps columns read together (a figure and its difference) in
    one table where the whole is too wide."""
    cells = [list(map(str, header))] + [list(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    whole = sum(widths) + 2 * (len(widths) - 1)
    if width is None or whole <= width:
        groups = [list(range(len(header)))]
    elif bands:
        groups = [group for band in bands for group in _column_groups(widths, width, keep, band)]
    else:
        groups = _column_groups(widths, width, keep)
    tables = []
    for columns in groups:
        lines = []
        for row in cells:
            parts = [row[i].ljust(widths[i]) if left or i == 0 else row[i].rjust(widths[i]) for i in columns]
            lines.append("  ".join(parts).rstrip())
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def _column_groups(widths: list, width: int, keep: int, columns=None) -> list:
    """The columns of each table text_table splits into: the first `keep`, then as many more of `columns`
    (default: all the others) in their order as stay within `width` (at least one more per table)."""
    keep = min(keep, len(widths))
    start = sum(widths[:keep]) + 2 * (keep - 1)
    groups, current, used = [], list(range(keep)), start
    for i in (range(keep, len(widths)) if columns is None else columns):
        if len(current) > keep and used + 2 + widths[i] > width:
            groups.append(current)
            current, used = list(range(keep)), start
        current.append(i)
        used += 2 + widths[i]
    groups.append(current)
    return groups


def wrapped(text: str, width: int = LINE_WIDTH, indent: str = "  ") -> str:
    """`text`'s lines folded at `width` where their words break (a word longer than a line is cut), each
    line after the first of a fold indented by `indent`: prose under a table, on one screen."""
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[:len(line) - len(line.lstrip(" "))]  # a line's own indent is kept, the fold's added
        out.append(textwrap.fill(line, width, initial_indent="", subsequent_indent=lead + indent,
                                 break_on_hyphens=False, drop_whitespace=True))
    return "\n".join(out)
