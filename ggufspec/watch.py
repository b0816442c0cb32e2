"""auto's guard: what each drafter's rounds deliver here, against plain decoding timed the same way.

The cost table predicts; this watches. Per source (lookup, the draft model, the MTP head, ...) it keeps the
tokens and seconds of its last rounds (the drafter's proposal and the target's verify, as the loop times them),
and beside them those of plain rounds. A source whose recent rounds deliver fewer tokens per second than plain
decoding is paused, whatever the table predicted (a mis-measured table, a host whose costs moved, text that
stopped copying), and offered to the planner again after a back-off that doubles each time it loses again and
starts over once it pays. Where no plain round has been timed lately, one is asked for (`probe`), unless the
source is far ahead of what the table says a plain step costs.
"""

from __future__ import annotations

from collections import deque

from .core import Round


class RateWatch:
    """Per source, recent tokens per second against plain decoding's; which sources the planner may use."""

    window = 6  # a source's last rounds judged together
    judge_after = 3  # timed rounds before a source is judged (one rejection is not a trend)
    pause = 8  # rounds a losing source is first left out; doubled at each loss in a row
    pause_max = 128
    stale = 48  # a plain round this many rounds old no longer says how fast plain decoding is
    clear_win = 1.3  # a source this far above the table's plain rate is judged without a plain round beside it

    def __init__(self):
        self.n = 0  # timed rounds seen
        self.rounds: dict[str, deque] = {}  # source -> (tokens, seconds) of its last rounds
        self.plain: deque = deque(maxlen=self.window)  # (round index, tokens, seconds) of plain rounds
        self.paused_until: dict[str, int] = {}
        self.backoff: dict[str, int] = {}  # the next pause of a source that lost last time
        self.resumed: set[str] = set()  # their next round catches up on what they missed: not counted
        self.pauses: dict[str, int] = {}  # how often each source was paused
        self.probe = False  # the next round is plain: a source is being judged and plain decoding is not timed lately

    def allows(self, source: str) -> bool:
        """Whether the planner may draft from this source this round."""
        return not self.probe and self.n >= self.paused_until.get(source, 0)

    def rate(self, source: str) -> float | None:
        """Tokens per second of the source's recent rounds (None: too few to judge; a source back from a pause
        is judged on its first round after the catch-up: it lost last time, and a retry must be cheap)."""
        w = self.rounds.get(source)
        needed = 1 if source in self.backoff else self.judge_after
        return _rate(w) if w and len(w) >= needed else None

    def plain_rate(self) -> float | None:
        """Tokens per second of recent plain rounds (None: none timed lately)."""
        return _rate([(t, s) for i, t, s in self.plain if self.n - i <= self.stale]) or None

    def observe(self, r: Round, table_plain_rate: float) -> None:
        """Count a verified round (untimed ones, as a `Llama`'s, teach nothing), then judge every source.
        table_plain_rate: what the cost table says plain decoding delivers now (tokens per second)."""
        seconds = r.draft_seconds + r.target_seconds
        if r.target_seconds <= 0:
            return
        self.n += 1
        # who spent the round's time: a drafter consulted whose draft came back empty (no token sure enough) still
        # cost its step, and a plain round it is not
        source = r.draft.source if r.draft is not None and r.draft.source else r.source
        if source == "target":
            self.plain.append((self.n, len(r.tokens), seconds))
            self.probe = False
        elif source in self.resumed:
            self.resumed.discard(source)
        else:
            self.rounds.setdefault(source, deque(maxlen=self.window)).append((len(r.tokens), seconds))
        for s in list(self.rounds):
            self._judge(s, table_plain_rate)

    def _judge(self, source: str, table_plain_rate: float) -> None:
        rate, plain = self.rate(source), self.plain_rate()
        if rate is None:
            return
        if plain is None:
            self.probe = self.probe or rate < self.clear_win * table_plain_rate
            return
        if rate >= plain:
            if len(self.rounds[source]) >= self.judge_after:
                self.backoff.pop(source, None)  # it pays, and not by one lucky round: a later loss starts over
            return
        pause = self.backoff.get(source, self.pause)
        self.paused_until[source] = self.n + pause
        self.backoff[source] = min(2 * pause, self.pause_max)
        self.pauses[source] = self.pauses.get(source, 0) + 1
        self.rounds[source].clear()
        self.resumed.add(source)


def _rate(rounds) -> float:
    seconds = sum(s for _, s in rounds)
    return sum(t for t, _ in rounds) / seconds if seconds > 0 else 0.0
