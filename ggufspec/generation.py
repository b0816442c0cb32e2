"""One generation: its settings, its moving parts in plain view, and what it yields.

`GenerationSettings` is everything a caller may set; `Generation` is built per call by the Engine
and holds the context it decodes on, its drafter (auto's learned acceptance and cost scales live and
die with it, so one call's choices never depend on the calls before it), its rng, the coupled rule's
noise and the verification policy; `chunks()` prefills, runs the rounds and turns them into text.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator

import numpy as np

from .core import DEFAULT_MODE, MODES, Round, Stats
from .costs import MAX_BATCH
from .drafters import Drafter
from .errors import GGUFSpecError
from .sampling import SAMPLING_RULES, PositionNoise, SamplingParams
from .speculative import Steps, prefill_piece
from .text import TextAssembler
from .verification import Verification

MAX_SEED = 2**63 - 1
# A prompt-lookup draft's longest: the longest measured batch less the round's last token (llama.cpp's
# n-gram drafters copy 48 to 64 tokens); the measured costs choose how many of them pay.
LOOKUP_MAX = MAX_BATCH - 1


@dataclass(frozen=True)
class GenerationSettings(SamplingParams):
    """Everything that shapes one generation (the sampling fields included). `validate()` names
    the flag of a bad value."""

    max_tokens: int = 128
    seed: int | None = None
    mode: str = DEFAULT_MODE
    # Most tokens the draft model drafts per round. None: DRAFT_MAX in draft mode; in auto, as many as the
    # measured costs say pay (a batch of 8 can cost less per token than one of 5).
    draft_max: int | None = None
    draft_min: int = 0
    # Stop a model draft at a token the draft is less sure of than this. None: in draft mode never; in auto,
    # where another token costs more than it is likely to return (from the measured costs, ~0.5 on a CPU).
    draft_p_min: float | None = None
    # Prompt lookup copies runs of the prompt: its drafts are free, so they may be longer than the
    # draft model's; in lookup and auto modes the measured costs choose how much of a copy pays.
    lookup_max: int = LOOKUP_MAX
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    tie_margin: float | None = None  # None: verification.margin_for this target's measured costs
    # Greedy: verify only in batches proven bit-identical to one-token decoding (identity by
    # construction). None: when this backend has such batches of 2 or more tokens.
    exact: bool | None = None
    # Keep what the KV caches already hold of this prompt (a chat's next turn, the same system
    # prompt, a retry), in whole aligned batches of n_batch tokens only, so that the output is
    # bit-identical to a cold start; False evaluates the whole prompt (the benchmark's default).
    reuse_prompt: bool = True
    # How sampled drafts are verified (sampling.SAMPLING_RULES; docs/guarantees.md): "coupled" (a seed gives
    # the target's own text in every mode) or "rejection" (Leviathan's rule). None: coupled with a seed.
    sampling_rule: str | None = None

    @property
    def rule(self) -> str:
        """The sampling rule in force (greedy rounds use neither)."""
        return self.sampling_rule or ("coupled" if self.seed is not None else "rejection")

    def validate(self, names: str = "flags") -> "GenerationSettings":
        """Every setting's type, then its range: GGUFSpecError naming the first bad one as the caller knows it
        (names="flags": the command line's flag; "fields": the setting's own name, as a server's request sets it)."""
        def n(setting: str) -> str:
            return setting if names == "fields" else FLAGS.get(setting, setting)

        self._check_types(names)
        stop_strings(self.stop, n("stop"))
        checks = [
            (self.max_tokens >= 1, f"{n('max_tokens')} must be at least 1 (got {self.max_tokens})"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"{n('temperature')} must be a finite number >= 0 (got {self.temperature})"),
            (self.top_k >= 0, f"{n('top_k')} must be >= 0 (got {self.top_k}; 0 turns it off)"),
            (0 < self.top_p <= 1, f"{n('top_p')} must be in (0, 1] (got {self.top_p})"),
            (0 <= self.min_p < 1, f"{n('min_p')} must be in [0, 1) (got {self.min_p})"),
            (self.draft_max is None or self.draft_max >= 1, f"{n('draft_max')} must be at least 1 (got {self.draft_max})"),
            (self.draft_min >= 0, f"{n('draft_min')} must be 0 or more (got {self.draft_min})"),
            (self.draft_max is None or self.draft_min <= self.draft_max,
             f"{n('draft_min')} must not exceed {n('draft_max')}={self.draft_max} (got {self.draft_min})"),
            (self.draft_p_min is None or 0 <= self.draft_p_min < 1,
             f"{n('draft_p_min')} must be in [0, 1) (got {self.draft_p_min})"),
            (self.lookup_max >= 1, f"{n('lookup_max')} must be at least 1 (got {self.lookup_max})"),
            (self.tie_margin is None or self.tie_margin >= 0, f"tie_margin must be >= 0 (got {self.tie_margin})"),
            (self.mode in MODES, f"{n('mode')} must be one of {', '.join(MODES)} (got {self.mode!r})"),
            (self.seed is None or 0 <= self.seed <= MAX_SEED,
             f"{n('seed')} must be between 0 and 2**63-1 = {MAX_SEED} (got {self.seed})"),
            (self.sampling_rule in (None, *SAMPLING_RULES),
             f"{n('sampling_rule')} must be one of {', '.join(SAMPLING_RULES)} (got {self.sampling_rule!r})"),
            (all(isinstance(x, str) and x for x in self.stop),
             f"{n('stop')}: every stop string must be non-empty text (got {list(self.stop)!r}; an empty one would stop at once)"),
        ]
        for ok, message in checks:
            if not ok:
                raise GGUFSpecError(message)
        for x in self.stop:
            check_text(x, n("stop"))
        return self

    def _check_types(self, names: str = "flags") -> None:
        for name, (flag, kind) in SETTING_TYPES.items():
            value = getattr(self, name)
            if value is None and name in OPTIONAL:
                continue
            whole = kind is int and isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            number = kind is float and isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
            if not (whole or number or (kind in (str, bool) and isinstance(value, kind))):
                what = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}[kind]
                label = name if names == "fields" else flag
                raise GGUFSpecError(f"{label} must be {what} (got {_short(value)}, {type(value).__name__})")


