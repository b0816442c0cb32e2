"""Tokens to text on hand-built token pieces: UTF-8 split across tokens, stop strings held back and cut,
end-of-generation tokens, the length limit; the chat roles a template renders."""

import numpy as np
import pytest

from ggufspec.errors import GGUFSpecError
from ggufspec.text import TextAssembler, check_chat_roles, find_stop, plural

# token id -> bytes; "é" is split over tokens 3 and 4, token 9 ends generation
PIECES = {0: b"he", 1: b"llo", 2: b" wor", 3: b"\xc3", 4: b"\xa9", 5: b"ld", 6: b"!", 7: b"EN", 8: b"D", 9: b""}
EOG = np.array([t == 9 for t in range(10)])


def assembler(**kw) -> TextAssembler:
    return TextAssembler(PIECES.__getitem__, EOG, **{"max_tokens": 100, **kw})


def stream(a: TextAssembler, rounds: list[list[int]]) -> tuple[list[str], str | None]:
    shown, finish = [], None
    for tokens in rounds:
        _, text, finish = a.add(tokens)
        shown.append(text)
        if finish:
            break
    return shown, finish


def test_utf8_split_over_tokens_is_shown_once_whole():
    shown, finish = stream(assembler(), [[0, 1], [3], [4, 5]])
    assert shown == ["hello", "", "éld"] and finish is None  # nothing half-decoded is shown


def test_end_of_generation_stops_and_is_not_kept_unless_ignored():
    kept, text, finish = assembler().add([0, 9, 1])
    assert (kept, text, finish) == ([0], "he", "stop")
    kept, text, finish = assembler(ignore_eos=True).add([0, 9, 1])
    assert (kept, text, finish) == ([0, 9, 1], "hello", None)


def test_a_stop_string_is_held_back_then_cut():
    a = assembler(stop=("END",))
    assert a.add([0, 1, 7]) == ([0, 1, 7], "hello", None)  # "EN" might be the start of "END": held back
    kept, text, finish = a.add([8, 6])
    assert (kept, text, finish) == ([8], "", "stop_string")  # the stop string and what follows never show
    assert a.text == "hello"


def test_held_text_that_is_no_stop_string_is_shown_later_and_at_the_end():
    a = assembler(stop=("END",), max_tokens=4)
    assert a.add([0, 1, 7])[1] == "hello"
    assert a.add([6]) == ([6], "EN!", "length")  # not a stop string after all: shown, and the limit flushes it


def test_the_length_limit_keeps_exactly_max_tokens():
    kept, text, finish = assembler(max_tokens=3).add([0, 1, 2, 5, 6])
    assert (kept, text, finish) == ([0, 1, 2], "hello wor", "length")


def test_a_dangling_utf8_byte_at_the_end_becomes_a_replacement_character():
    kept, text, finish = assembler(max_tokens=2).add([0, 3])
    assert (text, finish) == ("he\ufffd", "length")


def test_find_stop_looks_only_where_a_stop_could_end_after_since():
    assert find_stop("abcEND", ("END",), 4) == 3  # the stop string began before `since`, ends after it
    assert find_stop("ENDabc", ("END",), 5) == -1  # it ended before `since`: found earlier, not again
    assert find_stop("xxAAyyB", ("B", "AA"), 0) == 2  # the earliest of several


def test_chat_roles_a_template_renders_pass_and_any_other_is_one_line():
    messages = [{"role": r, "content": "x"} for r in ("system", "user", "assistant", "tool")]
    assert check_chat_roles(messages) == messages
    for role in ("wizard", "User", "sytem", None):
        with pytest.raises(GGUFSpecError, match=rf"p.jsonl, line 3: messages\[1\]: role {role!r} is not one"):
            check_chat_roles([messages[0], {"role": role, "content": "x"}], "p.jsonl, line 3: messages")


def test_counts_read_as_people_say_them():
    assert (plural(1, "thread"), plural(2, "thread"), plural("1", "chunk package")) == ("1 thread", "2 threads",
                                                                                      "1 chunk package")
