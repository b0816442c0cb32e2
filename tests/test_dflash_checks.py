"""DFlash drafts ggufspec/llama/dflash.py's check_dflash refuses, each in one line that says what is wrong."""

import pytest

from ggufspec.errors import GGUFSpecError
from ggufspec.llama.backend import Model
from ggufspec.llama.dflash import check_dflash
from tiny_hidden import read_target, write_tiny_dflash, write_tiny_target


def test_a_mask_token_past_the_vocabulary_is_named_with_the_vocabularys_size(tmp_path):
    target_file = write_tiny_target(tmp_path / "target.gguf")
    with Model(target_file) as target:
        n_vocab = target.n_vocab
        draft_file = write_tiny_dflash(tmp_path / "dflash-mask.gguf", read_target(target_file), mask_id=n_vocab + 5)
        with Model(draft_file, role="draft") as draft:
            with pytest.raises(GGUFSpecError) as e:
                check_dflash(target, draft)
    assert str(e.value).startswith(f"{draft_file}: its mask token id {n_vocab + 5} (tokenizer.ggml.mask_token_id) "
                                   f"is past the vocabulary's {n_vocab} tokens")
    assert "names no mask token" not in str(e.value) and "\n" not in str(e.value)
