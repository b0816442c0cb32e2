"""-ngl, -ngld and --n-cpu-moe: a count out of range is one line whose advice is a value the flag takes
(the library's -1 for every layer is `auto` to llama.cpp's programs, so the CLI takes the words only)."""

import pytest

from clirun import one_line, run
from ggufspec.errors import GGUFSpecError, LAYERS_MAX, check_layers


@pytest.mark.parametrize("flag", ["-ngl", "-ngld", "--n-cpu-moe"])
def test_a_negative_or_too_large_layer_count_advises_all_or_auto(flag):
    minus_one = one_line(run("generate", "-m", "target.gguf", "-p", "hi", flag, "-1"), "-1 is negative",
                         "llama.cpp's programs read -1 as auto, its library as every layer",
                         "use 'all' for every layer or 'auto'")
    too_large = one_line(run("generate", "-m", "target.gguf", "-p", "hi", flag, "1000000000000"),
                         f"must be at most {LAYERS_MAX}", "use 'all' for every layer")
    assert "-1" not in too_large.split("(got")[1] and "-1 as auto" not in one_line(
        run("generate", "-m", "target.gguf", "-p", "hi", flag, "-3"), "-3 is negative", "'all'", "'auto'")
    assert minus_one.startswith("Error: Invalid value for")


def test_the_library_takes_minus_one_for_every_layer_and_says_so():
    assert check_layers(-1, "n_gpu_layers") == -1
    with pytest.raises(GGUFSpecError, match=r"n_gpu_layers must be at most 2147483647, .*; use -1 for every layer$"):
        check_layers(2**40, "n_gpu_layers")
    with pytest.raises(GGUFSpecError, match="at least -1"):
        check_layers(-2, "n_gpu_layers")
