"""The real-shape fixture's quantized blocks read back, through the gguf package's own dequantizers, as the weights
they claim: centred, of the standard deviation asked, every Q4_K sub-block's scale and min the same; a chained
model's file (shaped.Chain) as logits that peak at its chain's successor, whatever the last token."""

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

from shaped import Q4_K, Q8_0, Chain, q4_k, q8_0, shaped_vocabulary, write_shaped


@pytest.mark.parametrize("kind, write", [(Q4_K, q4_k), (Q8_0, q8_0)])
def test_blocks_dequantize_to_centred_weights_of_the_asked_spread(kind, write):
    std = 512 ** -0.5
    blocks = write(64, 512, np.random.default_rng(0), std)
    w = dequantize(blocks, kind)
    assert w.shape == (64, 512)
    assert abs(float(w.mean())) < 0.02 * std and float(w.std()) == pytest.approx(std, rel=0.02)
    assert len(np.unique(w)) == (16 if kind == Q4_K else 255)  # every 4-bit (8-bit) value, one scale


N_VOCAB = 2048


def chained_logits(path) -> np.ndarray:
    """The logits a chained model's file gives after each token: W · rmsnorm(E[t]), from the dequantized rows (its
    blocks add nothing to the residual stream: their output projections dequantize to zeros)."""
    tensors = {t.name: t for t in GGUFReader(path).tensors}

    def weights(name: str) -> np.ndarray:
        return dequantize(tensors[name].data, tensors[name].tensor_type)

    assert not weights("blk.0.attn_output.weight").any() and not weights("blk.0.ffn_down.weight").any()
    embeddings = weights("token_embd.weight")
    normed = embeddings / np.sqrt((embeddings ** 2).mean(axis=1, keepdims=True) + 1e-5)
    return normed @ weights("output.weight").T


@pytest.mark.parametrize("n_embd, alpha", [(512, 1.0), (256, 0.7), (256, 0.5)])
def test_chained_logits_peak_at_the_chains_successor_after_q8_0_rounding(tmp_path, n_embd, alpha):
    types = shaped_vocabulary(N_VOCAB)[1]
    chain = Chain(seed=3, alpha=alpha)
    path = write_shaped(tmp_path / "chained.gguf", seed=int(alpha * 10), chain=chain, n_embd=n_embd, n_layer=1,
                        n_ff=256, n_head=4, n_head_kv=2, n_vocab=N_VOCAB)
    logits = chained_logits(path)
    successor = chain.successors(types)
    assert (logits.argmax(axis=1) == successor).all()  # every token's, the control and byte tokens' too
    rows = np.arange(N_VOCAB)
    chosen = logits[rows, successor]
    logits[rows, successor] = -np.inf
    assert (chosen - logits.max(axis=1)).min() > 0.5 * chain.logit  # far beyond 8-bit activations' rounding
    cycle, sigma = chain.cycle(types), Chain(seed=3).successors(types)
    assert len(cycle) == N_VOCAB - 3 - 256  # every ordinary token: not the 3 control and unknown, nor 256 byte tokens
    assert sorted(successor[cycle]) == sorted(cycle)  # the model's rule, a permutation of them
    followed = successor[cycle] == sigma[cycle]
    assert abs(followed.mean() - alpha) < 1 / len(cycle)


def test_the_chain_is_one_cycle_and_a_higher_alpha_follows_it_wherever_a_lower_does():
    types = shaped_vocabulary(N_VOCAB)[1]
    sigma, cycle = Chain(seed=3).successors(types), Chain(seed=3).cycle(types)
    token, seen = int(cycle[0]), []
    for _ in cycle:
        seen.append(token)
        token = int(sigma[token])
    assert token == cycle[0] and sorted(seen) == sorted(cycle)
    followed = {alpha: Chain(seed=3, alpha=alpha).successors(types)[cycle] == sigma[cycle] for alpha in (0.5, 0.7, 0.9)}
    assert (followed[0.5] <= followed[0.7]).all() and (followed[0.7] <= followed[0.9]).all()
