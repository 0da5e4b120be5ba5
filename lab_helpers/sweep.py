"""python -m lab_helpers.sweep: sweep one size of the synthetic network (the code is in lab_helpers/views/sweep_commands.py)."""
import sys
from lab_helpers.views.sweep_commands import main
if __name__ == "__main__":
    sys.exit(main())
