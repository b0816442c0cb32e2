"""The loop's own types, with no llama.cpp in them: what a drafter proposes (`Draft`), what a round
produced (`Round`), the modes, a generation's counters (`Stats`) and what the loop needs of a
target (`Target`). A numpy table of logits satisfies `Target`, so the loop, the sampling rules and
auto are tested on one in milliseconds (tests/fake.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import ContextManager, Literal, Protocol, Sequence

import numpy as np

# The chunk a server's prompts are evaluated (and kept for later prompts) in: llama-bench's prompt rate at -ub 128 was
# within noise of -ub 512 on an AVX-512 Xeon, 2 threads, Q8_0 and Q4_K_M (a GPU's may be lower: serve --prompt-chunk),
# and a chat's next turn evaluates again at most 127 tokens it shares with the last.
PROMPT_CHUNK = 128


@dataclass(frozen=True)
class Mode:
    """A way to generate: which drafter speculates for the target, if any."""

    name: str
    help: str
    speculates: bool = False  # its text is the target's own (the guarantees hold)
    needs_draft_model: bool = False
    head: str = ""  # drafts with a head reading the target's hidden states: mtp (its own layers), eagle3, dflash
    for_llama: bool = False  # a draft for llama-cpp-python's `Llama` can work this way (GGUFDraftModel)
    on_draft: bool = False  # decodes on the draft model's context, with no target (a baseline)


# The one table of modes, in the order the benchmark shows them; the CLI, the benchmark, `ggufspec tune`,
# GGUFDraftModel and the server read it.
MODE_TABLE = (
    Mode("target", "the target alone: plain decoding, no draft"),
    Mode("draft-alone", "the draft model generating by itself (a baseline: its text is the draft's)",
         needs_draft_model=True, on_draft=True),
    Mode("draft", "the draft model proposes, the target verifies", speculates=True, needs_draft_model=True,
         for_llama=True),
    Mode("lookup", "n-grams of the prompt and output are copied, no second model", speculates=True, for_llama=True),
    Mode("mtp", "the target's own multi-token-prediction (MTP/NextN) layers propose, the target verifies",
         speculates=True, head="mtp"),
    Mode("eagle3", "an EAGLE-3 draft (-md, trained for this target, reading its hidden states) proposes",
         speculates=True, head="eagle3"),
    Mode("dflash", "a DFlash draft (-md, trained for this target) proposes a block of tokens in one pass",
         speculates=True, head="dflash"),
    Mode("auto", "per round, whatever the measured costs say pays: no draft, lookup, the MTP layers, an EAGLE-3 or "
         "DFlash draft, or the draft model", speculates=True, for_llama=True),
)
MODES = tuple(m.name for m in MODE_TABLE)
DEFAULT_MODE = "auto"
DRAFTING_MODES = tuple(m.name for m in MODE_TABLE if m.speculates)  # their text is the target's
MODEL_MODES = tuple(m.name for m in MODE_TABLE if m.needs_draft_model)
HEAD_MODES = {m.name: m.head for m in MODE_TABLE if m.head}  # mode -> the head it drafts with
MTP_MODES = tuple(m for m, head in HEAD_MODES.items() if head == "mtp")
HIDDEN_DRAFT_MODES = tuple(m for m, head in HEAD_MODES.items() if head != "mtp")  # a draft GGUF given with -md
LLAMA_MODES = tuple(m.name for m in MODE_TABLE if m.for_llama)
DRAFT_ALONE_MODES = tuple(m.name for m in MODE_TABLE if m.on_draft)


def runnable_modes(draft_model: bool, file_head: str | None, heads: set[str], costs: bool) -> tuple[str, ...]:
    """The modes an Engine can run: with a draft model or not, the head its -md file is (mtp, eagle3, dflash: the
    draft modes draft with it), the heads it has, and measured costs (auto needs them)."""
    def runs(mode: str) -> bool:
        if mode in DRAFT_ALONE_MODES or (mode in MODEL_MODES and file_head is None):
            return draft_model
        head = file_head if mode in MODEL_MODES else HEAD_MODES.get(mode)
        return (head is None or head in heads) and (mode != "auto" or costs)

    return tuple(m for m in MODES if runs(m))


Logits = Literal["all", "last", "none"]


class Target(Protocol):
    """What the loop uses of a model and its context (backend.Context is one; tests/fake.py another)."""

    n_ctx: int
    n_batch: int
    n_vocab: int

    @property
    def n_past(self) -> int: ...
    @property
    def tokens(self) -> list[int]: ...
    def decode(self, tokens: Sequence[int], logits: Logits = "last") -> np.ndarray: ...
    def truncate(self, n: int) -> None: ...
    def no_rewind(self) -> ContextManager: ...  # a block whose decodes will not be rewound (see backend.Context)
    def start(self, prompt_tokens: list[int], reuse: bool = False) -> int: ...


@dataclass(kw_only=True)
class Draft:
    """A drafter's proposal."""

    tokens: list[int]
    q: list[np.ndarray] | None = None  # distributions the tokens were drawn from; None = one-hot (deterministic)
    seconds: float = 0.0
    source: str = "target"  # which drafter proposed ("target": none did)
    agreement: int = 0  # lookup: how many tokens before the copied place agree with the history
    resumed: bool = False  # lookup: the copy resumes past a token the text changed (LookupDrafter.match)
    copied: int = 0  # lookup+draft: the copy's tokens that lead the draft, the model's after them
    # a lazy draft model's first use: the prompt tokens it decoded this round (a one-off, not its cost per draft token)
    caught_up: int = 0
    # auto: verify this copy in one batch judged with the margin, though exact chunks exist (they cost more here)
    one_batch: bool = False
    predicted_rate: float | None = None  # auto: the tokens per second its cost table expected of this round
    table_rate: float | None = None  # auto: the same from the table alone, before what this source delivered corrected it


