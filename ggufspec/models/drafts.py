"""`ggufspec drafts`: every way a target can be drafted on this machine, checked and ranked from GGUF headers.

Candidates: the GGUFs of the models directory and the Hugging Face cache, the registry's models not downloaded
(its pairs' drafts for this target, and models whose vocabulary size fits), the target's own MTP layers, and
prompt lookup. Each is checked as `models check` checks a pair (`llama.compat`: the headers first, then the
vocabularies alone, no weights), or, for a draft that reads the target's hidden states (eagle3, dflash), by the
target layers it reads. What a draft step costs against a target step is predicted from the bytes each step
reads (a decode on CPUs and GPUs is bound by reading weights), and the expected speed-up from Leviathan's formula
(`costs.best_predicted`) at an assumed acceptance rate: both labelled so; `bench/draft_choice` measures them.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core import MODES
from ..costs import best_predicted
from ..errors import GGUFSpecError
from ..llama.draft_fit import HIDDEN_STATE_ARCHS, hidden_state_misfit
from ..llama.gguf_info import EXPERT_TENSORS
from ..paths import models_dir

# The acceptance rate a same-family draft is ranked at before --measure: the registry's measured pairs run 0.7
# (Llama 3 70B + 8B, llama.cpp) to 0.9 (the Qwen coder pair on code); lookup's depends on the text, so it has none.
ASSUMED_ALPHA = 0.7


@dataclass
class Candidate:
    """One way to draft for the target, as `ggufspec drafts` lists it."""

    name: str  # what to type: a registry name, a path, owner/name/file, or the drafter's name
    mode: str  # the --mode that drafts with it
    source: str  # models dir, Hub cache, registry, the target, always
    usable: bool | None  # None: not on this machine, so not checked
    why: str  # the reason in a few words (or what to run)
    path: str | None = None
    size_bytes: int | None = None
    quant: str | None = None
    cost_ratio: float | None = None  # a draft step over a target step, predicted from the bytes each reads
    expected: float | None = None  # Leviathan's speed-up at ASSUMED_ALPHA and the best length (predicted)
    draft_max: int | None = None
    measured: dict | None = None  # --measure: alpha, measured costs, expected and measured speed-up

    def to_dict(self) -> dict:
        return asdict(self)


def step_bytes(info, *, mtp: bool = False) -> int:
    """The weight bytes one decode step reads: a mixture's experts scaled to those a token uses, the MTP blocks
    left out of the trunk; mtp: the MTP blocks and the output head they share instead."""
    share = info.n_expert_used / info.n_expert if info.experts else 1.0
    total = 0
    for t in info.tensors:
        block = re.match(r"blk\.(\d+)\.", t.name)
        in_mtp = bool(block) and int(block.group(1)) >= info.n_trunk
        if in_mtp == mtp or (mtp and t.name == "output.weight"):
            total += t.n_bytes * (share if re.search(EXPERT_TENSORS, t.name) else 1.0)
    return int(total)


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Usable first, by expected speed-up (a cheaper step at equal alpha ranks first), then lookup (no prediction),
    then those not on this machine, then the unusable."""
    def key(c: Candidate):
        group = 0 if c.usable and c.expected is not None else 1 if c.usable else 2 if c.usable is None else 3
        measured = (c.measured or {}).get("speedup")
        return group, -(measured if measured is not None else c.expected or 0.0), c.name
    return sorted(candidates, key=key)


def predict(candidate: Candidate, target_bytes: int, draft_bytes: int | None, alpha: float = ASSUMED_ALPHA) -> None:
    """Fill in the cost ratio and the expected speed-up (both predicted from sizes)."""
    if draft_bytes is None or not target_bytes:
        return
    candidate.cost_ratio = draft_bytes / target_bytes
    candidate.expected, candidate.draft_max = best_predicted(alpha, candidate.cost_ratio)


def resolve_target(text: str, registry) -> tuple[Path, str | None]:
    """(the target's file, its registry name if it has one): a path, a registry name, or owner/name/file in the
    Hub cache; one line saying what to do where it is none of these here."""
    from .hub import cached_hub_file, local_path
    from .resolve import looks_like_path

    if text in registry.models:
        spec = registry.models[text]
        path = local_path(spec)
        if path is None:
            raise GGUFSpecError(f"{text}: {spec.file} is not on this machine; run `ggufspec models pull {text}` first")
        return path, text
    if looks_like_path(text) and Path(text).exists():
        return Path(text), next((n for n, s in registry.models.items() if s.file == Path(text).name), None)
    cached = cached_hub_file(text)
    if cached is not None:
        return cached, None
    registry.model(text) if not looks_like_path(text) else None  # an unknown name: the registry's close matches
    raise GGUFSpecError(f"{text}: no such file, and not in the Hugging Face cache; give a .gguf path, a registry name "
                        "or owner/name/file of a download")


