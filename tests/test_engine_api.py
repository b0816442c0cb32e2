"""The Engine as an API: one generation at a time across threads, superseded streams, the prompt's shapes,
stop strings, a closed engine. Each bad input is one GGUFSpecError (or one line from the CLI)."""

import json
import threading

import numpy as np
import pytest

from clirun import TIMEOUT, one_line, run
from ggufspec import Engine, GGUFSpecError


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine(tiny["target"], tiny["close"], n_ctx=512) as e:
        yield e


def test_one_engine_shared_by_threads_runs_one_generation_at_a_time(engine):
    expected = {p: engine.generate(p, max_tokens=40, ignore_eos=True, mode="draft").tokens
                for p in ("hello world", "def f(x):", "zzz zzz")}
    results, errors = {}, []

    def worker(i, prompt):
        try:
            for _ in range(3):
                results[(i, prompt)] = engine.generate(prompt, max_tokens=40, ignore_eos=True, mode="draft").tokens
        except Exception as e:  # noqa: BLE001 - the test reports whatever went wrong
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i, p)) for i in range(2) for p in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert not errors, errors
    assert all(results[(i, p)] == expected[p] for i in range(2) for p in expected)


def test_a_stream_superseded_by_a_later_generation_says_so(engine):
    stream = engine.stream("hello world", max_tokens=30, ignore_eos=True)
    next(stream)
    engine.generate("def f(x):", max_tokens=5)
    for _ in range(2):  # and again at each try (an ended generator would stop with a bare StopIteration)
        with pytest.raises(GGUFSpecError, match="superseded by a later generation"):
            next(stream)
    stream.close()
    assert list(stream) == []
    assert len(engine.generate("hello world", max_tokens=30, ignore_eos=True).tokens) == 30  # and the engine works


def test_prompt_tokens_as_a_numpy_array_or_a_tuple(engine):
    reference = engine.generate(prompt_tokens=[5, 6, 7], max_tokens=6, ignore_eos=True).tokens
    for given in (np.array([5, 6, 7]), np.array([5, 6, 7], dtype=np.int32), (5, 6, 7)):
        assert engine.generate(prompt_tokens=given, max_tokens=6, ignore_eos=True).tokens == reference
    with pytest.raises(GGUFSpecError, match=r"flat list or array of token ids \(got an array of shape \(1, 3\)\)"):
        engine.generate(prompt_tokens=np.array([[5, 6, 7]]))
    with pytest.raises(GGUFSpecError, match="prompt_tokens holds 5.0"):
        engine.generate(prompt_tokens=np.array([5.0, 6.0]))


def test_prompt_arguments_are_checked(engine):
    with pytest.raises(GGUFSpecError, match="not a token id of this model"):
        engine.generate(prompt_tokens=[1, 2**31])
    with pytest.raises(GGUFSpecError, match="not a token id"):
        engine.generate(prompt_tokens=[1, -5])
    with pytest.raises(GGUFSpecError, match="exactly one of a prompt, chat messages or prompt_tokens"):
        engine.generate("hello", prompt_tokens=[1, 5])
    with pytest.raises(GGUFSpecError, match="exactly one"):
        list(engine.stream("hello", prompt_tokens=[1, 5]))


@pytest.mark.parametrize("messages", [["hi"], [1, 2], "hi", [{"content": "hi"}], [{"role": "user"}], []])
def test_chat_messages_of_the_wrong_shape(engine, messages):
    with pytest.raises(GGUFSpecError, match="messages"):
        engine.generate(messages=messages, max_tokens=4)


def test_a_chat_role_the_template_would_drop_is_refused(engine):
    with pytest.raises(GGUFSpecError, match=r"messages\[0\]: role 'wizard' is not one chat templates render"):
        engine.generate(messages=[{"role": "wizard", "content": "abracadabra"}], max_tokens=4)


def test_stop_none_and_empty_stop(engine):
    reference = engine.generate("hello", max_tokens=12, ignore_eos=True)
    assert engine.generate("hello", max_tokens=12, ignore_eos=True, stop=None).tokens == reference.tokens
    with pytest.raises(GGUFSpecError, match="non-empty"):
        engine.generate("hello", max_tokens=12, stop=[""])


@pytest.mark.parametrize("stop", [5, True, 1.5, {"a": 1}, ["a", 2]])
def test_stop_of_the_wrong_type_is_one_error(engine, stop):
    with pytest.raises(GGUFSpecError, match="--stop must be a string or a list of strings"):
        engine.generate("hello", max_tokens=2, stop=stop)


def test_text_that_is_not_unicode_is_one_error_naming_where(engine):
    """A lone surrogate (what a JSON "\\ud800" or broken bytes decoded with surrogateescape leave in a str) cannot
    reach llama.cpp's UTF-8 tokenizer: one error naming the prompt, the message or the stop string."""
    with pytest.raises(GGUFSpecError, match=r"the prompt holds a lone surrogate \(U\+D800 at character 0\)"):
        engine.generate("\ud800x", max_tokens=2)
    with pytest.raises(GGUFSpecError, match=r"messages\[1\]\.content holds a lone surrogate \(U\+DFFF"):
        engine.generate(messages=[{"role": "system", "content": "ok"}, {"role": "user", "content": "a\udfff"}])
    with pytest.raises(GGUFSpecError, match="--stop holds a lone surrogate"):
        engine.generate("hello", max_tokens=2, stop=["\ud800"])


