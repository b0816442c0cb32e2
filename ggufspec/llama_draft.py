"""A GGUF draft model for llama-cpp-python's own `Llama(draft_model=...)`.

    from llama_cpp import Llama
    from ggufspec import GGUFDraftModel

    llm = Llama(model_path="target.gguf", draft_model=GGUFDraftModel("draft.gguf", target="target.gguf"),
                logits_all=True)

`Llama.generate` hands a draft model the whole history (the evaluated context plus the token
it just sampled), evaluates [last] + the proposal in one batch, keeps the proposed tokens that
equal its own samples and rewinds at the first difference: the output is the target's, greedy
or sampled. What was accepted is not reported; it shows in the next call's history, which is how
this drafter learns it. The draft model's KV cache follows the history (`ModelDrafter`): a
rejected tail is rewound, a new prompt that shares a prefix with the last one (a chat's next
turn) reuses it, nothing is evaluated twice.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from .backend import Context, LlamaDraftModel, Model
from .drafters import Draft, LookupDrafter, ModelDrafter
from .errors import GGUFSpecError
from .sampling import SamplingParams
from .speculative import Round
from .system import check_threads

MODES = ("auto", "draft", "lookup")
GREEDY = SamplingParams()  # proposals are the draft's argmax: Llama keeps only what it samples itself


class GGUFDraftModel(LlamaDraftModel):
    """Drafts for a `llama_cpp.Llama` with a second GGUF model, prompt lookup, or whichever pays.

    draft: a .gguf path or a registry name. target: the target's .gguf path (or name); with it the
    vocabularies are checked now and what a target step and a verify batch cost is measured (once per
    machine, cached), so mode "auto" proposes nothing where drafting does not pay, and proposals stay
    short enough that Llama's verify batch is bit-identical to one-token decoding where this backend
    has such batches (exact=None; True/False force it): greedy text is then Llama's own exactly.
    """

    def __init__(self, draft=None, *, target=None, mode: str = "auto", num_pred_tokens: int = 4, n_ctx: int = 4096,
                 n_batch: int = 512, n_gpu_layers: int = 0, n_threads: int | None = None, exact: bool | None = None,
                 registry=None, offline: bool = False):
        from .auto import AutoDrafter
        from .compat import check_compatible
        from .costs import LONG_KV, costs_for
        from .models import load_registry, resolve_model

        if mode not in MODES:
            raise GGUFSpecError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
        if n_ctx < 8:
            raise GGUFSpecError(f"n_ctx must be at least 8 (got {n_ctx})")
        if num_pred_tokens < 1:
            raise GGUFSpecError(f"num_pred_tokens must be at least 1 (got {num_pred_tokens})")
        check_threads(n_threads, "n_threads")
        if mode == "auto" and target is None:
            raise GGUFSpecError("mode 'auto' needs target=TARGET.gguf to measure what drafting costs; "
                                "or pick mode='draft' or mode='lookup'")
        self.mode, self.num_pred_tokens = mode, num_pred_tokens
        self.model = self.ctx = None
        if draft is None and mode != "lookup":
            raise GGUFSpecError(f"mode {mode!r} needs a draft model (a .gguf path or a registry name)")
        reg = load_registry(registry)
        target_path = resolve_model(str(target), reg, offline=offline) if target is not None else None
        try:
            if mode != "lookup":
                self.model = Model(resolve_model(str(draft), reg, offline=offline), n_gpu_layers=n_gpu_layers, role="draft")
                self.ctx = Context(self.model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads)
            costs, target_n_vocab = None, None
            if target_path is not None:
                with Model(target_path, role="target") as t:
                    target_n_vocab = t.n_vocab
                    if self.model is not None:
                        check_compatible(t, self.model)
                    with Context(t, n_ctx=LONG_KV + 32, n_batch=16, n_threads=n_threads) as tctx:
                        costs = costs_for(tctx, self.ctx)
        except BaseException:
            self.close()
            raise
        # [last] + draft stays a bit-exact batch (none: no drafting), and past the KV length where
        # exactness was seen nothing is proposed: greedy text is then Llama's own exactly.
        self.exact = costs is not None and (exact if exact is not None else costs.exact_batch >= 2)
        if self.exact:
            self.num_pred_tokens = min(num_pred_tokens, costs.exact_batch - 1)
        self.costs = costs
        self.lookup = LookupDrafter()
        self.model_drafter = ModelDrafter(self.model, self.ctx, target_n_vocab=target_n_vocab) if self.model is not None else None
        self._attached = None  # the Llama this drafter serves (see attach)
        if mode == "auto":
            # Llama verifies [last] + draft in one batch: no exact chunks.
            self.drafter = AutoDrafter(costs, exact=False, exact_batch=costs.exact_batch, lookup=self.lookup,
                                       model=self.model_drafter)
        else:
            self.drafter = self.model_drafter if mode == "draft" else self.lookup
        self._rng = np.random.default_rng(0)
        self._history: list[int] = []
        self._pending: tuple[Draft, float] | None = None  # the last proposal and when it was handed over
        self.stats = {"calls": 0, "drafted": 0, "accepted": 0, "by_source": {}}

    def attach(self, llama) -> None:
        """Serve this `llama_cpp.Llama`: check the draft's vocabulary against its model (one
        GGUFSpecError naming the mismatch) and size the drafts to its vocabulary. Done on the first
        call if not before; call it yourself to hear of a bad pair before generating."""
        from .backend import LlamaVocab
        from .compat import check_compatible

        if self._attached is llama:
            return
        if self.model is not None:
            vocab = LlamaVocab(llama)
            check_compatible(vocab, self.model)
            self.model_drafter = ModelDrafter(self.model, self.ctx, target_n_vocab=vocab.n_vocab)
            if self.mode == "draft":
                self.drafter = self.model_drafter
            elif self.mode == "auto":
                self.drafter.model = self.model_drafter
        _make_room_for_logits(llama)
        self._attached = llama

    def __call__(self, input_ids, /, **kwargs) -> np.ndarray:
        if self._attached is None:
            caller = sys._getframe(1).f_locals.get("self")  # Llama.generate calls its draft_model
            if caller is not None and hasattr(caller, "_model"):
                self.attach(caller)
        history = [int(x) for x in input_ids]
        now = time.perf_counter()
        if history[: len(self._history)] == self._history and self._history:
            self._observe(history, now)
        else:
            self._start(history)
        n = self.num_pred_tokens
        if self.exact and self.costs.exact_kv is not None and len(history) + n > self.costs.exact_kv:
            n = 0
        draft = self.drafter.propose(history, n, GREEDY, self._rng) if n else Draft([], source=self.mode)
        self._history, self._pending = history, (draft, time.perf_counter())
        self.stats["calls"] += 1
        return np.array(draft.tokens[: self.num_pred_tokens], dtype=np.intc)

    def _start(self, history: list[int]) -> None:
        """A new generation (or a retry, or a chat's next turn): drafters start over, the draft
        model's KV cache keeps whatever prefix it shares with the new history."""
        self._pending = None
        self.lookup.reset(history)
        if self.model_drafter is not None:
            self.model_drafter.follow()

    def _observe(self, history: list[int], now: float) -> None:
        """What the target kept of the last proposal, read from how the history went on."""
        if self._pending is None:
            return
        draft, handed = self._pending
        grown = history[len(self._history):]
        n_accepted = 0
        while n_accepted < min(len(draft.tokens), len(grown) - 1) and grown[n_accepted] == draft.tokens[n_accepted]:
            n_accepted += 1
        r = Round(grown, len(draft.tokens), n_accepted, draft.seconds, now - handed, draft)
        self.drafter.observe(r)
        if draft.tokens:
            self.stats["drafted"] += len(draft.tokens)
            self.stats["accepted"] += n_accepted
            by = self.stats["by_source"].setdefault(draft.source, {"drafted": 0, "accepted": 0})
            by["drafted"] += len(draft.tokens)
            by["accepted"] += n_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.stats["accepted"] / self.stats["drafted"] if self.stats["drafted"] else 0.0

    def close(self) -> None:
        for name in ("ctx", "model"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
            setattr(self, name, None)

    def __del__(self):
        self.close()


def _make_room_for_logits(llama) -> None:
    """llama-cpp-python sizes `Llama.scores` from the constructor's `logits_all` (n_batch rows when it
    is False), but a draft model makes `eval` write a row per evaluated token at its position: past
    n_batch tokens that breaks ("could not broadcast input array"). Give it the n_ctx rows it will
    write. np.zeros maps pages lazily, so only rows actually written take memory. A prompt longer than
    n_batch has already failed before a draft model is first called: pass logits_all=True."""
    scores = getattr(llama, "scores", None)
    n_ctx = getattr(llama, "_n_ctx", None)
    if not isinstance(scores, np.ndarray) or not n_ctx or scores.shape[0] >= n_ctx:
        return
    grown = np.zeros((n_ctx, scores.shape[1]), dtype=scores.dtype)
    grown[: scores.shape[0]] = scores
    llama.scores = grown
