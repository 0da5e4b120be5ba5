"""python -m lab_helpers.timeline: the allocator's timeline and the OOM explainer (the code is in lab_helpers/views/timeline_commands.py)."""
import sys
from lab_helpers.views.timeline_commands import main
if __name__ == "__main__":
    sys.exit(main())
