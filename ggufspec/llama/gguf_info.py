"""Reads GGUF headers with the `gguf` package: validation before llama.cpp sees a file, and facts.

The only module that imports `gguf`. llama.cpp can crash or print pages of log on a damaged
file; checking the header and the tensor extents here first turns that into one clear line.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import GGUFSpecError

GGUF_MAGIC = b"GGUF"
# A mixture of experts' expert tensors, as llama.cpp names them (common/common.h: LLM_FFN_EXPS_REGEX, which its
# --cpu-moe passes to its tensor buffer overrides; std::regex_search, as Python's re.search).
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


# The KV cache types llama.cpp's -ctk/-ctv take (common/arg.cpp, kv_cache_types).
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


@functools.lru_cache(maxsize=None)
def kv_cache_type(name: str, flag: str = "-ctk") -> tuple[int, float]:
    """A KV cache type by llama.cpp's name: (its ggml type id, bytes per element); one GGUFSpecError naming `flag`
    and the types there are for any other name."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if name not in KV_CACHE_TYPES:
        raise GGUFSpecError(f"{flag} {name!r} is not a KV cache type llama.cpp knows; "
                            f"use one of {', '.join(KV_CACHE_TYPES)}")
    ggml_type = GGMLQuantizationType[name.upper()]
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    return int(ggml_type), type_size / block


def check_kv_cache_types(info: "GGUFInfo", type_k: str, type_v: str) -> None:
    """One GGUFSpecError where a KV cache type's blocks do not divide this model's head size (llama.cpp refuses
    such a context with nothing but a log line)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for flag, name, head_dim in (("-ctk", type_k, info.head_dim_k), ("-ctv", type_v, info.head_dim_v)):
        block = GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]][0]
        if head_dim and head_dim % block:
            raise GGUFSpecError(f"{info.path}: {flag} {name} stores blocks of {block} values, which do not divide this "
                                f"model's head size {head_dim}; use f16, bf16 or f32")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    n_bytes: int
    type_name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file says about itself (no weights are read)."""

    path: str
    file_size: int
    architecture: str
    name: str
    n_layers: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_vocab: int
    vocab_type: str
    file_type: str
    has_chat_template: bool
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    n_expert: int = 0  # a mixture of experts: experts per layer (0: dense)
    n_expert_used: int = 0  # ... and experts per token
    kv_layers: tuple[int, ...] | None = None  # the layers with a KV cache (a hybrid's attention layers); None: all
    keeps_state: bool = False  # recurrent or hybrid: a state that cannot be cut back like a KV cache
    n_nextn: int = 0  # multi-token-prediction (MTP, "NextN") blocks after the trunk, with their tensors
    target_layers: tuple[int, ...] = ()  # a draft reading a target's hidden states (eagle3, dflash): its layer ids

    @property
    def n_trunk(self) -> int:
        """The layers a plain decode runs (llama.cpp counts MTP blocks in block_count)."""
        return self.n_layers - self.n_nextn

    @property
    def experts(self) -> tuple[int, int] | None:
        """(experts per token, experts per layer) of a mixture of experts; None for a dense model."""
        return (self.n_expert_used, self.n_expert) if self.n_expert > 1 and self.n_expert_used >= 1 else None

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "file_size": self.file_size,
            "architecture": self.architecture,
            "name": self.name,
            "n_layers": self.n_layers,
            "n_ctx_train": self.n_ctx_train,
            "n_embd": self.n_embd,
            "n_head": self.n_head,
            "n_head_kv": self.n_head_kv,
            "n_vocab": self.n_vocab,
            "vocab_type": self.vocab_type,
            "quantization": self.file_type,
            "has_chat_template": self.has_chat_template,
            "n_tensors": len(self.tensors),
            "mtp_layers": self.n_nextn,
        }


def file_stamp(path: Path) -> str:
    """size|mtime of a model file as it is loaded: what names its measured costs (it may be removed later)."""
    try:
        st = path.stat()
        return f"{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        return "?|?"


