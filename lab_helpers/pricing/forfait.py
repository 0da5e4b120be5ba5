"""Stand-in until the pricing package lands: the forfait's names, re-exported."""
from lab_helpers.calcul_forfaits import UNIT_COST_ROUNDING, compute_forfait, format_money
