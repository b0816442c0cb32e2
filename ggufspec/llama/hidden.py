"""Drafts that read the target's hidden states (llama.cpp's `eagle3` architecture), driven as llama.cpp's
`common/speculative.cpp` (draft-eagle3) drives them, through llama.cpp's staging API (`src/llama-ext.h`).

An `Eagle3Head` is an EAGLE-3 draft model on a context of its own (`ctx_other` = the target's) that *follows*
a target `Context`, as `heads.MtpHead` does: every batch the target decodes, the inputs of three target layers
(the draft's `target_layers`; the target's n_layer meaning its final hidden state) go through the draft's
encoder (one fused row g per position), and the draft's decoder takes at position P the pair (token P + 1,
g[P]). A batch's last pair needs the token after it, which only the next batch or the next draft knows: it is
*deferred* (`pending`: g and position), written by the next batch's first token (the bridge) or by the next
draft's first step (with the last token of the history). A rewind to n_keep makes the row at n_keep - 1 the
pending one and forgets the draft's positions from n_keep - 1 on. A draft runs the decoder from the pending
pair (`begin`), then each drafted token with the decoder's own hidden state (`step`); `end` forgets the
drafted positions but the first (its pair is the right one). Misuses abort the process inside llama.cpp (a
layer id past the target's layers, an encoder batch past n_ubatch), so each is checked here before the call.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..errors import GGUFSpecError
from .devices import on_software_device
from .draft_fit import hidden_state_misfit
from .heads import Follower, ext, follower_context, read_by_others
from .rows import RowBatch, run
from .runtime import C

EAGLE3_LAYERS = 3  # target layers an EAGLE-3 draft reads (llama.cpp refuses any other count)


def _bind(names, argtypes, restype):
    """A staging-API function under its plain or C++-mangled name (ImportError where this build lacks it), by
    llama-cpp-python's own lookup where it has one."""
    from llama_cpp import llama_cpp as L

    try:
        from llama_cpp.llama_cpp_ext import _ctypes_function_from_names
    except ImportError:
        _ctypes_function_from_names = None
    if _ctypes_function_from_names is not None:
        try:
            def stub():
                """A staging-API function of llama.cpp (src/llama-ext.h)."""

            stub.__name__ = stub.__qualname__ = names[0]
            return _ctypes_function_from_names(names, argtypes, restype)(stub)
        except AttributeError as e:
            raise ImportError(str(e)) from None
    for name in names:
        func = getattr(L._lib, name, None)
        if func is not None:
            func.argtypes, func.restype = argtypes, restype
            return func
    raise ImportError(f"this llama.cpp build has none of {', '.join(names)}")


class Staging:
    """The staging functions llama-cpp-python 0.3.36 does not bind (`src/llama-ext.h`), bound once."""

    _bound = None

    def __init__(self):
        from llama_cpp import llama_cpp as L

        ctx, model = L.llama_context_p_ctypes, L.llama_model_p_ctypes
        self.llama_set_embeddings_layer_inp = _bind(
            ("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
             "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z"),
            [ctx, ctypes.c_uint32, ctypes.c_bool], None)
        self.llama_get_embeddings_layer_inp = _bind(
            ("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
             "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z"),
            [ctx, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float))
        self.llama_model_target_layer_ids = _bind(
            ("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model",
             "?llama_model_target_layer_ids@@YAPEBHPEBUllama_model@@@Z"),
            [model], ctypes.POINTER(ctypes.c_int32))
        self.llama_model_target_layer_ids_n = _bind(
            ("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model",
             "?llama_model_target_layer_ids_n@@YAIPEBUllama_model@@@Z"),
            [model], ctypes.c_uint32)

    @classmethod
    def get(cls) -> "Staging":
        if cls._bound is None:
            cls._bound = cls()
        return cls._bound