@dataclass(kw_only=True)
class Round:
    """What one step produced."""

    tokens: list[int]  # accepted drafts + the target's token
    n_past: int = 0  # tokens in the target's cache when the round began
    n_drafted: int = 0
    n_accepted: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    draft: Draft = field(default_factory=lambda: Draft(tokens=[]))  # what the drafter proposed (before --draft-min)
    ties_settled: int = 0
    tie_gaps: list[float] = field(default_factory=list)
    seconds: float = 0.0  # the whole round: planning, drafting, verifying, the drafter's bookkeeping
    shared: bool = False  # verified from a batch decoded with other sequences (its target_seconds: that batch's)

    @property
    def source(self) -> str:
        """Which drafter this round's verified tokens came from ("target": none)."""
        return self.draft.source if self.n_drafted else "target"


@dataclass
class Stats:
    """Counters and timings of one generation (or, merged, of several)."""

    mode: str = "target"
    n_prompt: int = 0
    n_reused: int = 0  # prompt tokens kept from the KV cache (reuse_prompt), not evaluated again
    rounds_by_source: dict = field(default_factory=dict)  # which drafter each round used ("target": none)
    prompt_seconds: float = 0.0
    n_generated: int = 0
    generation_seconds: float = 0.0  # the rounds' own time, not the caller's between chunks
    rounds: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    full_accepts: int = 0  # rounds whose every drafted token was accepted
    accepted_histogram: list[int] = field(default_factory=list)  # [rounds with 0 accepted, 1, 2, ...]
    draft_seconds: float = 0.0
    # of which in rounds whose draft model caught up on the prompt (Draft.caught_up), and the tokens they drafted
    caught_up_seconds: float = 0.0
    caught_up_drafted: int = 0
    target_seconds: float = 0.0
    ties_settled: int = 0
    tie_gaps: list[float] = field(default_factory=list)
    n_timed: int = 0  # the tokens generation_seconds covers (see add)
    # auto's prediction, time-weighted: the sum over predicted rounds of seconds x predicted tokens per second
    predicted_tokens: float = 0.0
    predicted_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.n_timed / self.generation_seconds if self.generation_seconds > 0 else 0.0

    @property
    def predicted_rate(self) -> float | None:
        """Tokens per second auto's cost table expected of its rounds (None: no round was planned by it)."""
        return self.predicted_tokens / self.predicted_seconds if self.predicted_seconds > 0 else None

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

    def add(self, r: Round, n_kept: int | None = None) -> None:
        """Count a round; n_kept: how many of its tokens the output kept (fewer at a stop)."""
        n_kept = len(r.tokens) if n_kept is None else n_kept
        first = self.rounds == 0  # the token drawn from the prompt's row: its time is the prompt's, as llama.cpp counts
        self.rounds += 1
        self.rounds_by_source[r.source] = self.rounds_by_source.get(r.source, 0) + 1
        self.n_generated += n_kept
        self.n_timed += n_kept - (1 if first and n_kept else 0)
        self.generation_seconds += r.seconds
        self.n_drafted += r.n_drafted
        self.n_accepted += r.n_accepted
        if r.n_drafted:
            while len(self.accepted_histogram) <= r.n_accepted:
                self.accepted_histogram.append(0)
            self.accepted_histogram[r.n_accepted] += 1
            self.full_accepts += r.n_accepted == r.n_drafted
        if r.draft.predicted_rate:
            self.predicted_tokens += r.seconds * r.draft.predicted_rate
            self.predicted_seconds += r.seconds
        self.draft_seconds += r.draft_seconds
        if r.draft.caught_up:
            self.caught_up_seconds += r.draft_seconds
            self.caught_up_drafted += r.n_drafted
        self.target_seconds += r.target_seconds
        self.ties_settled += r.ties_settled
        self.tie_gaps.extend(r.tie_gaps)

    @classmethod
    def merge(cls, stats: Sequence["Stats"]) -> "Stats":
        """One Stats summing several (the benchmark's rows): α, τ and shares come out of the sums."""
        out = cls(mode=stats[0].mode if stats else "target")
        for s in stats:
            for f in fields(cls):
                mine, theirs = getattr(out, f.name), getattr(s, f.name)
                if isinstance(mine, dict):
                    for key, n in theirs.items():
                        mine[key] = mine.get(key, 0) + n
                elif f.name == "accepted_histogram":  # element by element
                    mine.extend([0] * (len(theirs) - len(mine)))
                    for k, n in enumerate(theirs):
                        mine[k] += n
                elif isinstance(mine, list):
                    mine.extend(theirs)
                elif f.name != "mode":
                    setattr(out, f.name, mine + theirs)
        return out

    def copy(self) -> "Stats":
        """A copy that later rounds do not change (its lists and dicts are its own). Made for every streamed
        chunk, so made directly (dataclasses.replace and fields() cost four times as much: 40 us a round under
        a profiler, a tenth of a round at a GPU's step on a tiny model)."""
        out = object.__new__(type(self))
        state = out.__dict__
        state.update(self.__dict__)
        for name, value in state.items():
            if type(value) is list or type(value) is dict:
                state[name] = value.copy()
        return out

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
