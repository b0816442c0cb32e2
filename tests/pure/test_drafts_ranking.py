"""The ranking of `ggufspec drafts` (models/drafts.py): Leviathan's formula on predicted costs, no model."""

from ggufspec.models.drafts import Candidate, predict, rank


def test_a_cheaper_draft_at_equal_alpha_ranks_first():
    slow, fast = (Candidate(n, "draft", "models dir", True, "") for n in ("a-slow", "b-fast"))
    predict(slow, 1000, 400)
    predict(fast, 1000, 100)
    lookup = Candidate("prompt lookup", "lookup", "always", True, "", cost_ratio=0.0)
    unusable = Candidate("c", "draft", "models dir", False, "")
    assert [c.name for c in rank([unusable, lookup, slow, fast])] == ["b-fast", "a-slow", "prompt lookup", "c"]
    assert fast.expected > slow.expected
