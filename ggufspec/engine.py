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
import threading
from dataclasses import replace
from typing import Iterator

from .auto import make_drafter
from .llama.backend import Closing, Context, Model
from .llama.dflash import DflashHead
from .llama.draft_fit import is_mtp_file, mtp_file_misfit
from .llama.heads import MtpHead, check_mtp
from .llama.hidden import Eagle3Head
from .llama.recurrent import ROLLBACK_ROWS
from .llama.repack import load as repack_load
from .llama.sequences import decode_together, together
from .llama.runtime import set_verbose, warn_once
from .llama.compat import check_compatible, text_pairing
from .llama.vocab import TextBridge, text_round_trip
from .core import DRAFT_ALONE_MODES, DRAFTING_MODES, HEAD_MODES, MODEL_MODES, MODES, Stats, runnable_modes  # noqa: F401
from .drafters import HeadDrafter, LookupDrafter, ModelDrafter
from .textdraft import TextDrafter
from .errors import GGUFSpecError, check_count, check_layers, exactly_one
from .generation import (Chunk, Generation, GenerationSettings, Result, check_messages, check_prompt_tokens, check_text,
                         keeps_its_error, resolve_settings)
from .batching import Batch
from .llama.gguf_info import check_kv_cache_types, kv_cache_type, read_info
from .llama.measure import costs_for
from .llama.rpc import devices_for
from .llama.system import check_threads
from .text import check_chat_roles
from .verification import Verification

HIDDEN_HEADS = {"eagle3": Eagle3Head, "dflash": DflashHead}  # draft architectures that read the target's hidden states

__all__ = ["Engine", "GenerationSettings", "Chunk", "Result", "Stats", "MODES"]