def test_content_parts_are_their_text(engine):
    """OpenAI's content parts are the text they hold, one part a line (llama-server's rule); other parts are refused."""
    def parts(*texts):
        return [{"role": "user", "content": [{"type": "text", "text": t} for t in texts]}]

    assert engine.tokenize_prompt(messages=parts("hi")) == engine.tokenize_prompt(messages=[{"role": "user", "content": "hi"}])
    assert engine.tokenize_prompt(messages=parts("a", "b")) == engine.tokenize_prompt(
        messages=[{"role": "user", "content": "a\nb"}])
    with pytest.raises(GGUFSpecError, match=r"messages\[0\]\.content\[0\] is a part of type 'input_audio'"):
        engine.tokenize_prompt(messages=[{"role": "user", "content": [{"type": "input_audio"}]}])
    with pytest.raises(GGUFSpecError, match=r"messages\[0\]\.content\[0\]\.text must be a string"):
        engine.tokenize_prompt(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}])


def test_a_closed_engine_says_so(tiny):
    e = Engine(tiny["target"], n_ctx=64)
    e.close()
    for read in (e.weights, e.cost_report, lambda: e.n_ctx):  # docs/api.md: GGUFSpecError, not AttributeError
        with pytest.raises(GGUFSpecError, match="this Engine is closed"):
            read()
    with pytest.raises(GGUFSpecError, match="this Engine is closed"):
        e.generate("hi", max_tokens=2)
    with pytest.raises(GGUFSpecError, match="this Engine is closed"):
        e.tokenize_prompt("hi")
    with pytest.raises(GGUFSpecError, match="this Engine is closed"):
        with e:
            pass


@pytest.mark.parametrize("temp", ["1e-38", "1e-320"])
def test_a_tiny_temperature_is_greedy_without_warnings(tiny, temp):
    greedy = run("generate", "-m", tiny["target"], "-p", "hello", "-n", 20, "--ignore-eos", "--json")
    r = run("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hello", "-n", 20, "--ignore-eos", "--json",
            "--temp", temp, "-s", 1)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == json.loads(greedy.stdout)["tokens"]
    assert "overflow" not in r.stderr and "invalid value" not in r.stderr


@pytest.mark.parametrize("temp", ["nan", "inf"])
def test_a_temperature_that_is_not_a_number(tiny, temp):
    one_line(run("generate", "-m", tiny["target"], "-p", "hello", "--temp", temp), "--temp must be a finite number")


@pytest.mark.parametrize("setting, value, needle", [
    ("max_tokens", 4.5, "-n/--n-predict (max_tokens) must be a whole number (got 4.5, float)"),
    ("max_tokens", "4", "must be a whole number (got '4', str)"), ("temperature", "0.5", "--temp (temperature) must be a number"),
    ("seed", 1.5, "-s/--seed (seed) must be a whole number"), ("top_k", 2.5, "--top-k (top_k) must be a whole number"),
    ("max_tokens", True, "must be a whole number (got True, bool)"), ("mode", 3, "--mode (mode) must be text"),
    ("draft_min", -1, "--draft-min must be 0 or more (got -1)"),
])
def test_settings_of_the_wrong_type_are_one_error_before_any_decoding(engine, setting, value, needle):
    n_past = engine.target_ctx.n_past
    with pytest.raises(GGUFSpecError) as e:
        engine.generate("hello", **{setting: value})
    assert needle in str(e.value)
    assert engine.target_ctx.n_past == n_past  # refused before the prompt was evaluated


def test_draft_min_above_draft_max_names_both(engine):
    with pytest.raises(GGUFSpecError, match=r"--draft-min must not exceed --draft-max=2 \(got 3\)"):
        engine.generate("hello", draft_min=3, draft_max=2)


def test_kv_cache_types_reach_the_context(tmp_path, tiny):
    """-ctk/-ctv as llama.cpp takes them: a q8_0 cache is about half an f16 one, with the same greedy text here."""
    from tiny import write_tiny_model

    wide = write_tiny_model(tmp_path / "wide.gguf", n_embd=128)  # head size 32: a q8_0 block divides it
    kv = {}
    for types in (("f16", "f16"), ("q8_0", "q8_0")):
        with Engine(wide, n_ctx=512, type_k=types[0], type_v=types[1], measure=False) as e:
            kv[types] = (e.target_ctx.buffers["KV"]["CPU"], e.generate("hello", max_tokens=8, mode="target").tokens)
    assert kv[("q8_0", "q8_0")][0] < 0.6 * kv[("f16", "f16")][0]
    with pytest.raises(GGUFSpecError, match="-ctk q8_0 stores blocks of 32 values, which do not divide this model's "
                                            "head size 16; use f16"):
        Engine(tiny["target"], type_k="q8_0", measure=False)
    with pytest.raises(GGUFSpecError, match="-ctv/--cache-type-v 'q3' is not a KV cache type llama.cpp knows"):
        Engine(tiny["target"], type_v="q3", measure=False)


@pytest.mark.parametrize("setting, value, needle", [
    ("n_batch", 0, "-b/--batch-size must be at least 1 (got 0)"),
    ("n_ctx", "4096", "-c/--ctx-size must be a whole number (got '4096', str)"),
    ("n_ctx", 4096.0, "-c/--ctx-size must be a whole number (got 4096.0, float)"),
    ("n_gpu_layers", "banana", "-ngl/--n-gpu-layers must be a whole number (got 'banana', str)"),
    ("draft_n_gpu_layers", -2, "-ngld/--n-gpu-layers-draft must be at least -1 (got -2)"),
    ("n_threads", 1.5, "-t/--threads must be a whole number (got 1.5, float)"),
    ("n_gpu_layers", 2**32, "-ngl/--n-gpu-layers must be at most 2147483647, llama.cpp's largest layer count "
                            "(got 4294967296); use -1 for every layer"),
])
def test_load_settings_of_the_wrong_type_are_one_error_before_anything_loads(tiny, setting, value, needle):
    with pytest.raises(GGUFSpecError) as e:
        Engine(tiny["target"], tiny["close"], **{setting: value})
    assert str(e.value) == needle
