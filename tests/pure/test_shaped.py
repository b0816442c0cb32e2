"""The real-shape fixture's quantized blocks read back, through the gguf package's own dequantizers, as the weights
they claim: centred, of the standard deviation asked, every Q4_K sub-block's scale and min the same."""

import numpy as np
import pytest
from gguf.quants import dequantize

from shaped import Q4_K, Q8_0, q4_k, q8_0


@pytest.mark.parametrize("kind, write", [(Q4_K, q4_k), (Q8_0, q8_0)])
def test_blocks_dequantize_to_centred_weights_of_the_asked_spread(kind, write):
    std = 512 ** -0.5
    blocks = write(64, 512, np.random.default_rng(0), std)
    w = dequantize(blocks, kind)
    assert w.shape == (64, 512)
    assert abs(float(w.mean())) < 0.02 * std and float(w.std()) == pytest.approx(std, rel=0.02)
    assert len(np.unique(w)) == (16 if kind == Q4_K else 255)  # every 4-bit (8-bit) value, one scale