def target_layer_ids(draft_model) -> list[int]:
    """The target layers whose inputs a draft reads (llama.cpp's `*.target_layers`; [] for other models)."""
    S = Staging.get()
    n = int(S.llama_model_target_layer_ids_n(draft_model._model))
    ids = S.llama_model_target_layer_ids(draft_model._model)
    return [int(ids[i]) for i in range(n)] if n and ids else []


def check_eagle3(target_model, draft_model) -> list[int]:
    """The target layer ids an EAGLE-3 draft reads, or one clear line why it cannot draft for this target."""
    arch = draft_model.meta("general.architecture")
    ids = target_layer_ids(draft_model)
    if arch != "eagle3" or len(ids) != EAGLE3_LAYERS:
        raise GGUFSpecError(f"{draft_model.path}: is not an EAGLE-3 draft (architecture {arch}, "
                            f"{len(ids)} target layers read; EAGLE-3 reads {EAGLE3_LAYERS}); give an eagle3 GGUF with -md")
    check_layer_ids(target_model, draft_model, ids, "eagle3.target_hidden_size")
    return ids


def check_layer_ids(target_model, draft_model, ids: list[int], width_key: str) -> None:
    """One clear line where a draft reads a target's hidden states that this target cannot give: an architecture
    whose graph hides its layer inputs, layers the target lacks, hidden states of another width (the header's
    `width_key` and the `fc` tensor's shape), another vocabulary (`draft_fit.hidden_state_misfit`, the check
    `drafts` and `models check` make)."""
    misfit = hidden_state_misfit(target_model.info, draft_model.info)
    width = draft_model.meta(width_key)
    n_embd = int(C.llama_model_n_embd(target_model._model))
    if not misfit and width is not None and int(width) != n_embd:
        misfit = f"reads hidden states {width} wide; the target's are {n_embd}: made for another target"
    if misfit:
        raise GGUFSpecError(f"{draft_model.path} cannot draft for {target_model.path}: {misfit}")


def check_target_on_host(target_model, draft_model, what: str) -> None:
    """One line where the target's layers are on Mesa's software Vulkan device (llvmpipe), before any layer input
    is asked for: there, with a hidden-state draft beside the target, lavapipe corrupts memory in its own queue
    thread (malloc's "corrupted double-linked list", or a SEGV reading near address 0), llama.cpp's own
    speculative-simple alike, in most runs. The same files keep the target's greedy and seeded text with the
    target's layers on the CPU, a CUDA GPU, an RPC server or a hardware Vulkan driver (an H100 through NVIDIA's;
    docs/guarantees.md), so nothing else is refused."""
    on_software = sorted(name for name in target_model.buffers if on_software_device(name))
    if on_software:
        raise GGUFSpecError(f"{draft_model.path}: {what} drafts read the target's layer inputs, which Mesa's software "
                            f"Vulkan device ({on_software[0]}, llvmpipe) corrupts memory copying back (llama.cpp's own "
                            f"program alike): keep the target's layers on the CPU (-ngl 0; the draft may use the "
                            f"device, -ngld), or use --mode mtp, draft or lookup; a hardware GPU's driver runs it")


def extract_layers(follower, on: bool) -> None:
    """Make the target output (on) or stop outputting the inputs of the layers `follower.layer_ids` (the target's
    n_layer: its final hidden state), leaving on those another active follower reads, on any sequence (reading
    rows not extracted aborts inside llama.cpp)."""
    target, X = follower.target, follower.X
    n_layer = int(C.llama_model_n_layer(target.model._model))
    kept = set() if on else read_by_others(follower)
    for lid in (i for i in follower.layer_ids if i not in kept):
        if lid < n_layer:
            Staging.get().llama_set_embeddings_layer_inp(target._ctx, lid, bool(on))
        else:  # the final hidden state: the target's own pre-norm rows, one per batch token
            X.llama_set_embeddings_nextn(target._ctx, bool(on), False)


