"""Text shown to the user (stand-in until the pricing move brings printable here)."""
from lab_helpers.calcul_forfaits import printable

__all__ = ["printable"]
