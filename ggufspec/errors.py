"""The one exception type that ggufspec raises for problems a user can fix.

The CLI turns it into a single line on stderr and a non-zero exit; library users can catch it.
"""


class GGUFSpecError(Exception):
    """A problem with the user's input or environment, stated in one line."""


class ContextFullError(GGUFSpecError):
    """The context window filled up before generation finished."""

    def __init__(self, message: str, tokens: list[int] | None = None):
        super().__init__(message)
        self.tokens = tokens or []
