"""python -m lab_helpers.notebook_sync: rebuild or check the generated files (the code is in lab_helpers/build/sync.py)."""
import sys
from lab_helpers.build.sync import main
if __name__ == "__main__":
    sys.exit(main())
