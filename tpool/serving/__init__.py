"""Serving on tpool pages: paged K/V storage, paged attention, a transformers integration, a loop.

``tpool.serving.kv`` and ``tpool.serving.attention`` need only torch;
``tpool.serving.hf`` and ``tpool.serving.engine`` need transformers (the
``tpool[hf]`` extra) and import it themselves: ``import tpool`` never does.
"""

from tpool.serving.attention import FlashInferAttention, StepMetadata, paged_attention, step_metadata
from tpool.serving.kv import PagedKVCache

__all__ = ["PagedKVCache", "StepMetadata", "step_metadata", "paged_attention", "FlashInferAttention"]
