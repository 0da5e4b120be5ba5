"""real_model's results as text for people: one table per command."""
from lab_helpers.core.tables import format_bytes
from lab_helpers.real.card_fit import CARD_FIT_KIND, format_card_fit
from lab_helpers.real.spec import COUNTER_KEYS


def _right_aligned_table(rows: list, columns: list) -> str:
    text = [[str(r.get(c, "")) if r.get(c) is not None else "-" for c in columns] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in text)) if text else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(t, widths)) for t in text]
    return "\n".join(lines)


def model_prediction_table(result: dict) -> str:
    """predict_model's document: one row per phase (and rank), bytes at its end and at its peak."""
    head = (f"{result['model']['config_name']} ({result['model']['architecture']}, "
            f"{result['model']['parameter_count']} parameters), transformers {result['model']['transformers_version']}\n")
    if result.get("allocator_conf"):  # present under expandable segments only
        head += f"allocator: {result['allocator_conf']} (reserved grows in pages)\n"
    if "ranks" in result:
        head += f"tensor parallel {len(result['ranks'])}: every figure is one rank's (one GPU's)\n"
        rows = [{"rank": rank["rank"], **r, **r["bytes_at_end"]} for rank in result["ranks"] for r in rank["phases"]]
    else:
        rows = [{**r, **r["bytes_at_end"]} for r in result["phases"]]
    table = _right_aligned_table(rows, (["rank"] if "ranks" in result else []) + [
        "phase", "index", "end_allocated_bytes", "peak_allocated_bytes", "end_reserved_bytes", "peak_reserved_bytes",
        "weights_bytes", "kv_cache_bytes", "workspace_bytes", "other_bytes", "transient_peak_bytes"])
    return head + table + "\n" + budget_lines(result).rstrip("\n") + out_of_memory_lines(result.get("out_of_memory"))


def budget_lines(result: dict) -> str:
    """The budget a prediction ran under, and the allocator's releases of its cached segments."""
    budget = result.get("budget") or {}
    if budget.get("bytes") is None and budget.get("source") is None:
        return f"budget: none: {budget.get('note', 'reserved is predicted for an unbounded device')}\n"
    text = (f"budget: {format_bytes(budget['bytes'])} ({budget['source']})\n" if budget.get("bytes") is not None
            else f"budget: {budget['source']}\n")
    releases = [r for rank in result.get("ranks", [result]) for r in rank.get("cache_releases", ())]
    for r in releases:
        text += (f"release and retry in {r['phase']}{'' if r['index'] is None else ' ' + str(r['index'])}: "
                 f"{format_bytes(r['released_bytes'])} of free cached segments given back, "
                 f"reserved {format_bytes(r['reserved_bytes_after'])} after\n")
    return text


def out_of_memory_lines(oom) -> str:
    """A predicted out-of-memory error, for people."""
    if not oom:
        return ""
    where = oom["phase"] + ("" if oom.get("index") is None else f" {oom['index']}")
    rank = f"rank {oom['rank']}, " if "rank" in oom else ""
    if "message" in oom:  # the expandable-segments model says it in words
        return f"\nOUT OF MEMORY predicted in phase {rank}{where}: {oom['message']}"
    return (f"\nOUT OF MEMORY predicted in phase {rank}{where}: tried to allocate "
            f"{format_bytes(oom['segment_bytes'])} (request {oom['request_bytes']} bytes) with "
            f"{format_bytes(oom['reserved_bytes'])} reserved, {format_bytes(oom['allocated_bytes'])} allocated, "
            f"{format_bytes(oom['free_under_budget_bytes'])} free under the budget of "
            f"{format_bytes(oom['budget_bytes'])}, after releasing "
            f"{format_bytes(oom['released_before_failing_bytes'])} of free cached segments")


def model_comparison_table(result: dict) -> str:
    """compare_model's result: measured - predicted, one row per phase (and rank)."""
    cols = (["rank"] if "tensor_parallel" in result else []) + ["phase", "index"] + [
        f"difference_{k}" for k in COUNTER_KEYS]
    budget = result.get("budget") or {}
    tail = f"\nreplayed under {budget.get('replayed_under', 'an unbounded device')}: {budget.get('rule', '')}"
    allocator = "" if result.get("allocator_conf", "expandable_segments:False") == "expandable_segments:False" else (
        f"; replayed under {result['allocator_conf']}")
    return (f"{result['config_name']}: measured - predicted, bytes; allocated exact: {result['allocated_exact']}"
            f"{allocator}\n"
            + _right_aligned_table(result["rows"], cols) + tail
            + out_of_memory_lines(budget.get("predicted_out_of_memory")))


def model_fit_table(result: dict) -> str:
    """fit_model's answer in lines, or card_fit's table of forfaits."""
    if result.get("kind") == CARD_FIT_KIND:
        return format_card_fit(result)
    weights = f", {result['quantization']} weights" if "quantization" in result else ""
    lines = [f"{result['config_name']}, {result['dtype']}{weights}, {result['new_tokens']} new tokens",
             f"budget: {format_bytes(result['budget_bytes'])} ({result['budget_source']})"]
    if "tensor_parallel" in result:
        lines.append(f"tensor parallel {result['tensor_parallel']}: the budget and every figure are one rank's")
    if result.get("allocator_conf") == "expandable_segments:True":
        lines.append("allocator: expandable_segments:True (pages mapped as segments grow)")
    if "fits" in result:
        lines.append(f"batch {result['batch']} x context {result['context']}: "
                     f"{'fits' if result['fits'] else 'does NOT fit'}"
                     + (f", peak reserved {format_bytes(result['peak_reserved_bytes'])}, headroom "
                        f"{format_bytes(result['headroom_bytes'])}"
                        if result["fits"] else ""))
    if "largest_context_at_batch" in result:
        lines.append(f"largest context at batch {result.get('batch')}: {result['largest_context_at_batch']}")
    if "largest_batch_at_context" in result:
        lines.append(f"largest batch at context {result.get('context')}: {result['largest_batch_at_context']}")
    return "\n".join(lines)


MODEL_TABLES = {"predict": model_prediction_table, "compare": model_comparison_table, "fit": model_fit_table}


def format_table(command: str, result: dict) -> str:
    """The result of real_model's `command` (predict, compare or fit) as text for people."""
    return MODEL_TABLES[command](result)
