"""The cost model's file errors, apart from the modules that read the files, so that a command
can name them (to report them in one line) without importing the readers; and a validation
error's one line."""


class ProfileError(ValueError):
    """A profile that is missing, corrupt, or of another schema version."""


class TraceError(ValueError):
    """A trace file that is missing, corrupt, or of another schema version."""


def validation_message(exc) -> str:
    """A pydantic ValidationError's first error in one line: where, and what (a validator's own
    ValueError as its message, without pydantic's "Value error, " before it)."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    if err["type"] == "value_error":
        message = str(err["ctx"]["error"])
    else:  # pydantic's own words, with the value it refused where that is a plain one
        value = err.get("input")
        scalar = isinstance(value, int | float | str) and not isinstance(value, bool)
        message = err["msg"] + (f", got {value!r}" if scalar else "")
    return f"{where}: {message}" if where else message
