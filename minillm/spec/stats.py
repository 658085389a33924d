"""Counts of speculative decoding (chapter 07): how many drafts were proposed and accepted, by
position, and what it cost. The batch-1 loop (spec/loop.py) and the engine
(engine/spec_decode.py) record into the same SpecStats.

    acceptance_rate         accepted drafts / proposed drafts
    mean_accepted_length    tokens per verification pass that carried drafts (accepted + 1)
    acceptance_by_position  P(draft i accepted | draft i proposed), i = 0 .. k-1

A tree of drafts (tree.py) counts every node as a proposed draft, its depths as the positions
(position i: a node i + 1 deep was accepted), and `num_side_branch_kept` counts the
verifications whose kept branch was not the first (the drafter's top guesses): what the extra
branches bought.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counts of one or many speculative runs (vLLM's names where it has them)."""
    num_drafts: int = 0                       # verification passes that carried >= 1 draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_forwards: int = 0              # prefill + plain decodes + verifications
    num_emitted_tokens: int = 0
    num_side_branch_kept: int = 0             # tree verifications that kept another branch
    num_steps_off: int = 0                    # engine steps without drafts because the batch
                                              # was above disable_by_batch_size
    accepted_per_position: list = field(default_factory=list)   # position i: accepted drafts
    drafted_per_position: list = field(default_factory=list)    # position i: proposed drafts
    draft_time: float = 0.0
    total_time: float = 0.0

    def record(self, num_drafted: int, num_accepted: int, depth=None, path=None) -> None:
        """One verification: num_drafted drafts (a tree's nodes), num_accepted kept; a tree
        gives its depth (the positions) and the node indices it kept (`path`, root first: a
        branch other than the first when they are not 0, 1, 2, ...)."""
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_side_branch_kept += path is not None and path != list(range(len(path)))
        positions = num_drafted if depth is None else depth
        for lst in (self.drafted_per_position, self.accepted_per_position):
            lst.extend([0] * (positions - len(lst)))          # one entry per draft position
        for i in range(positions):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: "SpecStats") -> None:
        """Add another run's counts and times to these (one SpecStats per prompt -> a total)."""
        for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_target_forwards",
                  "num_emitted_tokens", "num_side_branch_kept", "num_steps_off", "draft_time",
                  "total_time"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification pass that carried drafts: accepted + 1 (the bonus or
        the correction)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_by_position(self) -> list:
        """P(draft i accepted | draft i proposed), i = 0 .. k-1."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position,
                                                    self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "acceptance_by_position": self.acceptance_by_position,
                "num_target_forwards": self.num_target_forwards,
                "num_emitted_tokens": self.num_emitted_tokens,
                "num_side_branch_kept": self.num_side_branch_kept,
                "num_steps_off": self.num_steps_off}
