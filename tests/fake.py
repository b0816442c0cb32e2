"""A numpy target for the loop's tests: a fixed table of logits, no llama.cpp.

The row after position i depends on the tokens at i-1 and i (a table indexed by the pair), so
rewinding, batching and re-decoding must all be right for the text to come out the same. It keeps
the `core.Target` protocol: decode / truncate / start, n_past, tokens, n_ctx, n_batch, n_vocab.
`batch_drift` adds a small deterministic error to rows computed in batches of more than
`exact_batch` tokens, as llama.cpp's batched kernels do, so the tie rule can be tested.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ggufspec.drafters import LookupDrafter
from ggufspec.errors import ContextFullError


class Clock:
    """A stand-in for the `time` module of the loop's modules: only fake targets' decodes move it, by what
    their `seconds(n_tokens)` says a decode costs, so rounds are timed as a machine with those costs would."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def on_clock(monkeypatch) -> Clock:
    """A fake clock for the loop, auto and the drafters: their rounds are timed by what fake targets with a
    clock say their decodes cost, not by Python's speed on a numpy table (which would have auto's guard judge that)."""
    import ggufspec.auto
    import ggufspec.drafters
    import ggufspec.speculative

    clock = Clock()
    for module in (ggufspec.speculative, ggufspec.auto, ggufspec.drafters):
        monkeypatch.setattr(module, "time", clock)
    return clock


class FakeTarget:
    def __init__(self, n_vocab: int = 24, seed: int = 0, *, scale: float = 2.0, n_ctx: int = 512, n_batch: int = 64,
                 batch_drift: float = 0.0, exact_batch: int = 64, table: np.ndarray | None = None,
                 clock: Clock | None = None, seconds=None):
        rng = np.random.default_rng(seed)
        self.table = table if table is not None else rng.normal(size=(n_vocab, n_vocab, n_vocab)) * scale
        self.n_vocab, self.n_ctx, self.n_batch = n_vocab, n_ctx, n_batch
        self.batch_drift, self.exact_batch = batch_drift, exact_batch
        self._drift = np.random.default_rng(seed + 1000).normal(size=(n_ctx, n_vocab)) * batch_drift
        self.tokens: list[int] = []
        self.batches: list[int] = []  # the size of every decode, in order
        self.clock, self.seconds = clock, seconds  # seconds(n_tokens): what a decode costs on the clock

    def like(self, seed: int, closeness: float, **timing) -> "FakeTarget":
        """A draft of this target: its table plus noise (closeness 0: the same model). timing: clock, seconds."""
        noise = np.random.default_rng(seed).normal(size=self.table.shape) * closeness
        return FakeTarget(self.n_vocab, n_ctx=self.n_ctx, n_batch=self.n_batch, table=self.table + noise, **timing)

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def row(self, i: int) -> np.ndarray:
        """The logits row of position i (what the next token is drawn from)."""
        prev = self.tokens[i - 1] if i > 0 else 0
        return self.table[prev, self.tokens[i]]

    def decode(self, tokens, logits: str = "last"):
        tokens = [int(t) for t in tokens]
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextFullError(f"fake: {self.n_past} + {len(tokens)} > n_ctx={self.n_ctx}")
        start = self.n_past
        self.tokens.extend(tokens)
        self.batches.append(len(tokens))
        if self.clock is not None:
            self.clock.now += self.seconds(len(tokens))
        rows = np.stack([self.row(i) for i in range(start, self.n_past)])
        if len(tokens) > self.exact_batch:
            rows = rows + self._drift[start:self.n_past]
        if logits == "none":
            return None
        return rows if logits == "all" else rows[-1:]

    def no_rewind(self):
        return contextlib.nullcontext()

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def clear(self) -> None:
        self.tokens.clear()

    def start(self, prompt_tokens: list[int], reuse: bool = False) -> int:
        self.clear()
        return 0


class NoCopies(LookupDrafter):
    """A prompt lookup that never finds a copy, for tests of the other sources: a fake target's greedy text falls
    into a cycle after some tokens, which the real lookup drafts to the end (the cheapest source there)."""

    def match(self, history, draft_max):
        return [], 0, False


class FakeBridge:
    """Two vocabularies of texts (lists of strings, "" for a control token) and a greedy longest-match tokenizer
    for each: the `textdraft.Bridge` a TextDrafter reads, with no llama.cpp. Characters a vocabulary cannot write
    are dropped (its tokenization then does not give the text back, as with a lossy tokenizer)."""

    def __init__(self, target_texts: list[str], draft_texts: list[str], draft_prefix: list[int] = ()):
        self.target_texts, self.draft_texts = target_texts, draft_texts
        self.draft_prefix = list(draft_prefix)
        self.draft_stops = np.array([t == "" for t in draft_texts])
        self.tokenized = 0  # bytes tokenized for the draft, all told

    def target_piece(self, token: int) -> bytes:
        return self.target_texts[token].encode()

    def draft_piece(self, token: int) -> bytes:
        return self.draft_texts[token].encode()

    @staticmethod
    def _tokenize(texts: list[str], text: bytes) -> list[int]:
        s, out, i = text.decode(), [], 0
        by_text = {t: k for k, t in enumerate(texts) if t}
        longest = max(map(len, by_text))
        while i < len(s):
            n = next((n for n in range(min(longest, len(s) - i), 0, -1) if s[i:i + n] in by_text), 0)
            if n:
                out.append(by_text[s[i:i + n]])
            i += max(n, 1)
        return out

    def to_draft(self, text: bytes) -> list[int]:
        self.tokenized += len(text)
        return self._tokenize(self.draft_texts, text)

    def to_target(self, text: bytes) -> list[int]:
        return self._tokenize(self.target_texts, text)

    def shared(self):
        pairs = [(d, self.target_texts.index(t)) for d, t in enumerate(self.draft_texts) if t and t in self.target_texts]
        ids = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        return ids[:, 0], ids[:, 1]


class ScriptTarget(FakeTarget):
    """A model whose greedy text is a script, position by position, whatever was drafted before it: a text of
    chosen passages (copied from the prompt, or new). As a draft, `wrong` holds the positions where it proposes
    another token than the script's (the target's)."""

    def __init__(self, script: list[int], n_vocab: int, *, wrong=(), clock: Clock | None = None, seconds=None):
        super().__init__(n_vocab, n_ctx=len(script) + 16, n_batch=64, table=np.zeros((1, 1, 1)), clock=clock,
                         seconds=seconds)
        self.script, self.wrong = list(script), set(wrong)

    def row(self, i: int) -> np.ndarray:
        token = self.script[i + 1] if i + 1 < len(self.script) else 0
        if i in self.wrong:
            token = (token + 1) % self.n_vocab
        logits = np.zeros(self.n_vocab)
        logits[token] = 10.0
        return logits
