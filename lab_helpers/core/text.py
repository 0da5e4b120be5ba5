"""Text for people: a user's text made safe to print (control and unprintable characters escaped)."""


def printable(text: str) -> str:
    """Return `text` with control, non-printable and unpaired surrogate characters escaped."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)
