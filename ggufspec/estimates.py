"""What auto believes of each drafter's acceptance: running estimates with a prior (`Estimate`), and for prompt
lookup the priors by how far back a copy agrees with the text (`LOOKUP_PRIORS`, `lookup_bucket`)."""

from __future__ import annotations


class Estimate:
    """A running acceptance rate: a prior worth `weight` drafts, then observations with decay."""

    def __init__(self, prior: float, weight: float, decay: float = 0.98, wait: int = 24):
        self.accepted, self.drafted, self.decay = prior * weight, weight, decay
        self.prior, self.weight, self.fresh = prior, weight, True  # fresh: nothing observed since the prior
        self.idle, self.wait = 0, wait  # rounds unused in a row; how many before it starts over (`unused`)

    @property
    def value(self) -> float:
        return self.accepted / self.drafted

    def optimistic(self, c: float, value: float | None = None) -> float:
        """The estimate (or `value`, what `monotone` makes of it) plus an exploration bonus that shrinks as evidence
        accumulates (UCB): a kind of draft that has never been tried gets tried, or its prior would never be tested."""
        return min(1.0, (self.value if value is None else value) + c / self.drafted ** 0.5)

    def planned(self, c: float) -> float:
        """What a draft model or a head is planned with: fresh, with the exploration bonus (`optimistic`), so it is
        tried where only its prior says it loses (on a Zen 3 the default pair's draft loses at 0.8 and pays 1.2x at
        the 0.92 it is right on code); once tried, what it showed."""
        return self.optimistic(c) if self.fresh else self.value

    def unused(self) -> None:
        """A round it did not draft: after `wait` in a row it starts over from its prior, fresh (tried again: one
        unlucky first round does not write it off), and `wait` grows fourfold (24, 96, 384: where it loses, a try
        now and then, fewer and fewer; on a text where the draft is right half the time, 2-4% of plain decoding's
        speed over 240 tokens on the Zen 3 table, tests/pure/test_auto.py)."""
        self.idle += 1
        if self.idle >= self.wait:
            self.accepted, self.drafted, self.fresh = self.prior * self.weight, self.weight, True
            self.idle, self.wait = 0, 4 * self.wait

    def update(self, n_accepted: int, n_drafted: int) -> None:
        self.fresh, self.idle = False, 0
        for i in range(n_drafted):  # one Bernoulli observation per drafted position reached
            self.accepted = self.accepted * self.decay + (1.0 if i < n_accepted else 0.0)
            self.drafted = self.drafted * self.decay + 1.0
            if i >= n_accepted:
                break


# (shortest agreement of the bucket, prior alpha) for lookup drafts, by agreement length in tokens. Short
# agreements are weak evidence: in code answers, matches agreeing over 2-4 tokens were accepted about a
# third of the time (the Qwen pair, 128-token answers), so they are tried only where a batch is cheap.
LOOKUP_PRIORS = ((1, 0.2), (2, 0.3), (3, 0.45), (4, 0.6), (8, 0.8), (16, 0.85), (32, 0.9))
# A copy resumed past a token the text changed (LookupDrafter.match), whatever its agreement: its first token was right
# 4 times in 20 (the Qwen pair's five suites, 128-token answers: mostly a summary or an edit leaving its source), where
# copies of 8 or more agreeing tokens that nothing broke were right 88-100% of the time (dev/lookup_acceptance.py).
RESUMED_PRIOR = 0.3


def monotone(estimates: list[Estimate]) -> list[float]:
    """The estimates' values, in order of agreement, made non-decreasing by pooling each run of them that decreases,
    weighted by their evidence (isotonic regression): a copy agreeing further back is never the worse bet, so copies
    kept whole at a shorter agreement are evidence for the longer ones (the Q4_K_M pair's fix answers: two tokens kept
    at agreement 8 now make a copy at 11 one long batch, where bucket 16's prior alone had it drafted two at a time
    up to agreement 20), and copies that fail at a longer one pull the shorter ones down with them."""
    blocks: list[list[float]] = []  # [accepted, drafted, how many estimates]
    for e in estimates:
        blocks.append([e.accepted, e.drafted, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            accepted, drafted, n = blocks.pop()
            blocks[-1] = [blocks[-1][0] + accepted, blocks[-1][1] + drafted, blocks[-1][2] + n]
    return [accepted / drafted for accepted, drafted, n in blocks for _ in range(int(n))]


def lookup_bucket(agreement: int) -> int:
    return max(m for m, _ in LOOKUP_PRIORS if m <= max(1, agreement))
