"""Models and contexts: load with n_gpu_layers, decode a batch, logits, KV rewind, vocabulary.

llama.cpp itself is reached through `runtime` (the top-level llama_cpp module) and ggml's devices
through `devices`; the AMX route is `amx`. Thin wrappers over llama-cpp-python's low-level API. Logits come back as numpy views on
llama.cpp's own buffer (valid until the next decode on that context), so the hot path copies
nothing per row. Every handle is freed by `close()` (or `with`), in the right order.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from pathlib import Path

import numpy as np

from . import amx, system
from .devices import descriptions, device_array, devices, share_elsewhere, software_vulkan, supports_gpu_offload
from .overrides import BuftOverrides, cpu_buffer_type, expert_pattern
from ..errors import ContextFullError, GGUFSpecError
from .draft_fit import alone_misuse
from .gguf_info import file_stamp, kv_cache_type, read_info
from .system import default_threads  # noqa: F401 (rpc and doctor read it here)
from .recurrent import Checkpoints, cannot_be_cut, fitted_rollback
from .runtime import (C, Closing, buffers, build_features, create_context, decode_failed, init, llama_cpp_version,
                      llama_decode, load_model, warn_once)
from .runtime import set_verbose  # noqa: F401 (callers read it here)
from .sequences import Reusing, aligned_pieces, reusable_prefix, sequences_of, set_sequence
from .vocab import LlamaModel, VocabFacts

_NOTHING_SAVED = contextlib.nullcontext()
# llama_get_logits answering the buffer's address (an int), not a pointer object to convert on every decode
_logits_address = ctypes.cast(C.llama_get_logits, ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p))

CPU_WAITS = 0.75  # the share of a model's weights off the CPU from which its decodes leave the CPU idle

@functools.cache
def machine() -> dict:
    """This machine's identity (CPU, build features, devices, llama.cpp version) and its id."""
    local = [d for d in devices() if d["type"] != "RPC"]  # remote devices are part of a model's placement
    return system.describe(system.cpu_model(), build_features(), local, llama_cpp_version())