class Engine(Closing):
    """A target model, an optional draft model, their contexts, and the drafters.

    Load once, generate many times: each generation starts from a cleared KV cache.
    Use as a context manager or call `close()`; handles are freed in reverse order.
    rpc: llama.cpp RPC servers ("host:port", a list or comma-separated) whose devices take the
    target's layers (-ngl counts them as for a GPU); devices / draft_devices: the device names
    each model may use (llama.cpp's -dev / -devd; [] or "none" for the CPU alone); cpu_moe: a mixture-of-experts
    target's layers whose experts stay on the CPU (llama.cpp's --n-cpu-moe N; -1: every layer's, --cpu-moe);
    type_k / type_v: both models' KV cache types (llama.cpp's -ctk / -ctv: "f16", "q8_0", ...).
    mtp: load the target's MTP (NextN) layers, where its GGUF has them, for mode "mtp" and auto (default: True).
    n_seq: sequences each context holds (llama.cpp's -np): `generation(prompt_tokens, settings, slot)` builds a
    generation on sequence `slot`, which `batching.Batch` steps beside the others in one target batch; n_ctx is
    shared by them all; kv_unified: one KV cache for them (llama.cpp's -kvu; llama.sequences says what it costs).
    prompt_chunk: prompts are decoded in chunks of this many tokens at multiples of it (default n_batch), and a
    later prompt that begins the same keeps the whole chunks it shares (reuse_prompt), bit-identically.
    repack: llama.cpp's CPU weight repacking for both models (llama.cpp's --repack / --no-repack); None: as
    measured faster here, once per model and machine (`llama.repack`), where measuring is allowed.
    """

    def __init__(self, target, draft=None, *, n_ctx: int = 4096, n_batch: int = 512, n_threads: int | None = None,
                 n_gpu_layers: int = 0, draft_n_gpu_layers: int = 0, verbose: bool = False, measure: bool = True,
                 remeasure: bool = False, rpc=None, devices=None, draft_devices=None, cpu_moe: int = 0,
                 type_k: str = "f16", type_v: str = "f16", mtp: bool = True, n_seq: int = 1, kv_unified: bool = False,
                 prompt_chunk: int | None = None, repack: bool | None = None):
        check_count(n_ctx, "-c/--ctx-size", 8)
        if prompt_chunk is not None:
            check_count(prompt_chunk, "--prompt-chunk", 1)
        check_count(n_seq, "-np/--parallel", 1)
        check_count(n_batch, "-b/--batch-size", 1)
        check_layers(n_gpu_layers, "-ngl/--n-gpu-layers")  # -1: every layer
        check_layers(draft_n_gpu_layers, "-ngld/--n-gpu-layers-draft")
        check_threads(n_threads)
        cache_types = (type_k, type_v)
        kv_cache_type(type_k, "-ctk/--cache-type-k")
        kv_cache_type(type_v, "-ctv/--cache-type-v")
        set_verbose(verbose)
        self.target_model = self.target_ctx = self.draft_model = self.draft_ctx = self.mtp_model = self.head_model = None
        self.bridge = None  # a draft model of another vocabulary: text between the two (llama.vocab.TextBridge)
        self.vocab_difference = None  # and how the vocabularies differ, in a line
        self.heads: dict = {}  # heads following the target's hidden states, by name: mtp, eagle3, dflash
        self.slot_heads: list[dict] = [{} for _ in range(n_seq)]  # each sequence's (heads: sequence 0's)
        self.file_head: str | None = None  # the head the -md file is (an mtp-*.gguf, an eagle3 or dflash draft)
        # Which devices each model may use (-dev / -devd); RPC servers take the target's layers, not the draft's.
        target_devices, draft_devices = devices_for(rpc, devices, draft_devices)
        try:
            self._load = dict(repack=repack, measure=measure or remeasure, n_threads=n_threads)  # repack.load's
            self.target_model = repack_load(target, n_gpu_layers=n_gpu_layers, role="target", devices=target_devices,
                                            cpu_moe=cpu_moe, mtp=bool(mtp), **self._load)
            check_kv_cache_types(self.target_model.info, *cache_types)
            shape = dict(n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, cache_types=cache_types, n_seq=n_seq,
                         kv_unified=kv_unified, prompt_chunk=prompt_chunk)  # both contexts'
            self.target_ctx = Context(self.target_model, rollback=ROLLBACK_ROWS, **shape)
            self._load_draft(draft, n_gpu_layers=draft_n_gpu_layers, devices=draft_devices, shape=shape)
        except BaseException:
            self.close()
            raise
        # Costs of a decode here and the largest bit-exact batch: measured once, then cached (remeasure: again).
        self.costs = (costs_for(self.target_ctx, self.draft_ctx, refresh=remeasure, heads=list(self.heads.values()))
                      if measure or remeasure else None)
        if self.costs is not None:
            self.costs.experts = self.target_model.info.experts
        # The draft's drafter follows the draft context's cache from one generation to the next.
        self.model_drafter = None
        if self.bridge is not None:
            self.model_drafter = TextDrafter(self.draft_ctx, self.bridge, target_n_vocab=self.target_model.n_vocab)
        elif self.draft_model is not None:
            self.model_drafter = ModelDrafter(self.draft_ctx, target_n_vocab=self.target_model.n_vocab)
        # One generation at a time: a generation started in another thread waits for the running one;
        # one started in the same thread supersedes its unfinished stream (resuming that one raises).
        self._turn = threading.Lock()
        self._holder: int | None = None  # the thread whose generation runs
        self._generation = 0  # the running generation's number

    def _load_draft(self, draft, *, n_gpu_layers, devices, shape: dict) -> None:
        """The -md file, as what it is: the target's MTP layers (a sibling mtp-*.gguf), an EAGLE-3 or DFlash draft
        (a head following the target's context), or a draft model on a context of its own; and the target's own
        MTP head, where it has MTP layers."""
        info = read_info(draft) if draft is not None else None
        if info is not None and is_mtp_file(info):  # a sibling mtp-*.gguf: the target's MTP layers
            misfit = mtp_file_misfit(self.target_model.info, info)
            if misfit:  # llama.cpp would load them and assert (or read past its rows) at the first draft
                raise GGUFSpecError(f"{draft}: {misfit}: give the mtp-*.gguf written beside {self.target_model.path.name}")
            self.mtp_model = Model(draft, n_gpu_layers=n_gpu_layers, role="MTP layers", devices=devices, mtp=True)
            check_compatible(self.target_model, self.mtp_model)
            self.file_head, draft = "mtp", None
        if self.target_model.mtp_loaded or self.mtp_model is not None:
            self._add_heads("mtp", lambda target, share: MtpHead(target, model=self.mtp_model, share=share))
        if info is not None and info.architecture in HIDDEN_HEADS:  # an EAGLE-3 or DFlash draft: a head, not a model
            self.head_model = Model(draft, n_gpu_layers=n_gpu_layers, role=f"{info.architecture} draft",
                                    devices=devices)
            kind = HIDDEN_HEADS[info.architecture]
            self._add_heads(info.architecture, lambda target, share: kind(target, self.head_model, share=share,
                                                                         n_threads=shape["n_threads"]))
            self.file_head, draft = info.architecture, None
        if draft is not None:
            self.draft_model = repack_load(draft, n_gpu_layers=n_gpu_layers, role="draft", devices=devices, **self._load)
            self.vocab_difference = text_pairing(self.target_model, self.draft_model)
            if self.vocab_difference:  # another vocabulary: the draft drafts through text (textdraft)
                self.bridge = TextBridge(self.target_model, self.draft_model)
            check_kv_cache_types(self.draft_model.info, *shape["cache_types"])
            self.draft_ctx = Context(self.draft_model, **shape)

    def _add_heads(self, name: str, make) -> None:
        """A head of this kind per sequence (`slot_heads`; `heads`: sequence 0's), on one context (heads.Follower)."""
        for slot, target in enumerate(self.target_ctx.sequences or [self.target_ctx]):
            self.slot_heads[slot][name] = make(target, self.slot_heads[0].get(name))
        self.heads[name] = self.slot_heads[0][name]

    @property
    def mtp_head(self):
        """The target's MTP head (its own MTP layers, or a sibling mtp-*.gguf's), None where it has none."""
        return self.heads.get("mtp")

    def verification(self, exact: bool | None = None, tie_margin: float | None = None) -> Verification:
        """The verification policy for greedy rounds on this target (exact None: the default here; tie_margin None:
        the default margin, raised where this target's measured drift asks more: verification.margin_for)."""
        return Verification.of(self.costs, exact, tie_margin)

    def weights(self) -> dict:
        """Where llama.cpp put each model's weights, as it reported it: {role: {buffer: MiB}}."""
        self._check_open()
        out = {"target": self.target_model.buffers}
        draft = self.draft_model or self.head_model  # the draft model, or an EAGLE-3 / DFlash draft
        if draft is not None:
            out["draft"] = draft.buffers
        return out

    def cost_report(self) -> dict:
        """What `ggufspec costs` prints: the measured table, the ceiling, where each drafter pays."""
        self._check_open()
        v = self.verification()
        return {"target": str(self.target_model.path), "draft": str(self.draft_model.path) if self.draft_model else None,
                "threads": self.target_ctx.n_threads, "exact": v.exact, "tie_margin": v.tie_margin,
                "repack": {m.role: m.repacks for m in (self.target_model, self.draft_model) if m and m.repack_choice},
                **self.costs.report(v.batch_limit(), self.target_model.info.file_type),
                "text_round_trip": ({**text_round_trip(self.bridge), "difference": self.vocab_difference}
                                    if self.bridge else None)}

    @property
    def n_ctx(self) -> int:
        self._check_open()
        return self.target_ctx.n_ctx

    # -- prompts ------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | bytes | None = None, messages: list[dict] | None = None, *,
                        fit: bool = True) -> list[int]:
        """Prompt text or bytes (tokenized as llama.cpp does: bytes as they are, whatever their encoding) or chat
        messages (through the GGUF's template). fit=False: the caller checks the length."""
        self._check_open()
        if exactly_one({"a prompt": prompt, "chat messages": messages}) == "chat messages":
            messages = check_messages(messages)
            check_chat_roles(messages)
            tokens = self.target_model.tokenize_chat(messages)
        elif isinstance(prompt, (str, bytes)):
            tokens = self.target_model.tokenize(prompt if isinstance(prompt, bytes) else check_text(prompt, "the prompt"))
        else:
            raise GGUFSpecError(f"the prompt must be text or bytes (got {type(prompt).__name__}); "
                                "token ids go in prompt_tokens=")
        return self._check_prompt(tokens, fit)

    def _check_prompt(self, tokens, fit: bool = True) -> list[int]:
        """Token ids as a list, checked (fit: and against n_ctx): generation.check_prompt_tokens."""
        return check_prompt_tokens(tokens, self.target_model.n_vocab, self.n_ctx if fit else None)

    # -- generation ---------------------------------------------------------------------------

    @keeps_its_error
    def stream(self, prompt: str | bytes | None = None, *, messages: list[dict] | None = None,
               prompt_tokens: list[int] | None = None, settings: GenerationSettings | None = None,
               **overrides) -> Iterator[Chunk]:
        """Yield a Chunk per round; the last one carries finish_reason ("stop", "length" or "stop_string").

        Give one of prompt, messages or prompt_tokens. One generation runs at a time: a stream begun in another
        thread waits until this one ends (or is closed); a generation begun in the same thread before this stream
        ends supersedes it, and resuming it raises GGUFSpecError (again at each try, until it is closed)."""
        s = resolve_settings(settings, overrides)
        self._check_open()
        exactly_one({"a prompt": prompt, "chat messages": messages, "prompt_tokens": prompt_tokens})
        generation = self._begin()
        try:
            self._check_open()
            tokens = self.tokenize_prompt(prompt, messages) if prompt_tokens is None else self._check_prompt(prompt_tokens)
            yield from self._build(s, [int(t) for t in tokens]).chunks(lambda: self._before_round(generation))
        finally:
            self._end(generation)

    def generation(self, prompt_tokens: list[int], settings: GenerationSettings, slot: int) -> Generation:
        """A generation on sequence `slot` of an Engine of several (n_seq), for `batching.Batch` to step: checked
        settings and prompt tokens, its own drafter on the draft context's sequence of the same number."""
        self._check_open()
        if not 0 <= slot < self.n_seq:
            raise GGUFSpecError(f"sequence {slot} does not exist: this Engine holds {self.n_seq} (n_seq)")
        one = not self.target_ctx.sequences  # an Engine of one sequence: its own contexts (heads follow them)
        return self._build(settings.validate(), [int(t) for t in self._check_prompt(prompt_tokens)],
                           None if one else slot)

    def release(self, slot: int) -> None:
        """Sequence `slot`'s generation ended: its caches keep their canonical prompt chunks, for a later prompt that
        begins the same (`reusable`); nothing with one KV cache for all (kv_unified: the others' batches would
        attend past it), or where a recurrent state holds it (cut back only by decoding the prompt again)."""
        for ctx in (self.target_ctx, self.draft_ctx):
            if ctx is not None and ctx.sequences:
                seq = ctx.sequences[slot]
                seq.truncate(seq.canonical if not ctx.kv_unified and seq.checkpoints is None else 0)

    def reusable(self, slot: int, prompt_tokens: list[int]) -> int:
        """How many of these prompt tokens sequence `slot`'s target cache would keep (the scheduler's choice)."""
        ctx = self.target_ctx
        return (ctx.sequences[slot] if ctx.sequences else ctx).reusable(prompt_tokens)

    def decode_together(self, parts: list) -> list:
        """[(sequence, tokens, logits)] of the target's sequences decoded in one batch (llama.sequences)."""
        return decode_together(self.target_ctx, parts)

    def batch(self) -> Batch:
        """What steps this Engine's sequences together (`batching.Batch`): one target batch a step, the draft model's
        steps of every sequence that drafts decoded together (llama.sequences.together)."""
        return Batch(self.decode_together, self.costs, unified=self.target_ctx.kv_unified, plan_together=together)

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes this Engine can run (the others are refused in one line when asked for)."""
        return runnable_modes(self.draft_model is not None, self.file_head, set(self.heads), self.costs is not None)

    @property
    def n_seq(self) -> int:
        """The sequences each context holds (1: the Engine's own)."""
        return len(self.target_ctx.sequences) or 1

    def _build(self, s: GenerationSettings, prompt_tokens: list[int], slot: int | None = None) -> Generation:
        """One generation's parts, built here once and handed down: the context it decodes on (slot: that
        sequence of several), a fresh drafter (its own ModelDrafter copy, so --draft-p-min is its own), the
        verification policy."""
        shared = slot is not None  # stepped beside other sequences (batching.Batch)
        if slot is None and self.target_ctx.sequences:  # generate() on an Engine of several: sequence 0, as a
            slot = 0  # request there (one record of what its cache holds, for both to reuse)
        target_ctx = self.target_ctx if slot is None else self.target_ctx.sequences[slot]
        draft_ctx = self.draft_ctx if slot is None or self.draft_ctx is None else self.draft_ctx.sequences[slot]
        if s.mode in DRAFT_ALONE_MODES:  # the draft generating by itself: plain decoding on its context
            if self.draft_model is None:
                raise GGUFSpecError(f"mode {s.mode!r} needs a draft model (-md DRAFT)")
            if self.bridge is not None:  # another vocabulary: the prompt's text, as the draft tokenizes it
                text = b"".join(self.bridge.target_piece(t) for t in prompt_tokens)
                prompt_tokens = self.bridge.draft_prefix + self.bridge.to_draft(text)
            return Generation(s, prompt_tokens, self.draft_model, draft_ctx, None, Verification(), 0)
        if s.mode in DRAFTING_MODES and self.target_ctx.n_batch < 2:  # speculative.draft_max leaves no draft room
            warn_once(f"ggufspec: -b/--batch-size {self.target_ctx.n_batch} leaves no room to verify a draft (the "
                      f"target decodes [last] + draft as one batch): --mode {s.mode} runs as the target alone; use -b 2 "
                      "or more")
        verification = self.verification(s.exact, s.tie_margin)
        model = copy.copy(self.model_drafter) if self.model_drafter is not None else None
        if model is not None:
            model.p_min = s.draft_p_min or 0.0
            model.ctx = draft_ctx
        if s.mode in MODEL_MODES and self.draft_model is None and self.file_head is not None:
            s = replace(s, mode=self.file_head)  # -md named a head (mtp-*.gguf, an eagle3 or dflash draft): draft with it
        self._check_head(s.mode)
        own = self.slot_heads[slot or 0]
        heads = {name: HeadDrafter(head, p_min=s.draft_p_min or 0.0) for name, head in own.items()}
        lookup = LookupDrafter(ends=getattr(self.target_model, "control_mask", None))
        drafter, draft_max = make_drafter(s.mode, verification, self.costs, model=model, draft_max=s.draft_max,
                                          lookup=lookup, lookup_max=s.lookup_max, p_min=s.draft_p_min, heads=heads)
        if drafter is not None:  # beside other sequences the draft catches up when a batch lets it draft (lazily)
            drafter.max_tokens, drafter.lazy_model = s.max_tokens, shared
        used = {HEAD_MODES.get(s.mode)} | set(drafter.heads if drafter is not None else ())
        for name, head in sorted(own.items(), key=lambda kv: kv[0] in used):  # off first: rows others read stay
            head.activate(name in used)  # a head follows the target only for generations that draft with it
        if any(not own[name].synced for name in used if name in own):
            s = replace(s, reuse_prompt=False)  # a head missed decodes: the prompt is evaluated anew, with it
        return Generation(s, prompt_tokens, self.target_model, target_ctx, drafter, verification, draft_max)

    def _check_head(self, mode: str) -> None:
        """One line where `mode` drafts with a head this Engine has not got."""
        need = HEAD_MODES.get(mode)
        if need is None or need in self.heads:
            return
        if need == "mtp":
            check_mtp(self.target_model)
        label = {"eagle3": "an EAGLE-3", "dflash": "a DFlash"}[need]
        raise GGUFSpecError(f"mode {mode!r} needs {label} draft trained for this target: give its GGUF with -md "
                            f"(architecture {need})")

    def _before_round(self, generation: int) -> None:
        if generation != self._generation:
            raise GGUFSpecError("this stream was superseded by a later generation on the same Engine; "
                                "finish or close() a stream before starting another")
        self._check_open()

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

    def __enter__(self) -> "Engine":
        self._check_open()
        return self

    def generate(self, prompt: str | bytes | None = None, *, messages: list[dict] | None = None,
                 prompt_tokens: list[int] | None = None, settings: GenerationSettings | None = None,
                 **overrides) -> Result:
        """Generate to completion; returns text, generated token ids, stats and why it stopped."""
        exactly_one({"a prompt": prompt, "chat messages": messages, "prompt_tokens": prompt_tokens})
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
        for heads in getattr(self, "slot_heads", [])[::-1]:  # sequence 0's own the context the others share: last
            for head in heads.values():
                head.close()
        self.heads, self.slot_heads = {}, []
        for name in ("draft_ctx", "draft_model", "mtp_model", "head_model", "target_ctx", "target_model"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
                setattr(self, name, None)
