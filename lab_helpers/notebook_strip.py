"""python -m lab_helpers.notebook_strip: git's clean filter for notebooks (the code is in lab_helpers/build/strip.py)."""
import sys
from lab_helpers.build.strip import main
if __name__ == "__main__":
    sys.exit(main())