def find_drafts(target: str, registry=None) -> dict:
    """Every candidate draft for `target` on this machine, checked and ranked from headers and vocabularies alone
    (no weights load): {"target": {...}, "candidates": [Candidate.to_dict()], "assumed_alpha": ...}."""
    from ..llama.gguf_info import read_info
    from .registry import load_registry

    reg = load_registry(registry)
    path, name = resolve_target(target, reg)
    info = read_info(path)
    if info.architecture in HIDDEN_STATE_ARCHS or not info.n_vocab or not info.tensors:
        raise GGUFSpecError(f"{path}: is not a text model to draft for (architecture {info.architecture}"
                            f"{', no vocabulary' if not info.n_vocab else ''}); give the target model's GGUF")
    target_bytes = step_bytes(info)
    known = _registry_files(reg)
    candidates = []
    with _TargetVocabulary(path) as vocabulary:
        for label, source, file in _local_files(path):
            why = not_a_file(file)
            candidates.append(Candidate(label, "draft", source, False, why, str(file)) if why else
                              check_file(known.get(file.resolve(), label), source, file, info, target_bytes, vocabulary))
    candidates += _not_downloaded(reg, name, info, known, target_bytes)
    if info.n_nextn:
        own = Candidate("MTP layers (in the target)", "mtp", "the target", True,
                        f"{info.n_nextn} MTP layer{'s' if info.n_nextn > 1 else ''} in the target's own file",
                        str(path), quant=info.file_type)
        predict(own, target_bytes, step_bytes(info, mtp=True))
        candidates.append(own)
    candidates.append(Candidate("prompt lookup", "lookup", "always", True,
                                "no model: copies n-grams; alpha depends on the text",
                                cost_ratio=0.0))
    return {"target": {"name": name or str(path), "path": str(path), "size_bytes": info.file_size,
                       "quant": info.file_type, "architecture": info.architecture, "n_vocab": info.n_vocab},
            "assumed_alpha": ASSUMED_ALPHA, "candidates": [c.to_dict() for c in rank(candidates)]}


class _TargetVocabulary:
    """The target's vocabulary, loaded (vocabulary only) the first time a candidate passes the header checks."""

    def __init__(self, path: Path):
        self.path, self.model = path, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.model is not None:
            self.model.close()

    def pairing(self, draft: Path, *, same_only: bool = False) -> tuple[str | None, float | None]:
        """(why the draft cannot draft for the target, or None; the fraction of the target's tokens it shares by text
        where it drafts across tokenizers, else None). same_only: the same vocabulary or none (MTP layers)."""
        from ..llama.backend import Model
        from ..llama.compat import incompatibility, text_drafting_problem
        from ..llama.vocab import shared_tokens

        if self.model is None:
            self.model = Model(self.path, role="target", vocab_only=True)
        try:
            with Model(draft, role="draft", vocab_only=True) as model:
                difference = incompatibility(self.model, model)
                if difference is None or same_only:
                    return difference, None
                problem = text_drafting_problem(self.model, model)
                if problem:
                    return f"{difference}; across tokenizers {problem}", None
                return None, len(shared_tokens(self.model, model)[1]) / self.model.n_vocab
        except GGUFSpecError:
            return "llama.cpp cannot read its vocabulary", None


