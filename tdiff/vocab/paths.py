"""Module paths: the outermost model's label and the decoder layer a path or a call lies in.

Examples:
    >>> layer_of("model.layers.12.mlp.down_proj"), layer_of("decoder.final_layernorm")
    (12, None)
    >>> call_layer("model.layers.0.self_attn.rotary_emb", "model.layers.3.self_attn", 3)
    3
    >>> bool(DECODER_LAYER.search("transformer.h.2")), bool(DECODER_LAYER.search("model.layers.2.mlp"))
    (True, False)
"""

from __future__ import annotations

import re

# The outermost model's module path is "": this labels it in tensor names, reports and messages.
ROOT_LABEL = "(model)"

# Decoder-layer containers across frameworks: HF and SGLang "model.layers.N", Megatron
# "decoder.layers.N", GPT-2 "transformer.h.N", BERT "encoder.layer.N", others "blocks.N".
_CONTAINER = r"(?:^|\.)(?:layers|layer|h|blocks)\."
LAYER_CONTAINER = _CONTAINER + r"\d+"
# A decoder layer's own path ends in its container: "model.layers.3", "transformer.h.2".
DECODER_LAYER = re.compile(LAYER_CONTAINER + "$")
_LAYER_INDEX = re.compile(_CONTAINER + r"(\d+)(?=$|[.\[])")


def layer_of(path: str) -> int | None:
    """The decoder-layer index a module path lies in (the innermost one), or None."""
    found = _LAYER_INDEX.findall(path)
    return int(found[-1]) if found else None


def call_layer(path: str, caller: str | None, caller_layer: int | None) -> int | None:
    """The decoder layer a call of module ``path`` belongs to, made by the call of module
    ``caller`` (None at the top) that belongs to layer ``caller_layer``.

    The module path says the layer unless the module lies outside its caller, or its caller was
    attributed to a layer its own path does not say: a module shared by all layers (SGLang's one
    ``rotary_emb``) is named after its first owner, ``model.layers.0.self_attn.rotary_emb``, and
    each of its calls belongs to the layer that made it.
    """
    own = layer_of(path)
    if caller is None or caller_layer is None:
        return own
    owned = caller == "" or path.startswith(caller + ".")
    return own if owned and caller_layer == layer_of(caller) else caller_layer


def record_layer(record) -> int | None:
    """The decoder layer of a module record's call: the one recorded at capture time where the
    module path does not say it (``Record.layer``); for dumps that lack it, derived from the
    record's module path and its caller's (``Record.parent``)."""
    if record.layer is not None:
        return record.layer
    parent = record.parent
    return call_layer(record.module, parent, layer_of(parent) if parent else None)
