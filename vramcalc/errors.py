"""Error types shared by the library and the CLI, and the "did you mean" hint they carry."""

import difflib


class InputError(ValueError):
    """Bad user input: the CLI prints the message on one line and exits 2."""


def suggest(word: str, names: list[str] | tuple[str, ...], n: int = 3) -> str:
    """'; did you mean: a, b?' or '' when nothing is close."""
    close = difflib.get_close_matches(str(word).lower(), [x.lower() for x in names], n=n,
                                      cutoff=0.5)
    return f"; did you mean: {', '.join(close)}?" if close else ""
