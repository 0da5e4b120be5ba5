"""The tables for people of predict and compare."""

from lab_helpers.core.tables import format_bytes, phase_label, rank_groups, ranks_label, text_table


def _sizes_line(configuration) -> str:
    c = configuration
    return (f"batch {c['batch']}, context {c['context']}, width {c['width']}, hidden {c['hidden']}, "
            f"{c['dtype']}, warmup {c['warmup']}, repeats {c['repeats']}")


def predict_table(result: dict) -> str:
    """Predicted end and peak of allocated and reserved per phase (per rank at tensor parallel N),
    for people."""
    counters = ("end_allocated_bytes", "peak_allocated_bytes", "end_reserved_bytes", "peak_reserved_bytes")
    header = ("phase", "end allocated", "peak allocated", "end reserved", "peak reserved")
    workspace = " + ".join(str(b) for b in result["workspace"]["bytes"]) or "0"
    lines = [f"prediction: {_sizes_line(result['configuration'])}"]
    if "ranks" in result:
        for numbers, phases in rank_groups(result["ranks"]):
            lines.append(f"{ranks_label(numbers)}:")
            lines.append(text_table(header, [(phase_label(p), *(format_bytes(p[k]) for k in counters)) for p in phases]))
    else:
        lines.append(text_table(header, [(phase_label(p), *(format_bytes(p[k]) for k in counters))
                                         for p in result["phases"]]))
    lines.append(synthetic_budget_line(result.get("budget") or {}))
    for r in result.get("cache_releases", ()) if "ranks" not in result else ():
        lines.append(f"release and retry in {phase_label(r)}: {format_bytes(r['released_bytes'])} of free cached "
                     f"segments given back, reserved {format_bytes(r['reserved_bytes_after'])} after")
    if result.get("out_of_memory"):
        lines.append(synthetic_out_of_memory_line(result["out_of_memory"]))
    lines += ["each phase starts from the previous one's end",
              f"workspace: {workspace} bytes ({result['workspace']['source']})",
              f"reserved assumes: {result['reserved_assumptions']}"]
    if "outside_allocator" in result:
        lines.append(f"NCCL outside the allocator: {result['outside_allocator']}")
    return "\n".join(lines)


def synthetic_budget_line(budget: dict) -> str:
    if budget.get("bytes") is None:
        return f"budget: none: {budget.get('note', 'reserved is predicted for an unbounded device')}"
    return f"budget: {format_bytes(budget['bytes'])} ({budget['source']})"


def synthetic_out_of_memory_line(oom: dict) -> str:
    rank = f"rank {oom['rank']}, " if "rank" in oom else ""
    if "message" in oom:  # the expandable-segments model says it in words
        return f"OUT OF MEMORY predicted in phase {rank}{phase_label(oom)}: {oom['message']}"
    return (f"OUT OF MEMORY predicted in phase {rank}{phase_label(oom)}: tried to allocate "
            f"{format_bytes(oom['segment_bytes'])} (request {oom['request_bytes']} bytes) with "
            f"{format_bytes(oom['reserved_bytes'])} reserved, {format_bytes(oom['allocated_bytes'])} allocated, "
            f"budget {format_bytes(oom['budget_bytes'])}, after releasing "
            f"{format_bytes(oom['released_before_failing_bytes'])} of free cached segments")


def compare_table(result: dict) -> str:
    """Measured beside predicted peaks per phase, differences in bytes, for people; one table per
    rank at tensor parallel N, with what NCCL holds outside the allocator on that rank."""
    if "ranks" not in result:
        return _compare_rows_table(result)
    parts = [f"tensor parallel {result['tensor_parallel']}: allocated exact on every rank: "
             f"{'yes' if result['allocated_exact'] else 'no'}"]
    for rank in result["ranks"]:
        outside = rank.get("outside_allocator") or {}
        nccl = outside.get("nccl_outside_allocator_bytes")
        parts.append(f"rank {rank['rank']} ({rank.get('device')}): NCCL outside the allocator "
                     f"{'not measured' if nccl is None else format_bytes(nccl) if nccl >= 0 else f'{nccl} B'}")
        parts.append(_compare_rows_table({**rank, "workspace": result["workspace"]}))
    return "\n".join(parts)


def _compare_rows_table(result: dict) -> str:
    header = ("phase", "measured peak allocated", "predicted", "difference B",
              "measured peak reserved", "predicted", "difference B")
    rows = []
    for r in result["rows"]:
        rows.append((phase_label(r),
                     format_bytes(r["measured_peak_allocated_bytes"]), format_bytes(r["predicted_peak_allocated_bytes"]),
                     f"{r['difference_peak_allocated_bytes']:+d}",
                     format_bytes(r["measured_peak_reserved_bytes"]), format_bytes(r["predicted_peak_reserved_bytes"]),
                     f"{r['difference_peak_reserved_bytes']:+d}"))
    workspace = " + ".join(str(b) for b in result["workspace"]["bytes"]) or "0"
    budget = result.get("budget") or {}
    oom = budget.get("predicted_out_of_memory")
    return "\n".join([
        text_table(header, rows),
        f"replayed under {budget.get('replayed_under', 'an unbounded device')}: {budget.get('rule', '')}",
        *([synthetic_out_of_memory_line(oom) + " (the measured run completed)"] if oom else []),
        f"allocated exact (baseline, end and peak of every phase): {'yes' if result['allocated_exact'] else 'no'}",
        f"workspace predicted: {workspace} bytes ({result['workspace']['source']}); "
        f"detected from the cold forward: {result['workspace_detected_bytes']} bytes",
    ])
