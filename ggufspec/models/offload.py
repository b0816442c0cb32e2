"""GPU layer offload: how many layers of the target and of the draft go to the GPU.

The planner is pure arithmetic over sizes read from the GGUF files (or, for a model not yet on
this machine, estimated from its registry entry): each repeating layer's weights, the output
layer, the token embeddings (which llama.cpp keeps on the CPU), the KV cache for the chosen
context (layers x context x kv heads x head size x 2 for K and V x bytes per element) and a
compute-buffer allowance. With a VRAM budget it places the draft first (a draft left on the CPU
usually costs more than it saves), then as many target layers as fit, then checks that what
stays on the CPU fits in RAM. A mixture-of-experts target whose layers do not all fit keeps the
expert tensors of its first layers on the CPU (llama.cpp's --n-cpu-moe N), as few as it takes for
every other weight to go to the GPU: per token only k of e experts run, so experts cost least on the CPU.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, replace

from ..errors import GGUFSpecError

GiB = 1 << 30
MiB = 1 << 20

# Bits per weight of the bulk of a file, by quantisation (llama.cpp's quantize table).
BITS_PER_WEIGHT = {"Q2_K": 2.96, "Q3_K_S": 3.5, "Q3_K_M": 3.91, "Q3_K_L": 4.27, "Q4_0": 4.5, "Q4_K_S": 4.58,
                   "Q4_K_M": 4.89, "Q5_K_S": 5.54, "Q5_K_M": 5.7, "Q6_K": 6.56, "Q8_0": 8.5, "F16": 16.0, "BF16": 16.0,
                   "F32": 32.0}


@dataclass(frozen=True)
class ModelSizes:
    """What the planner needs to know about one model, in bytes."""

    name: str
    n_layers: int
    layer_bytes: tuple[int, ...]  # weights of each repeating layer
    output_bytes: int  # output matrix + final norm: offloaded as llama.cpp's "layer n_layers + 1"
    embed_bytes: int  # token embeddings: stay on the CPU
    n_embd: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    estimated: bool = False  # True when sizes come from the registry, not a GGUF header
    expert_bytes: tuple[int, ...] = ()  # a mixture of experts: the expert tensors' share of each layer's weights
    kv_layers: tuple[int, ...] | None = None  # the layers with a KV cache (a hybrid's attention layers); None: all
    type_k: str = "f16"  # the KV cache's types (-ctk, -ctv)
    type_v: str = "f16"
    mtp_layers: int = 0  # MTP (NextN) blocks among the layers: their own context (KV counted per layer, a compute buffer)

    def kv_bytes_per_layer(self, n_ctx: int) -> int:
        """The KV cache of one attention layer (K and V at their types' bytes per element)."""
        from ..llama.gguf_info import kv_cache_type

        per_element = kv_cache_type(self.type_k, "-ctk")[1] + kv_cache_type(self.type_v, "-ctv")[1]
        return int(n_ctx * self.n_head_kv * self.head_dim * per_element)

    def kv_bytes(self, i: int, n_ctx: int) -> int:
        """Layer i's KV cache: none for a hybrid's recurrent layers."""
        return self.kv_bytes_per_layer(n_ctx) if self.kv_layers is None or i in self.kv_layers else 0

    def device_layer_bytes(self, i: int, cpu_moe: int) -> int:
        """Layer i's weights on the GPU when the experts of the first cpu_moe layers stay on the CPU."""
        experts = self.expert_bytes[i] if self.expert_bytes and i < cpu_moe else 0
        return self.layer_bytes[i] - experts

    def compute_bytes(self, n_ubatch: int = 512) -> int:
        """Allowance for llama.cpp's compute buffer on the GPU: a batch's logits (CUDA keeps them on the device;
        Vulkan in host memory), its activations, and slack for attention without flash attention; twice that for a
        model with MTP layers, whose context (`--mode mtp`, auto) decodes every batch the target decodes."""
        return (2 if self.mtp_layers else 1) * (n_ubatch * (self.n_vocab + 16 * self.n_embd) * 4 + 32 * MiB)

    @property
    def file_bytes(self) -> int:
        return sum(self.layer_bytes) + self.output_bytes + self.embed_bytes


def sizes_from_info(info) -> ModelSizes:
    """From a GGUFInfo (gguf_info.read_info): per-layer tensor bytes grouped by blk.N."""
    from ..llama.gguf_info import EXPERT_TENSORS

    layers, experts = [0] * info.n_layers, [0] * info.n_layers
    output = embed = 0
    for t in info.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) < info.n_layers:
            layers[int(m.group(1))] += t.n_bytes
            if re.search(EXPERT_TENSORS, t.name):
                experts[int(m.group(1))] += t.n_bytes
        elif t.name.startswith("token_embd"):
            embed += t.n_bytes
        else:
            output += t.n_bytes
    if not any(t.name.startswith("output.") for t in info.tensors):
        output += embed  # tied embeddings: llama.cpp places a second copy of token_embd with the output layer
    return ModelSizes(info.name, info.n_layers, tuple(layers), output, embed, info.n_embd, info.n_head_kv,
                      info.head_dim_k, info.n_vocab, expert_bytes=tuple(experts) if any(experts) else (),
                      kv_layers=info.kv_layers, mtp_layers=info.n_nextn)


