"""auto's guard: what each drafter's rounds deliver here, against plain decoding timed the same way (`RateWatch`),
and against the cost table's forecast of them (`Credit`).

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
        elif r.draft is not None and r.draft.caught_up:
            pass  # a lazy draft model's catch-up on the prompt: a one-off the planner priced (AutoDrafter.catch_up)
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


class Credit:
    """What a credited source's recent rounds delivered over the table's forecast of them.

    The table's forecast takes drafted positions as alike, but a copy is kept whole or not at all far more often:
    where the text copies, copies (lookup, lookup+draft) deliver more than forecast. auto weighs them up by what
    their recent rounds delivered over the forecast, so it moves toward copying within a few rounds; the credit
    fades while other sources run, so the choice follows the text. Never weighed down (a source judged low by a
    few unlucky rounds would go unused and never show otherwise; the guard pauses one that loses to plain
    decoding), and not the draft model (credited too, it took rounds inside copies from lookup on the Qwen pair's
    fix suite: 0.97-0.99x of lookup alone against 1.06x).
    """

    prior = 6.0  # tokens' worth of belief in the table, per source
    decay = 0.85  # per round of that source: about its last seven rounds
    fade = 0.97  # per round of another source
    most = 1.6

    def __init__(self, credited: tuple[str, ...]):
        self.credited = credited
        self.sums: dict[str, list[float]] = {}  # source -> [tokens, tokens the table predicted], decayed

    def of(self, source: str) -> float:
        """What the source's recent rounds delivered over the table's forecast of them, at least 1 (1: not credited)."""
        tokens, predicted = self.sums.get(source, (0.0, 0.0))
        return min(self.most, max(1.0, (tokens + self.prior) / (predicted + self.prior)))

    def observe(self, r: Round) -> None:
        seconds = r.draft_seconds + r.target_seconds
        source = r.draft.source or r.source
        if not r.draft.table_rate or seconds <= 0 or r.shared:
            return
        for s, sums in self.sums.items():
            if s != source:
                sums[0] *= self.fade
                sums[1] *= self.fade
        if source not in self.credited:
            return
        sums = self.sums.setdefault(source, [0.0, 0.0])
        sums[0] = sums[0] * self.decay + len(r.tokens)
        sums[1] = sums[1] * self.decay + r.draft.table_rate * seconds


def _rate(rounds) -> float:
    seconds = sum(s for _, s in rounds)
    return sum(t for t, _ in rounds) / seconds if seconds > 0 else 0.0