# The type each setting must have, and the flag that names it in a message (API users see the same flags).
SETTING_TYPES = {
    "max_tokens": ("-n/--n-predict (max_tokens)", int), "temperature": ("--temp (temperature)", float),
    "top_k": ("--top-k (top_k)", int), "top_p": ("--top-p (top_p)", float), "min_p": ("--min-p (min_p)", float),
    "seed": ("-s/--seed (seed)", int), "mode": ("--mode (mode)", str), "draft_max": ("--draft-max (draft_max)", int),
    "draft_min": ("--draft-min (draft_min)", int), "draft_p_min": ("--draft-p-min (draft_p_min)", float),
    "lookup_max": ("--lookup-max (lookup_max)", int), "tie_margin": ("tie_margin", float),
    "ignore_eos": ("ignore_eos", bool), "reuse_prompt": ("reuse_prompt", bool), "exact": ("exact", bool),
}
OPTIONAL = {"seed", "draft_max", "draft_p_min", "exact", "tie_margin"}  # None: the default rule decides
# The command line's flag for each setting, as range errors name it (validate(names="fields") names the setting).
FLAGS = {"max_tokens": "-n/--n-predict", "temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p",
         "min_p": "--min-p", "draft_max": "--draft-max", "draft_min": "--draft-min", "draft_p_min": "--draft-p-min",
         "lookup_max": "--lookup-max", "mode": "--mode", "seed": "-s/--seed", "sampling_rule": "--sampling-rule",
         "stop": "--stop"}


@dataclass(frozen=True)
class Chunk:
    """One round's worth of output, as `stream` yields it: a fresh value each round."""

    text: str
    tokens: list[int]
    source: str  # which drafter this round's tokens came through ("target": none)
    n_drafted: int
    n_accepted: int
    stats: Stats  # running totals up to and including this round (a copy: later rounds do not change it)
    finish_reason: str | None = None


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str
    prompt_tokens: list[int]

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
                "n_prompt": len(self.prompt_tokens), "stats": self.stats.to_dict()}


def resolve_settings(settings: GenerationSettings | None, overrides: dict, names: str = "flags") -> GenerationSettings:
    """settings with overrides applied, checked (`validate`); stop may be None, one string or a list of them."""
    known = {f.name for f in fields(GenerationSettings)}
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"unknown generation setting(s): {', '.join(sorted(unknown))}")
    s = replace(settings or GenerationSettings(), **overrides)
    return replace(s, stop=stop_strings(s.stop, "stop" if names == "fields" else FLAGS["stop"])).validate(names)