def layer_rows(follower, m: int, at: int = 0) -> list[np.ndarray]:
    """The target's last batch's rows at..at + m (a sequence's part of a batch of several) of each layer input
    `follower.layer_ids` reads, as views."""
    target, S, X = follower.target, Staging.get(), follower.X
    n_layer, w = int(C.llama_model_n_layer(target.model._model)), int(C.llama_model_n_embd(target.model._model))
    return [np.ctypeslib.as_array(S.llama_get_embeddings_layer_inp(target._ctx, lid) if lid < n_layer
                                  else X.llama_get_embeddings_nextn(target._ctx), shape=(at + m, w))[at:]
            for lid in follower.layer_ids]


class Eagle3Head(Follower):
    """An EAGLE-3 draft on its own context, following the target Context `target` (see the module)."""

    name = "eagle3"
    _batches = ("_dec", "_enc")

    def __init__(self, target, draft_model, *, n_threads: int | None = None, share: "Eagle3Head | None" = None):
        self.layer_ids = check_eagle3(target.model, draft_model)
        check_target_on_host(target.model, draft_model, "EAGLE-3")
        self.target, self.draft_model = target, draft_model
        self.X, self.S = ext(), Staging.get()
        self.n_layer_target = int(C.llama_model_n_layer(target.model._model))
        self.n_embd_target = int(C.llama_model_n_embd(target.model._model))
        self.n_embd = int(C.llama_model_n_embd(draft_model._model))
        self.n_vocab = target.n_vocab
        self._ctx, self.buffers = (share._ctx, {}) if share else follower_context(
            target, draft_model, "the EAGLE-3 draft's context", n_threads=n_threads)
        self.X.llama_set_embeddings_nextn(self._ctx, True, True)  # the decoder's pre-norm state of its outputs
        self.n_batch = int(C.llama_n_batch(self._ctx))
        self.n_ubatch = int(C.llama_n_ubatch(self._ctx))  # the encoder takes at most this many rows at once
        self._mem = C.llama_get_memory(self._ctx)
        seq_id = getattr(target, "seq_id", 0)
        self._dec = RowBatch(self.n_batch, self.n_embd, tokens=True, seq_id=seq_id)
        self._enc = RowBatch(self.n_ubatch, EAGLE3_LAYERS * self.n_embd_target, tokens=False, seq_id=seq_id)
        self._enc.out[:] = 1
        self.n_target = 0  # the target's positions this head has followed
        self.n_draft = 0  # the draft context's positions (pairs 0..n_draft-1)
        self.pending_pos = -1  # the deferred pair's position (-1: none), and its g
        self.pending_g = np.zeros(self.n_embd, dtype=np.float32)
        self.synced = True
        self.active = False
        self._g: dict[int, np.ndarray] = {}  # g rows by position (a window, see heads.ROW_WINDOW)
        self._h = self.pending_g
        self._drafting = 0
        self.seconds = {"encode": 0.0, "catch_up": 0.0, "draft": 0.0}
        self.rows_fed = 0
        self._attach(target, share)

    # -- following the target -------------------------------------------------------------------

    def _follow(self, on: bool) -> None:
        extract_layers(self, on)  # the inputs of the layers this draft reads

    def ready(self, n_past: int) -> bool:
        """Whether a draft can start at position n_past (the pair at n_past - 1 is the deferred one)."""
        return (self.active and self.synced and self.n_target == n_past and n_past > 0
                and self.pending_pos == n_past - 1)

    def process(self, start: int, tokens: np.ndarray, at: int = 0) -> None:
        """The target decoded `tokens` at start.. (rows at.. of its last batch): encode its layers' rows, decode
        the pairs they complete."""
        if not self.active or not self.synced or start != self.n_target:
            self.synced = False
            return
        m = len(tokens)
        g = self._encode(m, at)
        dec, n = self._dec, 0
        if self.n_draft > start:  # positions a rewind did not reach (a draft's first pair): written again here
            self._forget(start)
            self.n_draft = start
        if self.pending_pos >= 0 and self.pending_pos + 1 == start and self.pending_pos >= self.n_draft:
            dec.token[0], dec.pos[0], dec.rows[0] = tokens[0], self.pending_pos, self.pending_g  # the bridge
            n = 1
        dec.token[n : n + m - 1] = tokens[1:]
        dec.pos[n : n + m - 1] = np.arange(start, start + m - 1, dtype=np.int32)
        dec.rows[n : n + m - 1] = g[: m - 1]
        n += m - 1
        if n:
            dec.out[:n] = 0
            run(self, dec, n, "catch_up")
            self.rows_fed += n
        self.n_draft = start + m - 1
        self.pending_pos, self.pending_g = start + m - 1, g[m - 1]
        for k in range(m):
            self._g[start + k] = g[k]
        self.n_target = start + m
        self._rows_kept(self._g, self.n_target)

    def _encode(self, m: int, at: int = 0) -> np.ndarray:
        """The encoder's g rows of the target's last batch's m tokens from row `at`, in chunks of at most n_ubatch
        rows."""
        w = self.n_embd_target
        layers = layer_rows(self, m, at)
        g = np.empty((m, self.n_embd), dtype=np.float32)
        enc = self._enc
        for i in range(0, m, self.n_ubatch):
            n = min(self.n_ubatch, m - i)
            for k, rows in enumerate(layers):
                enc.rows[:n, k * w : (k + 1) * w] = rows[i : i + n]
            enc.pos[:n] = np.arange(self.n_draft + i, self.n_draft + i + n, dtype=np.int32)  # unused by the encoder
            g[i : i + n] = run(self, enc, n, "encode", encode=True)[1]
        return g

    def cut(self, n_keep: int) -> None:
        """The target forgot its positions from n_keep on: the row at n_keep - 1 becomes the deferred pair's,
        and the draft forgets its positions from there (the next batch or draft writes that pair)."""
        if n_keep == 0:
            self._forget(0)
            self.n_target = self.n_draft = 0
            self.pending_pos, self.synced = -1, True
            self._g.clear()
            return
        if n_keep >= self.n_target:
            return
        self.n_target = n_keep
        g = self._g.get(n_keep - 1)
        if g is None:
            self.synced = False
            return
        self.pending_pos, self.pending_g = n_keep - 1, g
        if self.n_draft > n_keep - 1:
            self._forget(n_keep - 1)
            self.n_draft = n_keep - 1

    # -- drafting ---------------------------------------------------------------------------------

    def begin(self, token: int, position: int, n: int = 1) -> np.ndarray:
        """The first draft step (of up to n): the deferred pair completed with `token` (the history's last, at `position` =
        the target's n_past). Returns the logits of the next token (a view, valid until the next step)."""
        if self.n_draft > self.pending_pos:
            self._forget(self.pending_pos)
            self.n_draft = self.pending_pos
        self._drafting = 0
        self._h = self.pending_g
        return self.step(token)

    def step(self, token: int) -> np.ndarray:
        """The next draft step: `token` after the last one, with the decoder's own state from that step."""
        position = self.pending_pos + self._drafting
        if position >= self.target.n_ctx:
            raise GGUFSpecError("the EAGLE-3 draft's context is full")
        dec = self._dec
        dec.token[0], dec.pos[0], dec.out[0], dec.rows[0] = token, position, 1, self._h
        logits, h = run(self, dec, 1, "draft")
        self._drafting += 1
        self.n_draft = position + 1
        self._h = np.array(h[0])
        return logits[0]

    def end(self) -> None:
        """Forget the drafted positions but the first (the deferred pair, now complete)."""
        if self._drafting > 1:
            self._forget(self.pending_pos + 1)
            self.n_draft = self.pending_pos + 1
        self._drafting = 0
