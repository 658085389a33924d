"""Speculative decoding (chapter 07).

    rejection.py   rejection_sample (exact for any draft) and greedy_accept (exact match)
    theory.py      acceptance alpha = 1 - TV, tokens per verification, speedup, break-even;
                   the sampler's output distribution by enumeration (the exactness proof)
    ngram.py       prompt lookup: propose what followed the last n tokens earlier on
    medusa.py      Medusa-style heads on the target's hidden state (the learned draft)
    proposers.py   NgramProposer, MedusaProposer, DraftModelProposer, early_exit_model
    loop.py        speculative_generate: the batch-1 draft/verify loop, SpecStats
    train_medusa.py  self-distillation of the heads on the bundled model's own text
The engine side (proposals verified inside the ragged batch) is minillm/engine/spec_decode.py.
"""
from .loop import SpecStats, speculative_generate
from .medusa import DEFAULT_WEIGHTS, MedusaHeads
from .ngram import ngram_propose
from .proposers import (DraftModelProposer, MedusaProposer, NgramProposer, early_exit_model,
                        final_probs, skip_layer_model)
from .rejection import greedy_accept, rejection_sample, residual
from . import theory

__all__ = ["rejection_sample", "greedy_accept", "residual", "ngram_propose", "NgramProposer",
           "MedusaProposer", "MedusaHeads", "DraftModelProposer", "early_exit_model", "skip_layer_model",
           "final_probs", "speculative_generate", "SpecStats", "theory", "DEFAULT_WEIGHTS"]