def stop_strings(value, name: str = "--stop") -> tuple[str, ...]:
    """Stop strings as a tuple, from None, one string, or a list or tuple of strings; anything else is one line."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
        return tuple(value)
    raise GGUFSpecError(f"{name} must be a string or a list of strings (got {_short(value)})")


def check_text(text: str, where: str) -> str:
    """Text llama.cpp's tokenizer can take: UTF-8, and bytes that are not (which Python holds as the surrogates
    U+DC80-U+DCFF, as it decodes a command line's, and which go to llama.cpp as the bytes they were). Any other lone
    surrogate (a JSON "\\ud800" with no pair) is one line naming where, instead of an encoder's error deep inside."""
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as e:
        raise GGUFSpecError(f"{where} holds a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}), "
                            "which is not text: send valid Unicode") from None
    return text


def check_prompt_tokens(tokens, n_vocab: int, n_ctx: int | None = None) -> list[int]:
    """Token ids as a list (from a list, tuple, range or numpy array of ints), each below n_vocab, fewer than n_ctx."""
    if isinstance(tokens, np.ndarray) and tokens.ndim == 1:
        tokens = tokens.tolist()
    elif isinstance(tokens, (list, tuple, range)):
        tokens = list(tokens)
    else:
        shape = f"an array of shape {tokens.shape}" if isinstance(tokens, np.ndarray) else type(tokens).__name__
        raise GGUFSpecError(f"prompt_tokens must be a flat list or array of token ids (got {shape})")
    if not tokens:
        raise GGUFSpecError("the prompt is empty; give some text")
    bad = next((t for t in tokens if not isinstance(t, (int, np.integer)) or not 0 <= t < n_vocab), None)
    if bad is not None:
        raise GGUFSpecError(f"prompt_tokens holds {bad!r}, not a token id of this model (0 to {n_vocab - 1})")
    if n_ctx is not None and len(tokens) >= n_ctx:
        raise GGUFSpecError(f"the prompt is {len(tokens)} tokens, longer than the context (n_ctx={n_ctx}); raise -c or "
                            "shorten the prompt")
    return tokens


def check_messages(messages, where: str = "messages") -> list[dict]:
    """Chat messages as a template needs them: a non-empty list of {"role": str, "content": str} (extra keys
    allowed), a content of OpenAI's text parts ([{"type": "text", "text": ...}]) flattened into one string, one
    part a line, as llama-server does; anything else is one line naming the first bad entry."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, (list, tuple)) or not messages:
        raise GGUFSpecError(f"{where} must be a non-empty list of {{\"role\": ..., \"content\": ...}} dicts "
                            f"(got {_short(messages)})")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), (str, list)):
            raise GGUFSpecError(f"{where}[{i}] must be a dict with a `role` string and a `content` string "
                                f"(got {_short(m)})")
        content = m["content"] if isinstance(m["content"], str) else _text_parts(m["content"], f"{where}[{i}].content")
        check_text(m["role"], f"{where}[{i}].role")
        out.append({**m, "content": check_text(content, f"{where}[{i}].content")})
    return out


def _text_parts(parts: list, where: str) -> str:
    """OpenAI's content parts, text alone: their texts one a line (llama.cpp's common_chat_msgs_parse_oaicompat)."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"a part of type {kind!r}" if isinstance(kind, str) else f"{_short(part)}"
            raise GGUFSpecError(f"{where}[{j}] is {what}: this model takes text parts alone "
                                "({\"type\": \"text\", \"text\": ...})")
        if not isinstance(part.get("text"), str):
            raise GGUFSpecError(f"{where}[{j}].text must be a string (got {_short(part.get('text'))})")
        texts.append(part["text"])
    return "\n".join(texts)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Stream:
    """Chunks from a generator, as a stream whose error stays: once a round raised GGUFSpecError (a stream superseded,
    its Engine closed), each later next() raises it again, where an ended generator would stop with a bare
    StopIteration; close() ends it (and frees what the generator holds)."""

    def __init__(self, chunks: Iterator[Chunk]):
        self._chunks, self._error = chunks, None

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        if self._error is not None:
            raise self._error
        try:
            return next(self._chunks)
        except GGUFSpecError as e:
            self._error = e
            raise

    def close(self) -> None:
        self._error = None
        self._chunks.close()