class Model(VocabFacts, Closing):
    """A loaded GGUF model and its vocabulary."""

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = 0, role: str = "model", repack: bool = True,
                 vocab_only: bool = False, avoid_amx: bool | None = None, devices: list[str] | None = None,
                 cpu_moe: int = 0, mtp: bool = False):
        """cpu_moe: keep the expert tensors of the first N layers on the CPU (-1: of every layer), as
        llama.cpp's --n-cpu-moe N / --cpu-moe; the rest of those layers goes where -ngl puts it.
        mtp: load the model's MTP (NextN) layers too, where its GGUF has them (`heads.MtpHead` drafts with them)."""
        init()
        self.path = Path(path)
        self.role = role
        self.info = read_info(self.path)  # one clear line for missing, non-GGUF or truncated files
        self.stamp = file_stamp(self.path)
        problem = amx.problem(self.info)
        self.avoids_amx = bool(problem) if avoid_amx is None else avoid_amx
        if n_gpu_layers != 0 and not supports_gpu_offload():
            warn_once("ggufspec: this llama.cpp build has no GPU support; all layers stay on the CPU")
        self.cpu_moe = int(cpu_moe) if self.info.experts else 0
        self.mtp_loaded = bool(mtp and self.info.n_nextn and not vocab_only)
        params = self._params(n_gpu_layers, repack, vocab_only, devices)
        params.load_mtp = self.mtp_loaded
        self.devices = devices
        described = descriptions() if devices else {}
        # What decides where layers run, for the cost cache: devices by name and what they are, experts kept on the CPU.
        self.devices_key = "default" if devices is None else ",".join(f"{n}@{described.get(n, '?')}" for n in devices) or "cpu"
        if self.cpu_moe:
            self.devices_key += f",experts-on-cpu:{self.cpu_moe}"
        self.repacks = bool(repack)  # llama.cpp's CPU weight repacking asked for (`repack.load` chooses it)
        if not self.repacks:  # another placement of the same weights: its own cost table
            self.devices_key += ",no-repack"
        self._model, log = load_model(str(self.path), params)
        self.buffers = buffers(log).get("model", {})  # where llama.cpp put the weights, as it reports it: {buffer: MiB}
        # whether repacking is a choice here: it took weights, or was turned off (`repack.load`, `ggufspec costs`)
        self.repack_choice = "CPU_REPACK" in self.buffers or not self.repacks
        # most of the weights on a hardware GPU or an RPC server: the CPU mostly waits while this model decodes
        self.cpu_waits = share_elsewhere(self.buffers) >= CPU_WAITS
        if not self._model and problem:
            raise GGUFSpecError(f"{self.path}: {problem}")
        if not self._model and not vocab_only and not self.info.tensors:
            raise GGUFSpecError(f"{self.path}: holds a vocabulary and no weights (a vocab-only GGUF); "
                                f"give the {role}'s model file itself")
        if not self._model:
            reason = next((" ".join(line.rsplit("error loading model: ", 1)[1].split()) for line in reversed(log)
                           if "error loading model: " in line), None)
            raise GGUFSpecError(
                f"{self.path}: llama.cpp could not load this {role} "
                + (f"({reason})" if reason else "(unsupported architecture or damaged file; --verbose shows llama.cpp's reason)"))
        self.n_gpu_layers = int(n_gpu_layers)
        self._read_vocab(C.llama_model_get_vocab(self._model))
        self.n_layer = C.llama_model_n_layer(self._model)
        self._eog = np.zeros(self.n_vocab, dtype=bool)
        self.control_mask = np.zeros(self.n_vocab, dtype=bool)  # template markers and ends of generation
        for t in range(self.n_vocab):
            self._eog[t] = eog = C.llama_vocab_is_eog(self._vocab, t)
            self.control_mask[t] = eog or C.llama_vocab_is_control(self._vocab, t)

    def _params(self, n_gpu_layers: int, repack: bool, vocab_only: bool, devices: list[str] | None):
        """llama_model_params; what they point at is kept alive on self."""
        params = C.llama_model_default_params()
        pairs = []
        experts = expert_pattern(self.cpu_moe, self.info.n_layers) if not vocab_only else None
        if experts:
            pairs.append((experts, cpu_buffer_type()))
        if self.avoids_amx and repack and not vocab_only:
            pairs += amx.repack_overrides(self.info, n_gpu_layers)
            repack = False
        if pairs:
            self._overrides = BuftOverrides(pairs)
            params.tensor_buft_overrides = self._overrides.pointer
        params.n_gpu_layers = int(n_gpu_layers)
        params.use_extra_bufts = bool(repack)  # CPU weight repacking: faster, but batches of >= 4 round differently
        params.vocab_only = bool(vocab_only)
        if devices is not None:  # llama.cpp's -dev: the devices layers may go to (an empty list: the CPU only)
            self._devices = device_array(devices)
            params.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        return params

    # -- vocabulary ---------------------------------------------------------------------------

    def detokenize(self, tokens: list[int], *, special: bool = False) -> str:
        return b"".join(self.token_to_piece(t, special=special) for t in tokens).decode("utf-8", errors="replace")

    @property
    def eog_mask(self) -> np.ndarray:
        return self._eog

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = C.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            C.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    @property
    def chat_template(self) -> str | None:
        return self.meta("tokenizer.chat_template")

    def render_chat(self, messages: list[dict]) -> str:
        """Render chat messages with the GGUF's template in llama-cpp-python's sandboxed Jinja environment."""
        template = self.chat_template
        if not template:
            raise GGUFSpecError(f"{self.path}: this model has no chat template; use a plain prompt (-p) instead of --chat")
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        bos = self.token_text(self.bos).decode("utf-8", errors="replace") if self.bos >= 0 else ""
        eos = self.token_text(self.eos).decode("utf-8", errors="replace") if self.eos >= 0 else ""
        try:
            return Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)(messages=messages).prompt
        except Exception as e:  # a template error is the model's, but the user needs to hear of it in one line
            raise GGUFSpecError(f"{self.path}: its chat template failed to render ({type(e).__name__}: {e})") from None

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        text = self.render_chat(messages)
        bos_text = self.token_text(self.bos).decode("utf-8", errors="replace") if self.bos >= 0 else ""
        # Templates often write the BOS themselves; do not add a second one.
        add_special = not (self.add_bos and bos_text and text.startswith(bos_text))
        return self.tokenize(text, add_special=add_special, parse_special=True)

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        if getattr(self, "_model", None):
            C.llama_model_free(self._model)
            self._model = None


