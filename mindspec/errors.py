"""User-facing errors: the CLI prints them on one line and exits 2 (the server maps them to 4xx)."""


class MindspecError(Exception):
    """Bad input a user can fix: a broken checkpoint, a mismatched draft, a prompt too long..."""
