"""GGUFDraftModel inside llama-cpp-python's own Llama: same text as Llama alone, greedy and sampled."""

import numpy as np
import pytest
from llama_cpp import Llama
from stats import chi2_critical, two_sample_chi2

from ggufspec import GGUFDraftModel, GGUFSpecError

NO_EOS = {2: -1000.0}  # the tiny models' end-of-generation token: keep them talking


def llama(path, draft=None, **kw):
    llm = Llama(model_path=str(path), n_ctx=1024, n_batch=16, draft_model=draft, verbose=False, seed=0, **kw)
    if draft is not None:
        draft.attach(llm)
    return llm


@pytest.fixture(scope="module")
def plain(tiny):
    return llama(tiny["target"])


@pytest.mark.parametrize("mode", ["draft", "lookup", "auto"])
def test_greedy_text_equals_llama_alone_past_n_batch(tiny, plain, mode):
    """The path a user writes first (no logits_all) works past n_batch (16 here) and changes nothing."""
    draft = GGUFDraftModel(tiny["close"], target=tiny["target"], mode=mode, n_ctx=1024)
    spec = llama(tiny["target"], draft)
    for prompt in ("hello world", "def f(x):", "hello world again"):  # the third shares a prefix: reused
        a = plain.create_completion(prompt, max_tokens=200, temperature=0, logit_bias=NO_EOS)
        b = spec.create_completion(prompt, max_tokens=200, temperature=0, logit_bias=NO_EOS)
        assert b["choices"][0]["text"] == a["choices"][0]["text"] and a["usage"]["completion_tokens"] > 16, prompt
    if mode != "auto":  # auto may rightly decline to draft on tiny models
        assert draft.stats["drafted"] > 0 and 0 < draft.acceptance_rate <= 1
        assert set(draft.stats["by_source"]) == {mode}
    draft.close()


def test_chat_streaming_and_stop_strings(tiny, plain):
    draft = GGUFDraftModel(tiny["close"], target=tiny["target"], mode="draft")
    spec = llama(tiny["target"], draft, logits_all=True)  # the chat prompt is longer than n_batch (16)
    messages = [{"role": "user", "content": "hi there"}]
    a = plain.create_chat_completion(messages, max_tokens=80, temperature=0, logit_bias=NO_EOS)
    b = spec.create_chat_completion(messages, max_tokens=80, temperature=0, logit_bias=NO_EOS)
    assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    full = a["choices"][0]["message"]["content"]
    def stream(model):  # (Llama's own streaming drops bytes of a character split across tokens, draft or not)
        return "".join(c["choices"][0]["text"] for c in model.create_completion(
            "hello world", max_tokens=60, temperature=0, logit_bias=NO_EOS, stream=True))

    streamed = stream(spec)
    assert streamed == stream(plain) and len(streamed) > 20
    text = plain.create_completion("hello world", max_tokens=60, temperature=0, logit_bias=NO_EOS)["choices"][0]["text"]
    stop = text[12:14]
    cut = [m.create_completion("hello world", max_tokens=60, temperature=0, logit_bias=NO_EOS, stop=[stop])
           for m in (plain, spec)]
    assert cut[1]["choices"][0]["text"] == cut[0]["choices"][0]["text"] == text[: text.index(stop)]
    assert cut[1]["choices"][0]["finish_reason"] == "stop"
    assert full and draft.stats["drafted"] > 0


def _first_two(model, n, temperature):
    """Counts of the first two sampled tokens over n generations (Llama.generate, no filters)."""
    prompt, counts = [1, 5, 6], {}
    for _ in range(n):
        gen = model.generate(prompt, top_k=0, top_p=1.0, min_p=0.0, temp=temperature, reset=True)
        pair = (next(gen), next(gen))
        gen.close()
        counts[pair] = counts.get(pair, 0) + 1
    return counts


def test_sampled_text_follows_llamas_own_distribution(tiny):
    """Llama keeps a drafted token only when it equals its own sample: the first two tokens must be
    distributed as without a draft. Negative control: another temperature is told apart."""
    plain = llama(tiny["letters"])
    spec = llama(tiny["letters"], GGUFDraftModel(tiny["letters_sharp"], mode="draft"))
    n = 1500
    a, b = _first_two(plain, n, 1.0), _first_two(spec, n, 1.0)
    stat, df = two_sample_chi2(a, b)
    assert stat < chi2_critical(df), f"with a draft the samples differ: chi2 {stat:.1f} on {df} df"
    hot = _first_two(plain, n, 1.6)
    stat_hot, df_hot = two_sample_chi2(a, hot)
    assert stat_hot > chi2_critical(df_hot), "the test cannot tell temperature 1.0 from 1.6: it has no power"


