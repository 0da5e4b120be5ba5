"""python -m lab_helpers.real_model: real transformers models' memory (the code is in lab_helpers/real/commands.py)."""
import sys
from lab_helpers.real.commands import main
if __name__ == "__main__":
    sys.exit(main())
