"""A GGUF draft model for llama-cpp-python's own `Llama`.

    from llama_cpp import Llama
    from ggufspec import GGUFDraftModel

    draft = GGUFDraftModel("draft.gguf", mode="auto")
    llm = Llama(model_path="target.gguf", draft_model=draft)
    draft.attach(llm)  # checks the pair, measures costs through llm's own context

`Llama.generate` hands a draft model the whole history (the evaluated context plus the token
it just sampled), evaluates [last] + the proposal in one batch, keeps the proposed tokens that
equal its own samples and rewinds at the first difference: the output is the target's, greedy
or sampled. What was accepted is not reported; it shows in the next call's history, which is how
this drafter learns it. The draft model's KV cache follows the history (`ModelDrafter`): a
rejected tail is rewound, a new prompt that shares a prefix with the last one (a chat's next
turn) reuses it, nothing is evaluated twice.
"""

from __future__ import annotations

import numpy as np

from .llama.backend import Context, Model
from .llama.gguf_info import read_info
from .llama.vocab import LlamaModel
from .llama.runtime import LlamaDraftModel
from .core import LLAMA_MODES, MTP_MODES, Draft, Round
from .auto import make_drafter
from .drafters import LookupDrafter, ModelDrafter
from .textdraft import TextDrafter
from .errors import GGUFSpecError, check_count, check_layers
from .sampling import SamplingParams
from .llama.system import check_threads
from .verification import Verification

GREEDY = SamplingParams()  # proposals are the draft's argmax: Llama keeps only what it samples itself


