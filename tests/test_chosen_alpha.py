"""A pair whose acceptance rate is chosen (tests/shaped.py's Chain): the target writes σ, one cycle through the
ordinary tokens; a draft of alpha α writes σ(t) after a share α of them. At temperature 0 each drafted token is
then accepted with probability α given the ones before it were, in ggufspec and in llama.cpp's
llama-speculative-simple alike.

The measured α̂ = accepted / (accepted + rounds ended by a rejection): every drafted token decided is one draw,
accepted with probability α. Its tolerance is three standard errors of that many draws (under 0.08 at N tokens).
"""

import math

import pytest

from shaped import Chain, alpha_from_rounds, shaped_vocabulary, write_shaped
from spec_order import reference_bin
from ggufspec import Engine

N_VOCAB = 2048
TARGET = dict(n_embd=512, n_layer=2, n_ff=1024, n_head=8, n_head_kv=4, n_vocab=N_VOCAB)
DRAFT = dict(n_embd=256, n_layer=1, n_ff=512, n_head=4, n_head_kv=2, n_vocab=N_VOCAB)  # its own width and depth
CHAIN_SEED = 3
ALPHAS = (0.5, 0.7, 0.9)
PROMPT = "Once upon a time"
N = 400  # tokens per generation: about 340-390 draws at draft_max 4, so 3 standard errors are under 0.08
DRAFT_MAX = 4
N_CTX = 1024
THREADS = 1  # the answer does not depend on it, and one thread does not stall when the CPUs are busy


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The target and a draft per chosen alpha, written once for the module."""
    d = tmp_path_factory.mktemp("chained")
    target = write_shaped(d / "target.gguf", seed=1, chain=Chain(CHAIN_SEED), **TARGET)
    drafts = {alpha: write_shaped(d / f"draft-{alpha}.gguf", seed=2, chain=Chain(CHAIN_SEED, alpha=alpha), **DRAFT)
              for alpha in ALPHAS}
    return target, drafts


@pytest.fixture(scope="module")
def target_only(pair):
    """The target's own greedy generation: (prompt tokens, generated tokens, text)."""
    with Engine(pair[0], n_ctx=N_CTX, n_threads=THREADS, measure=False) as engine:
        prompt_tokens = engine.tokenize_prompt(PROMPT)
        out = engine.generate(prompt_tokens=prompt_tokens, max_tokens=N, mode="target", ignore_eos=True,
                              temperature=0)
    return prompt_tokens, out.tokens, out.text


def tolerance(alpha: float, n_draws: int) -> float:
    """Three standard errors of the share of n_draws that succeed with probability alpha."""
    return 3 * math.sqrt(alpha * (1 - alpha) / n_draws)


def test_the_target_writes_the_chain_and_no_token_twice(target_only):
    prompt_tokens, tokens, _ = target_only
    successor = Chain(CHAIN_SEED).successors(shaped_vocabulary(N_VOCAB)[1])
    written = [prompt_tokens[-1]] + tokens[:64]
    assert [int(successor[t]) for t in written[:-1]] == written[1:]
    assert len(set(tokens)) == len(tokens) == N  # the whole generation: a cycle of 1,800 tokens repeats none


@pytest.mark.parametrize("alpha", ALPHAS)
def test_ggufspec_accepts_the_chosen_share(pair, target_only, alpha):
    prompt_tokens, target_tokens, _ = target_only
    with Engine(pair[0], pair[1][alpha], n_ctx=N_CTX, n_threads=THREADS, measure=False) as engine:
        out = engine.generate(prompt_tokens=prompt_tokens, max_tokens=N, mode="draft", draft_max=DRAFT_MAX,
                              ignore_eos=True, temperature=0)
    assert out.tokens == target_tokens
    stats = out.stats
    rejections = sum(stats.accepted_histogram) - stats.full_accepts  # rounds that drafted and lost a token
    n_draws = stats.n_accepted + rejections
    measured = stats.n_accepted / n_draws
    print(f"alpha {alpha}: ggufspec measured {measured:.3f} over {n_draws} draws "
          f"(n_drafted {stats.n_drafted}, n_accepted {stats.n_accepted}, rounds {stats.rounds})")
    assert tolerance(alpha, n_draws) < 0.08
    assert abs(measured - alpha) < tolerance(alpha, n_draws), (measured, alpha, n_draws)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_llama_cpp_accepts_the_chosen_share(pair, target_only, alpha):
    """llama-speculative-simple on the same files (draft-simple, greedy, draft-max 4, p-min 0 by default): every
    round but the last one or two drafts 4 tokens, so its accepted per round is α + α² + α³ + α⁴; a round writes
    its accepted tokens and one of the target's, so the rounds are the tokens it decoded less those it accepted."""
    from ggufspec.bench.reference import speculative_simple

    program = reference_bin()
    theirs = speculative_simple(program.parent, pair[0], pair[1][alpha], PROMPT, N, THREADS, N_CTX, DRAFT_MAX)
    rounds = theirs["n_generated"] - theirs["n_accepted"]
    measured = alpha_from_rounds(theirs["n_accepted"] / rounds, DRAFT_MAX)
    n_draws = theirs["n_accepted"] + rounds * (1 - measured ** DRAFT_MAX)  # accepted, and the rejections expected
    print(f"alpha {alpha}: llama.cpp measured {measured:.3f} (decoded {theirs['n_generated']}, "
          f"n_drafted {theirs['n_drafted']}, n_accept {theirs['n_accepted']})")
    assert abs(measured - alpha) < tolerance(alpha, n_draws), (measured, alpha, theirs)
    assert theirs["text"].startswith(target_only[2].encode())  # it wrote the chain too, past N by a round