def test_bad_drafts_are_one_error_and_leave_nothing_open(tiny, tmp_path):
    with pytest.raises(GGUFSpecError, match="cannot draft for .*no token for 244 of the 256 bytes"):
        GGUFDraftModel(tiny["letters"], target=tiny["target"], mode="draft")  # its tokenizer would abort on the text
    with pytest.raises(GGUFSpecError, match="no such file"):
        GGUFDraftModel(tmp_path / "missing.gguf", mode="draft")
    with pytest.raises(GGUFSpecError, match="needs a draft model"):
        GGUFDraftModel(None, mode="auto")
    with pytest.raises(GGUFSpecError, match="-c/--ctx-size|n_ctx"):
        GGUFDraftModel(tiny["close"], mode="draft", n_ctx=4)
    with pytest.raises(GGUFSpecError, match="mode must be one of"):
        GGUFDraftModel(tiny["close"], mode="magic")


def test_a_draft_that_cannot_serve_without_target_is_named_at_attach(tiny):
    draft = GGUFDraftModel(tiny["letters"], mode="draft")  # no target=: checked against the Llama itself
    with pytest.raises(GGUFSpecError, match="cannot draft for .*no token for 244 of the 256 bytes"):
        llama(tiny["target"], draft)
    draft.close()


@pytest.mark.parametrize("with_target", [False, True])
def test_a_draft_of_another_vocabulary_drafts_through_text_in_llama(tiny, with_target):
    """The target itself at other ids: Llama's own greedy text, drafts proposed in the Llama's ids and kept."""
    plain = llama(tiny["lettered"])
    draft = GGUFDraftModel(tiny["permuted"], target=tiny["lettered"] if with_target else None, mode="draft")
    spec = llama(tiny["lettered"], draft)
    for prompt in ("hello world", "def f(x):"):
        a = plain.create_completion(prompt, max_tokens=60, temperature=0, logit_bias=NO_EOS)
        b = spec.create_completion(prompt, max_tokens=60, temperature=0, logit_bias=NO_EOS)
        assert b["choices"][0]["text"] == a["choices"][0]["text"], prompt
    assert draft.stats["drafted"] > 0 and type(draft.model_drafter).__name__ == "TextDrafter"
    assert draft.acceptance_rate > 0.6, draft.stats  # not all: the target writes control tokens, which have no text
    draft.close()


def test_an_unattached_draft_says_what_to_do(tiny):
    draft = GGUFDraftModel(tiny["close"], mode="draft")
    spec = Llama(model_path=str(tiny["target"]), n_ctx=256, n_batch=16, draft_model=draft, verbose=False)
    with pytest.raises(GGUFSpecError, match=r"attach\(llm\)"):
        spec.create_completion("hello", max_tokens=8, temperature=0)
    draft.close()


def test_a_refused_recurrent_llama_is_left_as_it_was(tiny, tmp_path):
    """attach refuses a Llama whose model is recurrent before touching it: the Llama still generates alone."""
    from tiny import write_tiny_hybrid

    draft = GGUFDraftModel(tiny["close"], mode="draft")
    recurrent = Llama(model_path=str(write_tiny_hybrid(tmp_path / "lfm2.gguf", "lfm2")), n_ctx=256, verbose=False)
    with pytest.raises(GGUFSpecError, match="a recurrent or hybrid model"):
        draft.attach(recurrent)
    assert recurrent.draft_model is None
    assert recurrent.create_completion("hello", max_tokens=4, temperature=0)["choices"][0]["text"] is not None
    draft.close()


def test_attach_measures_through_the_llamas_own_context_and_loads_no_second_target(tiny):
    """Costs come from the Llama's context (its settings name the cache entry); a draft given after
    construction gets Llama's every-row logits; the text stays Llama's own."""
    from ggufspec.llama import measure

    plain = llama(tiny["target"]).create_completion("hello world", max_tokens=40, temperature=0, logit_bias=NO_EOS)
    draft = GGUFDraftModel(tiny["close"], mode="auto")
    spec = Llama(model_path=str(tiny["target"]), n_ctx=1024, n_batch=16, verbose=False, seed=0)
    draft.attach(spec)  # no draft_model= at construction
    assert spec.draft_model is draft and spec._logits_all
    assert draft.costs is not None and any("|Llama fa" in k for k in measure.load_cache())
    out = spec.create_completion("hello world", max_tokens=40, temperature=0, logit_bias=NO_EOS)
    assert out["choices"][0]["text"] == plain["choices"][0]["text"]
    draft.close()


