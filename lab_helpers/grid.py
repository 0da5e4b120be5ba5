"""python -m lab_helpers.grid: check a results grid and report its costs (the code is in lab_helpers/pricing/grid_commands.py)."""
import sys
from lab_helpers.pricing.grid_commands import main
if __name__ == "__main__":
    sys.exit(main())
