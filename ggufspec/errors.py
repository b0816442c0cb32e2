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


def exactly_one(given: dict) -> str:
    """The one check that a caller gave exactly one of several alternatives (a prompt, chat messages or
    prompt tokens; -p, -f or --chat): `given` maps each alternative's name, as the caller knows it, to its
    value; returns the name of the one given, else GGUFSpecError naming them all."""
    named = [name for name, value in given.items() if value is not None]
    if len(named) != 1:
        names = list(given)
        raise GGUFSpecError(f"give exactly one of {', '.join(names[:-1])} or {names[-1]}")
    return named[0]
