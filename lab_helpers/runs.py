"""python -m lab_helpers.runs: measurement files side by side (the code is in lab_helpers/views/runs_commands.py)."""
import sys
from lab_helpers.views.runs_commands import main
if __name__ == "__main__":
    sys.exit(main())