def keeps_its_error(chunks: Callable[..., Iterator[Chunk]]) -> Callable[..., Stream]:
    """A generator function of Chunks made a function that returns its chunks as a `Stream`."""
    @functools.wraps(chunks)
    def stream(*args, **kwargs) -> Stream:
        return Stream(chunks(*args, **kwargs))

    return stream


class Generation:
    """The parts of one generation. model/ctx: what it decodes on (the target, or the draft for
    the draft alone); drafter: None for plain decoding; draft_max: the round's drafting budget."""

    def __init__(self, s: GenerationSettings, prompt_tokens: list[int], model, ctx, drafter: Drafter | None,
                 verification: Verification, draft_max: int):
        self.settings, self.prompt_tokens = s, prompt_tokens
        self.model, self.ctx, self.drafter = model, ctx, drafter
        self.verification, self.draft_max = verification, draft_max if drafter is not None else 0
        self.rng = np.random.default_rng(s.seed)
        seed = s.seed if s.seed is not None else int(np.random.SeedSequence().entropy % (MAX_SEED + 1))
        ahead = getattr(model, "cpu_waits", False)  # a target on a GPU: noise is made while it decodes
        self.noise = PositionNoise(seed, ctx.n_vocab, ahead=ahead) if not s.greedy and s.rule == "coupled" else None
        self.stats = Stats(mode=s.mode, n_prompt=len(prompt_tokens))
        self.steps: Steps | None = None  # once the prompt is in (`prefill`)
        self._reused: int | None = None  # prompt tokens kept from the cache, once the prompt is started
        self.text = TextAssembler(model.token_to_piece, model.eog_mask, stop=s.stop, max_tokens=s.max_tokens,
                                  ignore_eos=s.ignore_eos)

    def begin(self) -> Chunk:
        """Prefill, reset the drafter, and the first round's chunk (the token of the prompt's last row); later
        rounds are `steps.plan` and `steps.finish`, each turned into a chunk by `take`."""
        chunk = None
        while chunk is None:
            chunk = self.prefill()
        return chunk

    @property
    def begun(self) -> bool:
        """Whether the prompt is in and rounds may be stepped."""
        return self.steps is not None

    def prefill(self, chunk: int | None = None) -> Chunk | None:
        """Evaluate the prompt (chunk: only its next piece, up to where an aligned chunk of that many tokens ends, so
        a server's running requests go on between pieces); once its last token is in, reset the drafter and return
        the first round's chunk, else None."""
        s = self.settings
        start = time.perf_counter()
        if self._reused is None:
            self._reused = self.stats.n_reused = self.ctx.start(self.prompt_tokens, reuse=s.reuse_prompt)
        logits = prefill_piece(self.ctx, self.prompt_tokens, chunk)
        if logits is not None and self.drafter is not None:
            self.drafter.reset(self.prompt_tokens, reuse=s.reuse_prompt)
        self.stats.prompt_seconds += time.perf_counter() - start
        if logits is None:
            return None
        self.steps = Steps(self.ctx, self.drafter, self.prompt_tokens, logits, s, self.rng, max_tokens=s.max_tokens,
                           draft_max=self.draft_max, draft_min=s.draft_min, verification=self.verification,
                           noise=self.noise)
        return self.take(self.steps.first())

    def chunks(self, before_round: Callable[[], None] = lambda: None) -> Iterator[Chunk]:
        """Prefill, then a Chunk per round until the text ends; before_round runs before each round."""
        try:
            chunk = self.begin()
            yield chunk
            while chunk.finish_reason is None and not self.steps.done:
                before_round()
                chunk = self.take(self.steps.finish(self.steps.plan()))
                yield chunk
        finally:
            self.close()

    def close(self) -> None:
        if self.noise is not None:
            self.noise.close()

    def take(self, r: Round) -> Chunk:
        new_tokens, shown, finish = self.text.add(r.tokens)
        self.stats.add(r, len(new_tokens))
        return Chunk(shown, new_tokens, r.source, r.n_drafted, r.n_accepted, self.stats.copy(), finish)
