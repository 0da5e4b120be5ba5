"""real_model's --task train results as text for people: the tables of predict, compare and fit, and
fit --card --task train's table of forfaits (lab_helpers.real.card_tables')."""
from lab_helpers.core.tables import LINE_WIDTH, format_bytes, phase_label, text_table, wrapped
from lab_helpers.pricing.forfait import format_money
from lab_helpers.real.card_tables import card_fit_table


def format_train_card(result: dict) -> str:
    """The result as aligned lines for people (card_fit's table)."""
    c = result["configuration"]
    what = f"{c['train']} fine-tuning" + (f" on the {c['quantize']} base" if "quantize" in c else "")
    run = (f"{c['config_name']} {c['dtype']}, batch {c['batch']}, context {c['context']}, {what}, "
           f"{c['optimizer']}" + (" fused" if c["fused"] else "")
           + (", gradient checkpointing" if c["gradient_checkpointing"] else "")
           + (f", {c['autocast']} autocast" if "autocast" in c else ""))
    cheaper = result.get("with_gradient_checkpointing")
    before = ([] if cheaper is None else
              [f"With --gradient-checkpointing: {cheaper['gpu']} at "
               f"{format_money(cheaper['total_price_cents'], result['currency'])}"
               + (f", {format_money(cheaper['saves_cents'], result['currency'])} less than the cheapest fit above"
                  if "saves_cents" in cheaper else ", where no GPU model fits without it")
               + f" (peak reserved {format_bytes(cheaper['peak_reserved_bytes'])}).", ""])
    return card_fit_table(result, run, [*before, f"Degrees: {result['degree_rule']}."],
                          [f"Fits: {result['criterion']}."])


def train_fit_table(result: dict) -> str:
    lines = [f"budget: {format_bytes(result['budget_bytes'])} ({result['budget_source']})",
             f"training: {result['train']} fine-tuning"
             + (f" on the {result['quantize']} base" if "quantize" in result else "") + f", {result['optimizer']}"
             + (", gradient checkpointing" if result["gradient_checkpointing"] else "")
             + (f", {result['autocast']} autocast" if "autocast" in result else "")]
    if "fits" in result:
        lines.append(f"batch {result['batch']} x context {result['context']}: "
                     + (f"fits, peak reserved {format_bytes(result['peak_reserved_bytes'])}, headroom "
                        f"{format_bytes(result['headroom_bytes'])}"
                        if result["fits"] else "does NOT fit"))
    if "largest_context_at_batch" in result:
        lines.append(f"largest context at batch {result['batch']}: {result['largest_context_at_batch']} "
                     f"(bound: {result['largest_context_bound']})")
    if "largest_batch_at_context" in result:
        lines.append(f"largest batch at context {result['context']}: {result['largest_batch_at_context']} "
                     f"(bound: {result['largest_batch_bound']})")
    if "bounded" in result:
        lines.append(f"note: {result['bounded']}")
    lines.append(f"criterion: {result['criterion']}")
    return wrapped("\n".join(lines))


def train_prediction_table(result: dict) -> str:
    c = result["configuration"]
    header = ("phase", "end allocated", "peak allocated", "peak reserved", "gradients", "optimizer states",
              "activations")
    rows = [(phase_label(p), format_bytes(p["end_allocated_bytes"]), format_bytes(p["peak_allocated_bytes"]),
             format_bytes(p["peak_reserved_bytes"]), format_bytes(p["end_allocated_bytes_by_kind"]["gradients"]),
             format_bytes(p["end_allocated_bytes_by_kind"]["optimizer_states"]),
             format_bytes(p["end_allocated_bytes_by_kind"]["activations"])) for p in result["phases"]]
    return wrapped("\n".join([
        f"training prediction: {c['config_name']}, {c['dtype']}, batch {c['batch']}, context {c['context']}, "
        f"{c['steps']} steps, {c['train']} fine-tuning, {c['optimizer']} ({result['optimizer']['implementation']})"
        + (", gradient checkpointing" if c["gradient_checkpointing"] else "")
        + (f", {c['autocast']} autocast" if "autocast" in c else ""),
        text_table(header, rows, width=LINE_WIDTH),
        f"overall peak: {format_bytes(result['overall']['peak_allocated_bytes'])} allocated, "
        f"{format_bytes(result['overall']['peak_reserved_bytes'])} reserved",
        f"optimizer: {result['optimizer']['note']}",
        result["attention"],
        *(f"note: {n}" for n in result["notes"]),
        f"assumes: {result['assumptions']}",
    ]))


def train_comparison_table(result: dict) -> str:
    header = ("phase", "measured peak allocated", "predicted", "difference B", "measured peak reserved",
              "predicted", "difference B")
    rows = [(phase_label(r), format_bytes(r["measured_peak_allocated_bytes"]),
             format_bytes(r["predicted_peak_allocated_bytes"]), f"{r['difference_peak_allocated_bytes']:+d}",
             format_bytes(r["measured_peak_reserved_bytes"]), format_bytes(r["predicted_peak_reserved_bytes"]),
             f"{r['difference_peak_reserved_bytes']:+d}") for r in result["rows"]]
    # where too wide for one table: allocated (measured, predicted, difference), then reserved
    return "\n".join([text_table(header, rows, width=LINE_WIDTH, bands=((1, 2, 3), (4, 5, 6))),
                      f"allocated exact (baseline, end and peak): {'yes' if result['allocated_exact'] else 'no'}",
                      f"worst peak difference: allocated {result['peak_allocated_worst_relative']:.4%}, reserved "
                      f"{result['peak_reserved_worst_relative']:.4%}"])
