"""Speculative decoding (chapter 07).

    rejection.py   verify (the one verifier), rejection_sample (exact for any draft) and
                   greedy_accept (exact match)
    theory.py      acceptance alpha = 1 - TV, tokens per verification, speedup, break-even;
                   the sampler's output distribution by enumeration (the exactness proof)
    ngram.py       prompt lookup: propose what followed the last n tokens earlier on
    medusa.py      Medusa-style heads on the target's hidden state (the first learned draft)
    eagle.py       the EAGLE drafter: one decoder layer on the target's features, FR-Spec head
    proposers.py   NgramProposer, MedusaProposer, DraftModelProposer, EagleProposer (one class
                   per method, one batch `propose`), early_exit_model, skip_layer_model
    stats.py       SpecStats: drafts proposed / accepted, by position
    loop.py        speculative_generate: the batch-1 draft/verify loop; tree_generate: the
                   same with EAGLE tree drafts verified in one forward (tree.py)
    tree.py        tree verification: the tree mask, per-node positions, the acceptance walk
    train_medusa.py  self-distillation of the heads on the bundled model's own text
    eagle_data.py  the model's own conversations (topics x styles, held-out split), features
    train_eagle.py the drafter's training and its held-out acceptance by draft position
The engine side (the seam: DraftRequest, Draft, NoProposer, build_proposer; proposals verified
inside the ragged batch) is minillm/engine/spec_decode.py.
"""
from ..engine.spec_decode import Draft, DraftRequest, NoProposer, build_proposer
from .loop import speculative_generate, tree_generate
from .eagle import DEFAULT_EAGLE_WEIGHTS, EagleDrafter
from .medusa import DEFAULT_WEIGHTS, MedusaHeads
from .ngram import ngram_propose
from .proposers import (DraftModelProposer, DraftModelState, EagleProposer, MedusaProposer,
                        NgramProposer, early_exit_model, skip_layer_model)
from .rejection import greedy_accept, rejection_sample, residual, verify
from .stats import SpecStats
from . import theory

__all__ = ["rejection_sample", "greedy_accept", "residual", "verify", "ngram_propose",
           "NgramProposer", "MedusaProposer", "MedusaHeads", "DraftModelProposer",
           "DraftModelState", "EagleProposer", "EagleDrafter", "DEFAULT_EAGLE_WEIGHTS",
           "early_exit_model", "skip_layer_model", "speculative_generate", "tree_generate",
           "SpecStats", "theory",
           "DEFAULT_WEIGHTS", "Draft", "DraftRequest", "NoProposer", "build_proposer"]
