"""python -m lab_helpers.forfait_fit: the old name of `real_model fit --card` (lab_helpers/real/card_commands.py)."""
import sys
from lab_helpers.real.card_commands import main
if __name__ == "__main__":
    sys.exit(main())
