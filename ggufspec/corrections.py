"""What the rounds show of the measured cost table now, and the tables auto plans with, corrected by it.

The table is measured at load in a short cache: in a long one every verified row attends to every cached token (a
batch there costs more steps: extra_rows), and past exact_kv a round is one batch whose rows are judged with a margin,
a near-tie among them decoded again (at a rate this text shows: tie_rate; a lookup copy's rows apart, copy_tie_rate).
"""

from __future__ import annotations

from .costs import Costs


class CostCorrections:
    """extra_rows and the near-tie rates learnt from timed rounds, and `costs` / `copy_costs`: the measured table
    corrected with them (a lookup copy's planned with copy_costs)."""

    # How far one verify may move extra_rows, and how much of the way it goes: a batch dearer than the table is
    # believed at once (drafting on would lose every round), a cheaper one more slowly (one fast batch is no trend).
    extra_rows_clip = (0.5, 8.0)
    extra_rows_fade = 0.97  # per undrafted round: a dear batch is tried again some 20 rounds later, a stall forgotten
    tie_prior = (0.3, 10.0)  # a near-tie in some thirty judged rows until the text shows its own (prose on the Qwen pair: 1 in 9)
    # The rows of a lookup copy are the target copying its context, which it does surely: on the Q4_K_M Qwen pair's
    # edit and fix suites past 256 cached tokens, copies of up to 63 tokens verified in one batch met no near-tie
    # (gap under 0.64) in some 550 rows, where the prose prior above would expect 16 and price a 63-token copy at 9
    # steps of re-checks (its 15-token copies won). A text whose copies do meet near-ties teaches that within ~50 rows.
    copy_tie_prior = (0.05, 25.0)
    tie_decay = 0.98  # per judged row: the text's last fifty or so rows

    def __init__(self, measured: Costs, *, margin: bool):
        self.measured = self.costs = self.copy_costs = measured
        # what a verified row beyond the first costs now over what the table says: from the table's measured depth at
        # first (the prompt's, `floor`), then from each timed verify, fast
        self.extra_rows = 1.0
        # (ties, rows judged) seen, decayed, from a prior (none where no margin is kept); a copy's rows apart
        self.ties = (self.tie_prior[0] if margin else 0.0, self.tie_prior[1])
        self.copy_ties = (self.copy_tie_prior[0] if margin else 0.0, self.copy_tie_prior[1])
        self._corrected_with = (1.0, 0.0, 0.0)  # (extra_rows, tie_rate, copy_tie_rate) the tables are corrected with
        self.correct()

    @property
    def tie_rate(self) -> float:
        """The chance that a row judged with a margin is a near-tie, here in this text (a copy's rows apart)."""
        return self.ties[0] / self.ties[1]

    @property
    def copy_tie_rate(self) -> float:
        """The chance that a row of a lookup copy, judged with a margin, is a near-tie here."""
        return self.copy_ties[0] / self.copy_ties[1]

    def at_least_floor(self, n_past: int) -> None:
        """A cache of n_past tokens makes rows at least as dear as the table's depth says (a long prompt's)."""
        self.set_extra_rows(max(self.extra_rows, self.measured.rows_at(n_past)))

    def learn_rows(self, seconds: float, rows: int, target_scale: float) -> None:
        """A verify of `rows` rows took `seconds`, with the target running at target_scale times the table's speed."""
        table = self.measured.batch_seconds(rows) - self.measured.batch_seconds(1)
        if table <= 0:
            return
        seen = (seconds - self.measured.batch_seconds(1) * target_scale) / (table * target_scale)
        seen = min(self.extra_rows_clip[1], max(self.extra_rows_clip[0], seen))
        weight = 0.7 if seen > self.extra_rows else 0.3
        self.set_extra_rows(self.extra_rows + weight * (seen - self.extra_rows))

    def fade(self, n_past: int) -> None:
        """An undrafted round teaches nothing of batches: a dear one seen fades towards the table's depth."""
        if self.extra_rows > (floor := self.measured.rows_at(n_past)):
            self.set_extra_rows(floor + (self.extra_rows - floor) * self.extra_rows_fade)

    def learn_ties(self, ties: int, rows: int, copy: bool = False) -> None:
        decay = self.tie_decay ** rows
        was = self.copy_ties if copy else self.ties
        now = (was[0] * decay + ties, was[1] * decay + rows)
        if copy:
            self.copy_ties = now
        else:
            self.ties = now
        self.correct()

    def set_extra_rows(self, extra: float) -> None:
        self.extra_rows = extra
        self.correct()

    def correct(self) -> None:
        """Rebuild the tables where what they are corrected with moved (by a tenth of a tie rate: the copies' is a
        few in a thousand)."""
        (extra, ties, copy_ties), (was_extra, was_ties, was_copy) = (
            (self.extra_rows, self.tie_rate, self.copy_tie_rate), self._corrected_with)

        def moved(now: float, was: float) -> bool:
            return abs(now - was) > max(0.0005, 0.1 * max(now, was))

        new_extra = abs(extra - was_extra) > 0.01 * extra
        if new_extra or moved(ties, was_ties):
            self.costs = self.measured.corrected(extra, ties)
            was_ties = ties
        if new_extra or moved(copy_ties, was_copy):
            self.copy_costs = self.measured.corrected(extra, copy_ties)
            was_copy = copy_ties
        self._corrected_with = (extra if new_extra else was_extra, was_ties, was_copy)
