"""Where the checkout's files are: data/ and the generated standalone files lie below REPOSITORY."""
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