def check_file(name: str, source: str, path: Path, target, target_bytes: int, vocabulary) -> Candidate:
    """One GGUF on this machine as a draft for the target (a GGUFInfo): usable or why not, its cost predicted."""
    from ..llama.gguf_info import read_info
    from ..llama.compat import header_incompatibility
    from ..llama.draft_fit import is_mtp_file, mtp_file_misfit

    c = Candidate(name, "draft", source, False, "", str(path))
    share = None  # a draft of another vocabulary: the fraction of the target's tokens it writes alike
    try:
        info = read_info(path)
    except GGUFSpecError as e:
        c.size_bytes = path.stat().st_size if path.exists() else None
        c.why = ("truncated file: download it again" if "truncated" in str(e) else
                 "not a GGUF file" if "not a GGUF" in str(e) else "damaged GGUF header: download it again")
        return c
    c.size_bytes, c.quant = info.file_size, info.file_type
    if info.architecture == "clip" or "mmproj" in path.name.lower():
        c.why = "an mmproj (vision projector), not a text model"
    elif info.architecture in HIDDEN_STATE_ARCHS:
        c.mode = info.architecture
        misfit = hidden_state_misfit(target, info)
        exists = c.mode in MODES
        c.usable = not misfit and exists
        c.why = misfit or (f"reads target layers {list(info.target_layers)}" if exists
                           else f"fits, but this ggufspec has no --mode {c.mode} yet")
    elif not info.n_vocab:
        c.why = f"no vocabulary ({info.architecture}): not a text model"
    elif not info.tensors:
        c.why = "a vocabulary alone, no weights"
    else:
        c.mode = "mtp" if is_mtp_file(info) else "draft"
        mtp = c.mode == "mtp"
        reason = (mtp_file_misfit(target, info) or header_incompatibility(target, info)) if mtp else None
        if reason is None:
            reason, share = vocabulary.pairing(path, same_only=mtp)
        c.usable, c.why = reason is None, reason or ("the target's MTP layers, in a file of their own" if mtp else
                                                     f"text-level: shares {100 * share:.0f}% of the target's tokens"
                                                     if share is not None else _vocabulary_fits(target.n_vocab, info.n_vocab))
    if c.usable:
        # across tokenizers, a token the draft cannot write as the target does is never drafted right
        predict(c, target_bytes, step_bytes(info, mtp=c.mode == "mtp"), ASSUMED_ALPHA * (share or 1.0))
    return c


def _vocabulary_fits(target: int, draft: int) -> str:
    if target == draft:
        return f"same vocabulary ({draft} tokens)"
    return f"vocabulary fits ({draft} tokens, the target's {target}: padding)"


def _local_files(target: Path) -> list[tuple[str, str, Path]]:
    """(label, source, path) of every name ending .gguf beside the target, in the models directory and the Hub
    cache, the target left out (`not_a_file` says which of them are no file to read)."""
    from .hub import cached_ggufs

    found = []
    for folder, source in ((target.parent, "beside it"), (models_dir(), "models dir")):
        if folder.is_dir():
            found += [(p.name, source, p) for p in sorted(folder.glob("*.gguf"))]
    found += [(label, "Hub cache", p) for label, p in cached_ggufs()]
    seen, out = {_same_file(target)}, []
    for label, source, p in found:
        if _same_file(p) not in seen:
            seen.add(_same_file(p))
            out.append((label, source, p))
    return out


def _same_file(path: Path) -> Path:
    """The file a path names, links followed; a link loop or a link to nothing: the path itself, made absolute."""
    try:
        return path.resolve(strict=True)
    except (OSError, RuntimeError):  # RuntimeError: a link loop, before Python 3.13
        return Path(os.path.abspath(path))


def not_a_file(path: Path) -> str | None:
    """Why a name ending .gguf is no file to read as a draft (a link loop, a link to nothing, a directory, a named
    pipe or a device), in a few words; None for a regular file."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop: no file"
        if path.is_symlink():
            return f"a link to {os.readlink(path)}, which is not there"
        return f"cannot be read ({e.strerror})"
    if stat.S_ISDIR(mode):
        return "a directory, not a GGUF file"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO), not a GGUF file"
    if not stat.S_ISREG(mode):
        return "a device or socket, not a GGUF file"
    return None


def _registry_files(reg) -> dict[Path, str]:
    """The registry's models on this machine: {their file (resolved): their name}."""
    from .hub import local_path

    return {p.resolve(): n for n, spec in reg.models.items() if (p := local_path(spec)) is not None}


def _not_downloaded(reg, name: str | None, target, known: dict, target_bytes: int) -> list[Candidate]:
    """Registry models not on this machine that could draft for the target: its pairs' drafts, and models whose
    vocabulary size (models.toml's shape) fits and that are smaller; checked once downloaded."""
    here = set(known.values())
    paired = {p.draft: p.name for p in reg.pairs.values() if name and p.draft and p.target == name and p.draft != name}
    out = []
    for model, spec in reg.models.items():
        n_vocab = spec.shape.get("n_vocab")
        fits = n_vocab is not None and abs(n_vocab - target.n_vocab) <= 128 and (spec.size or 0) < target.file_size
        if model in here or model == name or not (model in paired or fits):
            continue
        why = (f"pair {paired[model]}" if model in paired else "its models.toml vocabulary size fits") \
            + ("" if spec.checked else "; an unchecked entry")
        c = Candidate(model, "draft", "registry", None, f"not downloaded ({why}): `ggufspec models pull {model}`",
                      size_bytes=spec.size, quant=spec.quant or None)
        if spec.size:
            predict(c, target.file_size, spec.size)
        out.append(c)
    return out
