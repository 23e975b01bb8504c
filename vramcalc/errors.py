"""Error types shared by the library and the CLI, and the "did you mean" hint they carry."""

import difflib

SHOWN_CHARS = 300  # user text longer than this is cut in messages


class InputError(ValueError):
    """Bad user input: the CLI prints the message on one line and exits 2."""


def shown(text: object, limit: int = SHOWN_CHARS) -> str:
    """User text as it appears in a message: quoted and escaped like `repr` (a newline or a
    terminal escape cannot split or colour the line), cut to `limit` characters."""
    raw = str(text)
    if len(raw) > limit:
        return repr(raw[:limit]) + f"... ({len(raw):,} characters)"
    return repr(raw)


def shown_path(path: object, limit: int = SHOWN_CHARS) -> str:
    """A path as it appears in a message: as it is when printable and short, else `shown`."""
    raw = str(path)
    return raw if len(raw) <= limit and raw.isprintable() else shown(raw, limit)


def one_line(message: str, limit: int = 4 * SHOWN_CHARS) -> str:
    """A message made safe for one stderr line: control characters escaped, whitespace runs
    collapsed, cut to `limit` characters (the last defence; messages use `shown`)."""
    text = " ".join(str(message).split())
    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
    return text if len(text) <= limit else text[:limit] + "..."


def suggest(word: str, names: list[str] | tuple[str, ...], n: int = 3) -> str:
    """'; did you mean: a, b?' or '' when nothing is close."""
    close = difflib.get_close_matches(str(word).lower(), [x.lower() for x in names], n=n,
                                      cutoff=0.5)
    return f"; did you mean: {', '.join(close)}?" if close else ""
