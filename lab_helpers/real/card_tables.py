"""The cheapest-forfait answers of real_model fit --card as text and rows for people: the table of
lab_helpers.real.card_fit and lab_helpers.real.train_card's answers."""
from lab_helpers.core.tables import LINE_WIDTH, format_bytes, text_table, wrapped
from lab_helpers.pricing.forfait import format_money
from lab_helpers.real.budget import DERIVED, MEASURED


def table_rows(result: dict) -> list:
    """One dict per GPU model with the columns people read (for pandas or format_card_fit)."""
    currency = result["currency"]
    out = []
    for rank, row in enumerate(result["rows"], start=1):
        fits = row["fits"]
        out.append({
            "rank": rank if fits else None, "gpu": row["gpu"],
            "tensor_parallel": row.get("tensor_parallel"), "lots": row.get("lots"), "gpus": row.get("gpus"),
            "total_price": format_money(row["total_price_cents"], currency) if fits else "does not fit",
            "unit_cost": (format_money(row["unit_cost_cents"], currency)
                          if fits and row["unit_cost_cents"] is not None else None),
            "budget_bytes": row["budget_bytes"], "memory": row["memory_source"],
            "peak_reserved_bytes": row.get("peak_reserved_bytes"),
        })
    return out


def people_rows(result: dict) -> list:
    """table_rows for people (the text table, the notebooks' tables): the budget and the peak reserved
    per GPU in GiB with the bytes beside them (format_bytes), "-" for any value not known."""
    out = []
    for row in table_rows(result):
        budget, peak = row.pop("budget_bytes"), row.pop("peak_reserved_bytes")
        memory = row.pop("memory")  # re-added after the budget: the columns' order
        row = {**row, "budget": format_bytes(budget), "memory": memory,
               "peak_reserved": None if peak is None else format_bytes(peak)}
        out.append({key: "-" if value is None else value for key, value in row.items()})
    return out


def format_card_fit(result: dict) -> str:
    """The result as aligned lines for people."""
    c = result["configuration"]
    return card_fit_table(
        result, f"{c['config_name']} {c['dtype']}, batch {c['batch']}, context {c['context']}, "
                f"{c['new_tokens']} new tokens",
        [f"Degrees: {result['degree_rule']}; allowed for this model: "
         f"{', '.join(map(str, result['allowed_degrees'])) or 'none'}.",
         # a degree the plan cannot split the model by is a fact of the model, not an error
         *(f"  not possible: {why}" for why in result["refused_degrees"].values())],
        [f"NCCL: {result['nccl_rule']}; peak_reserved is the worst rank's."])


def card_fit_table(result: dict, run: str, before: list, after: list) -> str:
    """An answer's rows as aligned lines under a title naming the `run`, then the lines `before`, the
    order and memory rule, the lines `after`, the unit cost's rounding if asked and the notice: within
    LINE_WIDTH, the columns split into a table of prices and one of memory (each led by rank and gpu)
    where one table would be wider, the text wrapped."""
    columns = ["rank", "gpu", "tensor_parallel", "lots", "gpus", "total_price", "budget", "memory", "peak_reserved"]
    if result["accepted_results"] is not None:
        columns.insert(6, "unit_cost")
    rows = people_rows(result)
    memory = columns.index("budget")
    bands = (list(range(2, memory)), list(range(memory, len(columns))))  # the prices, then the memory
    lines = [f"{run}: {result['days']}-day forfaits of {result['rate_card']} (snapshot {result['snapshot_date']})",
             text_table(columns, [[r[k] for k in columns] for r in rows], width=LINE_WIDTH, keep=2, left=True,
                        bands=bands)]
    # each GPU model that does not fit says what bound it: the rows' "reason", as the JSON has it
    why = [f"Not fitting, {row['gpu']}: {row['reason']}." for row in result["rows"]
           if not row["fits"] and row.get("reason")]
    lines += ["", *why, *([""] if why else []), *before, f"Order: {result['order']}.",
              f"Memory per GPU (budget): {MEASURED} = {result['memory_rule'][MEASURED]}; "
              f"{DERIVED} = {result['memory_rule'][DERIVED]}.", *after]
    if result["accepted_results"] is not None:
        lines.append(f"Per accepted result ({result['accepted_results']:,}): {result['unit_cost_rounding']}.")
    lines.append(f"Notice: {result['notice']}")
    return wrapped("\n".join(lines))
