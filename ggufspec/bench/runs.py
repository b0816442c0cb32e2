"""The benchmark's runs: which configurations (rows) to run, and running them.

Models are loaded once. Each configuration (a mode and, for drafting modes, a draft length) runs every
prompt `repeats` times after `warmup` uncounted runs, configurations taking turns on each prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

from ..core import DRAFTING_MODES, HEAD_MODES, MODEL_MODES, MODES, MTP_MODES, Stats
from ..drafters import DRAFT_MAX
from ..engine import Engine, GenerationSettings
from ..errors import GGUFSpecError
from .prompts import Prompt


@dataclass(frozen=True)
class Config:
    """One row's worth of settings."""

    mode: str  # one of MODES
    draft_max: int | None = None

    @property
    def label(self) -> str:
        return self.mode if self.draft_max is None else f"{self.mode} (draft-max {self.draft_max})"


@dataclass
class Run:
    config: Config
    prompt: Prompt
    repeat: int
    tokens: list[int]
    text: str
    stats: Stats
    rss: int


@dataclass
class BenchSettings:
    modes: tuple[str, ...] = MODES
    draft_max: tuple[int, ...] | None = None  # None: draft rows at the pair's length (or DRAFT_MAX), auto unbounded
    max_tokens: int = 64
    repeats: int = 1
    warmup: int = 1
    ignore_eos: bool = True
    generation: dict = field(default_factory=dict)  # temperature, seed, top_k, ... for every run
    reuse_prompt: bool = False  # False: every run evaluates its whole prompt (cold prefill)
    draft_length: int = DRAFT_MAX  # the draft rows' length without --draft-max values (a pair may recommend one)

    @property
    def draft_lengths(self) -> tuple[int, ...]:
        """The draft rows' lengths (and llama.cpp's draft-model rows'): --draft-max values, or draft_length."""
        return self.draft_max or (self.draft_length,)

    @property
    def greedy(self) -> bool:
        return (self.generation.get("temperature") or 0.0) <= 0.0

    @property
    def comparable(self) -> bool:
        """Whether every mode must write the target's own tokens: greedy runs, and sampled runs with a
        seed under the coupled rule (the default with a seed)."""
        return self.greedy or (self.generation.get("seed") is not None
                               and GenerationSettings(**self.generation).rule == "coupled")

    def validate(self) -> "BenchSettings":
        """Every bad value in one line, before anything runs."""
        if self.repeats < 1 or self.warmup < 0:
            raise GGUFSpecError("--repeats must be at least 1 and --warmup at least 0")
        if self.max_tokens < 2:
            raise GGUFSpecError(f"bench -n must be at least 2 (got {self.max_tokens}): the first token comes with the "
                                "prompt's batch, so tokens per second are timed from the second on")
        if self.draft_max is not None and (not self.draft_max or min(self.draft_max) < 1):
            raise GGUFSpecError(f"--draft-max values must be at least 1 (got {self.draft_max})")
        if not self.modes:
            raise GGUFSpecError(f"--modes names no mode; choose from {', '.join(MODES)}")
        for mode in self.modes:
            if mode not in MODES:
                raise GGUFSpecError(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
        GenerationSettings(max_tokens=self.max_tokens, draft_max=max(self.draft_lengths), **self.generation).validate()
        return self


def check_modes(modes: tuple[str, ...], has_draft: bool, heads=(), target: str = "this target") -> None:
    """One line for the first mode asked for by name that the models cannot run: a draft model's without one, a
    head's without it (heads: those the models have, of mtp, eagle3, dflash; target: the target's name). The
    default modes (every one) ask for nothing by name: the rows the models cannot run are left out instead."""
    if tuple(modes) == MODES:
        return
    unrunnable = [mode for mode in modes if mode in MODEL_MODES] if not has_draft else []
    if unrunnable:
        raise GGUFSpecError(f"--modes {','.join(unrunnable)} needs a draft model: give -md DRAFT or name a pair")
    mode = next((mode for mode in modes if mode in HEAD_MODES and HEAD_MODES[mode] not in heads), None)
    if mode is not None:
        raise GGUFSpecError(f"--modes {mode} needs " + (f"a target with MTP (NextN) layers; {target} has none"
                                                        if mode in MTP_MODES else f"an {mode} draft GGUF given with -md"))


def plan(settings: BenchSettings, has_draft: bool, heads=(), target: str = "this target") -> list[Config]:
    """The rows to run. Without --draft-max values, draft rows draft settings.draft_length tokens (the
    pair's, or DRAFT_MAX) and auto's row drafts as far as the measured costs say pays. Rows of modes the
    models cannot run are left out of the default modes, and one line where asked for by name (`check_modes`)."""
    check_modes(settings.modes, has_draft, heads, target)
    headless = [mode for mode in settings.modes if mode in HEAD_MODES and HEAD_MODES[mode] not in heads]
    configs = []
    for mode in settings.modes:
        if (mode in MODEL_MODES and not has_draft) or mode in headless:
            continue
        if mode == "lookup":  # its drafts run to --lookup-max whatever --draft-max says: one row
            configs.append(Config(mode))
        elif mode == "auto" and settings.draft_max is None:
            configs.append(Config(mode))  # its model drafts as far as the costs say pays
        elif mode in DRAFTING_MODES:
            configs += [Config(mode, n) for n in settings.draft_lengths]
        else:
            configs.append(Config(mode))
    if not any(c.mode == "target" for c in configs):
        configs.insert(0, Config("target"))  # the baseline every speed-up is measured against
    return configs


def prompt_tokens(engine: Engine, prompt: Prompt) -> list[int]:
    """Through the model's chat template when it has one, as a user would send it."""
    if prompt.messages is not None:
        if not engine.target_model.chat_template:
            raise GGUFSpecError(f"it holds chat messages, and {engine.target_model.path.name} has no chat template; "
                                "give it as a `prompt` string instead")
        return engine.tokenize_prompt(messages=list(prompt.messages))
    if engine.target_model.chat_template:
        return engine.tokenize_prompt(messages=[{"role": "user", "content": prompt.text}])
    return engine.tokenize_prompt(prompt.text)


def tokenized_prompts(engine: Engine, prompts: list[Prompt], max_tokens: int,
                      tokenize=prompt_tokens) -> list[tuple[Prompt, list[int]]]:
    """Every prompt with its tokens (`tokenize(engine, prompt)`), all checked before anything runs: a prompt and
    -n tokens must fit the context, a sequence's share of it where the engine holds several (a prompt that fills it
    would end the run halfway, or a server refuse the request); one line names the longest that does not."""
    out = []
    for p in prompts:
        try:
            out.append((p, tokenize(engine, p)))
        except GGUFSpecError as e:
            raise GGUFSpecError(f"prompt {p.where}: {e}") from None
    too_long = [(p, len(t)) for p, t in out if len(t) + max_tokens > engine.n_ctx]
    if too_long:
        p, n = max(too_long, key=lambda x: x[1])
        fewer = f", lower -n to {engine.n_ctx - n}" if engine.n_ctx - n >= 2 else ""
        more = f" ({len(too_long) - 1} more prompts too)" if len(too_long) > 1 else ""
        raise GGUFSpecError(f"prompt {p.where} is {n} tokens: with -n {max_tokens} it needs a context of {n + max_tokens}, "
                            f"more than -c {engine.n_ctx}{more}; raise -c to {n + max_tokens}{fewer}, or leave it out")
    return out


def prompt_text(engine: Engine, prompt: Prompt) -> str:
    """The prompt as text, as `prompt_tokens` sees it (chat template applied), for other programs."""
    if prompt.messages is not None:
        return engine.target_model.render_chat(list(prompt.messages))
    if engine.target_model.chat_template:
        return engine.target_model.render_chat([{"role": "user", "content": prompt.text}])
    return prompt.text


def run_one(engine: Engine, config: Config, tokens: list[int], settings: BenchSettings):
    kw = dict(settings.generation, max_tokens=settings.max_tokens, ignore_eos=settings.ignore_eos,
              reuse_prompt=settings.reuse_prompt)
    if config.draft_max:
        kw["draft_max"] = config.draft_max
    return engine.generate(prompt_tokens=tokens, mode=config.mode, **kw)


@dataclass(frozen=True)
class Progress:
    """Where a benchmark is: runs done of total, what just ran, and an estimate of what is left."""

    done: int
    total: int
    config: Config
    prompt: Prompt
    elapsed: float

    @property
    def seconds_left(self) -> float:
        return self.elapsed / self.done * (self.total - self.done) if self.done else 0.0


def run(engine: Engine, prompts: list[Prompt], settings: BenchSettings, runs: list[Run], progress=None,
        others=None) -> list[Run]:
    """Append every counted run to `runs` as it finishes (so an interrupt keeps what was done);
    `progress(Progress)` after each (warm-up runs count in the total). others: other programs' configurations
    (`others.references`, each with a `label`), one more turn each on every prompt and repeat, each run by
    others(reference, prompt, repeat), which keeps what it ran (llama.cpp's speculative-simple: `reference_runs`)."""
    extra = others.references if others is not None else []
    configs = plan(settings, engine.draft_model is not None, set(engine.heads), engine.target_model.path.name)
    tokenized = tokenized_prompts(engine, prompts, settings.max_tokens)
    proc = psutil.Process()
    total = (len(configs) * (settings.warmup + settings.repeats * len(prompts))
             + len(extra) * settings.repeats * len(prompts))
    start, done = time.perf_counter(), 0

    def one(config, prompt, tokens, repeat=None):
        nonlocal done
        if isinstance(config, Config):
            result = run_one(engine, config, tokens, settings)
            if repeat is not None:  # kept before progress is told, so an interrupt there keeps it
                runs.append(Run(config, prompt, repeat, result.tokens, result.text, result.stats,
                                proc.memory_info().rss))
        else:
            others(config, prompt, repeat)
        done += 1
        if progress:
            progress(Progress(done, total, config, prompt, time.perf_counter() - start))

    for _ in range(settings.warmup):  # caches, page faults, thread pools: not counted
        for config in configs:
            one(config, tokenized[0][0], tokenized[0][1])
    for repeat in range(settings.repeats):
        for prompt, tokens in tokenized:
            for config in turns([*configs, *extra], repeat):
                one(config, prompt, tokens, repeat)
    return runs


def turns(configs: list, repeat: int) -> list:
    """The order configurations run in on a prompt: they take turns on each prompt, so a machine that speeds up or
    slows down during the run (other load, clocks) moves every row alike instead of favouring one; and every other
    repeat runs them the other way round, so a drift within a prompt's runs favours no place in the order (the
    last row was always run last: on the Q4_K_M pair auto, decoding plainly, read 0.96x of the target it matched)."""
    return list(configs) if repeat % 2 == 0 else list(reversed(configs))
