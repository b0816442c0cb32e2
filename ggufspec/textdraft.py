"""A draft model of another vocabulary: speculation across tokenizers, through text.

Two rules, after Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for
Heterogeneous Vocabularies" (ICML 2025), as transformers ships them:

- greedy, SLEM (string-level exact match): the draft writes in its own vocabulary; its text is tokenized by the
  target's tokenizer and proposed as target tokens. The target keeps a token only where it is its own argmax, so any
  proposal is safe; a good one is the text the target would write.
- sampled, either that greedy text as a deterministic proposal (q one-hot, as prompt lookup's), or on the tokens
  both vocabularies share by text (TLI, token-level intersection): the draft's logits restricted to those tokens
  and moved to the target's ids, one to one, so q is a distribution over target ids. Either way the verification
  rules run unchanged (the coupled rule with a seed, Leviathan's without); which of the two drafts is chosen per
  pair from the tokens each has had kept (`RuleChoice`).

The draft's KV cache follows the history's text: the target's accepted tokens are written out as text (control
tokens, which have none to share, are left out), and the text is tokenized by the draft's tokenizer a window at a
time: the last `WINDOW` draft tokens are tokenized again with the new text, since a merge may reach back across
them; what comes before stays, so the draft's cache is never evaluated again from the start.
"""

from __future__ import annotations

import codecs
import time
from typing import Callable, Protocol

import numpy as np

from .core import Draft, Target
from .drafters import ModelDrafter, draft_tokens
from .sampling import PositionNoise, SamplingParams

WINDOW = 4  # draft tokens tokenized again with each new text: a merge rarely reaches further back
WORD_BACK = 8  # how far before the window or the overlap a word's start is looked for (`_word_start`)
OVERLAP = 3  # target tokens written before a draft's text when tokenizing it, so its first token merges as the target's
GREEDY = SamplingParams()
NO_TOKEN = -1e30  # the logit of a draft token the target has not got (exp() of it is 0, and it stays finite)


class Bridge(Protocol):
    """What a text drafter needs of the two tokenizers (llama.vocab.TextBridge is one; tests/fake.py another)."""

    draft_prefix: list[int]  # what the draft's tokenizer starts a text with (its BOS, where it adds one)
    draft_stops: np.ndarray  # draft tokens a draft stops at: its control tokens and ends of generation

    def target_piece(self, token: int) -> bytes: ...  # b"" for a control token
    def draft_piece(self, token: int) -> bytes: ...
    def to_draft(self, text: bytes) -> list[int]: ...  # no BOS, special tokens not parsed
    def to_target(self, text: bytes) -> list[int]: ...
    def shared(self) -> tuple[np.ndarray, np.ndarray]: ...  # (draft ids, target ids) of the same texts, one to one


class RuleChoice:
    """Which of the two sampled rules drafts better for a pair, from the tokens each has had kept a round (an
    exponential average). Both are lossless; which gains more depends on the pair: measured on Qwen2.5-Coder 1.5B
    with Gemma 3 270M at temperature 0.7, the greedy text kept 35% of its drafted tokens and the shared tokens 23%
    (seeded, 30% and 20%), while a draft that is the target in other ids keeps nearly all on the shared tokens.
    Each is tried first; then the better one drafts, the other every EXPLORE-th round so a change is seen."""

    RULES = ("text", "shared")
    EXPLORE = 8
    DECAY = 0.1

    def __init__(self):
        self.kept = {rule: None for rule in self.RULES}
        self.picked = {rule: 0 for rule in self.RULES}
        self.rounds = 0

    def pick(self) -> str:
        self.rounds += 1
        untried = [rule for rule in self.RULES if self.kept[rule] is None]
        if untried:
            rule = min(untried, key=self.picked.get)
            self.picked[rule] += 1
            return rule
        best, other = sorted(self.RULES, key=lambda rule: -self.kept[rule])
        return other if self.rounds % self.EXPLORE == 0 else best

    def learn(self, rule: str, kept: int) -> None:
        now = self.kept[rule]
        self.kept[rule] = float(kept) if now is None else now + self.DECAY * (kept - now)


