"""What a cache layer's update leaves for the attention call right after it, and the reverse.

Per-layer registries shared by the layers (:mod:`testbed.policies.layers`, :mod:`testbed.policies.cache`),
the attention function of :func:`testbed.policies.hook.policy_attention` and the attention observers
(:mod:`testbed.policies.selection`). They live in a module of their own, below all of those, so that
none of them imports another to reach them. Every registry is a container changed in place (never
rebound), so ``from .handoff import PENDING`` sees the one object.
"""

from __future__ import annotations

__all__ = ["PENDING", "DIRECT", "SELECT", "OBSERVER", "OBSERVE_SECONDS", "ACTIVE", "ROPE", "require_active"]

# layer index -> (the layer, the boolean mask its last update left for the attention call after it)
PENDING: dict[int, tuple] = {}
# layer index -> (the layer, new tokens): its update returned only the float32 keys; attention reads
# the packed middle from its codes (testbed.policies.packed_attention)
DIRECT: dict[int, tuple] = {}
# layer index -> the layer whose prefill waits for the attention call to choose its sink
SELECT: dict[int, object] = {}
# a function (layer index, query, key, scale) that every attention call inside policy_attention
# reports to (observe_concentration: the oracle's float32 pass over a whole segment)
OBSERVER: list = [None]
# seconds spent measuring attention for policies that decide from it (sinks, allocations): their cost
OBSERVE_SECONDS = [0.0]
# how many policy_attention blocks are open: an update that needs the mask or the direct path
# outside one is refused before attention can run with transformers' own (wrong) mask
ACTIVE = [0]
# layer index -> (position_embeddings, the attention module's class name): what each decoder layer's
# attention module was called with in the current forward, captured by policy_attention's forward
# pre-hooks (the rotary cos / sin of the new tokens) for a layer that stores pre-RoPE keys
ROPE: dict[int, tuple] = {}


def require_active(what: str, layer_idx) -> None:
    if not ACTIVE[0]:
        raise RuntimeError(f"layer {layer_idx}: {what} needs the model to run inside "
                           "testbed.policies.hook.policy_attention(model); refused rather than attending wrongly")
