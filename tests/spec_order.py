"""ggufspec's own round in llama.cpp's speculative-simple order, to compare drafted and accepted counts with
llama-speculative-simple's (tests/test_mtp.py: draft-mtp; tests/test_eagle3.py: draft-eagle3)."""

import os
from pathlib import Path

import numpy as np
import pytest

from ggufspec.drafters import HeadDrafter
from ggufspec.sampling import SamplingParams
from ggufspec.speculative import speculative_step
from ggufspec.verification import Verification


def speculative_simple_counts(ctx, head, prompt_tokens: list[int], n_predict: int, draft_max: int, *,
                              drafter=None, verification=None) -> tuple[int, int, list[int]]:
    """ggufspec's own round (speculative_step, HeadDrafter(head), the head following the target context `ctx`)
    in llama.cpp's speculative-simple order: the prompt but its last token decoded, then rounds from the last
    prompt token, each verified in one batch (as llama.cpp does, near-ties not re-decoded), until more than
    n_predict tokens; end-of-generation ignored (--ignore-eos). Where no draft fits the budget llama.cpp drafts
    its whole n_max all the same (common_speculative_draft truncates only to a budget above 0): so here.
    drafter / verification: another drafter (None with head=None: target-only rounds) or rule, in the same
    order. Returns (drafted, accepted, tokens)."""
    if head is not None:
        head.activate(True)
        drafter = drafter or HeadDrafter(head)
    ctx.clear()
    with ctx.no_rewind():
        ctx.decode(prompt_tokens[:-1], logits="none")
    params, rng = SamplingParams(), np.random.default_rng(0)
    verification = verification or Verification(exact=False, tie_margin=0.0)
    history, n_out, drafted, accepted = list(prompt_tokens), 0, 0, 0
    while n_out <= n_predict:
        budget = max(0, min(draft_max, ctx.n_ctx - (len(history) - 1) - 2, n_predict - n_out - 1)) or draft_max
        r = speculative_step(ctx, drafter, history, budget, params, rng, verification=verification)
        drafted, accepted, n_out = drafted + r.n_drafted, accepted + r.n_accepted, n_out + len(r.tokens)
        history += r.tokens
    return drafted, accepted, history[len(prompt_tokens):]



def run_with(ctx, head, prompt: str, draft_max: int, n: int = 48, **kw) -> tuple[int, int, list[int]]:
    """speculative_simple_counts on a prompt's text, with `head` the one follower of ctx that follows (turning one
    off keeps the rows the next reads) and None: target-only rounds."""
    for other in ctx.followers:
        other.activate(other is head)
    return speculative_simple_counts(ctx, head, ctx.model.tokenize(prompt), n, draft_max, **kw)


def assert_counts_equal_llama_cpps(ctx, head, target_file, draft_file, prompt: str, draft_max: int, spec_type: str,
                                   n_ctx: int, n: int = 48) -> None:
    """The head's drafted and accepted counts in speculative-simple's order equal llama-speculative-simple's with
    --spec-type spec_type on the same files, prompt and lengths (some drafts rejected: rewinds compared too)."""
    from ggufspec.bench.reference import speculative_simple

    theirs = speculative_simple(reference_bin().parent, target_file, draft_file, prompt, n, ctx.n_threads, n_ctx,
                                draft_max, spec_type)
    drafted, accepted, _ = run_with(ctx, head, prompt, draft_max, n)
    assert 0 < theirs["n_accepted"] < theirs["n_drafted"]
    assert (drafted, accepted) == (theirs["n_drafted"], theirs["n_accepted"])
    assert 0 < theirs["seconds_to_n"] <= theirs["seconds"]  # its log's rounds add up to what it decoded

def reference_bin(program: str = "llama-speculative-simple") -> Path:
    """A program of the llama.cpp this llama-cpp-python wraps, from ../shared/tools/llama-cpp-reference's build
    (LLAMA_CPP_REFERENCE_BIN, else its default cache): skipped where absent, failed where CI requires it."""
    import llama_cpp

    folder = os.environ.get("LLAMA_CPP_REFERENCE_BIN") or (
        Path.home() / ".cache" / "llama-cpp-reference" / llama_cpp.__version__ / "build" / "bin")
    path = Path(folder) / program
    if not os.access(path, os.X_OK):
        message = f"{path} not found: build it with ../shared/tools/llama-cpp-reference"
        if os.environ.get("GGUFSPEC_REQUIRE_LLAMA_CPP") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path
