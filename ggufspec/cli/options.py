"""The command line's shared flags, declared once each, and how they become library arguments."""

from __future__ import annotations

import functools
import sys

import click

from ..errors import GGUFSpecError, check_layers
from ..core import DEFAULT_MODE, MODE_TABLE
from ..sampling import SAMPLING_RULES


def user_errors(fn):
    """Turn a GGUFSpecError into one line on stderr and exit 1; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GGUFSpecError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)

    return wrapper


class Layers(click.ParamType):
    """-ngl values: a number of layers, 'all', or 'auto' (the offload planner decides)."""

    name = "N|all|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, list)) or value in ("all", "auto"):
            return value
        if "," in str(value):  # a sweep: `ggufspec bench -ngl 0,16,all`
            return [self.convert(v.strip(), param, ctx) for v in str(value).split(",") if v.strip()]
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a layer count, 'all' or 'auto'", param, ctx)
        if n < 0:  # the library's -1 (every layer) is 'auto' to llama.cpp's programs: the CLI takes the words only
            ambiguous = " (llama.cpp's programs read -1 as auto, its library as every layer)" if n == -1 else ""
            self.fail(f"{n} is negative{ambiguous}; use 'all' for every layer or 'auto' to let the planner decide",
                      param, ctx)
        try:
            return check_layers(n, "a layer count", every="'all'")
        except GGUFSpecError as e:
            self.fail(str(e), param, ctx)


def _apply(fn, options):
    for option in reversed(options):
        fn = option(fn)
    return fn


registry_option = click.option("--registry", type=click.Path(dir_okay=False), default=None, envvar="GGUFSPEC_REGISTRY",
                               help="A models.toml that adds to or overrides the built-in one.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
moe_option = click.option("--n-cpu-moe", "cpu_moe", type=Layers(), default=None,
                          help="A mixture of experts: keep the experts of the first N layers on the CPU ('all': "
                               "llama.cpp's --cpu-moe; default: as few as the memory needs where -ngl is auto, else none).")


ctx_option = click.option("-c", "--ctx-size", "n_ctx", type=int, default=4096, show_default=True, help="Context size in tokens.")
target_option = click.option("-m", "--model", "target", help="Target model: a .gguf path or a model name from models.toml.")
draft_option = click.option("-md", "--model-draft", "--spec-draft-model", "draft", help="Draft model: a .gguf path or a model name.")
# llama.cpp's KV cache types: -ctv would read as `-c tv` were it not declared wherever -c is
cache_type_options = [
    click.option("-ctk", "--cache-type-k", "type_k", default="f16", show_default=True,
                 help="KV cache type of K (llama.cpp's -ctk): f16, q8_0, q4_0, ... (both models)."),
    click.option("-ctv", "--cache-type-v", "type_v", default="f16", show_default=True,
                 help="KV cache type of V (llama.cpp's -ctv); a quantized V needs flash attention (both models)."),
]
rpc_option = click.option("--rpc", default=None, envvar="GGUFSPEC_RPC", metavar="HOST:PORT[,...]",
                          help="llama.cpp RPC servers (`ggufspec rpc-server` on each): the target's layers go there, "
                               "the draft stays here.")
LOAD_KEYS = ("pair", "target", "draft", "n_gpu_layers", "draft_n_gpu_layers", "cpu_moe", "n_ctx", "n_batch", "n_threads",
             "type_k", "type_v", "registry", "offline", "verbose", "rpc", "devices", "draft_devices", "repack")


def model_options(fn):
    """Which models to load and how: shared by generate, bench and costs."""
    return _apply(fn, [
        click.argument("pair", required=False), target_option, draft_option,
        click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=Layers(), default=None,
                     help="Target layers on the GPU: N, all or auto (default auto)."),
        click.option("-ngld", "--n-gpu-layers-draft", "--spec-draft-ngl", "draft_n_gpu_layers", type=Layers(), default=None,
                     help="Draft layers on the GPU: N, all or auto (default auto)."),
        moe_option, ctx_option, *cache_type_options,
        click.option("-b", "--batch-size", "n_batch", type=int, default=512, show_default=True, help="Logical batch size."),
        click.option("-t", "--threads", "n_threads", type=int, default=None, help="CPU threads (default: physical cores)."),
        click.option("--repack/--no-repack", " /-nr", "repack", default=None,
                     help="llama.cpp's CPU weight repacking for both models (default: whichever decoded faster here, "
                          "timed once per model; without it verify batches stay bit-identical to more rows)."),
        registry_option, rpc_option,
        click.option("-dev", "--device", "devices", default=None,
                     help="Devices the target may use, e.g. RPC0,RPC1 ('none': the CPU alone; default: all, or the RPC ones with --rpc)."),
        click.option("-devd", "--device-draft", "--spec-draft-device", "draft_devices", default=None,
                     help="Devices the draft may use (default: all, or this machine's own with --rpc)."),
        click.option("--offline", is_flag=True, help="Never reach the Hugging Face Hub; use local or cached files."),
        click.option("--verbose", is_flag=True, help="Show llama.cpp's own log."),
    ])


def sampling_options(fn):
    return _apply(fn, [
        click.option("-n", "--n-predict", "max_tokens", type=int, default=None, help="Tokens to generate."),
        click.option("--temp", "temperature", type=float, default=None, help="Temperature; 0 is greedy (default 0)."),
        click.option("--top-k", type=int, default=None, help="Keep the K most likely tokens (0: off)."),
        click.option("--top-p", type=float, default=None, help="Nucleus sampling mass in (0, 1]."),
        click.option("--min-p", type=float, default=None, help="Drop tokens below min-p x the top probability."),
        click.option("-s", "--seed", type=int, default=None, help="Random seed; the same seed gives the same text."),
        click.option("--draft-max", "--draft", "--spec-draft-n-max", "draft_max", default=None,
                     help="Most tokens drafted per round."),
        click.option("--draft-min", "--spec-draft-n-min", "draft_min", type=int, default=None,
                     help="Fewest drafted tokens worth verifying."),
        click.option("--draft-p-min", "--spec-draft-p-min", "draft_p_min", type=float, default=None,
                     help="Stop drafting when the draft's own confidence falls below this (default: "
                          "never in draft mode; in auto, where another drafted token costs more than it "
                          "is likely to save, from the measured costs)."),
        click.option("--lookup-max", "--spec-ngram-simple-size-m", "lookup_max", type=int, default=None,
                     help="Most tokens a prompt-lookup draft copies per round (default 63; the measured costs "
                          "choose how many of them pay)."),
        click.option("--mode", default=None, help="; ".join(f"{m.name}: {m.help}" for m in MODE_TABLE)
                     + f" (default {DEFAULT_MODE})."),
        click.option("--spec-type", default=None, metavar="TYPE[,TYPE]",
                     help="llama.cpp's name for --mode: none = target, draft-simple = draft, ngram-simple or "
                          "ngram-map-k = lookup, draft-mtp = mtp, draft-eagle3 = eagle3, draft-dflash = dflash, a draft type with an "
                          "n-gram type = auto."),
        click.option("--sampling-rule", type=click.Choice(SAMPLING_RULES), default=None,
                     help="How sampled drafts are verified. coupled: a seed gives the target's own text in every "
                          "mode (Gumbel noise per position; lower acceptance). rejection: Leviathan's rule (higher "
                          "acceptance; the text with a seed depends on what was drafted). Default: coupled with "
                          "-s/--seed, rejection without."),
        click.option("--ignore-eos", is_flag=True, default=None, help="Keep generating past end-of-generation tokens."),
        click.option("--exact/--no-exact", default=None,
                     help="Greedy: verify only in batch sizes that are bit-identical to one-token decoding. "
                          "Default: in those where the backend has them (llama.cpp's CPU kernels), but a long copy "
                          "in one batch with near-ties re-checked where that costs less (as past 256 cached tokens); "
                          "--no-exact: one batch, near-ties re-checked, always."),
    ])


GENERATION_OPTIONS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "draft_min", "draft_p_min", "mode",
                "ignore_eos", "exact", "sampling_rule", "lookup_max")

# llama.cpp's --spec-type names (common/speculative.cpp) and the --mode that means the same here.
SPEC_TYPES = {"none": "target", "draft-simple": "draft", "ngram-simple": "lookup", "ngram-map-k": "lookup",
              "draft-mtp": "mtp", "draft-eagle3": "eagle3", "draft-dflash": "dflash"}
SPEC_TYPES_ELSEWHERE = ("draft-dspark", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def mode_for_spec_type(value: str) -> str:
    """--spec-type as llama.cpp takes it (a comma list) to a --mode; one line where nothing here means the same."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise GGUFSpecError("--spec-type names no type; give e.g. draft-simple or ngram-simple")
    for name in names:
        if name in SPEC_TYPES_ELSEWHERE:
            raise GGUFSpecError(f"--spec-type {name} is a llama.cpp drafter that ggufspec does not have; the nearest are "
                                "draft-simple (--mode draft) and ngram-simple (--mode lookup), or --mode auto")
        if name not in SPEC_TYPES:
            raise GGUFSpecError(f"--spec-type {name!r} is not a llama.cpp type ggufspec knows; choose from "
                                f"{', '.join(SPEC_TYPES)}")
    modes = {SPEC_TYPES[n] for n in names}
    if len(modes) == 1:
        return modes.pop()
    if "target" not in modes:
        return "auto"  # several drafters together (a draft model, MTP, n-grams): auto chooses per round
    raise GGUFSpecError(f"--spec-type {value}: 'none' cannot be combined with other types")


