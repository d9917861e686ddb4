"""Data feeding for distributed training.

Contract: `ShareBatchSampler` hands each rank its share of every global batch from one seeded
permutation per epoch; shares may change between steps (`set_shares`) and every epoch still covers
each sample exactly once; `state_dict()` / `load_state_dict()` resume the same data order.
"""

from __future__ import annotations

from trainspec.data.sampler import SamplerStateError, ShareBatchSampler, StepBatch, apportion

__all__ = ["SamplerStateError", "ShareBatchSampler", "StepBatch", "apportion"]
