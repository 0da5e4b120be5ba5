"""real_model's results as text for people: one table per command."""
from lab_helpers.core.tables import LINE_WIDTH, format_bytes, phase_label, rank_groups, ranks_label, text_table, wrapped
from lab_helpers.real.card_fit import CARD_FIT_KIND
from lab_helpers.real.card_tables import format_card_fit
from lab_helpers.real.spec import COUNTER_KEYS


PHASE_COUNTERS = ("end_allocated_bytes", "peak_allocated_bytes", "end_reserved_bytes", "peak_reserved_bytes")


def _phase_tables(phases: list) -> list:
    """Each phase's counters, then what its end allocated is made of (the kinds add up to it) and the
    largest transient above it, sizes in MiB or GiB with the bytes beside them."""
    kinds = list(phases[0]["end_allocated_bytes_by_kind"]) if phases else []
    counters = text_table(("phase", "end allocated", "peak allocated", "end reserved", "peak reserved"),
                          [(phase_label(p), *(format_bytes(p[k]) for k in PHASE_COUNTERS)) for p in phases],
                          width=LINE_WIDTH)
    made_of = text_table(("phase", *(k.replace("_", " ") for k in kinds), "transient peak"),
                         [(phase_label(p), *(format_bytes(p["end_allocated_bytes_by_kind"][k]) for k in kinds),
                           format_bytes(p["transient_peak_bytes"])) for p in phases], width=LINE_WIDTH)
    return [counters, "end allocated, by kind (they add up to it), and the largest transient above it:", made_of]


def model_prediction_table(result: dict) -> str:
    """predict_model's document for people: per phase (and rank), allocated and reserved at its end and
    peak, then what the end allocated is made of."""
    c, model = result["configuration"], result["model"]
    lines = [f"{model['config_name']} ({model['architecture']}, {model['parameter_count']} parameters), "
             f"transformers {model['transformers_version']}: {c['dtype']}, batch {c['batch']}, "
             f"context {c['context']}, {c['new_tokens']} new tokens"]
    if result.get("allocator_conf"):  # present under expandable segments only
        lines.append(f"allocator: {result['allocator_conf']} (reserved grows in pages)")
    if "ranks" in result:
        lines.append(f"tensor parallel {len(result['ranks'])}: every figure is one rank's (one GPU's)")
        for numbers, phases in rank_groups(result["ranks"]):
            lines += [f"{ranks_label(numbers)}:", *_phase_tables(phases)]
    else:
        lines += _phase_tables(result["phases"])
    return wrapped("\n".join(lines) + "\n" + budget_lines(result).rstrip("\n")
                   + out_of_memory_lines(result.get("out_of_memory")))


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


def _other_differences(row: dict) -> str:
    """The counters other than the peaks, 'exact' where measured equals predicted, else each difference."""
    off = [f"{key[:-len('_bytes')].replace('_', ' ')} {row[f'difference_{key}']:+d} B" for key in COUNTER_KEYS
           if key not in ("peak_allocated_bytes", "peak_reserved_bytes") and row[f"difference_{key}"]]
    return ", ".join(off) or "exact"


# where the comparison is too wide for one table: allocated, reserved, then the other counters
COMPARISON_BANDS = ((1, 2, 3), (4, 5, 6), (7,))


def model_comparison_table(result: dict) -> str:
    """compare_model's result for people: measured beside predicted peaks per phase (and rank), their
    differences (measured - predicted) in bytes, and every other counter's difference."""
    ranked = "tensor_parallel" in result
    header = ("phase", "measured peak allocated", "predicted", "difference B", "measured peak reserved", "predicted",
              "difference B", "baseline and end")
    rows = [((f"rank {r['rank']} " if ranked else "") + phase_label(r),
             format_bytes(r["measured_peak_allocated_bytes"]), format_bytes(r["predicted_peak_allocated_bytes"]),
             f"{r['difference_peak_allocated_bytes']:+d}",
             format_bytes(r["measured_peak_reserved_bytes"]), format_bytes(r["predicted_peak_reserved_bytes"]),
             f"{r['difference_peak_reserved_bytes']:+d}", _other_differences(r)) for r in result["rows"]]
    budget = result.get("budget") or {}
    allocator = "" if result.get("allocator_conf", "expandable_segments:False") == "expandable_segments:False" else (
        f"; replayed under {result['allocator_conf']}")
    return wrapped(f"{result['config_name']}: measured beside predicted; allocated exact: "
                   f"{'yes' if result['allocated_exact'] else 'no'}{allocator}\n"
                   + text_table(header, rows, width=LINE_WIDTH, bands=COMPARISON_BANDS)
                   + f"\nreplayed under {budget.get('replayed_under', 'an unbounded device')}: {budget.get('rule', '')}"
                   + out_of_memory_lines(budget.get("predicted_out_of_memory")))


# fit's largest-size answers, by what set them (lab_helpers.real.fit.ANSWER_BOUNDS)
BOUND_WORDS = {
    "memory": "memory: one more does not fit the budget",
    "positions": "positions: the model's positions less the new tokens, not memory",
    "weights": "the weights alone exceed the budget",
    "search bound": "the search's number of predictions: a lower bound, not memory's",
    "size limit": "the lab's size limit (batch x (context + new tokens), batch and context bounds), not memory",
}


def bound_words(bound: str) -> str:
    """A fit answer's bound ('memory', 'positions', ...) said for people."""
    return f"bound: {bound}" if bound not in BOUND_WORDS else f"bound: {BOUND_WORDS[bound]}"


def weights_lines(result: dict) -> list:
    """Why no size fits when the weights alone exceed the budget, and which weights stay unquantized."""
    if result.get("weights_fit", True) or "weights_bytes" not in result:
        return []
    lines = [f"the weights alone, {format_bytes(result['weights_bytes'])}, exceed the budget"]
    kept = result.get("unquantized_parameters")
    if kept and kept["kept"]:
        groups = ", ".join(f"{g['module_class']} ({g['tensor_dims']}-D, {format_bytes(g['bytes'])})"
                           for g in kept["kept"][:3])
        lines[0] += (f"; bitsandbytes quantizes only torch.nn.Linear layers (not the output head): "
                     f"{format_bytes(kept['kept_bytes'])} of parameters stay in {result['dtype']}, "
                     f"the largest {groups}")
    return lines


def model_fit_table(result: dict) -> str:
    """fit_model's answer in lines, or card_fit's table of forfaits: the answer, what set each largest
    size, sizes in GiB with the bytes beside them, within LINE_WIDTH."""
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
    lines += weights_lines(result)
    if "weights_fit" in result:
        lines.append(f"weights fit: {'yes' if result['weights_fit'] else 'no'}")
    if "largest_context_at_batch" in result:
        lines.append(f"largest context at batch {result.get('batch')}: {result['largest_context_at_batch']} "
                     + (f"(bound: positions: {result['context_bound']} = the model's positions less "
                        f"{result['new_tokens']} new tokens, not memory)"
                        if result.get("largest_context_bound") == "positions" else
                        f"({bound_words(result.get('largest_context_bound', ''))})"))
    if "largest_batch_at_context" in result:
        lines.append(f"largest batch at context {result.get('context')}: {result['largest_batch_at_context']} "
                     f"({bound_words(result.get('largest_batch_bound', ''))})")
    return wrapped("\n".join(lines))


MODEL_TABLES = {"predict": model_prediction_table, "compare": model_comparison_table, "fit": model_fit_table}


def format_table(command: str, result: dict) -> str:
    """The result of real_model's `command` (predict, compare or fit) as text for people."""
    return MODEL_TABLES[command](result)
