"""The Python API: open a target (and optionally a draft), then stream or generate.

    from ggufspec import Engine
    with Engine("target.gguf", draft="draft.gguf") as engine:
        result = engine.generate("def fib(n):", max_tokens=64)
        print(result.text, result.stats.acceptance_rate)

`stream` yields a `Chunk` per round; `generate` drains it into a `Result`. The CLI and the
benchmark are both thin consumers of `stream`.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Iterator

import numpy as np

from .auto import AutoDrafter
from .backend import Closing, Context, Model, set_verbose
from .compat import check_compatible
from .costs import costs_for
from .drafters import Drafter, LookupDrafter, ModelDrafter
from .errors import GGUFSpecError
from .prompts import check_messages
from .rpc import placement
from .system import check_threads
from .sampling import SAMPLING_RULES, PositionNoise, SamplingParams
from .speculative import DEFAULT_TIE_MARGIN, Verification, prefill, rounds
from .text import TextAssembler

# auto: per round, whatever pays (no draft / lookup / draft model); draft: the draft model;
# lookup: prompt n-grams; target: no drafting; draft-alone: the draft model generating by
# itself (a baseline for the benchmark: its text is the draft's, not the target's).
MODES = ("auto", "target", "draft", "lookup", "draft-alone")
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class GenerationSettings(SamplingParams):
    """Everything that shapes one generation (the sampling fields included). `validate()` names
    the flag of a bad value."""

    max_tokens: int = 128
    seed: int | None = None
    mode: str = "auto"
    draft_max: int = 4
    draft_min: int = 0
    draft_p_min: float = 0.0
    # Prompt lookup copies runs of the prompt: its drafts are free, so they may be longer than the
    # draft model's; in lookup and auto modes the measured costs choose how much of a copy pays.
    lookup_max: int = 32
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    tie_margin: float = DEFAULT_TIE_MARGIN
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

    def validate(self) -> "GenerationSettings":
        checks = [
            (self.max_tokens >= 1, f"-n/--n-predict must be at least 1 (got {self.max_tokens})"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"--temp must be a finite number >= 0 (got {self.temperature})"),
            (self.top_k >= 0, f"--top-k must be >= 0 (got {self.top_k}; 0 turns it off)"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1] (got {self.top_p})"),
            (0 <= self.min_p < 1, f"--min-p must be in [0, 1) (got {self.min_p})"),
            (self.draft_max >= 1, f"--draft-max must be at least 1 (got {self.draft_max})"),
            (0 <= self.draft_min <= self.draft_max,
             f"--draft-min must be between 0 and --draft-max={self.draft_max} (got {self.draft_min})"),
            (0 <= self.draft_p_min < 1, f"--draft-p-min must be in [0, 1) (got {self.draft_p_min})"),
            (self.lookup_max >= 1, f"--lookup-max must be at least 1 (got {self.lookup_max})"),
            (self.tie_margin >= 0, f"tie_margin must be >= 0 (got {self.tie_margin})"),
            (self.mode in MODES, f"--mode must be one of {', '.join(MODES)} (got {self.mode!r})"),
            (self.seed is None or 0 <= self.seed <= MAX_SEED,
             f"-s/--seed must be between 0 and 2**63-1 = {MAX_SEED} (got {self.seed})"),
            (self.sampling_rule in (None, *SAMPLING_RULES),
             f"--sampling-rule must be one of {', '.join(SAMPLING_RULES)} (got {self.sampling_rule!r})"),
            (all(isinstance(x, str) and x for x in self.stop),
             f"--stop: every stop string must be non-empty text (got {list(self.stop)!r}; an empty one would stop at once)"),
        ]
        for ok, message in checks:
            if not ok:
                raise GGUFSpecError(message)
        return self


@dataclass
class Stats:
    """Counters and timings of one generation."""

    mode: str = "target"
    n_prompt: int = 0
    n_reused: int = 0  # prompt tokens kept from the KV cache (reuse_prompt), not evaluated again
    rounds_by_source: dict = field(default_factory=dict)  # which drafter each round used ("target": none)
    prompt_seconds: float = 0.0
    n_generated: int = 0
    generation_seconds: float = 0.0
    rounds: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    full_accepts: int = 0  # rounds whose every drafted token was accepted
    accepted_histogram: list[int] = field(default_factory=list)  # [rounds with 0 accepted, 1, 2, ...]
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    ties_settled: int = 0
    tie_gaps: list[float] = field(default_factory=list)

    @property
    def n_timed(self) -> int:
        """The tokens generation_seconds covers: all but the first, which comes with the prompt's batch
        (its time is prompt_seconds, the time to first token), as llama.cpp counts."""
        return max(0, self.n_generated - 1)

    @property
    def tokens_per_second(self) -> float:
        return self.n_timed / self.generation_seconds if self.generation_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """alpha: accepted / drafted."""
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """tau: tokens produced per target pass (accepted drafts + the target's own)."""
        return self.n_generated / self.rounds if self.rounds else 0.0

    @property
    def overhead_seconds(self) -> float:
        return max(0.0, self.generation_seconds - self.draft_seconds - self.target_seconds)

    def add(self, r) -> None:
        self.rounds += 1
        self.rounds_by_source[r.source] = self.rounds_by_source.get(r.source, 0) + 1
        self.n_drafted += r.n_drafted
        self.n_accepted += r.n_accepted
        if r.n_drafted:
            while len(self.accepted_histogram) <= r.n_accepted:
                self.accepted_histogram.append(0)
            self.accepted_histogram[r.n_accepted] += 1
            self.full_accepts += r.n_accepted == r.n_drafted
        self.draft_seconds += r.draft_seconds
        self.target_seconds += r.target_seconds
        self.ties_settled += r.ties_settled
        self.tie_gaps.extend(r.tie_gaps)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tokens_per_second=self.tokens_per_second, acceptance_rate=self.acceptance_rate,
                 tokens_per_round=self.tokens_per_round, overhead_seconds=self.overhead_seconds)
        return d

    def summary(self) -> str:
        line = (f"{self.n_generated} tokens in {self.generation_seconds:.2f} s = {self.tokens_per_second:.1f} tok/s "
                f"(prompt {self.n_prompt} tokens{f', {self.n_reused} reused' if self.n_reused else ''}, "
                f"{self.prompt_seconds:.2f} s) | mode {self.mode}")
        if self.n_drafted:
            line += (f" | drafted {self.n_drafted}, accepted {self.n_accepted} (α {self.acceptance_rate:.1%}), "
                     f"τ {self.tokens_per_round:.2f} tokens/round")
        return line


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