def split_options(options: dict, *, check: bool = True, **load_extra):
    """(LoadOptions, the generation settings given, --draft-max as typed) from click's options; check: the settings
    checked now, before any model loads (bench checks its own: BenchSettings.validate)."""
    from ..generation import resolve_settings
    from ..models.resolve import LoadOptions

    load = LoadOptions(**{k: options[k] for k in LOAD_KEYS if k in options}, **load_extra)
    given = {k: options[k] for k in GENERATION_OPTIONS if options.get(k) is not None}
    if options.get("spec_type") is not None:
        mode = mode_for_spec_type(options["spec_type"])
        if given.get("mode", mode) != mode:
            raise GGUFSpecError(f"--spec-type {options['spec_type']} means --mode {mode}, but --mode {given['mode']} was given")
        given["mode"] = mode
    if check:
        resolve_settings(None, given)  # a bad value is one line now, before any model loads or is measured
    return load, given, options.get("draft_max")


def int_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    """'1,3,5' -> (1, 3, 5); None stays None; an empty item ('1,,2', '1,') is one line, not skipped."""
    if text is None:
        return None
    items = [x.strip() for x in str(text).split(",")]
    if "" in items:
        raise GGUFSpecError(f"{flag} has an empty item (got {text!r}); give whole numbers separated by commas, "
                            "e.g. 1,2,4")
    try:
        values = tuple(int(x) for x in items)
    except ValueError:
        raise GGUFSpecError(f"{flag} takes whole numbers separated by commas (got {text!r})") from None
    if min(values) < 1:
        raise GGUFSpecError(f"{flag} values must be at least 1 (got {text!r})")
    return values


def whole_number(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise GGUFSpecError(f"{flag} must be a whole number (got {text!r})") from None
