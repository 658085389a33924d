"""Speculative decoding (chapter 07).

    rejection.py   verify (the one verifier), rejection_sample (exact for any draft) and
                   greedy_accept (exact match)
    theory.py      acceptance alpha = 1 - TV, tokens per verification, speedup, break-even;
                   the sampler's output distribution by enumeration (the exactness proof)
    ngram.py       prompt lookup: propose what followed the last n tokens earlier on
    medusa.py      Medusa-style heads on the target's hidden state (the learned draft)
    proposers.py   NgramProposer, MedusaProposer, DraftModelProposer (one class per method, one
                   batch `propose`), early_exit_model, skip_layer_model
    stats.py       SpecStats: drafts proposed / accepted, by position
    loop.py        speculative_generate: the batch-1 draft/verify loop
    train_medusa.py  self-distillation of the heads on the bundled model's own text
The engine side (the seam: DraftRequest, Draft, NoProposer, build_proposer; proposals verified
inside the ragged batch) is minillm/engine/spec_decode.py.
"""
from ..engine.spec_decode import Draft, DraftRequest, NoProposer, build_proposer
from .loop import speculative_generate
from .medusa import DEFAULT_WEIGHTS, MedusaHeads
from .ngram import ngram_propose
from .proposers import (DraftModelProposer, DraftModelState, MedusaProposer, NgramProposer,
                        early_exit_model, skip_layer_model)
from .rejection import greedy_accept, rejection_sample, residual, verify
from .stats import SpecStats
from . import theory

__all__ = ["rejection_sample", "greedy_accept", "residual", "verify", "ngram_propose",
           "NgramProposer", "MedusaProposer", "MedusaHeads", "DraftModelProposer",
           "DraftModelState",
           "early_exit_model", "skip_layer_model", "speculative_generate", "SpecStats", "theory",
           "DEFAULT_WEIGHTS", "Draft", "DraftRequest", "NoProposer", "build_proposer"]