def sizes_from_spec(spec) -> ModelSizes:
    """Estimate from a registry entry (size, shape, quant) for a file that is not on this machine."""
    shape = spec.shape or {}
    need = ("n_embd", "n_head_kv", "head_dim", "n_vocab")
    if not spec.n_layers or not spec.size or not all(k in shape for k in need):
        raise GGUFSpecError(f"{spec.name}: not on this machine and its registry entry lacks size/shape to plan from; "
                            f"download it first (`ggufspec models pull {spec.name}`)")
    bpw = BITS_PER_WEIGHT.get(spec.quant.upper(), 4.89)
    embed = int(shape["n_vocab"] * shape["n_embd"] * bpw / 8)
    output = int(shape["n_vocab"] * shape["n_embd"] * max(bpw, BITS_PER_WEIGHT["Q6_K"]) / 8)  # K-quants keep output at Q6_K
    per_layer = max(0, (spec.size - embed - output) // spec.n_layers)
    return ModelSizes(spec.name, spec.n_layers, (per_layer,) * spec.n_layers, output, embed, shape["n_embd"],
                      shape["n_head_kv"], shape["head_dim"], shape["n_vocab"], estimated=True)


@dataclass
class Placement:
    name: str
    role: str
    n_gpu_layers: int  # what llama.cpp gets: 0..n_layers + 1 (the +1 is the output layer)
    n_layers: int
    gpu_bytes: int
    cpu_bytes: int
    kv_bytes: int
    estimated: bool
    cpu_moe: int = 0  # the first N layers' experts stay on the CPU (llama.cpp's --n-cpu-moe N)

    @property
    def flag(self) -> str:
        return "all" if self.n_gpu_layers > self.n_layers else str(self.n_gpu_layers)

    @property
    def moe_flag(self) -> str:
        """llama.cpp's flag for the experts kept on the CPU ('' for none)."""
        if not self.cpu_moe:
            return ""
        return "--cpu-moe" if self.cpu_moe >= self.n_layers else f"--n-cpu-moe {self.cpu_moe}"

    @property
    def layers_on_gpu(self) -> str:
        """Repeating layers on the GPU out of all, as people count them (45/80)."""
        return f"{max(0, min(self.n_gpu_layers, self.n_layers + 1) - 1)}/{self.n_layers}" + (" + output" if self.n_gpu_layers else "")


@dataclass
class Plan:
    vram_bytes: int
    ram_bytes: int
    n_ctx: int
    target: Placement
    draft: Placement | None
    split: dict | None = None  # target layers per device (device name -> count), as llama.cpp splits them
    type_k: str = "f16"  # both models' KV cache types (-ctk, -ctv)
    type_v: str = "f16"

    @property
    def gpu_bytes(self) -> int:
        return self.target.gpu_bytes + (self.draft.gpu_bytes if self.draft else 0)

    @property
    def cpu_bytes(self) -> int:
        return self.target.cpu_bytes + (self.draft.cpu_bytes if self.draft else 0)

    def flags(self) -> str:
        out = f"-ngl {self.target.flag}" + (f" {self.target.moe_flag}" if self.target.cpu_moe else "") + f" -c {self.n_ctx}"
        out += "".join(f" {flag} {t}" for flag, t in (("-ctk", self.type_k), ("-ctv", self.type_v)) if t != "f16")
        if self.draft:
            out += f" -ngld {self.draft.flag}"
        return out

    def to_dict(self) -> dict:
        return {"vram_bytes": self.vram_bytes, "ram_bytes": self.ram_bytes, "n_ctx": self.n_ctx, "type_k": self.type_k,
                "type_v": self.type_v,
                "flags": self.flags(),
                "gpu_bytes": self.gpu_bytes, "cpu_bytes": self.cpu_bytes, "split": self.split,
                "models": [asdict(p) | {"flag": p.flag} for p in (self.target, self.draft) if p]}


def _place(m: ModelSizes, role: str, budget: int, n_ctx: int, cpu_moe: int = 0) -> Placement:
    """As many of m's layers as fit in `budget`, in llama.cpp's order, the experts of its first cpu_moe
    layers on the CPU.

    llama.cpp offloads from the top: n_gpu_layers = n puts the output layer and the last n - 1
    repeating layers on the GPU (i_gpu_start = n_layer + 1 - n). Token embeddings stay on the CPU.
    """
    compute = m.compute_bytes()
    cpu_moe = _moe_layers(cpu_moe, m) if m.expert_bytes else 0
    used, n = 0, 0
    if budget >= compute + m.output_bytes:
        used, n = compute + m.output_bytes, 1
        for i in reversed(range(m.n_layers)):
            if used + m.device_layer_bytes(i, cpu_moe) + m.kv_bytes(i, n_ctx) > budget:
                break
            used += m.device_layer_bytes(i, cpu_moe) + m.kv_bytes(i, n_ctx)
            n += 1
    repeating = max(0, n - 1)
    gpu_weights = (m.output_bytes if n else 0) + sum(m.device_layer_bytes(i, cpu_moe)
                                                     for i in range(m.n_layers - repeating, m.n_layers))
    cpu_kv = sum(m.kv_bytes(i, n_ctx) for i in range(m.n_layers - repeating))
    cpu = m.file_bytes - gpu_weights + cpu_kv + (compute if n == 0 else 0)
    return Placement(m.name, role, n, m.n_layers, used, cpu, sum(m.kv_bytes(i, n_ctx) for i in range(m.n_layers)),
                     m.estimated, cpu_moe)


def _place_moe(m: ModelSizes, role: str, budget: int, n_ctx: int, cpu_moe: int | None) -> Placement:
    """With cpu_moe None (a mixture of experts, the planner's choice): every layer on the GPU with as few
    layers' experts on the CPU as that takes; where even all experts on the CPU leave layers over, as many
    layers as fit with every expert on the CPU."""
    if cpu_moe is not None or not m.expert_bytes:
        return _place(m, role, budget, n_ctx, cpu_moe or 0)
    for k in range(m.n_layers + 1):
        p = _place(m, role, budget, n_ctx, k)
        if p.n_gpu_layers > m.n_layers:
            return p
    return p if p.n_gpu_layers > 1 else _place(m, role, budget, n_ctx, 0)  # no layer on the GPU: nothing to keep back


def split_layers(n_gpu_layers: int, n_layers: int, free_by_device: dict[str, int]) -> dict[str, int]:
    """How llama.cpp spreads n_gpu_layers (output layer included) over devices by default: in
    proportion to their free memory, in order (llama-model.cpp, load_tensors: splits)."""
    names = list(free_by_device)
    if not names or n_gpu_layers <= 0:
        return {}
    total = sum(free_by_device.values()) or len(names)
    cumulative, running = [], 0.0
    for name in names:
        running += (free_by_device[name] or total / len(names)) / total
        cumulative.append(running)
    count = dict.fromkeys(names, 0)
    n = min(n_gpu_layers, n_layers + 1)
    for j in range(n):  # j-th offloaded layer from the bottom (the last one is the output layer)
        i = next((k for k, c in enumerate(cumulative) if c > j / n), len(names) - 1)
        count[names[i]] += 1
    return count


def plan(target: ModelSizes, draft: ModelSizes | None, *, vram_bytes: int, ram_bytes: int | None, n_ctx: int,
         draft_vram_bytes: int | None = None, devices: dict[str, int] | None = None, cpu_moe: int | None = None,
         type_k: str = "f16", type_v: str = "f16") -> Plan:
    """Draft first, fully if it fits; then target layers; refuse if the CPU side exceeds RAM.

    draft_vram_bytes: the draft's own budget where it goes to other devices than the target (a
    target on RPC servers, a draft on this machine); devices: the target's devices and their free
    memory, to show the split across them; cpu_moe: the target's layers whose experts stay on the
    CPU (None: as few as it takes, for a mixture of experts); type_k, type_v: the KV caches' types (-ctk, -ctv)."""
    if n_ctx < 1:
        raise GGUFSpecError(f"-c must be positive (got {n_ctx})")
    from ..llama.gguf_info import kv_cache_type

    kv_cache_type(type_k, "-ctk")
    kv_cache_type(type_v, "-ctv")
    types = {"type_k": type_k, "type_v": type_v}
    target, draft = replace(target, **types), replace(draft, **types) if draft else None
    d = None
    budget = max(0, vram_bytes)
    if draft is not None:
        d = _place(draft, "draft", budget if draft_vram_bytes is None else max(0, draft_vram_bytes), n_ctx)
        budget -= d.gpu_bytes if draft_vram_bytes is None else 0
    t = _place_moe(target, "target", budget, n_ctx, cpu_moe)
    p = Plan(vram_bytes, ram_bytes, n_ctx, t, d, split_layers(t.n_gpu_layers, t.n_layers, devices) if devices else None,
             type_k, type_v)
    if ram_bytes is not None and p.cpu_bytes > ram_bytes:
        raise GGUFSpecError(
            f"this plan needs {size_text(p.cpu_bytes)} of RAM beside {size_text(p.gpu_bytes)} of VRAM, but the machine "
            f"has {size_text(ram_bytes)}: {size_text(p.cpu_bytes - ram_bytes)} missing; use a smaller quantisation, "
            "a smaller -c, or more VRAM"
        )
    return p


def size_text(n_bytes: int) -> str:
    """A size as people read it: GiB from 1 GiB up, MiB below it (where "0.0 GiB" would say nothing)."""
    return f"{n_bytes / GiB:.1f} GiB" if abs(n_bytes) >= GiB else f"{n_bytes / MiB:.0f} MiB"


def parse_size(text: str, flag: str = "--vram") -> int:
    """'24GiB', '24G', '8192MiB', '0' -> bytes (G and GB read as GiB, as GPU makers' sizes are)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise GGUFSpecError(f"{flag} {text!r} is not a size; write e.g. 24GiB, 8192MiB{' or 0' if flag == '--vram' else ''}")
    unit = {"": 1, "K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * unit)


def detect_vram() -> int:
    """Free memory of this machine's GPUs together, as llama.cpp's backends report it (ggml_backend_dev_memory:
    CUDA, ROCm, Vulkan, Metal, SYCL alike); 0 where this build sees none."""
    from ..llama.devices import local_gpus

    return sum(local_gpus().values())


def total_ram() -> int:
    import psutil

    return psutil.virtual_memory().total


def sizes_for(path_or_spec) -> ModelSizes:
    from ..llama.gguf_info import read_info

    if isinstance(path_or_spec, (str, os.PathLike)):
        return sizes_from_info(read_info(path_or_spec))
    return sizes_from_spec(path_or_spec)


def resolve_layers(target, draft, ngl, ngld, *, n_ctx: int, vram_bytes: int | None = None,
                   draft_vram_bytes: int | None = None, devices: dict[str, int] | None = None,
                   cpu_moe: int | None = None, type_k: str = "f16", type_v: str = "f16") -> tuple[int, int, int]:
    """Turn N / 'all' / 'auto' into the n_gpu_layers llama.cpp gets, for target and draft, and the target's
    layers whose experts stay on the CPU (cpu_moe: N, -1 for all, None: the plan's where -ngl is auto, else 0).

    With the target's devices known (devices: name -> free bytes, e.g. RPC servers), a layer count
    they cannot hold is refused in one line instead of failing inside llama.cpp."""
    def one(value, sizes_plan):
        if value == "all":
            return -1  # llama.cpp: negative means every layer
        if value == "auto":
            return sizes_plan
        return int(value)

    if devices and vram_bytes is None:
        vram_bytes = sum(devices.values())
    if devices and ngl not in ("auto", 0, None):
        t = replace(sizes_for(target), type_k=type_k, type_v=type_v)
        fits = _place(t, "target", vram_bytes, n_ctx, _moe_layers(cpu_moe, t)).n_gpu_layers
        wanted = t.n_layers + 1 if ngl == "all" else min(int(ngl), t.n_layers + 1)
        if wanted > fits:
            raise GGUFSpecError(f"-ngl {ngl}: the target's devices ({', '.join(devices)}) have {size_text(vram_bytes)} free, "
                                f"room for {fits} of its {t.n_layers + 1} layers; use -ngl {fits} or -ngl auto, or add a server")
    fixed = cpu_moe or 0
    if "auto" not in (ngl, ngld):
        return one(ngl, 0), one(ngld, 0), fixed
    vram = detect_vram() if vram_bytes is None else vram_bytes
    dvram = vram if draft_vram_bytes is None else draft_vram_bytes
    if vram <= 0 and dvram <= 0:
        return one(ngl, 0), one(ngld, 0), fixed  # nothing to plan: everything stays on the CPU
    p = plan(sizes_for(target), sizes_for(draft) if draft else None, vram_bytes=vram, ram_bytes=None, n_ctx=n_ctx,
             draft_vram_bytes=draft_vram_bytes, cpu_moe=cpu_moe if ngl == "auto" else fixed, type_k=type_k,
             type_v=type_v)
    return (one(ngl, p.target.n_gpu_layers), one(ngld, p.draft.n_gpu_layers if p.draft else 0),
            p.target.cpu_moe if ngl == "auto" else fixed)


def cpu_moe_value(value) -> int | None:
    """--n-cpu-moe as the planner and engine take it: N, -1 for every layer ('all'), None for the plan's choice."""
    if isinstance(value, list):
        raise GGUFSpecError("--n-cpu-moe takes one value (N, all or auto), not a list")
    return None if value in (None, "auto") else -1 if value == "all" else int(value)


def moe_text(cpu_moe: int) -> str:
    """An expert split as --n-cpu-moe reads it (-1: all)."""
    return "all" if cpu_moe < 0 else str(cpu_moe)


def _moe_layers(cpu_moe: int | None, m: ModelSizes) -> int:
    return m.n_layers if cpu_moe is not None and cpu_moe < 0 else cpu_moe or 0