@pytest.mark.parametrize("target_pad, draft_pad", [(64, 0), (0, 64)])
@pytest.mark.parametrize("with_target", [True, False])
def test_vocabularies_of_different_sizes_inside_llama(tmp_path, target_pad, draft_pad, with_target):
    from tiny import write_tiny_model

    target = write_tiny_model(tmp_path / "t.gguf", seed=0, pad=target_pad)
    draft_path = write_tiny_model(tmp_path / "d.gguf", seed=0, perturb=0.05, pad=draft_pad)
    plain = llama(target)
    draft = GGUFDraftModel(draft_path, target=target if with_target else None, mode="draft")
    spec = llama(target, draft)
    for prompt in ("hello world", "def f(x):"):
        a = plain.create_completion(prompt, max_tokens=60, temperature=0, logit_bias=NO_EOS)
        b = spec.create_completion(prompt, max_tokens=60, temperature=0, logit_bias=NO_EOS)
        assert b["choices"][0]["text"] == a["choices"][0]["text"], prompt
    assert draft.stats["drafted"] > 0
    draft.close()


@pytest.mark.slow
def test_greedy_tokens_of_the_real_pair_past_256_cached_are_llamas_own():
    """360 tokens of a completion (past 256 cached tokens) and 48 of a chat, with the draft model. On CPU, llama.cpp's
    verify batch equals its one-token step bit for bit only with flash attention on and, past 256
    cached tokens, one thread (with more, a one-token step splits attention over the threads; with
    flash attention off no batch is exact): that is the configuration tested, the one the README gives
    for identical text. GGUFDraftModel measures the same and keeps [last] + draft within the exact size."""
    from conftest import real_model

    target = real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    draft_path = real_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")

    def run(draft):
        llm = Llama(model_path=str(target), n_ctx=1024, n_threads=1, n_threads_batch=1, flash_attn=True,
                    draft_model=draft, verbose=False)
        if draft is not None:
            draft.attach(llm)  # measured in this Llama's own context: flash attention on, one thread
        bias = {t: -1000.0 for t in {llm.token_eos(), *llm.tokenize(b"<|im_end|><|endoftext|>", add_bos=False, special=True)}}
        completion = llm.create_completion("def quicksort(a):", max_tokens=360, temperature=0, logit_bias=bias)
        chat = llm.create_chat_completion([{"role": "user", "content": "Explain how a hash map works, with an example in Python."}],
                                          max_tokens=48, temperature=0, logit_bias=bias)
        llm.close()
        assert completion["usage"]["completion_tokens"] == 360 and chat["usage"]["completion_tokens"] == 48
        return completion["choices"][0]["text"], chat["choices"][0]["message"]["content"]

    plain = run(None)
    draft = GGUFDraftModel(draft_path, target=target, mode="draft", n_threads=1)
    spec = run(draft)
    assert draft.costs.exact_batch >= 2 and draft.num_pred_tokens == min(4, draft.costs.exact_batch - 1)
    assert spec == plain
    assert draft.stats["drafted"] > 150 and draft.acceptance_rate > 0.5  # many rounds, many rewinds
    assert draft.stats["drafted"] - draft.stats["accepted"] > 30
    draft.close()


def test_the_llama_adapter_reads_acceptance_from_how_the_history_went_on():
    """GGUFDraftModel is never told what Llama accepted: it reads it from the next call's history."""
    from ggufspec.llama_draft import GGUFDraftModel

    d = GGUFDraftModel(None, mode="lookup", num_pred_tokens=3)
    d._attached = "a Llama"  # attach() needs a real one; the bookkeeping does not
    history = [5, 6, 7, 8, 5, 6]
    assert list(d(np.array(history))) == [7, 8, 5]
    history += [7, 8, 9]  # Llama kept 7, 8, rejected 5, and sampled 9 instead
    d(np.array(history))
    assert (d.stats["drafted"], d.stats["accepted"]) == (3, 2) and d.stats["by_source"] == {"lookup": {"drafted": 3, "accepted": 2}}
    d([1, 2, 3])  # a new prompt: nothing is counted against the last proposal
    assert d.stats["drafted"] == 3