def complete_utf8(text: bytes) -> bytes:
    """`text` less a last character cut short (a draft may end inside one; the target would not propose half)."""
    decoder = codecs.getincrementaldecoder("utf-8")("ignore")
    decoder.decode(text, final=False)
    pending = len(decoder.getstate()[0])
    return text[: len(text) - pending] if pending else text


class TextDrafter(ModelDrafter):
    """A draft model whose vocabulary is not the target's: proposals and q in the target's ids (see the module)."""

    name = "draft"
    continues_copies = False

    def __init__(self, ctx: Target, bridge: Bridge, *, target_n_vocab: int, p_min: float = 0.0,
                 sampled_rule: str | None = None):
        super().__init__(ctx, p_min=p_min)
        self.bridge = bridge
        # sampled rounds draft by "text" (the greedy text, q one-hot) or on the "shared" tokens (q the draft's),
        # whichever has kept more tokens a round for this pair (None), or by the rule named here
        self.sampled_rule = sampled_rule
        self.choice = RuleChoice()  # shared by this drafter's copies: what one generation learns, the next uses
        self._last: tuple | None = None  # the last sampled proposal: (its rule, the history's length, its tokens)
        self._to_draft: dict = {}  # a shared target id -> the draft's (filled in place: this drafter's copies share it)
        self.target_vocab = target_n_vocab  # the proposals' ids (the inner ModelDrafter works in the draft's)
        self._text_of: list[int] = []  # the target history converted so far
        self._text = b""
        self._draft: list[int] = []  # the draft's tokenization of _text (after draft_prefix)
        self._ends: list[int] = []  # where each of those ends in _text

    def _own_history(self, history: list[int]) -> list[int]:
        """The history as the draft's tokens: its text, tokenized by the draft a window at a time."""
        bridge = self.bridge
        n = len(self._text_of)
        if len(history) < n or history[:n] != self._text_of:  # not an extension: a new text
            self._text_of, self._text, self._draft, self._ends, n = [], b"", [], [], 0
            self._committed = min(self._committed, len(bridge.draft_prefix))
        new = b"".join(bridge.target_piece(t) for t in history[n:])
        self._text_of = list(history)
        if new:
            keep = self._word_start(self._draft, max(0, len(self._draft) - WINDOW), bridge.draft_piece)
            start = self._ends[keep - 1] if keep else 0
            self._text += new
            tail, ends = self._tokenize_from(start)
            if (ends[-1] if ends else start) != len(self._text):  # the tokenizer changed the text (a space added)
                keep, (tail, ends) = 0, self._tokenize_from(0)  # so it is tokenized all anew
            self._draft = self._draft[:keep] + tail
            self._ends = self._ends[:keep] + ends
            self._committed = min(self._committed, len(bridge.draft_prefix) + keep)  # the cache agrees up to here at most
        return bridge.draft_prefix + self._draft

    @staticmethod
    def _word_start(tokens: list[int], i: int, piece) -> int:
        """i, or the nearest token before it (up to WORD_BACK) whose text starts a word (a space first): tokenizing
        from there is tokenizing a piece of a text as the whole text would be (a tokenizer that puts a space before
        a text tokenizes it exactly, and byte-level BPE splits words before it merges)."""
        for j in range(i, max(0, i - WORD_BACK) - 1, -1):
            if j == 0 or piece(tokens[j]).startswith(b" "):
                return j
        return i

    def _tokenize_from(self, start: int) -> tuple[list[int], list[int]]:
        """The draft's tokens for the text from byte `start` on, and where each ends in the text."""
        tokens, ends, at = self.bridge.to_draft(self._text[start:]), [], start
        for t in tokens:
            at += len(self.bridge.draft_piece(t))
            ends.append(at)
        return tokens, ends

    def reset(self, prompt_tokens: list[int], *, reuse: bool = False, lazy: bool = False) -> None:
        super().reset(prompt_tokens, reuse=reuse, lazy=lazy)
        self._committed = min(self._committed, self._stable(len(self.bridge.draft_prefix) + len(self._draft)))

    def _stable(self, n_draft_history: int) -> int:
        """How much of a draft history of this length later histories keep (the window is tokenized again)."""
        return max(len(self.bridge.draft_prefix), n_draft_history - WINDOW)

    def propose(self, history: list[int], draft_max: int, params: SamplingParams, rng: np.random.Generator,
                *, noise: PositionNoise | None = None, p_min: float | None = None,
                may_extend: Callable[[int], bool] | None = None) -> Draft:
        start = time.perf_counter()
        p_min = self.p_min if p_min is None else p_min
        own = self._own_history(history)
        draft_max = min(draft_max, self.ctx.n_ctx - len(own))
        if draft_max <= 0 or not own:
            return Draft(tokens=[], source=self.name)
        pending = self._sync_own(own)
        caught_up = self._caught_up(len(own), pending)
        logits = self.ctx.decode(pending, logits="last")[0]
        self._committed = min(len(self.kv_tokens), self._stable(len(own)))
        self._learn(history)
        rule = "text" if params.greedy else self.sampled_rule or self.choice.pick()
        if rule == "text":
            tokens, qs = self._by_text(history, logits, draft_max, p_min), None
        else:
            tokens, qs = self._on_shared(history, logits, draft_max, params, rng, noise, p_min, may_extend)
        self._last = (rule, len(history), tokens) if not params.greedy else None
        self._seen = len(history) + len(tokens) - 1  # about as many of the target's tokens as the cache then holds
        return Draft(tokens=tokens, q=qs, seconds=time.perf_counter() - start, source=self.name, caught_up=caught_up)

    def _learn(self, history: list[int]) -> None:
        """How many tokens of the last sampled proposal the history kept, told to the choice of rule."""
        if self._last is not None and len(history) > self._last[1]:
            rule, n, tokens = self._last
            kept = next((i for i, t in enumerate(tokens) if n + i >= len(history) or history[n + i] != t), len(tokens))
            self.choice.learn(rule, kept)
        self._last = None

    def _by_text(self, history, logits, draft_max, p_min) -> list[int]:
        """SLEM: the draft's greedy text, as the target's tokenizer writes it after the history's last tokens (a
        deterministic proposal: sampled rounds verify it as one, q one-hot)."""
        bridge = self.bridge
        decode = lambda x: self.ctx.decode([x], logits="last")[0]
        own, _ = draft_tokens(logits, decode, 0, draft_max, GREEDY, None, noise=None, p_min=p_min, may_extend=None,
                              n_vocab=self.ctx.n_vocab)
        stop = next((i for i, t in enumerate(own) if bridge.draft_stops[t]), len(own))
        text = complete_utf8(b"".join(bridge.draft_piece(t) for t in own[:stop]))
        if not text:
            return []
        before = history[self._word_start(history, max(0, len(history) - OVERLAP), bridge.target_piece):]
        lead = b"".join(bridge.target_piece(t) for t in before)
        tokens = bridge.to_target(lead + text) if lead else []
        if tokens[: len(before)] == before:  # the history's last tokens stay as they are: what follows continues them
            tokens = tokens[len(before):]
        else:  # the draft's first characters merge into the history's last token: its text alone
            tokens = bridge.to_target(text)
        return tokens[:draft_max]

    def _on_shared(self, history, logits, draft_max, params, rng, noise, p_min, may_extend):
        """TLI: the draft's distribution on the shared tokens, in the target's ids; each proposal is fed back to
        the draft as its own token."""
        draft_ids, target_ids = self.bridge.shared()
        to_draft = self._to_draft
        if not to_draft:
            to_draft.update(zip(target_ids.tolist(), draft_ids.tolist()))

        def moved(row: np.ndarray) -> np.ndarray:
            out = np.full(self.target_vocab, NO_TOKEN, dtype=np.float32)
            out[target_ids] = row[draft_ids]
            return out

        return draft_tokens(moved(logits), lambda x: moved(self.ctx.decode([to_draft[x]], logits="last")[0]),
                            len(history), draft_max, params, rng, noise=noise, p_min=p_min, may_extend=may_extend,
                            n_vocab=self.target_vocab)
