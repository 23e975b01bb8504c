"""Error types shared by the library and the CLI."""


class InputError(ValueError):
    """Bad user input: the CLI prints the message on one line and exits 2."""
