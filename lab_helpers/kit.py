"""python -m lab_helpers.kit: build and verify the distribution kit (the code is in lab_helpers/build/kit.py)."""
import sys
from lab_helpers.build.kit import main
if __name__ == "__main__":
    sys.exit(main())
