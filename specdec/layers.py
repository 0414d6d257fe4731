"""How hidden layers are numbered, everywhere: the target's forward and both decoding sessions.

Layer ``i`` is the output of decoder layer ``i`` (transformers' ``hidden_states[i + 1]``);
negative indices count from the end; the last layer is returned after the model's final norm.
A module of its own, free of heavy imports, so the decoder can use it without loading models.
"""

from __future__ import annotations

from specdec.errors import ModelError


def resolve_layer(layer: int, num_layers: int) -> int:
    """The decoder layer ``layer`` names (negatives count from the end), in ``0..num_layers-1``.

    Every place that reads hidden layers (:class:`FrozenTarget`, the decoding sessions) numbers
    them through this function; layer ``i`` is transformers' ``hidden_states[i + 1]``.

    Raises:
        ModelError: out of range; the message names the index and the valid range.
    """
    if not -num_layers <= layer < num_layers:
        raise ModelError(
            f"hidden layer {layer} out of range for a target with {num_layers} layers "
            f"(valid: {-num_layers}..{num_layers - 1})"
        )
    return layer % num_layers