class Context(Closing, Reusing):
    """A llama.cpp context on one model, one sequence, with a reusable batch.

    `tokens` are what the KV cache holds, position by position (`n_past` of them); `decode` appends,
    `truncate` rewinds. A prompt (tokens decoded without a row each) goes in chunks of `chunk` tokens
    (n_batch unless asked) cut at multiples of `chunk`, as llama.cpp cuts a prompt into batches from
    position 0. `canonical`: how many leading positions were computed in such whole chunks, each decoded
    after canonical ones, i.e. exactly as a cold start computes them; `reusable` keeps only those, so a
    reused prompt is bit-identical to a cold one.
    """

    def __init__(self, model: Model, *, n_ctx: int = 4096, n_batch: int = 512, n_threads: int | None = None,
                 rollback: int = 0, cache_types: tuple[str, str] = ("f16", "f16"), n_seq: int = 1,
                 kv_unified: bool = False, prompt_chunk: int | None = None):
        """n_seq: sequences the context holds (llama.cpp's n_seq_max; `sequences` are their Targets, each with
        n_ctx // n_seq tokens; the Context's own decode and truncate act on sequence 0, so use one or the other);
        kv_unified: one KV cache for them all (llama.cpp's -kvu: a batch of several is one ubatch, but a
        sequence's cells interleave with the others', and its rows round differently than alone); by default
        a KV stream per sequence, laid out as a context of its own lays it out;
        rollback: where the memory cannot be cut, ask llama.cpp to keep the recurrent states of this many
        last positions (its `n_rs_seq`; some architectures only: `Checkpoints.rewind`), as many as the batch allows;
        cache_types: the KV cache's K and V types (llama.cpp's -ctk, -ctv); prompt_chunk: the chunk prompts are
        decoded in, and reused by (at most n_batch; default n_batch)."""
        misuse = alone_misuse(model.info)  # llama.cpp segfaults creating such a context, or decodes garbage
        if misuse:
            raise GGUFSpecError(f"{model.path}: {misuse}")
        self.model = model
        self.n_vocab = model.n_vocab
        n_threads = n_threads or default_threads()
        params = C.llama_context_default_params()
        params.n_ctx = int(n_ctx)
        params.n_batch = int(n_batch)
        params.n_ubatch = int(n_batch)
        params.n_seq_max = int(n_seq)
        params.kv_unified = bool(kv_unified) and n_seq > 1
        self.kv_unified = bool(params.kv_unified)
        params.n_threads = int(n_threads)
        params.n_threads_batch = int(n_threads)
        self.cache_types = cache_types
        params.type_k, params.type_v = (kv_cache_type(t)[0] for t in cache_types)
        params.no_perf = True
        # llama.cpp caps n_batch (and so n_ubatch) at n_ctx before padding n_ctx
        # several sequences rewind a recurrent state from their own checkpoints (llama.sequences), not llama.cpp's rollback
        uncut = cannot_be_cut(model._model) and n_seq == 1
        params.n_rs_seq = fitted_rollback(rollback, min(n_ctx, n_batch)) if uncut else 0
        if software_vulkan():  # Mesa's llvmpipe crashes in llama.cpp's flash attention and op offload (devices.software_vulkan)
            params.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_DISABLED
            params.op_offload = False
        self.flash_attn_type, self.op_offload = params.flash_attn_type, params.op_offload
        self._owned = True
        self._ctx, log = create_context(model._model, params)
        self.buffers = buffers(log)  # what llama.cpp allocated where: {"KV" | "compute" | ...: {buffer: MiB}}
        if not self._ctx:
            raise GGUFSpecError(
                f"{model.path}: llama.cpp could not create a context of {n_ctx} tokens (out of memory? try a smaller -c)"
            )
        self._setup(min(int(n_ctx), C.llama_n_ctx(self._ctx)), n_threads, prompt_chunk)  # llama.cpp pads n_ctx up; the user's size is the limit
        if n_seq > 1:  # the context's own decodes are sequence 0's, within its share
            self.sequences = sequences_of(self, n_seq)
            self.n_ctx = self.sequences[0].n_ctx

    @classmethod
    def of_llama(cls, llama) -> "Context":
        """A Context on a `llama_cpp.Llama`'s own llama.cpp context (its flash attention, threads, offload),
        to measure costs through it; the Llama keeps owning model and context. Leaves its cache as found
        only if cleared: call `llama.reset()` after use."""
        self = cls.__new__(cls)
        self.model = LlamaModel(llama)
        self.n_vocab = self.model.n_vocab
        self._owned = False
        self.kv_unified = False
        self._ctx = llama._ctx.ctx
        self.flash_attn_type = llama.context_params.flash_attn_type
        self.op_offload = bool(getattr(llama.context_params, "op_offload", True))
        self._setup(llama.n_ctx(), int(llama.context_params.n_threads))
        return self

    def _setup(self, n_ctx: int, n_threads: int, prompt_chunk: int | None = None) -> None:
        self.n_ctx = self.n_ctx_total = n_ctx  # of several sequences: n_ctx becomes sequence 0's share
        self.n_batch = C.llama_n_batch(self._ctx)
        self.chunk = min(int(prompt_chunk or self.n_batch), self.n_batch)
        self.n_threads = n_threads
        self._mem = C.llama_get_memory(self._ctx)
        self._batch = C.llama_batch_init(self.n_batch, 0, 1)
        self._batch_live = True
        for i in range(self.n_batch):  # one sequence: set once, never touched again
            self._batch.n_seq_id[i] = 1
            self._batch.seq_id[i][0] = 0
        self._token_buf = np.ctypeslib.as_array(self._batch.token, shape=(self.n_batch,))
        self._pos_buf = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
        self._out_buf = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        self._positions, self._views = np.arange(n_ctx, dtype=np.int32), {}
        self.tokens: list[int] = []
        self.canonical = 0
        # What follows this context's memory (a model's MTP head, heads.MtpHead): told of every batch decoded
        # (`process(start, tokens)`) and every cut (`cut(n_keep)`), as llama.cpp's drafters hear of them.
        self.followers: list = []
        # A recurrent state (mamba, and the recurrent layers of a hybrid) cannot be cut like a KV cache:
        # such a context saves that state before each decode and rewinds by restoring it (see truncate).
        self.cuttable = not cannot_be_cut(getattr(self.model, "_model", None))
        self.checkpoints = Checkpoints(C.llama_n_rs_seq(self._ctx) if not self.cuttable else 0)
        self.sequences = []

    def no_rewind(self):
        """A `with` block whose decodes the caller will not rewind into: where the memory cannot be cut, they
        save no state (a rewind there is still right: it decodes again from an earlier state)."""
        return self.checkpoints.paused() if not self.cuttable else _NOTHING_SAVED  # a cut memory saves nothing

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def reusable(self, prompt_tokens: list[int]) -> int:
        """How many leading tokens of `prompt_tokens` a new generation may keep from the KV cache and
        still compute the rest exactly as a cold start would (`sequences.reusable_prefix`: the common
        prefix within `canonical`, rounded down to a whole chunk; the last token is evaluated again)."""
        return reusable_prefix(self.tokens, self.canonical, prompt_tokens, self.chunk)

    def decode(self, tokens, *, logits: str = "last") -> np.ndarray | None:
        """Append `tokens` at positions n_past.. and run the model.

        logits: "last" (one row), "all" (a row per token) or "none". Returns a read-only view of
        shape (rows, n_vocab) on llama.cpp's buffer, valid until the next decode.
        """
        tokens = np.asarray(tokens, dtype=np.int32)
        n = len(tokens)
        if n == 0:
            raise GGUFSpecError("nothing to decode: no tokens were given")
        if self.n_past + n > self.n_ctx:
            raise ContextFullError(
                f"the context is full: {self.n_past} + {n} tokens do not fit in n_ctx={self.n_ctx}; raise -c or lower -n"
            )
        if logits == "all" and n > self.n_batch:
            raise GGUFSpecError(f"cannot return logits for {n} tokens in one batch of at most {self.n_batch}")
        if not self.cuttable:
            self.checkpoints.save(self._ctx, self.n_past)
        for start, end in [(0, n)] if logits == "all" else aligned_pieces(self.n_past, n, self.chunk):
            m = end - start
            self._token_buf[:m] = tokens[start:end]
            self._pos_buf[:m] = self._positions[self.n_past:self.n_past + m]
            if logits == "all":
                self._out_buf[:m] = 1
            else:
                self._out_buf[:m] = 0
                if logits == "last" and end == n:
                    self._out_buf[m - 1] = 1
            self._batch.n_tokens = m
            if self.sequences:  # the batch's rows may hold other sequences' ids from a batch of several
                set_sequence(self._batch, m, 0)
            self.checkpoints.batch_start = self.n_past
            decode_failed(llama_decode(self._ctx, self._batch), m, self.n_past, self.n_ctx)
            for follower in self.followers:
                follower.process(self.n_past, self._token_buf[:m])
            if self.canonical == self.n_past and m == self.chunk and self.n_past % self.chunk == 0:
                self.canonical += m
            self.tokens.extend(tokens[start:end].tolist())
        if logits == "none":
            return None
        return self.logits(n if logits == "all" else 1)

    def logits(self, rows: int) -> np.ndarray:
        """A read-only view of the last decode's first `rows` rows of logits on llama.cpp's buffer, valid until the next
        decode; made once per (buffer, rows): making it anew took some 10 us a decode, a GPU-speed step's 1-3 %."""
        key = (_logits_address(self._ctx), rows)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= 64:  # buffers llama.cpp reallocated since
                self._views.clear()
            view = self._views[key] = np.ctypeslib.as_array(
                (ctypes.c_float * (rows * self.n_vocab)).from_address(key[0])).reshape(rows, self.n_vocab)
            view.flags.writeable = False
        return view

    def truncate(self, n_keep: int) -> None:
        """Forget every position from n_keep on (rewinds rejected draft tokens). Where the memory cannot
        be cut (a recurrent state), restore the state saved at the latest position up to n_keep, cut the
        attention part there, and decode the kept tokens after it again (`Checkpoints.rewind`)."""
        if n_keep >= self.n_past:
            return
        if not self.cuttable:
            self.checkpoints.rewind(self, n_keep)
        elif not self.cut(n_keep):
            raise GGUFSpecError(f"llama.cpp could not rewind the KV cache to position {n_keep}")

    def cut(self, n_keep: int) -> bool:
        """Drop the memory's positions from n_keep on, if llama.cpp can (a recurrent state only within its
        rollback; a hybrid's attention part always); whether it did."""
        if not C.llama_memory_seq_rm(self._mem, 0, n_keep, -1):
            return False
        for follower in self.followers:
            follower.cut(n_keep)
        del self.tokens[n_keep:]
        self.canonical = min(self.canonical, n_keep)
        return True

    def clear(self) -> None:
        if self.sequences:  # the others are theirs
            C.llama_memory_seq_rm(self._mem, 0, 0, -1)
        else:
            C.llama_memory_clear(self._mem, True)
        for follower in self.followers:
            follower.cut(0)
        self.tokens.clear()
        self.canonical = 0
        self.checkpoints.clear()

    def close(self) -> None:
        followers = [f for seq in getattr(self, "sequences", ()) for f in seq.followers]
        for follower in followers[::-1] + list(getattr(self, "followers", ())):  # their contexts refer to this one
            follower.close()
        self.sequences, self._views = [], {}
        if getattr(self, "_batch_live", False):
            C.llama_batch_free(self._batch)
            self._batch_live = False
        if getattr(self, "_ctx", None):
            if getattr(self, "_owned", True):
                C.llama_free(self._ctx)
            self._ctx = None