class GGUFDraftModel(LlamaDraftModel):
    """Drafts for a `llama_cpp.Llama` with a second GGUF model, prompt lookup, or whichever pays.

    draft: a .gguf path or a registry name (None for mode "lookup"). `attach(llm)` (once, before
    generating) ties it to the Llama it serves: the vocabularies are checked, and what a target step
    and a verify batch cost is measured through that Llama's own context (its flash attention, threads
    and offload; once per machine, cached), so mode "auto" proposes nothing where drafting does not
    pay, and proposals stay short enough that Llama's verify batch is bit-identical to one-token
    decoding where that context has such batches (exact=None; True/False force it): greedy text is
    then Llama's own exactly. target: a .gguf path or name whose vocabulary is checked now (its
    weights are not loaded), so a bad pair is one error before the Llama loads.
    """

    def __init__(self, draft=None, *, target=None, mode: str = "auto", num_pred_tokens: int = 4, n_ctx: int = 4096,
                 n_batch: int = 512, n_gpu_layers: int = 0, n_threads: int | None = None, exact: bool | None = None,
                 registry=None, offline: bool = False):
        from .models.resolve import load_registry, resolve_model

        if mode in MTP_MODES:
            raise GGUFSpecError(
                f"mode {mode!r} cannot serve llama-cpp-python's Llama: it loads a model without its MTP layers and "
                "hands a draft model no hidden states; use ggufspec's Engine (`ggufspec generate --mode mtp`), or "
                "llama-cpp-python's example server (examples/server/server.py, its draft-mtp)")
        if mode not in LLAMA_MODES:
            raise GGUFSpecError(f"mode must be one of {', '.join(LLAMA_MODES)} (got {mode!r})")
        check_count(n_ctx, "n_ctx", 8)
        check_count(n_batch, "n_batch", 1)
        check_count(num_pred_tokens, "num_pred_tokens", 1)
        check_layers(n_gpu_layers, "n_gpu_layers")  # -1: every layer
        check_threads(n_threads, "n_threads")
        if draft is None and mode != "lookup":
            raise GGUFSpecError(f"mode {mode!r} needs a draft model (a .gguf path or a registry name)")
        self.mode, self.wanted, self.num_pred_tokens, self._exact = mode, num_pred_tokens, num_pred_tokens, exact
        self.model = self.ctx = None
        self._closed = False
        reg = load_registry(registry)
        target_path = resolve_model(str(target), reg, offline=offline) if target is not None else None
        if target_path is not None and read_info(target_path).keeps_state:  # refused from its header, before it loads
            raise cannot_rewind(target_path)
        try:
            if mode != "lookup":
                self.model = Model(resolve_model(str(draft), reg, offline=offline), n_gpu_layers=n_gpu_layers, role="draft")
                self.ctx = Context(self.model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads)
                if target_path is not None:  # the vocabulary only: the weights are the Llama's to load
                    with Model(target_path, role="target", vocab_only=True) as t:
                        self._drafter_for(t)
        except BaseException:
            self.close()
            raise
        self.costs = None
        self.verification = Verification()
        self.lookup = LookupDrafter()  # its index follows the Llama's history (reset in _start)
        self.model_drafter = ModelDrafter(self.ctx) if self.model is not None else None
        # auto is built at attach, when the Llama's costs are known; until then it drafts by lookup
        self.drafter = self.lookup if mode == "auto" else make_drafter(mode, self.verification, None,
                                                                      model=self.model_drafter, lookup=self.lookup)[0]
        self._attached = None  # the Llama this drafter serves
        self._rng = np.random.default_rng(0)
        self._history: list[int] = []
        self._pending: Draft | None = None  # the last proposal
        self.stats = {"calls": 0, "drafted": 0, "accepted": 0, "by_source": {}}

    def attach(self, llama) -> None:
        """Serve this `llama_cpp.Llama` (call once, before generating; it sets `llama.draft_model` if it
        is not this draft yet). Checks the draft's vocabulary against its model (one GGUFSpecError naming
        the mismatch), sizes the drafts to its vocabulary, and measures (or reads from the cache) what a
        step and a verify batch cost in its own context; this clears the Llama's KV cache."""
        from .llama.measure import costs_for

        if self._closed:  # its model and context were freed: nothing could draft, and measuring would use none
            raise GGUFSpecError("GGUFDraftModel: this draft was closed; make a new one to attach")
        if self._attached is llama:
            return
        target = LlamaModel(llama)
        if self.model is not None:
            self.model_drafter = self._drafter_for(target)
        borrowed = Context.of_llama(llama)
        if not borrowed.cuttable:  # Llama rewinds a rejected draft with a partial seq_rm, which such a memory refuses
            borrowed.close()
            raise cannot_rewind(target.path)
        # only a Llama this draft can serve is changed: a refused one keeps generating alone
        if llama.draft_model is not self:  # a draft given after construction: Llama then needs every row's logits
            llama.draft_model, llama._logits_all = self, True
        _make_room_for_logits(llama)
        try:
            self.costs = costs_for(borrowed, self.ctx)
        finally:
            borrowed.close()
            llama.reset()  # its cache was used for measuring: evaluate the next prompt afresh
        # Llama verifies [last] + draft in one batch: exact means keeping that batch within the exact size.
        self.verification = Verification.of(self.costs, self._exact)
        self.num_pred_tokens = self.verification.exact_draft_max(0, self.wanted)
        # auto plans with one-batch verification's costs: that is how Llama verifies
        self.drafter, _ = make_drafter(self.mode, Verification.of(self.costs, False), self.costs,
                                       model=self.model_drafter, lookup=self.lookup, draft_max=self.wanted)
        self._attached = llama

    def _drafter_for(self, target) -> ModelDrafter:
        """The draft model's drafter for this target's vocabulary: its own ids (the same vocabulary, or padded), or
        through text (another tokenizer: `textdraft`); one GGUFSpecError where neither can serve."""
        from .llama.compat import text_pairing
        from .llama.vocab import TextBridge

        if text_pairing(target, self.model) is None:
            return ModelDrafter(self.ctx, target_n_vocab=target.n_vocab)
        return TextDrafter(self.ctx, TextBridge(target, self.model), target_n_vocab=target.n_vocab)

    def __call__(self, input_ids, /, **kwargs) -> np.ndarray:
        if self._attached is None:
            raise GGUFSpecError("GGUFDraftModel: call draft.attach(llm) with the Llama it drafts for before generating")
        if self._closed:  # its model was freed: drafting with it would crash llama.cpp
            raise GGUFSpecError("GGUFDraftModel: this draft was closed; make a new one (and attach it) to draft again")
        history = [int(x) for x in input_ids]
        if history[: len(self._history)] == self._history and self._history:
            self._observe(history)
        else:
            self._start(history)
        # Llama evaluates [last] + the proposal after len(history) - 1 tokens into its input_ids, sized by
        # the n_ctx it was given (llama.cpp may round its context up): never propose past that room
        n = self.verification.exact_draft_max(len(history), self.num_pred_tokens)
        if _room(self._attached) is not None:
            n = min(n, max(0, _room(self._attached) - len(history)))
        draft = self.drafter.propose(history, n, GREEDY, self._rng) if n else Draft(tokens=[], source=self.mode)
        self._history, self._pending = history, draft
        self.stats["calls"] += 1
        return np.array(draft.tokens[: self.num_pred_tokens], dtype=np.intc)

    def _start(self, history: list[int]) -> None:
        """A new generation (or a retry, or a chat's next turn): drafters start over, the draft
        model's KV cache keeps whatever prefix it shares with the new history."""
        self._pending = None
        self.lookup.reset(history)
        if self.model_drafter is not None:
            self.model_drafter.follow()

    def _observe(self, history: list[int]) -> None:
        """What the target kept of the last proposal, read from how the history went on. The target's
        time is not known here (Llama's sampling and the caller's time sit between two calls), so
        auto learns acceptance from it, and costs from what was measured at attach."""
        if self._pending is None:
            return
        draft = self._pending
        grown = history[len(self._history):]
        n_accepted = 0
        while n_accepted < min(len(draft.tokens), len(grown) - 1) and grown[n_accepted] == draft.tokens[n_accepted]:
            n_accepted += 1
        self.drafter.observe(Round(tokens=grown, n_past=len(self._history) - 1, n_drafted=len(draft.tokens),
                                   n_accepted=n_accepted, draft_seconds=draft.seconds, draft=draft))
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
        self._closed = True
        for name in ("ctx", "model"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
            setattr(self, name, None)

    def __del__(self):
        self.close()


def cannot_rewind(path) -> GGUFSpecError:
    return GGUFSpecError(f"{path}: a recurrent or hybrid model, whose state llama-cpp-python's Llama cannot rewind "
                         "after a rejected draft; speculate on it with ggufspec's Engine or `ggufspec generate`")


def _room(llama) -> int | None:
    """How many tokens the Llama can hold: its input_ids' length (what it was given as n_ctx); None: not known."""
    ids = getattr(llama, "input_ids", None)
    return len(ids) if isinstance(ids, np.ndarray) else getattr(llama, "_n_ctx", None)


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
