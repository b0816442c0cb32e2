"""The Python API: open a target (and optionally a draft), then stream or generate.

    from ggufspec import Engine
    with Engine("target.gguf", draft="draft.gguf") as engine:
        result = engine.generate("def fib(n):", max_tokens=64)
        print(result.text, result.stats.acceptance_rate)

`stream` yields a `Chunk` per round; `generate` drains it into a `Result`. The CLI and the
benchmark are both thin consumers of `stream`.
"""

from __future__ import annotations

import codecs
import copy
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
from .rpc import placement
from .sampling import SamplingParams
from .speculative import DEFAULT_TIE_MARGIN, Verification, prefill, rounds

# auto: per round, whatever pays (no draft / lookup / draft model); draft: the draft model;
# lookup: prompt n-grams; target: no drafting; draft-alone: the draft model generating by
# itself (a baseline for the benchmark: its text is the draft's, not the target's).
MODES = ("auto", "target", "draft", "lookup", "draft-alone")


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

    def validate(self) -> "GenerationSettings":
        checks = [
            (self.max_tokens >= 1, f"-n/--n-predict must be at least 1 (got {self.max_tokens})"),
            (self.temperature >= 0, f"--temp must be >= 0 (got {self.temperature})"),
            (self.top_k >= 0, f"--top-k must be >= 0 (got {self.top_k}; 0 turns it off)"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1] (got {self.top_p})"),
            (0 <= self.min_p < 1, f"--min-p must be in [0, 1) (got {self.min_p})"),
            (self.draft_max >= 1, f"--draft-max must be at least 1 (got {self.draft_max})"),
            (0 <= self.draft_min <= self.draft_max,
             f"--draft-min must be between 0 and --draft-max={self.draft_max} (got {self.draft_min})"),
            (0 <= self.draft_p_min < 1, f"--draft-p-min must be in [0, 1) (got {self.draft_p_min})"),
            (self.tie_margin >= 0, f"tie_margin must be >= 0 (got {self.tie_margin})"),
            (self.mode in MODES, f"--mode must be one of {', '.join(MODES)} (got {self.mode!r})"),
            (self.seed is None or 0 <= self.seed < 2**63, f"-s/--seed must be a non-negative integer (got {self.seed})"),
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


def _find_stop(text: str, stops: tuple[str, ...], since: int) -> int:
    """Index of the earliest stop string that ends after position `since`, or -1."""
    hits = [i for x in stops if (i := text.find(x, max(0, since - len(x) + 1))) >= 0]
    return min(hits, default=-1)


def _settings(settings: GenerationSettings | None, overrides: dict) -> GenerationSettings:
    known = {f.name for f in fields(GenerationSettings)}
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"unknown generation setting(s): {', '.join(sorted(unknown))}")
    s = replace(settings or GenerationSettings(), **overrides)
    if isinstance(s.stop, str):
        s = replace(s, stop=(s.stop,))
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
        if n_threads is not None and n_threads < 1:
            raise GGUFSpecError(f"-t/--threads must be at least 1 (got {n_threads})")
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
        self.model_drafter = ModelDrafter(self.draft_model, self.draft_ctx) if self.draft_model else None
        self.lookup_drafter = LookupDrafter()
        self._auto: dict[bool, AutoDrafter] = {}

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
                **self.costs.report(self.exact_batch if exact else None)}

    @property
    def n_ctx(self) -> int:
        return self.target_ctx.n_ctx

    # -- prompts ------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | bytes | None = None, messages: list[dict] | None = None) -> list[int]:
        """Prompt text or bytes (tokenized as llama.cpp does: bytes as they are, whatever their
        encoding) or chat messages (through the GGUF's template)."""
        if (prompt is None) == (messages is None):
            raise GGUFSpecError("give exactly one of a prompt or chat messages")
        tokens = self.target_model.tokenize_chat(messages) if messages is not None else self.target_model.tokenize(prompt)
        return self._check_prompt(tokens)

    def _check_prompt(self, tokens: list[int]) -> list[int]:
        if not tokens:
            raise GGUFSpecError("the prompt is empty; give some text")
        if len(tokens) >= self.n_ctx:
            raise GGUFSpecError(
                f"the prompt is {len(tokens)} tokens, longer than the context (n_ctx={self.n_ctx}); raise -c or shorten the prompt"
            )
        return tokens

    # -- generation ---------------------------------------------------------------------------

    def _drafter(self, mode: str, exact: bool) -> Drafter | None:
        if mode == "auto":
            if self.costs is None:
                raise GGUFSpecError("mode 'auto' needs the measured costs (Engine(measure=True))")
            # One per engine and verification kind: what it learns about alpha and costs carries over.
            if exact not in self._auto:
                self._auto[exact] = AutoDrafter(self.costs, exact=exact, exact_batch=self.exact_batch,
                                                lookup=self.lookup_drafter, model=self.model_drafter)
            return self._auto[exact]
        if mode in ("draft", "draft-alone") and self.model_drafter is None:
            raise GGUFSpecError(f"mode '{mode}' needs a draft model (-md DRAFT)")
        return {"draft": self.model_drafter, "lookup": self.lookup_drafter}.get(mode)

    def stream(self, prompt: str | bytes | None = None, *, messages: list[dict] | None = None,
               prompt_tokens: list[int] | None = None, settings: GenerationSettings | None = None,
               **overrides) -> Iterator[Chunk]:
        """Yield a Chunk per round; the last one carries finish_reason ("stop", "length" or "stop_string")."""
        s = _settings(settings, overrides)
        exact = self.exact_for(s.exact)
        drafter = self._drafter(s.mode, exact)
        if prompt_tokens is None:
            prompt_tokens = self.tokenize_prompt(prompt, messages)
        else:
            self._check_prompt(prompt_tokens)
        model, ctx = (self.draft_model, self.draft_ctx) if s.mode == "draft-alone" else (self.target_model, self.target_ctx)
        if self.model_drafter:
            self.model_drafter.p_min = s.draft_p_min
        stats = Stats(mode=s.mode, n_prompt=len(prompt_tokens))
        start = time.perf_counter()
        logits, stats.n_reused = prefill(ctx, prompt_tokens, reuse=s.reuse_prompt)
        if drafter is not None:
            drafter.reset(prompt_tokens, reuse=s.reuse_prompt)
        stats.prompt_seconds = time.perf_counter() - start

        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text, emitted, finish = "", 0, None
        eog = model.eog_mask
        hold = max((len(x) for x in s.stop), default=1) - 1  # text that may still become a stop string
        on_target = ctx is self.target_ctx
        verification = Verification(self.exact_batch if on_target else 1, exact, s.tie_margin,
                                    self.costs.exact_kv if on_target and self.costs else None)
        gen_start = time.perf_counter()
        for r in rounds(ctx, drafter, prompt_tokens, logits, s, np.random.default_rng(s.seed), max_tokens=s.max_tokens,
                        draft_max=s.draft_max if drafter is not None else 0, draft_min=s.draft_min,
                        verification=verification):
            stats.add(r)
            new_tokens = []
            for t in r.tokens:
                if eog[t] and not s.ignore_eos:
                    finish = "stop"
                    break
                new_tokens.append(t)
                before = len(text)
                text += decoder.decode(model.token_to_piece(t))
                cut = _find_stop(text, s.stop, before)
                if cut >= 0:
                    text, finish = text[:cut], "stop_string"
                    break
                if stats.n_generated + len(new_tokens) >= s.max_tokens:
                    finish = "length"
                    break
            stats.n_generated += len(new_tokens)
            stats.generation_seconds = time.perf_counter() - gen_start
            if finish is None:
                upto = max(emitted, len(text) - hold)
            else:
                if finish != "stop_string":
                    text += decoder.decode(b"", final=True)
                upto = len(text)
            yield Chunk(text[emitted:upto], new_tokens, r.source, r.n_drafted, r.n_accepted, copy.deepcopy(stats), finish)
            emitted = upto
            if finish is not None:
                return

    def generate(self, prompt: str | bytes | None = None, *, messages: list[dict] | None = None,
                 prompt_tokens: list[int] | None = None, settings: GenerationSettings | None = None,
                 **overrides) -> Result:
        """Generate to completion; returns text, generated token ids, stats and why it stopped."""
        if prompt_tokens is None:
            prompt_tokens = self.tokenize_prompt(prompt, messages)
        parts, tokens, chunk = [], [], None
        for chunk in self.stream(prompt_tokens=prompt_tokens, settings=settings, **overrides):
            parts.append(chunk.text)
            tokens.extend(chunk.tokens)
        return Result("".join(parts), tokens, chunk.stats, chunk.finish_reason, list(prompt_tokens))

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        for name in ("draft_ctx", "draft_model", "target_ctx", "target_model"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
                setattr(self, name, None)
