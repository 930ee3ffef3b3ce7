"""The project's error types: a user's mistake, and a failed data-quality gate.

A ``UserError`` names the field (or thing), the value that was wrong, and the fix. The
CLI prints it as one line and exits with status 2; no traceback. Internal invariants use
``assert`` instead and surface as ordinary tracebacks, because they are our bugs.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input: a recipe, URI, task file, credential or argument."""

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        shown = repr(value_text(self.value))
        return f"{self.field}={shown}: {self.problem}; fix: {self.fix}"


def value_text(value: object, limit: int = 200) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


EXIT_DATA_QUALITY = 3


class DataQualityError(Exception):
    """The data-quality gate failed: the trainer's input is malformed. Retrying cannot
    help (the data would be just as bad); the CLI exits with status 3."""

    exit_code = EXIT_DATA_QUALITY