def check_file(path: str | os.PathLike) -> Path:
    """Return the path if it is a readable file that starts like a GGUF, else raise one clear line."""
    p = Path(path)
    if not p.exists():
        raise GGUFSpecError(f"{p}: no such file; give the path of a .gguf model or a name from models.toml")
    if p.is_dir():
        raise GGUFSpecError(f"{p}: is a directory, not a .gguf file")
    if not p.is_file():  # a FIFO would block the open below until something writes to it
        raise GGUFSpecError(f"{p}: not a regular file (a pipe, socket or device); give the path of a .gguf file")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise GGUFSpecError(f"{p}: cannot be read ({e.strerror})") from None
    if magic != GGUF_MAGIC:
        raise GGUFSpecError(f"{p}: not a GGUF file (it does not start with 'GGUF'); convert it with llama.cpp's convert_hf_to_gguf.py")
    return p


class _Reader:
    """Little-endian GGUF values from a buffer, at a moving position: scalars and strings kept,
    arrays of strings skipped but counted, small numeric arrays kept."""

    def __init__(self, m):
        import struct

        from gguf import GGUFValueType as VT

        self.m, self.pos, self.struct, self.VT = m, 0, struct, VT
        self.scalar = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
                       VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}

    def take(self, fmt: str):
        v = self.struct.unpack_from(fmt, self.m, self.pos)[0]
        self.pos += self.struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.m):
            raise ValueError("string runs past the end of the file")
        v = bytes(self.m[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return v

    def value(self, vtype: int):
        VT = self.VT
        vtype = VT(vtype)
        if vtype == VT.STRING:
            return self.string()
        if vtype != VT.ARRAY:
            return self.take(self.scalar[vtype])
        etype, count = VT(self.take("<I")), self.take("<Q")
        if etype == VT.STRING:
            for _ in range(count):
                n = self.take("<Q")  # (not `pos += take()`: that adds to the position before the take)
                self.pos += n
            return count
        if etype == VT.ARRAY:
            raise ValueError("nested arrays are not supported")
        fmt = self.scalar[etype]
        size = self.struct.calcsize(fmt)
        if count <= 4096:  # small arrays (per-layer head counts) are worth keeping
            vals = list(self.struct.unpack_from("<" + fmt[1] * count, self.m, self.pos))
            self.pos += size * count
            return vals
        self.pos += size * count
        return count


class _Header:
    """A fast walk over a GGUF header: scalar/string values kept, arrays skipped but counted.

    gguf.GGUFReader builds a numpy object per vocabulary entry (10 s for a 150k vocabulary);
    this reads what ggufspec needs in well under a second, with the format constants from gguf.
    """

    def __init__(self, path: Path):
        import mmap

        from gguf import GGUFValueType as VT

        self.fields: dict[str, object] = {}
        self.array_lengths: dict[str, int] = {}
        self.tensors: list[TensorInfo] = []
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            r = _Reader(m)
            if r.take("<4s") != GGUF_MAGIC:
                raise ValueError("bad magic")
            self.version = r.take("<I")
            if self.version < 2:
                raise ValueError(f"GGUF version {self.version} is too old")
            n_tensors, n_kv = r.take("<Q"), r.take("<Q")
            for _ in range(n_kv):
                key = r.string()
                vtype = r.take("<I")
                v = r.value(vtype)
                if VT(vtype) == VT.ARRAY and isinstance(v, int):
                    self.array_lengths[key] = v
                self.fields[key] = v
            infos = []
            for _ in range(n_tensors):
                name = r.string()
                dims = tuple(r.take("<Q") for _ in range(r.take("<I")))
                infos.append((name, dims, r.take("<I"), r.take("<Q")))
            align = int(self.fields.get("general.alignment", 32))
            self._tensors(infos, (r.pos + align - 1) // align * align, len(m))

    def _tensors(self, infos, data_start: int, size: int) -> None:
        """Each tensor's type and size, checked to lie within the file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        for name, dims, ttype, offset in infos:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = 1
            for d in dims:
                n_elements *= d
            n_bytes = n_elements // block * type_size
            end = data_start + offset + n_bytes
            if end > size:
                raise _Truncated(name, end, size)
            self.tensors.append(TensorInfo(name, n_bytes, qtype.name, dims))


class _Truncated(Exception):
    def __init__(self, name, end, size):
        super().__init__(name)
        self.name, self.end, self.size = name, end, size


def read_info(path: str | os.PathLike) -> GGUFInfo:
    """Parse the header and tensor table; raise GGUFSpecError if the file is damaged or cut short."""
    from gguf import LlamaFileType

    p = check_file(path)
    size = p.stat().st_size
    try:
        header = _Header(p)
    except _Truncated as t:
        raise GGUFSpecError(
            f"{p}: truncated GGUF (tensor {t.name} ends at byte {t.end:,} but the file has {t.size:,}); download it again"
        ) from None
    except Exception as e:  # struct.error, ValueError (unknown type codes), ... all mean damage
        raise GGUFSpecError(f"{p}: damaged GGUF header ({type(e).__name__}: {e}); download the file again") from None
    fields = header.fields
    tensors = header.tensors
    arch = str(fields.get("general.architecture", "unknown"))

    def arch_int(key: str, default: int = 0) -> int:
        v = fields.get(f"{arch}.{key}", default)
        if isinstance(v, list):  # per-layer arrays (e.g. head counts): the planner wants the largest
            v = max(v) if v else default
        return int(v)

    head_count_kv = fields.get(f"{arch}.attention.head_count_kv")
    # a per-layer array marks a hybrid's recurrent layers with 0 KV heads: only the others hold a KV cache
    kv_layers = tuple(i for i, n in enumerate(head_count_kv) if n) if isinstance(head_count_kv, list) else None
    n_embd = arch_int("embedding_length")
    n_head = arch_int("attention.head_count")
    n_head_kv = arch_int("attention.head_count_kv", n_head) or n_head
    head_dim = n_embd // n_head if n_head else 0
    ftype = fields.get("general.file_type")
    try:
        file_type = LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_") if ftype is not None else "unknown"
    except ValueError:
        file_type = f"type {ftype}"
    return GGUFInfo(
        path=str(p),
        file_size=size,
        architecture=arch,
        name=str(fields.get("general.name", p.stem)),
        n_layers=arch_int("block_count"),
        n_ctx_train=arch_int("context_length"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=arch_int("attention.key_length", head_dim) or head_dim,
        head_dim_v=arch_int("attention.value_length", head_dim) or head_dim,
        n_vocab=header.array_lengths.get("tokenizer.ggml.tokens", 0),
        vocab_type=str(fields.get("tokenizer.ggml.model", "none")),
        file_type=file_type,
        has_chat_template="tokenizer.chat_template" in fields,
        tensors=tuple(tensors),
        n_expert=arch_int("expert_count"),
        n_expert_used=arch_int("expert_used_count"),
        n_nextn=_nextn_blocks(arch_int("block_count"), arch_int("nextn_predict_layers"), tensors),
        kv_layers=kv_layers,
        target_layers=_target_layers(fields.get(f"{arch}.target_layers")),
        keeps_state=_keeps_state(fields, arch, kv_layers, arch_int("block_count")),
    )


def _target_layers(value) -> tuple[int, ...]:
    return tuple(int(i) for i in value) if isinstance(value, list) else ()


# Keys only recurrent layers have: Mamba's SSM, LFM2's short convolution, RWKV's WKV (llama.cpp's llm_kv names).
STATE_KEYS = (".ssm.", ".shortconv.", ".wkv.", ".time_mix_extra_dim", ".token_shift_count")


def _keeps_state(fields: dict, arch: str, kv_layers, n_layers: int) -> bool:
    """Whether the header describes a recurrent or hybrid model (llama.cpp's llama_model_is_recurrent/_hybrid, read
    before loading): keys of recurrent layers, or layers without KV heads."""
    own = [k for k in fields if k.startswith(arch + ".")]
    return any(marker in k for k in own for marker in STATE_KEYS) or (kv_layers is not None and len(kv_layers) < n_layers)


def _nextn_blocks(n_layers: int, declared: int, tensors) -> int:
    """MTP blocks a GGUF carries: declared by `nextn_predict_layers`, and present as llama.cpp checks them
    (`blk.<block_count - 1>.nextn.eh_proj.weight`, common_speculative_types_from_gguf); 0 where either lacks."""
    if declared <= 0 or n_layers <= 0:
        return 0
    names = {t.name for t in tensors}
    return declared if f"blk.{n_layers - 1}.nextn.eh_proj.weight" in names else 0
