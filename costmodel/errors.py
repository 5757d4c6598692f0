"""The cost model's file errors, apart from the modules that read the files, so that a command
can name them (to report them in one line) without importing the readers."""


class ProfileError(ValueError):
    """A profile that is missing, corrupt, or of another schema version."""


class TraceError(ValueError):
    """A trace file that is missing, corrupt, or of another schema version."""
