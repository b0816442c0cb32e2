"""From what the user typed (a pair name, model names, or paths) to GGUF files on disk, and to a
loaded `Engine`: the one place that resolves names, plans offload and opens models."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..core import DEFAULT_MODE
from ..errors import GGUFSpecError
from .hub import ensure_model, local_path
from ..paths import models_dir
from .registry import PairSpec, Registry, load_registry


@dataclass
class LoadOptions:
    """Which models to load and how (the CLI's shared model flags)."""

    pair: str | None = None
    target: str | None = None
    draft: str | None = None
    n_gpu_layers: int | str | None = None  # N, "all", "auto"; None: the pair's default, else auto
    draft_n_gpu_layers: int | str | None = None
    cpu_moe: int | str | None = None  # N, "all", "auto"/None: the target's layers whose experts stay on the CPU
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int | None = None
    type_k: str = "f16"  # the KV caches' types (llama.cpp's -ctk, -ctv)
    type_v: str = "f16"
    registry: str | None = None
    offline: bool = False
    verbose: bool = False
    remeasure: bool = False
    use_default: bool = False  # no pair and no -m: the registry's default pair
    rpc: str | None = None  # llama.cpp RPC servers, "host:port[,host:port]": the target's layers go there
    devices: str | None = None  # llama.cpp's -dev for the target ("RPC0,CUDA0"; "none": the CPU alone)
    draft_devices: str | None = None  # and -devd for the draft
    n_seq: int = 1  # sequences in each context (serve's -np): n_ctx is theirs together
    kv_unified: bool = False  # and one KV cache for them all (serve's -kvu), not a stream each
    prompt_chunk: int | None = None  # prompts decoded (and reused) in aligned chunks of this many tokens; None: -b
    repack: bool | None = None  # llama.cpp's CPU weight repacking (--repack / --no-repack); None: as measured here


def looks_like_path(text: str) -> bool:
    return text.endswith(".gguf") or "/" in text or os.path.lexists(text)


def resolve_model(name_or_path: str, registry: Registry, *, offline: bool = False) -> Path:
    """A path is taken as it is (checked when loaded); a registry name is found or downloaded."""
    if looks_like_path(name_or_path):
        path = Path(name_or_path)
        if os.path.lexists(path):
            try:
                path.stat()
            except OSError as e:  # a symlink loop, a dangling link, a directory we may not enter
                raise GGUFSpecError(f"{path}: cannot resolve this path ({e.strerror}); check the link or give the file itself") from None
        return path
    return ensure_model(registry.model(name_or_path), offline=offline)


def pair_names(pair: str | None, target: str | None, draft: str | None, reg: Registry, *,
               use_default: bool = False) -> tuple[str, str | None, PairSpec | None]:
    """(target name or path, draft name or path or None, the pair's spec if a pair was named)."""
    if pair is not None and target is not None:
        raise GGUFSpecError("give a pair name or -m TARGET, not both")
    if pair is None and target is None:
        if not use_default or not reg.default_pair:
            raise GGUFSpecError("name a pair (see `ggufspec models list`) or give -m TARGET (and -md DRAFT)")
        pair = reg.default_pair
    if pair is not None and looks_like_path(pair):
        return pair, draft, None
    if pair is not None:
        spec = reg.pair(pair)
        return spec.target, draft or spec.draft, spec
    return target, draft, None


def resolve_models(pair: str | None, target: str | None, draft: str | None, *, registry=None, offline: bool = False,
                   use_default: bool = False) -> tuple[Path, Path | None, dict]:
    """Return (target path, draft path or None, the pair's defaults: settings and offload)."""
    reg = load_registry(registry)
    target, draft, spec = pair_names(pair, target, draft, reg, use_default=use_default)
    defaults = pair_defaults(spec) if spec else {}
    return resolve_model(target, reg, offline=offline), resolve_model(draft, reg, offline=offline) if draft else None, defaults


def merge_pair_settings(pair: dict, given: dict, *, bench: bool = False) -> tuple[dict, int | None]:
    """The one rule for a pair's settings (models.toml [pairs.NAME.settings]) under the user's: the user's
    win. Returns (the run's settings, the pair's draft length). The pair's draft_max is draft mode's length:
    a run in auto drafts as far as the measured costs say pays, so there it is left out, unless the pair's own
    mode is auto (then it is auto's cap, as `tune --write` measured it); the benchmark gives it to its draft
    rows. bench: every row names its own mode and draft length, so the pair's mode and draft_max are left out
    of the settings."""
    pair = dict(pair)
    draft_length = pair.pop("draft_max", None)
    if bench:
        pair.pop("mode", None)
    merged = {**pair, **given}
    caps = merged.get("mode", DEFAULT_MODE) != "auto" or pair.get("mode") == "auto"
    if not bench and draft_length is not None and "draft_max" not in merged and caps:
        merged["draft_max"] = draft_length
    return merged, draft_length


def pair_defaults(spec: PairSpec) -> dict:
    out = {"settings": dict(spec.settings), "name": spec.name}
    if spec.n_gpu_layers is not None:
        out["n_gpu_layers"] = spec.n_gpu_layers
    if spec.draft_n_gpu_layers is not None:
        out["draft_n_gpu_layers"] = spec.draft_n_gpu_layers
    if spec.n_cpu_moe is not None:
        out["cpu_moe"] = spec.n_cpu_moe
    return out


def open_engine(o: LoadOptions, modes: tuple[str, ...] = (), measure: bool | None = None):
    """Resolve names, plan offload, load the models: (Engine, the pair's defaults). modes: those the run will
    use, checked against the files before anything loads (mtp: the target's MTP layers). measure: whether the
    costs are measured (None: unless every mode is "target", which verifies nothing)."""
    from ..core import HEAD_MODES, HIDDEN_DRAFT_MODES, MTP_MODES
    from ..engine import Engine
    from ..llama.gguf_info import read_info
    from ..llama.heads import check_mtp_file, is_mtp_file
    from .offload import cpu_moe_value, resolve_layers
    from ..llama.rpc import budgets, devices_for

    target, draft, defaults = resolve_models(o.pair, o.target, o.draft, registry=o.registry, offline=o.offline,
                                             use_default=o.use_default)
    if any(m in MTP_MODES for m in modes) and not (draft and is_mtp_file(read_info(draft))):
        check_mtp_file(target)
    for mode in (m for m in modes if m in HIDDEN_DRAFT_MODES):
        arch = read_info(draft).architecture if draft else None
        if arch != HEAD_MODES[mode]:
            raise GGUFSpecError(f"--mode {mode} drafts with {'an EAGLE-3' if mode == 'eagle3' else 'a DFlash'} draft "
                                f"trained for this target (a GGUF of architecture {HEAD_MODES[mode]}); "
                                + (f"{Path(draft).name}'s architecture is {arch}" if draft else "give one with -md"))
    target_devices, draft_devices = devices_for(o.rpc, o.devices, o.draft_devices)
    # The planner's budgets: the free memory of the devices each model may use (none named: any GPU found).
    planned = {}
    if target_devices is not None:
        free, draft_free = budgets(target_devices, draft_devices)
        planned = {"devices": free, "draft_vram_bytes": draft_free if draft else None}

    def layers(key):
        value = getattr(o, key)
        if isinstance(value, list):
            raise GGUFSpecError("a comma list of layer counts is a sweep: use it with `ggufspec bench`")
        return value if value is not None else defaults.get(key, "auto")

    moe = o.cpu_moe if o.cpu_moe is not None else defaults.get("cpu_moe")  # the pair's (`tune --write`)
    ngl, ngld, cpu_moe = resolve_layers(target, draft, layers("n_gpu_layers"), layers("draft_n_gpu_layers"), n_ctx=o.n_ctx,
                                        cpu_moe=cpu_moe_value(moe), type_k=o.type_k, type_v=o.type_v, **planned)
    engine = Engine(target, draft, n_ctx=o.n_ctx, n_batch=o.n_batch, n_threads=o.n_threads, n_gpu_layers=ngl,
                    draft_n_gpu_layers=ngld, verbose=o.verbose, remeasure=o.remeasure, devices=target_devices,
                    draft_devices=draft_devices, cpu_moe=cpu_moe, type_k=o.type_k, type_v=o.type_v, n_seq=o.n_seq,
                    kv_unified=o.kv_unified, prompt_chunk=o.prompt_chunk, repack=o.repack,
                    measure=measure if measure is not None else not modes or any(m != "target" for m in modes))
    return engine, defaults


def plan_offload(pair: str | None, target: str | None, draft: str | None, *, registry=None, vram_bytes: int | None,
                 ram_bytes: int, n_ctx: int, rpc: str | None = None, cpu_moe: int | None = None, type_k: str = "f16",
                 type_v: str = "f16"):
    """The offload plan for a pair or models, from their GGUF files or, not downloaded, their registry
    entries. With RPC servers: the target over their devices (split as llama.cpp splits it), the draft
    on this machine's own GPUs."""
    from .offload import plan, sizes_for
    from ..llama.devices import local_gpus
    from ..llama.rpc import budgets, devices_for

    devices = draft_vram = None
    if rpc:
        devices, draft_vram = budgets(*devices_for(rpc))
    if vram_bytes is None and not devices:
        local = local_gpus()
        devices = local if len(local) > 1 else None  # several GPUs: show how llama.cpp splits the layers
        vram_bytes = sum(local.values())
    elif vram_bytes is None:
        vram_bytes = sum(devices.values())
    reg = load_registry(registry)
    target, draft, _ = pair_names(pair, target, draft, reg)

    def sizes(name):
        if looks_like_path(name):
            return sizes_for(name)
        spec = reg.model(name)
        return sizes_for(local_path(spec) or spec)

    return plan(sizes(target), sizes(draft) if draft else None, vram_bytes=vram_bytes, ram_bytes=ram_bytes, n_ctx=n_ctx,
                draft_vram_bytes=draft_vram, devices=devices, cpu_moe=cpu_moe, type_k=type_k, type_v=type_v)


def status(registry: Registry) -> dict:
    """Where each registry model is on this machine (None if not here), for `models list`."""
    return {name: local_path(spec) for name, spec in registry.models.items()}


def listing(registry=None) -> dict:
    """Pairs and models of the registry, and which are on this machine (`ggufspec models list`)."""
    reg = load_registry(registry)
    where = status(reg)
    models = [{"name": n, "repo": s.repo, "file": s.file, "quant": s.quant, "n_layers": s.n_layers,
               "n_params_b": s.n_params, "path": str(where[n]) if where[n] else None,
               "size_bytes": where[n].stat().st_size if where[n] else None, "mirror": s.mirror is not None,
               "checked": s.checked}
              for n, s in reg.models.items()]
    pairs = [{"name": n, "default": n == reg.default_pair, "target": p.target, "draft": p.draft,
              "mode": p.settings.get("mode"), "ready": all(where.get(m.name) for m in reg.models_of(n))
              and all(Path(m).is_file() for m in (p.target, p.draft) if m and reg.is_file_member(m)),
              "checked": all(m.checked for m in reg.models_of(n)), "draft_max": p.settings.get("draft_max"),
              "note": p.note} for n, p in reg.pairs.items()]
    return {"pairs": pairs, "models": models, "models_dir": str(models_dir()), "registries": list(reg.sources)}


def pull(name: str, *, mirror: str | None = None, registry=None, offline: bool = False, log=print) -> list[tuple[str, Path]]:
    """Download a pair's models or one model (Hub, or the offline mirror): [(name, path)]."""
    from .mirror import fetch

    reg = load_registry(registry)
    out = []
    for spec in reg.models_of(name):
        path = fetch(spec, models_dir(), registry=reg, log=log) if mirror else ensure_model(spec, offline=offline)
        out.append((spec.name, path))
    return out


def info(model: str, registry=None) -> dict:
    """What a GGUF file says about itself (a path, or a registry name already downloaded)."""
    from ..llama.gguf_info import read_info

    return read_info(local_model(model, load_registry(registry))).to_dict()


def local_model(name_or_path: str, reg: Registry) -> Path:
    """A path as it is, or a registry model's file on this machine (checked); for the commands that only read
    files, one line saying how to get a model that is not here, and whether its entry was ever checked."""
    if not looks_like_path(name_or_path):
        spec = reg.model(name_or_path)
        if local_path(spec) is None:
            unchecked = " (an unchecked entry: repository and file as published, not verified)" if not spec.checked else ""
            raise GGUFSpecError(f"{spec.name}: not on this machine ({spec.repo}, {spec.file}); "
                                f"`ggufspec models pull {spec.name}` downloads it{unchecked}")
    return resolve_model(name_or_path, reg, offline=True)


def check_pair(target: str, draft: str | None = None, registry=None) -> str:
    """One sentence saying the draft can serve the target; GGUFSpecError saying why not. No draft: TARGET is a
    pair's name (its target and draft), or a model checked for MTP layers of its own to draft with."""
    from ..llama.backend import Model
    from ..llama.compat import check_compatible, text_pairing
    from ..llama.vocab import shared_tokens
    from ..llama.draft_fit import alone_misuse, is_mtp_file, mtp_file_misfit
    from ..llama.gguf_info import read_info
    from ..llama.heads import check_mtp_file

    reg = load_registry(registry)
    pair = reg.pairs.get(target) if draft is None else None
    if pair:
        target, draft = pair.target, pair.draft
    target_path = local_model(target, reg)
    draft_path = local_model(draft, reg) if draft else None
    target_info = read_info(target_path)
    misuse = alone_misuse(target_info)
    if misuse:  # a draft-only file named as the target
        raise GGUFSpecError(f"{target_path}: {misuse}")
    if draft_path is None:
        n = check_mtp_file(target_path)
        return f"{target_path.name} carries {n} MTP layer{'s' if n > 1 else ''} of its own to draft with (--mode mtp)"
    draft_info = read_info(draft_path)
    if is_mtp_file(draft_info):
        misfit = mtp_file_misfit(target_info, draft_info)
        if misfit:
            raise GGUFSpecError(f"{draft_path.name} cannot draft for {target_path.name}: {misfit}")
    with Model(target_path, role="target", vocab_only=True) as t, Model(draft_path, role="draft", vocab_only=True) as d:
        if d.info.architecture in ("eagle3", "dflash"):
            return _check_hidden_draft(t.path, d.path)
        if is_mtp_file(d.info):
            check_compatible(t, d)
            return (f"compatible: {d.path.name} holds the MTP layers of {t.path.name} ({d.info.n_nextn} block"
                    f"{'s' if d.info.n_nextn > 1 else ''}): use -md {d.path.name} --mode mtp")
        difference = text_pairing(t, d)
        for m in (t, d):  # a vocabulary that fits is not yet a model that loads: load each (mapped, not copied)
            Model(m.path, role=m.role, repack=False).close()
        mtp = t.info.n_nextn
        if difference:
            n_shared = len(shared_tokens(t, d)[1])
            how = (f"across tokenizers, through text ({difference}): its greedy drafts are its text as the target "
                   f"tokenizes it, its sampled ones on the {n_shared:,} tokens both write alike "
                   f"({100 * n_shared / t.n_vocab:.0f}% of the target's {t.n_vocab:,})")
        elif t.n_vocab != d.n_vocab:
            how = (f"padded vocabulary: {t.vocab_type}, target {t.n_vocab:,} tokens, draft {d.n_vocab:,}; the ids both "
                   "have are the same tokens")
        else:
            how = f"same vocabulary: {t.vocab_type}, {t.n_vocab:,} tokens"
        return (f"compatible: {d.path.name} can draft for {t.path.name}, {how}"
                + (f"; {t.path.name} also carries {mtp} MTP layer{'s' if mtp > 1 else ''} of its own (--mode mtp)"
                   if mtp else ""))


def _check_hidden_draft(target, draft) -> str:
    """An EAGLE-3 or DFlash draft against its target, both loaded (mapped, not copied): the layers it reads exist,
    the hidden states' width and the vocabulary match (what llama.cpp would otherwise abort on)."""
    from ..llama.backend import Model
    from ..llama.dflash import check_dflash
    from ..llama.hidden import check_eagle3

    with Model(target, role="target", repack=False) as t, Model(draft, role="draft", repack=False) as d:
        arch = d.info.architecture
        ids = check_eagle3(t, d) if arch == "eagle3" else check_dflash(t, d)[0]
        what = "an EAGLE-3" if arch == "eagle3" else "a DFlash"
        return (f"compatible: {d.path.name} is {what} draft for {t.path.name}: it reads the inputs of target layers "
                f"{', '.join(map(str, ids))} of {t.info.n_layers} ({t.n_vocab} tokens); use --mode {arch}")