def test_a_closed_draft_says_so_instead_of_crashing(tiny):
    """A GGUFDraftModel closed while its Llama lives on: the next generation is one GGUFSpecError, not a
    segmentation fault inside llama.cpp."""
    draft = GGUFDraftModel(tiny["close"], mode="draft")
    llm = llama(tiny["target"], draft)
    assert llm.create_completion("hello", max_tokens=4, temperature=0)["choices"][0]["text"] is not None
    draft.close()
    with pytest.raises(GGUFSpecError, match="this draft was closed"):
        llm.create_completion("hello", max_tokens=8, temperature=0)


@pytest.mark.parametrize("mode", ["draft", "lookup"])
def test_drafts_never_run_past_the_room_the_llama_has(tiny, mode):
    """Llama(n_ctx=100) keeps its tokens in an array of 100 (llama.cpp rounds the context up to 256): a
    proposal past it broke Llama's eval ("could not broadcast ... (5,) into (1,)"). Past 100 tokens the
    draft proposes nothing and the text is Llama's alone."""
    plain = Llama(model_path=str(tiny["target"]), n_ctx=100, verbose=False)
    alone = plain.create_completion("hello", max_tokens=150, temperature=0, logit_bias=NO_EOS)
    draft = GGUFDraftModel(tiny["close"] if mode == "draft" else None, mode=mode)
    llm = Llama(model_path=str(tiny["target"]), n_ctx=100, draft_model=draft, verbose=False)
    draft.attach(llm)
    spec = llm.create_completion("hello", max_tokens=150, temperature=0, logit_bias=NO_EOS)
    assert spec["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"] == 150
    assert spec["choices"][0]["text"] == alone["choices"][0]["text"]
    assert mode == "lookup" or draft.stats["drafted"] > 0
    draft.close()


def test_a_draft_file_removed_after_loading_still_attaches(tiny, tmp_path):
    """The weights are loaded (mapped) already; the cost cache names the file by what it was when loaded."""
    import shutil

    copy = tmp_path / "draft.gguf"
    shutil.copy(tiny["close"], copy)
    draft = GGUFDraftModel(copy, mode="draft")
    copy.unlink()
    llm = llama(tiny["target"], draft)
    assert llm.create_completion("hello", max_tokens=8, temperature=0, logit_bias=NO_EOS)["usage"]["completion_tokens"] == 8
    draft.close()


@pytest.mark.parametrize("setting, value, needle", [
    ("n_batch", 0, "n_batch must be at least 1 (got 0)"),
    ("n_batch", "8", "n_batch must be a whole number (got '8', str)"),
    ("n_gpu_layers", "x", "n_gpu_layers must be a whole number (got 'x', str)"),
    ("num_pred_tokens", 2.5, "num_pred_tokens must be a whole number (got 2.5, float)"),
    ("n_threads", 1.5, "n_threads must be a whole number (got 1.5, float)"),
])
def test_settings_that_llama_cpp_cannot_take_name_themselves(tiny, setting, value, needle):
    """n_batch=0 said 'could not create a context of 4096 tokens (out of memory? ...)'."""
    with pytest.raises(GGUFSpecError) as e:
        GGUFDraftModel(tiny["close"], mode="draft", **{setting: value})
    assert str(e.value) == needle


def test_recurrent_and_hybrid_targets_are_known_from_their_headers(tiny, tmp_path):
    from tiny import write_tiny_hybrid, write_tiny_mamba2, write_tiny_moe

    from ggufspec.llama.gguf_info import read_info

    for path in (write_tiny_hybrid(tmp_path / "lfm2.gguf", "lfm2"), write_tiny_mamba2(tmp_path / "mamba2.gguf"),
                 write_tiny_hybrid(tmp_path / "granite.gguf", "granitehybrid")):
        assert read_info(path).keeps_state, path
        with pytest.raises(GGUFSpecError, match="a recurrent or hybrid model"):
            GGUFDraftModel(tiny["close"], target=path, mode="draft")
    for path in (tiny["target"], write_tiny_moe(tmp_path / "moe.gguf")):
        assert not read_info(path).keeps_state, path
