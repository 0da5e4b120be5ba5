"""Stand-in until the pricing package lands: printable, re-exported."""
from lab_helpers.calcul_forfaits import printable
