"""testbed: a simulation and ablation testbed for KV-cache compression research.

Two sources (synthetic attention, real-model capture) produce :class:`testbed.case.Case` objects;
packed quantizers (:mod:`testbed.quant`) turn K/V (or Q/K, or probabilities) into byte-exact
:class:`testbed.quant.Packed` payloads; analyses measure attention-output error and the attention
topology; every array is stored with its nbytes and SHA-256 and re-derived by :mod:`testbed.audit`.
README.md says what it does; AGENTS.md where each part lives and the rules a change keeps.
"""

__version__ = "0.1.0"
