"""Where the checkout's files are: data/ and the generated standalone files lie below REPOSITORY."""
from pathlib import Path

# .parent, not .parents[2]: a standalone file that bundles this module may lie one folder below the
# root (/workspace/calcul_forfaits.py), where parents[2] raises IndexError at import
REPOSITORY = Path(__file__).resolve().parent.parent.parent
