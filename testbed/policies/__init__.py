"""KV-cache policies that run inside a model: what is kept, at which precision, as tokens arrive.

:class:`Policy` (one small dataclass, named presets in ``PRESETS``) and :class:`PolicyCache`, a
transformers ``Cache`` of :class:`PolicyLayer` (a ``DynamicLayer`` subclass) that runs a policy in
any causal LM (:mod:`.cache`; its layers in :mod:`.layers`, the attention function it runs under in
:mod:`.hook`). Those modules need transformers (the ``capture`` extra); the policy does not.
"""

from .policy import HEADER_BYTES, MIDDLE_SCHEMES, Policy
from .presets import PRESETS, preset

__all__ = ["Policy", "PRESETS", "MIDDLE_SCHEMES", "preset", "HEADER_BYTES"]
