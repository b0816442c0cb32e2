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


def check_count(value, name: str, minimum: int) -> int:
    """A whole number of at least `minimum` (a bool, a float, a string are not), else one GGUFSpecError
    naming the setting as the caller knows it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFSpecError(f"{name} must be a whole number (got {value!r}, {type(value).__name__})")
    if value < minimum:
        raise GGUFSpecError(f"{name} must be at least {minimum} (got {value})")
    return value


LAYERS_MAX = 2**31 - 1  # llama_model_params.n_gpu_layers is an int32_t: a larger count would wrap


def check_layers(value, name: str, every: str = "-1") -> int:
    """A layer count as llama.cpp's library takes it (-ngl, -ngld): a whole number from -1 (every layer) to
    LAYERS_MAX, else one GGUFSpecError naming the setting; the CLI's flags and the API's settings share this rule.
    every: how the caller writes "every layer" (the API: -1; the CLI: 'all'), the advice for a count too large."""
    check_count(value, name, -1)
    if value > LAYERS_MAX:
        raise GGUFSpecError(f"{name} must be at most {LAYERS_MAX}, llama.cpp's largest layer count (got {value}); "
                            f"use {every} for every layer")
    return value


def exactly_one(given: dict) -> str:
    """The one check that a caller gave exactly one of several alternatives (a prompt, chat messages or
    prompt tokens; -p, -f or --chat): `given` maps each alternative's name, as the caller knows it, to its
    value; returns the name of the one given, else GGUFSpecError naming them all."""
    named = [name for name, value in given.items() if value is not None]
    if len(named) != 1:
        names = list(given)
        raise GGUFSpecError(f"give exactly one of {', '.join(names[:-1])} or {names[-1]}")
    return named[0]
