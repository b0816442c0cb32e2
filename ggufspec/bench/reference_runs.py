"""llama.cpp's speculative-simple rows, run on each prompt in turn with ggufspec's own configurations.

A VM's speed moves by a quarter within minutes: llama.cpp's rows, run once each after every ggufspec run, met
another machine than the rows they are compared with. Here each of speculative-simple's configurations is one
more turn on each prompt (`runs.turns`: the order reversed every other repeat), `--repeats` times, so the drift
meets both alike and its rows get a spread over repeats as ggufspec's do.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from ..errors import GGUFSpecError
from .prompts import Prompt
from .reference import (DRAFTERS, ProgramHung, _row, _run_twice, _speculative_configs, placement, same_text,
                        speculative_simple)


@dataclass(frozen=True)
class Reference:
    """One of speculative-simple's rows: its --spec-type, draft-max (None: an n-gram drafter, which reads none) and
    the -md file."""

    spec_type: str
    draft_max: int | None
    second: Path | None

    @property
    def label(self) -> str:
        what = f"{DRAFTERS.get(self.spec_type, 'draft model')} (draft-max {self.draft_max})" if self.draft_max \
            else self.spec_type
        return f"llama.cpp speculative-simple, {what}"

    @property
    def mode(self) -> str:
        return f"llama.cpp-{self.spec_type}"


@dataclass
class ReferenceRun:
    reference: Reference
    prompt: Prompt
    repeat: int
    result: dict  # speculative_simple's: n_generated, seconds, n_drafted, n_accepted, text


class ReferenceRunner:
    """Runs speculative-simple's configurations one prompt at a time (`__call__`, from runs.run) and keeps each run.
    A configuration whose program fails is not run again and its row is left out, with one line through note; one
    that runs past the time limit stops them all (the rows whose repeats finished stand)."""

    def __init__(self, bin_dir: str | Path, engine, n_tokens: int, draft_max: tuple[int, ...], text_of, note):
        self.bin_dir, self.n_tokens, self.text_of, self.note = Path(bin_dir), n_tokens, text_of, note
        self.target, self.flags = engine.target_model.path, placement(engine, "llama-speculative-simple")
        self.threads, self.n_ctx, self.longest = engine.target_ctx.n_threads, engine.n_ctx, max(draft_max)
        self.references = [Reference(*c) for c in _speculative_configs(engine, draft_max)]
        if getattr(engine, "bridge", None) is not None:  # ggufspec drafts through text; llama.cpp refuses the pair
            note(f"llama.cpp's speculative-simple drafts only with a draft of the target's vocabulary "
                 f"({engine.vocab_difference}): its draft-simple rows are left out")
        self.failed: set[Reference] = set()
        self.hung = False
        self.runs: list[ReferenceRun] = []

    def __call__(self, ref: Reference, prompt: Prompt, repeat: int) -> None:
        if self.hung or ref in self.failed:
            return
        text = self.text_of(prompt)
        try:
            result = _run_twice(lambda: speculative_simple(
                self.bin_dir, self.target, ref.second, text, n_tokens=self.n_tokens, threads=self.threads,
                n_ctx=self.n_ctx, draft_max=ref.draft_max or self.longest, spec_type=ref.spec_type,
                placement=self.flags), self.note)
        except ProgramHung as e:
            self.note(f"{e}; llama.cpp's speculative-simple rows from here on are left out")
            self.hung = True
            return
        except GGUFSpecError as e:
            self.note(f"{e}; its rows are left out")
            self.failed.add(ref)
            return
        if result is None:
            self.failed.add(ref)
        else:
            self.runs.append(ReferenceRun(ref, prompt, repeat, result))

    def rows(self, group: str, prompts: list[Prompt], target_tps: float | None,
             ours: dict[Prompt, str | bytes | None]) -> list[dict]:
        """The group's rows, each over the repeats in which it finished every prompt of the group: the median of
        their tok/s and their range. A repeat's tok/s sums its prompts' runs: each run's tokens up to -n over its
        time until they were out, where its log shows its rounds (else all it decoded over all its time; the
        row's `counted_to_n` says which). ours: ggufspec's target-only text per prompt, which each prompt's first
        run is compared with."""
        out = []
        for ref in self.references:
            if ref in self.failed:
                continue
            by_repeat: dict[int, dict[Prompt, dict]] = {}
            for r in self.runs:
                if r.reference == ref and r.prompt in prompts:
                    by_repeat.setdefault(r.repeat, {})[r.prompt] = r.result
            done = {k: v for k, v in sorted(by_repeat.items()) if len(v) == len(prompts)}
            if not done:
                continue
            results = [x for v in done.values() for x in v.values()]
            to_n = all(x.get("seconds_to_n") is not None for x in results)
            speeds = [_speed(v.values(), self.n_tokens if to_n else None) for v in done.values()]
            drafted, accepted = sum(x["n_drafted"] for x in results), sum(x["n_accepted"] for x in results)
            row = _row(ref.label, ref.mode, ref.draft_max, statistics.median(speeds), target_tps,
                       accepted / drafted if drafted else None, group)
            row.update(tokens_per_second_min=min(speeds), tokens_per_second_max=max(speeds), repeats=len(done),
                       n_generated=sum(x["n_generated"] for x in results), n_asked=self.n_tokens * len(results),
                       counted_to_n=to_n,
                       tokens_per_second_all=statistics.median([_speed(v.values()) for v in done.values()]))
            first = next(iter(done.values()))
            same = [(p.label, same_text(ours.get(p), first[p]["text"])) for p in prompts]
            if all(x is not None for _, x in same):
                other = [label for label, x in same if not x]  # prompts where llama.cpp wrote another text
                row.update(identical_to_target=not other, other_text=other,
                           divergence={"prompt": other[0]} if other else None)
            out.append(row)
        return out


def _speed(results, n_tokens: int | None = None) -> float:
    """Tokens over seconds, summed over a repeat's prompts: with n_tokens, each run's first n_tokens over its time
    until they were out (`reference.seconds_to`); else all it decoded over all its time."""
    if n_tokens is None:
        tokens, seconds = zip(*((x["n_generated"], x["seconds"]) for x in results))
    else:
        tokens, seconds = zip(*((min(x["n_generated"], n_tokens), x["seconds_to_n"]) for x in results))
    return sum(tokens) / max(1e-9, sum(seconds))
