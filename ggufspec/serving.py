"""The server's scheduler: a thread that admits requests into free sequences between steps (continuous
batching), steps them together through one `batching.Batch`, and hands each its chunks; requests wait in a
bounded queue, leave when done or cancelled, and go to the free sequence whose cache holds most of their prompt.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .batching import Batch, gap_tokens, runs
from .errors import GGUFSpecError
from .generation import Chunk, Generation, GenerationSettings


class ServerStopping(GGUFSpecError):
    """What a request still running or waiting gets when the server stops before it is done."""


@dataclass
class Ticket:
    """One request: what to generate, and where its chunks go (`deliver(chunk)`, then `deliver(None)` at the end,
    or `deliver(error)`). cancel(): the client went away; its sequence is freed before the next step."""

    prompt_tokens: list[int]
    settings: GenerationSettings
    deliver: Callable
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Totals:
    """What the server has done, for /metrics."""

    requests: int = 0
    errors: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of which kept from a sequence's cache, not evaluated again
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    busy_seconds: float = 0.0


class Scheduler:
    """A thread that runs a Batch over n_slots sequences: requests wait in a queue (at most max_queue), join
    free sequences between steps and leave when done or cancelled. build(prompt_tokens, settings, slot) ->
    Generation; release(slot): that sequence's generation ended; reusable(slot, prompt_tokens): how many of them
    its cache still holds (a request goes to the free sequence that holds most, as llama-server picks a slot).
    Where every sequence has a KV stream of its own, llama.cpp puts only sequences of consecutive ids in one
    ubatch, so a request on a sequence apart from the running ones costs its whole batch an extra ubatch every step
    it runs, which a prefix it finds cached there must outweigh: gap_tokens is that ubatch's price in prompt
    tokens, from the batch's measured costs (`batching.gap_tokens`; None: nothing measured, or one KV cache for
    all, and the prefix alone decides)."""

    def __init__(self, build: Callable, release: Callable, batch: Batch, n_slots: int, max_queue: int = 64,
                 reusable: Callable | None = None):
        self.build, self.release, self.batch, self.reusable = build, release, batch, reusable
        self.gap_tokens = None if batch is None or batch.unified else gap_tokens(batch.costs)
        self.n_slots, self.max_queue = n_slots, max_queue
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.active: dict[int, tuple[Ticket, Generation]] = {}
        self.totals = Totals()
        self._wake = threading.Condition()
        self._stopping = False
        self.ended_at_stop = 0  # requests still running or waiting when it stopped
        self._thread = threading.Thread(target=self._run, name="ggufspec-scheduler", daemon=True)

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop after the step under way; each request running or waiting gets ServerStopping. Returns how many."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()
        return self.ended_at_stop

    def submit(self, ticket: Ticket) -> int:
        """Queue a request; returns how many wait before it (0: it starts at the next step if a slot is free)."""
        with self._wake:
            if len(self.waiting) >= self.max_queue:
                raise GGUFSpecError(f"the server is busy: {len(self.active)} requests running and {len(self.waiting)} "
                                    "waiting; try again later")
            ahead = len(self.waiting) + max(0, len(self.active) - self.n_slots + 1)
            self.waiting.append(ticket)
            self._wake.notify()
            return ahead

    @property
    def idle_slots(self) -> int:
        return self.n_slots - len(self.active)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.waiting and not self.active:
                    self._wake.wait()
                if self._stopping:
                    break
            try:
                self._drop_cancelled()
                self._admit()
                if self.active:
                    self._step()
            except Exception as e:  # noqa: BLE001 (a fault of the step, not of one request: end those running)
                for slot in list(self.active):
                    self._end(slot, error=e)
        stopping = ServerStopping("the server stopped before this request finished; send it again once it is back")
        self.ended_at_stop = len(self.active) + len(self.waiting)
        for slot in list(self.active):
            self._end(slot, error=stopping)
        for ticket in self.waiting:
            ticket.deliver(stopping)

    def _admit(self) -> None:
        while len(self.active) < self.n_slots:
            with self._wake:
                if not self.waiting:
                    return
                ticket = self.waiting.popleft()
            if ticket.cancelled.is_set():
                self.totals.cancelled += 1
                continue
            slot = self._free_slot(ticket.prompt_tokens, ticket.settings.max_tokens)
            try:
                self.active[slot] = (ticket, self.build(ticket.prompt_tokens, ticket.settings, slot))
            except Exception as e:  # noqa: BLE001
                self.totals.errors += 1
                ticket.deliver(e)

    def _free_slot(self, prompt_tokens: list[int], max_tokens: int = 0) -> int:
        """The free sequence whose cache holds most of this prompt, less (gap_tokens) what the ubatches its rows
        would add to every step cost over the request's max_tokens (the lowest of those worth as much)."""
        free = sorted(set(range(self.n_slots)) - set(self.active))
        if len(free) == 1:
            return free[0]
        held = {slot: self.reusable(slot, prompt_tokens) if self.reusable else 0 for slot in free}
        if self.gap_tokens is None:
            return max(free, key=lambda slot: (held[slot], -slot))
        now = runs(set(self.active))
        return max(free, key=lambda slot: (held[slot] - (runs(set(self.active) | {slot}) - now) * self.gap_tokens
                                           * max_tokens, -slot))

    def _drop_cancelled(self) -> None:
        for slot, (ticket, _) in list(self.active.items()):
            if ticket.cancelled.is_set():
                self.totals.cancelled += 1
                self._end(slot)

    def _step(self) -> None:
        """Each joining request's prompt: all of it where no other request is generating, else its next chunk (so
        those go on between its chunks; each is decoded alone, as a cold start decodes it); then one round of every
        request whose prompt is in."""
        start = time.perf_counter()
        slots = [s for s in sorted(self.active) if self.active[s][1].begun]
        for slot in sorted(self.active):
            if not self.active[slot][1].begun:
                self._prefill(slot, whole=not slots)
        if slots:
            self._round(slots)
        self.totals.busy_seconds += time.perf_counter() - start

    def _prefill(self, slot: int, whole: bool) -> None:
        g = self.active[slot][1]
        try:
            chunk = g.prefill(None if whole else getattr(g.ctx, "chunk", g.ctx.n_batch))
        except Exception as e:  # noqa: BLE001
            self._end(slot, error=e)
            return
        if chunk is not None:
            self._deliver(slot, chunk)

    def _round(self, slots: list[int]) -> None:
        results = self.batch.step([self.active[s][1] for s in slots])
        self.totals.steps += 1
        by_generation = {id(g): r for g, r in results}
        for slot in slots:
            result = by_generation[id(self.active[slot][1])]
            if isinstance(result, BaseException):
                self._end(slot, error=result)
            else:
                self._deliver(slot, result)

    def _deliver(self, slot: int, chunk: Chunk) -> None:
        ticket, g = self.active[slot]
        ticket.deliver(chunk)
        if chunk.finish_reason is not None or g.steps.done:  # after its first chunk, steps exist
            self._end(slot)

    def _end(self, slot: int, error: BaseException | None = None) -> None:
        ticket, g = self.active.pop(slot)
        g.close()
        s = g.stats
        self.totals.requests += 1
        self.totals.errors += error is not None
        self.totals.prompt_tokens += s.n_prompt
        self.totals.cached_tokens += s.n_reused
        self.totals.completion_tokens += s.n_generated
        self.totals.drafted += s.n_drafted
        self.totals.accepted += s.n_accepted
        try:
            self.release(slot)
        finally:
            ticket.deliver(error)
