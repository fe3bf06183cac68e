"""INT8 weights with stochastic-rounding updates for HMT (``method.weight_dtype=int8``; Q-GaLore, Zhang et al.,
2024, §3.3): the codec (``codec``: block-absmax codes, dequantization through a Triton kernel or its PyTorch
fallback) and the layer (``linear``: ``Int8Linear`` with its custom autograd Function, and the ``Int8Weight``
handle HMT's optimizer updates through ``hmt_core.precision.UpdateWriter``) and, for the vocabulary matrices
(``method.embedding_dtype=int8``), ``embedding``: ``Int8Embedding`` and ``quantize_vocab``."""

from hmt_core.int8_weights.codec import BLOCK, QMAX, block_absmax, dequantize, dequantize_torch, num_blocks, quantize
from hmt_core.int8_weights.embedding import Int8Embedding, quantize_vocab
from hmt_core.int8_weights.linear import (
    Int8Linear,
    Int8LinearFunction,
    Int8Weight,
    Materialize,
    int8_layers,
    is_phantom,
    place_on,
    quantize_linears,
    role,
    trained_in_place,
)

__all__ = ["BLOCK", "QMAX", "Int8Embedding", "Int8Linear", "Int8LinearFunction", "Int8Weight", "Materialize",
           "block_absmax", "dequantize", "dequantize_torch", "int8_layers", "is_phantom", "num_blocks", "place_on",
           "quantize", "quantize_linears", "quantize_vocab", "role", "trained_in_place"]
