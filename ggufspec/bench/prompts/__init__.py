"""Prompts for the benchmark: the built-in suites (the JSONL files beside this module) and
the user's own prompt files (plain text, one prompt per line, or JSONL with `prompt` or
`messages` per line)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ...errors import GGUFSpecError
from ...generation import check_messages
from ...text import check_chat_roles

SUITES = ("code", "edit", "chat", "summarize", "fix")  # fix: not in the default run


@dataclass(frozen=True, eq=False)  # by identity: a prompt may hold chat messages (dicts)
class Prompt:
    suite: str
    index: int
    text: str | None = None
    messages: tuple | None = None
    source: str = ""  # where it was read: "FILE, line N"

    @property
    def label(self) -> str:
        return f"{self.suite}-{self.index}"

    @property
    def where(self) -> str:
        """The prompt as an error names it: its label, and its file and line."""
        return f"{self.label} ({self.source})" if self.source else self.label


def load_suite(name: str) -> list[Prompt]:
    if name not in SUITES:
        raise GGUFSpecError(f"--suite {name!r} is not a built-in suite; choose from {', '.join(SUITES)}")
    text = resources.files(__name__).joinpath(f"{name}.jsonl").read_text()
    return _parse_prompts(text, name, f"suite {name}")


def load_prompts_file(path: str | Path) -> list[Prompt]:
    """Plain text (one prompt per line) or JSONL with `prompt` or `messages` per line."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise GGUFSpecError(f"{p}: cannot read the prompts file ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise GGUFSpecError(f"{p}: not UTF-8 at byte {e.start} (line {line}); save the prompts file as UTF-8") from None
    prompts = _parse_prompts(text, p.stem, str(p))
    if not prompts:
        raise GGUFSpecError(f"{p}: no prompts in the file")
    return prompts


def load_prompts(prompts_file: str | None, suites: str, limit: int = 0) -> list[Prompt]:
    """A prompts file, or the first `limit` prompts (0: all) of each named built-in suite."""
    if prompts_file:
        return load_prompts_file(prompts_file)
    names = [s.strip() for s in (suites or "").split(",") if s.strip()]
    if not names:
        raise GGUFSpecError(f"--suite names no suite (got {suites!r}); choose from {', '.join(SUITES)}")
    if limit < 0:
        raise GGUFSpecError(f"--limit must be 0 (all) or more (got {limit})")
    return [p for name in names for p in load_suite(name)[:limit or None]]


def _parse_prompts(text: str, suite: str, where: str) -> list[Prompt]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise GGUFSpecError(f"{where}, line {n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise GGUFSpecError(f"{where}, line {n}: a JSON line must be an object with `prompt` or `messages`")
            if isinstance(obj.get("prompt"), str):
                out.append(Prompt(suite, len(out), text=obj["prompt"], source=f"{where}, line {n}"))
            elif isinstance(obj, dict) and "messages" in obj:
                messages = check_chat_roles(check_messages(obj["messages"], f"{where}, line {n}: messages"),
                                            f"{where}, line {n}: messages")
                out.append(Prompt(suite, len(out), messages=tuple(messages), source=f"{where}, line {n}"))
            else:
                raise GGUFSpecError(f"{where}, line {n}: a JSON line needs a `prompt` string or a `messages` list")
        else:
            out.append(Prompt(suite, len(out), text=line, source=f"{where}, line {n}"))
    return out
