"""The one exception a user sees: what is wrong and what to do, in one line."""


class TdiffError(Exception):
    """A user's mistake or bad input. The CLI prints it in one line and exits 2."""


class DumpError(TdiffError):
    """A dump that cannot be read: missing, corrupt, incomplete or of an unknown format."""