def _settings(settings: GenerationSettings | None, overrides: dict) -> GenerationSettings:
    known = {f.name for f in fields(GenerationSettings)}
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"unknown generation setting(s): {', '.join(sorted(unknown))}")
    s = replace(settings or GenerationSettings(), **overrides)
    if s.stop is None:
        s = replace(s, stop=())
    elif isinstance(s.stop, str):
        s = replace(s, stop=(s.stop,))
    elif not isinstance(s.stop, tuple):
        s = replace(s, stop=tuple(s.stop))
    return s.validate()


class Engine(Closing):
    """A target model, an optional draft model, their contexts, and the drafters.

    Load once, generate many times: each generation starts from a cleared KV cache.
    Use as a context manager or call `close()`; handles are freed in reverse order.
    rpc: llama.cpp RPC servers ("host:port", a list or comma-separated) whose devices take the
    target's layers (-ngl counts them as for a GPU); devices / draft_devices: the device names
    each model may use (llama.cpp's -dev / -devd; [] or "none" for the CPU alone).
    """

    def __init__(self, target, draft=None, *, n_ctx: int = 4096, n_batch: int = 512, n_threads: int | None = None,
                 n_gpu_layers: int = 0, draft_n_gpu_layers: int = 0, verbose: bool = False, measure: bool = True,
                 remeasure: bool = False, rpc=None, devices=None, draft_devices=None):
        if n_ctx < 8:
            raise GGUFSpecError(f"-c/--ctx-size must be at least 8 (got {n_ctx})")
        if n_batch < 1:
            raise GGUFSpecError(f"-b/--batch-size must be at least 1 (got {n_batch})")
        check_threads(n_threads)
        set_verbose(verbose)
        self.target_model = self.target_ctx = self.draft_model = self.draft_ctx = None
        # Which devices each model may use (llama.cpp's -dev / -devd); with RPC servers the target
        # spreads over them and the draft stays on this machine.
        target_devices, draft_devices = placement(rpc, devices, draft_devices)
        try:
            self.target_model = Model(target, n_gpu_layers=n_gpu_layers, role="target", devices=target_devices)
            self.target_ctx = Context(self.target_model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads)
            if draft is not None:
                self.draft_model = Model(draft, n_gpu_layers=draft_n_gpu_layers, role="draft", devices=draft_devices)
                check_compatible(self.target_model, self.draft_model)
                self.draft_ctx = Context(self.draft_model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads)
        except BaseException:
            self.close()
            raise
        # Costs of a decode here and the largest bit-exact batch: measured once, then cached
        # (remeasure=True measures again, e.g. after the machine's load or clocks changed).
        self.costs = costs_for(self.target_ctx, self.draft_ctx, refresh=remeasure) if measure or remeasure else None
        self.exact_batch = self.costs.exact_batch if self.costs else 1
        self.model_drafter = ModelDrafter(self.draft_model, self.draft_ctx,
                                          target_n_vocab=self.target_model.n_vocab) if self.draft_model else None
        self.lookup_drafter = LookupDrafter()
        self._auto: dict[tuple[str, bool], AutoDrafter] = {}
        # One generation at a time: a generation started in another thread waits for the running one;
        # one started in the same thread supersedes its unfinished stream (resuming that one raises).
        self._turn = threading.Lock()
        self._holder: int | None = None  # the thread whose generation runs
        self._generation = 0  # the running generation's number

    def exact_for(self, setting: bool | None) -> bool:
        """Whether greedy rounds verify in bit-exact chunks: as set, or by default when this
        backend has bit-identical batches of 2 tokens or more."""
        return setting if setting is not None else self.exact_batch >= 2

    def placement(self) -> dict:
        """Where llama.cpp put each model's weights, as it reported it: {role: {buffer: MiB}}."""
        out = {"target": self.target_model.buffers}
        if self.draft_model is not None:
            out["draft"] = self.draft_model.buffers
        return out

    def cost_report(self) -> dict:
        """What `ggufspec costs` prints: the measured table, the ceiling, where each drafter pays."""
        exact = self.exact_for(None)
        return {"target": str(self.target_model.path), "draft": str(self.draft_model.path) if self.draft_model else None,
                "threads": self.target_ctx.n_threads, "exact": exact,
                **self.costs.report(self.exact_batch if exact else None, self.target_model.info.file_type)}

    @property
    def n_ctx(self) -> int:
        return self.target_ctx.n_ctx

    # -- prompts ------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | bytes | None = None, messages: list[dict] | None = None) -> list[int]:
        """Prompt text or bytes (tokenized as llama.cpp does: bytes as they are, whatever their
        encoding) or chat messages (through the GGUF's template)."""
        self._check_open()
        if (prompt is None) == (messages is None):
            raise GGUFSpecError("give exactly one of a prompt or chat messages")
        if messages is not None:
            tokens = self.target_model.tokenize_chat(check_messages(messages))
        elif isinstance(prompt, (str, bytes)):
            tokens = self.target_model.tokenize(prompt)
        else:
            raise GGUFSpecError(f"the prompt must be text or bytes (got {type(prompt).__name__}); "
                                "token ids go in prompt_tokens=")
        return self._check_prompt(tokens)

    def _check_prompt(self, tokens: list[int]) -> list[int]:
        if not tokens:
            raise GGUFSpecError("the prompt is empty; give some text")
        n_vocab = self.target_model.n_vocab
        bad = next((t for t in tokens if not isinstance(t, (int, np.integer)) or not 0 <= t < n_vocab), None)
        if bad is not None:
            raise GGUFSpecError(f"prompt_tokens holds {bad!r}, not a token id of this model (0 to {n_vocab - 1})")
        if len(tokens) >= self.n_ctx:
            raise GGUFSpecError(
                f"the prompt is {len(tokens)} tokens, longer than the context (n_ctx={self.n_ctx}); raise -c or shorten the prompt"
            )
        return tokens

    # -- generation ---------------------------------------------------------------------------

    def _drafter(self, mode: str, exact: bool) -> Drafter | None:
        """auto: the cost-aware planner over lookup and the draft model; lookup: the same planner
        over lookup alone (a copy is drafted as far as it pays, and not at all where it does not),
        or, without measured costs, lookup drafts of --draft-max tokens."""
        if mode == "auto" and self.costs is None:
            raise GGUFSpecError("mode 'auto' needs the measured costs (Engine(measure=True))")
        if mode == "auto" or (mode == "lookup" and self.costs is not None):
            # One per engine, mode and verification kind: what it learns about alpha and costs carries over.
            if (mode, exact) not in self._auto:
                self._auto[mode, exact] = AutoDrafter(self.costs, exact=exact, exact_batch=self.exact_batch,
                                                      lookup=self.lookup_drafter,
                                                      model=self.model_drafter if mode == "auto" else None)
            return self._auto[mode, exact]
        if mode in ("draft", "draft-alone") and self.model_drafter is None:
            raise GGUFSpecError(f"mode '{mode}' needs a draft model (-md DRAFT)")
        return {"draft": self.model_drafter, "lookup": self.lookup_drafter}.get(mode)

    def stream(self, prompt: str | bytes | None = None, *, messages: list[dict] | None = None,
               prompt_tokens: list[int] | None = None, settings: GenerationSettings | None = None,
               **overrides) -> Iterator[Chunk]:
        """Yield a Chunk per round; the last one carries finish_reason ("stop", "length" or "stop_string").

        Give one of prompt, messages or prompt_tokens. One generation runs at a time: a stream begun
        in another thread waits until this one ends (or is closed); a generation begun in the same
        thread before this stream ends supersedes it, and resuming it raises GGUFSpecError.
        """
        s = _settings(settings, overrides)
        self._check_open()
        given = [x for x in (prompt, messages, prompt_tokens) if x is not None]
        if len(given) != 1:
            raise GGUFSpecError("give exactly one of a prompt, chat messages or prompt_tokens")
        generation = self._begin()
        try:
            yield from self._run(generation, s, prompt, messages, prompt_tokens)
        finally:
            self._end(generation)

    def _run(self, generation: int, s: GenerationSettings, prompt, messages, prompt_tokens) -> Iterator[Chunk]:
        self._check_open()
        exact = self.exact_for(s.exact)
        drafter = self._drafter(s.mode, exact)
        if prompt_tokens is None:
            prompt_tokens = self.tokenize_prompt(prompt, messages)
        else:
            self._check_prompt(prompt_tokens)
        prompt_tokens = [int(t) for t in prompt_tokens]
        model, ctx = (self.draft_model, self.draft_ctx) if s.mode == "draft-alone" else (self.target_model, self.target_ctx)
        if self.model_drafter:
            self.model_drafter.p_min = s.draft_p_min
        stats = Stats(mode=s.mode, n_prompt=len(prompt_tokens))
        start = time.perf_counter()
        logits, stats.n_reused = prefill(ctx, prompt_tokens, reuse=s.reuse_prompt)
        if drafter is not None:
            drafter.reset(prompt_tokens, reuse=s.reuse_prompt)
        stats.prompt_seconds = time.perf_counter() - start

        text = TextAssembler(model.token_to_piece, model.eog_mask, stop=s.stop, max_tokens=s.max_tokens,
                             ignore_eos=s.ignore_eos)
        on_target = ctx is self.target_ctx
        verification = Verification(self.exact_batch if on_target else 1, exact, s.tie_margin,
                                    self.costs.exact_kv if on_target and self.costs else None,
                                    self.costs.chunk() if on_target and self.costs else None)
        draft_max = s.draft_max
        if isinstance(drafter, AutoDrafter):  # lookup drafts run to --lookup-max, the model's to --draft-max
            drafter.model_max, draft_max = s.draft_max, max(s.draft_max, s.lookup_max)
        coupled = not s.greedy and s.rule == "coupled"
        seed = s.seed if s.seed is not None else int(np.random.SeedSequence().entropy % (MAX_SEED + 1))
        noise = PositionNoise(seed, ctx.n_vocab) if coupled else None
        steps = rounds(ctx, drafter, prompt_tokens, logits, s, np.random.default_rng(s.seed), max_tokens=s.max_tokens,
                       draft_max=draft_max if drafter is not None else 0, draft_min=s.draft_min,
                       verification=verification, noise=noise)
        while True:
            if generation != self._generation:
                raise GGUFSpecError("this stream was superseded by a later generation on the same Engine; "
                                    "finish or close() a stream before starting another")
            self._check_open()
            round_start = time.perf_counter()
            r = next(steps, None)
            if r is None:
                return
            stats.add(r)
            new_tokens, shown, finish = text.add(r.tokens)
            stats.n_generated += len(new_tokens)
            # the rounds' own time: the caller's time between chunks is not generation time
            stats.generation_seconds += time.perf_counter() - round_start
            yield Chunk(shown, new_tokens, r.source, r.n_drafted, r.n_accepted, copy.deepcopy(stats), finish)
            if finish is not None:
                return

    def _begin(self) -> int:
        """Wait for this generation's turn (see `stream`); returns its number."""
        me = threading.get_ident()
        if self._holder != me:
            self._turn.acquire()
            self._holder = me
        self._generation += 1
        return self._generation

    def _end(self, generation: int) -> None:
        if generation == self._generation and self._holder is not None:
            self._holder = None
            self._turn.release()

    def _check_open(self) -> None:
        if self.target_ctx is None:
            raise GGUFSpecError("this Engine is closed; open a new one")

    def generate(self, prompt: str | bytes | None = None, *, messages: list[dict] | None = None,
                 prompt_tokens: list[int] | None = None, settings: GenerationSettings | None = None,
                 **overrides) -> Result:
        """Generate to completion; returns text, generated token ids, stats and why it stopped."""
        if sum(x is not None for x in (prompt, messages, prompt_tokens)) != 1:
            raise GGUFSpecError("give exactly one of a prompt, chat messages or prompt_tokens")
        if prompt_tokens is None:
            prompt_tokens = self.tokenize_prompt(prompt, messages)
        parts, tokens, chunk = [], [], None
        stream = self.stream(prompt_tokens=prompt_tokens, settings=settings, **overrides)
        try:
            for chunk in stream:
                parts.append(chunk.text)
                tokens.extend(chunk.tokens)
        finally:
            stream.close()
        return Result("".join(parts), tokens, chunk.stats, chunk.finish_reason, [int(t) for t in prompt_tokens])

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Free the models and contexts. A generation running in another thread finishes first."""
        turn = getattr(self, "_turn", None)
        waited = turn is not None and self._holder not in (None, threading.get_ident()) and turn.acquire()
        try:
            self._free()
        finally:
            if waited:
                turn.release()

    def _free(self) -> None:
        for name in ("draft_ctx", "draft_model", "target_ctx", "target_model"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
                setattr(self, name, None)
