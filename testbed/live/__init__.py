"""The live quality study: cache policies inside a real model, judged by the model's predictions.

For each corpus segment the model reads a prefill of P tokens, then T teacher-forced decode
steps (the true next token is fed, one scored prediction per step) through the cache under test.
Per step: the log-probability of the true token, KL(p_float32 || p_policy) against the same model
with transformers' ``DynamicCache`` (the float32 reference), and whether the top-1 token agrees
with the reference's. The cache's stored bytes are measured after every forward call.

Arms of one study: the reference (``dynamic_cache``), every policy of the protocol
(:mod:`testbed.policies`, run through :class:`~testbed.policies.cache.PolicyCache`) and the peers
users know, transformers' ``QuantizedCache`` with the quanto backend at 2 and 4 bits (which
re-quantizes its whole history each time its float residual fills; it runs one token per forward,
on its own schedule).

Modes (protocol key ``mode``): ``"chunked"`` feeds the tokens between two changes of a policy's
stored state (:meth:`~testbed.policies.policy.Policy.next_change`: a flush of a group for a
quantized middle) as one forward call, which is exact — each of those tokens attends the same
stored history plus the float32 tokens before it, as it would one token per forward; an evicting
policy takes any chunk, its cache handing attention a per-token mask that hides from each token
what it would already have evicted; ``"step"`` feeds one token per forward for every arm. The reference is exact in
any chunking and runs in chunks of ``reference_chunk`` tokens.

Units are segments: every per-token array is stored, rows are per (segment, arm), and the report's
intervals are bootstraps over segments, never over tokens.

Corpus: Python's own ``pydoc_data.topics`` (the help topics of the standard library, ~465k
characters of technical English, no download) or text files named in the protocol (paths relative
to the protocol file). Segments are disjoint, evenly spaced over the token stream, and their token
ids are stored and hashed.

The package, by responsibility: :mod:`~testbed.live.spec` (the protocol's spec and validation, the
arms it declares), :mod:`~testbed.live.corpus` (corpus text, segments), :mod:`~testbed.live.decode`
(chunk schedule, forward calls, one arm's teacher-forced decode), :mod:`~testbed.live.peers`
(DynamicCache and quanto bytes, quanto's warm-up), :mod:`~testbed.live.prefill` (the shared prefill
and the oracle passes), :mod:`~testbed.live.run` (plan, units, run_unit) and
:mod:`~testbed.live.summary` (the report.md section). The names other modules use are re-exported
here (``from testbed.live import chunk_schedule``).
"""

from ..policies import PRESETS
from .corpus import corpus_text, segment_starts
from .decode import chunk_schedule, forward, run_arm
from .peers import dynamic_bytes, quanto_bytes, warm_quanto
from .prefill import (OraclePasses, SharedPrefill, mass_candidates, measures_concentration, oracle_passes,
                      oracle_schedule, scored_needs, shared_prefill)
from .run import batch_note, batch_units, cost_kind, plan, run_unit
from .spec import (CORPUS, PEER, REFERENCE, SPEC, arms_of, case_id, check_model, context_views, estimate_bytes,
                   peer_name, policies_of, segment_indices, validate)
from .summary import EQUAL_BYTES_NOTE, MIN_CI_SEGMENTS, bootstrap, comparator, equal_bytes, report, summarize

__all__ = ["validate", "plan", "batch_units", "run_unit", "report", "policies_of", "scored_needs", "corpus_text",
           "segment_starts", "chunk_schedule", "quanto_bytes", "REFERENCE", "comparator", "equal_bytes",
           "SPEC", "PEER", "CORPUS", "PRESETS", "check_model", "context_views", "case_id", "segment_indices", "estimate_bytes",
           "peer_name",
           "arms_of", "forward", "run_arm", "dynamic_bytes", "warm_quanto", "SharedPrefill", "shared_prefill",
           "OraclePasses", "oracle_schedule", "oracle_passes", "mass_candidates", "measures_concentration",
           "cost_kind", "batch_note", "MIN_CI_SEGMENTS", "bootstrap", "summarize", "EQUAL_BYTES_NOTE"]
