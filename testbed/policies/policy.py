"""KV-cache policies: what a live cache keeps, and at which precision, as tokens arrive.

A policy splits the key axis of one layer's cache into three regions, in physical order::

    sink (first S tokens) | middle (everything older than the window) | recent window (newest R)

The sink and the window are kept float32. The middle is kept float32, quantized with a scheme of
:mod:`testbed.quant` (grouped integers with K per channel or per token and V per token, as in KIVI;
MX) or dropped (eviction, as StreamingLLM does with its sink + window).

Tokens leave the window one at a time, but a quantized middle takes them only in whole groups of
``group`` tokens: the newest tokens wait in float32 until a whole group has aged out of the
window, so K per channel is always quantized over complete groups and never re-quantized
(KIVI's schedule; Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache"). Between R and R + G - 1 tokens are therefore float32 behind the sink. A dropped middle
keeps exactly the newest R tokens (StreamingLLM: Xiao et al., 2024, "Efficient Streaming Language
Models with Attention Sinks"; keys keep the positions they were rotated with).

Which tokens the sink holds (``sink_select``): ``"first"``, the first S (StreamingLLM's and KIVI's
sink); or ``"mass"``, chosen online at the prefill, per layer, KV head and sequence, from the
attention the prefill's own queries paid: among the prefill tokens that will leave the float32
window (the first ``max(S, P - R)``), the S with the largest mean share of attention over the
queries that see them (and over the KV head's query heads). Nothing of the future is used. The
chosen tokens keep their post-RoPE keys, so they attend as the tokens they are; the rest of the
prefill goes on to the window and the middle in order. Bytes are the same as the first-S sink's:
S float32 tokens either way.

A policy also says where its stored state next changes (:meth:`Policy.next_change`): between two
such points every new token attends the same stored history plus float32 tokens, so a study can
feed those tokens as one forward call and get exactly what one token per forward would give.

Byte accounting (per layer and sequence; heads and head_dim are the model's): float32 sink and
window K + V, the middle's packed arrays (codes, float16 scales and zero-points or E8M0 scales),
one 16-byte (N, D) header; :meth:`Policy.layer_bytes` is that closed form.

Mixed precision per head (``low`` set): the middle of each (layer, KV head) pair of a sequence is
stored either with ``middle``'s bits or with ``low``'s; ``round(low_share × pairs)`` of the model's
pairs get ``low``, chosen per sequence when the prefill ends by the rule ``alloc`` (:data:`ALLOC`):

- ``"concentrated"``: the pairs whose prefill attention is most concentrated (lowest mean effective
  support, exp(entropy) / visible keys over the prefill's queries and the KV head's query heads)
  get the low bits; ``"diffuse"``: the most diffuse ones do;
- ``"late"``: the last layers (content-blind: the depth prior "late layers compress");
- ``"random"``: a fixed pseudo-random order of the pairs (SHA-256 of ``"layer:head"``; content-blind,
  the same for every sequence).

``alloc_from = "oracle"`` takes the concentration from a float32 pass over the whole segment
(prefill and every step to come): impossible online, an upper bound for the prefill rule. The
bits are stored, one byte per pair, and counted. At ``low_share`` ½ with int4 / int2 the mean
bytes are exactly those of a 3-bit KIVI layout; at ⅔ with int8 / int2 exactly int4's
(:meth:`Policy.cache_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from ..quant import MX, IntGrouped, Quantizer
from ..quant.constants import HEADER_BYTES
from . import codec as codec_of

__all__ = ["Policy", "scored_held", "pyramid_keep", "LAYER_SCHEDULES", "LAYER_FIELDS", "HEAD_SCHEDULES",
           "HEAD_FIELDS", "ADA_ALPHA", "safeguard_count", "SELECT_FIELDS", "SELECT_CLASS_BYTES", "selective_bytes",
           "dense_pair_bytes",
           "SCORER_FIELDS", "SCORER_MODES", "SCORED_TOKEN_EXTRA", "STORE_SCHEMES", "STORE_FIELDS", "DENSE_FIELDS",
           "MIDDLE_SCHEMES", "SINK_SELECT", "KEY_ROPE", "ALLOC", "sink_candidates", "HEADER_BYTES",
           "scheme_bytes_per_token", "HEAVY_TOKEN_EXTRA"]

# Schemes for the middle region: "float32", "drop", grouped integers, MX element formats, and "codec": any
# quantizer of testbed.quant, given per K and V by the policy's ``codec`` (testbed.policies.codec)
MIDDLE_SCHEMES = ("float32", "drop", "int2", "int3", "int4", "int8", "mxfp8", "mxfp4", "codec")
_MX_ELEMENT = {"mxfp8": "e4m3", "mxfp4": "e2m1"}
SINK_SELECT = ("first", "mass")
# where the stored keys stand against the rotary embedding: "post" (as the model hands them to the
# cache, rotated), or "pre" (un-rotated before storage, rotated again at every read: KVQuant's
# pre-RoPE keys; testbed.policies.layers obtains them)
KEY_ROPE = ("post", "pre")
# rules that choose which (layer, KV head) pairs of a mixed policy get the low bits
ALLOC = ("concentrated", "diffuse", "late", "random")
ALLOC_FROM = ("prefill", "oracle")
MIXED_FIELDS = ("low", "low_share", "alloc", "alloc_from")  # in a row's policy config only when mixed
HEAVY_FIELDS = ("heavy", "heavy_rule")  # in a row's policy config only when heavy hitters are kept
# a scored selection (testbed.policies.scorers): which scorer, when it decides (SCORER_MODES), how many
# tokens per (layer, KV head) it keeps, its seed; in a row's policy config only when a scorer is set
SCORER_FIELDS = ("scorer", "scorer_mode", "keep", "seed")
SCORER_MODES = ("prefill", "online")
# how a scored selection's kept count varies over layers: the same ``keep`` at every layer, or
# PyramidKV's (Cai et al., 2024) linear funnel, more tokens at low layers (:func:`pyramid_keep`); the
# pyramid's fields are in a row's policy config only when it is set
LAYER_SCHEDULES = ("uniform", "pyramid")
LAYER_FIELDS = ("layers", "beta", "layer_keep")
# how a prefill-mode scored selection shares a layer's kept count among its KV heads: ``keep`` per head,
# or Ada-KV's (Feng et al., 2024) one top-(keep x KV heads) over the layer's heads with a per-head
# safeguard of ``alpha`` (kvpress's AdaKVPress alpha_safeguard, default 0.20; :func:`safeguard_count`);
# the fields are in a row's policy config only when adaptive
HEAD_SCHEDULES = ("uniform", "adaptive", "selective")
HEAD_FIELDS = ("heads", "alpha")
# the seed's selective rule (``heads="selective"``): a prefill-mode scored selection whose (layer, KV head) pairs are
# classed at the prefill's end, ``round(sparse_share x pairs)`` of them sparse (the scorer's top ``keep``), the rest
# dense (every token); which pairs by the rule ``alloc`` (:data:`ALLOC`) from ``alloc_from``; in a row's policy config
# (with ``heads``, without ``alpha``) only when selective
SELECT_FIELDS = ("sparse_share", "alloc", "alloc_from")
# bytes per (layer, KV head) pair of a selective selection: its class (sparse or dense), one byte
SELECT_CLASS_BYTES = 1
ADA_ALPHA = 0.2
# bytes per kept token per KV head of a scored selection beside its float32 K and V: int32 index, float32 score
SCORED_TOKEN_EXTRA = 8
# a prefill-mode scored selection's kept tokens stored by a uniform storage (``store``: its middle, ``store_window``:
# its float32 window R; groups of ``group``): in a row's policy config only when set
STORE_SCHEMES = ("float32", "int2", "int3", "int4", "int8", "mxfp8", "mxfp4")
STORE_FIELDS = ("store", "store_window")
# a selective selection's dense pairs stored by a uniform storage (``dense``: its middle, one of the quantized
# STORE_SCHEMES; ``dense_window``: its float32 window R) instead of float32: in a row's policy config only when set
DENSE_FIELDS = ("dense", "dense_window")
# which candidates a heavy-hitter policy keeps: the most attended (H2O's accumulated score), the
# oldest (content-blind: a float32 sink of C tokens at the same bytes, the control), or the most
# attended over the whole segment (the oracle: a float32 pass over the segment in advance, impossible
# online, an upper bound for the online rule)
HEAVY_RULES = ("attention", "first", "oracle")
# bytes per held heavy hitter per KV head beside its float32 K and V: its int32 index and float32 score
HEAVY_TOKEN_EXTRA = 8


def scheme_bytes_per_token(middle: str, heads: int, head_dim: int, group: int = 32, feature_group: int = 32,
                           key_axis: str = "channel") -> float:
    """Bytes of K + V per packed token of ``heads`` KV heads under one quantized middle scheme
    (codes, scales, zero-points)."""
    d, g, f = head_dim, group, feature_group
    if middle in _MX_ELEMENT:
        bits = 8 if middle == "mxfp8" else 4
        dp = -(-d // 32) * 32
        per = dp * bits // 8 + dp // 32
        return 2.0 * heads * per
    bits = int(middle[3:])
    v = -(-(-(-d // f) * f) * bits // 8) + 4 * (-(-d // f))
    if key_axis == "channel":
        k = -(-d * bits // 8) + 4 * d / g
    else:
        k = v
    return heads * (k + v)


def scored_held(keep: int, mode: str, n: int, prefill: int) -> int:
    """Tokens a scored selection keeping ``keep`` holds per (layer, KV head) after ``n`` tokens
    (``n >= prefill``): online, at most ``keep``; deciding at the prefill only, the prefill's top
    ``keep`` and every later token."""
    if mode == "online":
        return min(n, keep)
    return min(prefill, keep) + max(0, n - prefill)


def selective_bytes(sparse: int, keep: int, n: int, prefill: int, layers: int, heads: int, head_dim: int,
                    dense: "Policy | None" = None) -> int:
    """Whole-cache bytes of a selective selection (one sequence) after ``n >= prefill`` tokens, ``sparse``
    of its ``layers x heads`` pairs sparse: per layer a header; per pair its class byte; per sparse pair
    its held tokens (the prefill's top ``keep`` and every later token, :func:`scored_held`) of float32 K
    and V with an int32 index and a float32 score each; per dense pair every token's float32 K and V
    (no index: its positions are implied), or with ``dense`` (a uniform storage policy) what that
    storage holds for one KV head after n tokens (:func:`dense_pair_bytes`)."""
    pairs = layers * heads
    if not 0 <= sparse <= pairs:
        raise ValueError(f"{sparse} sparse pairs of {pairs}")
    held = scored_held(keep, "prefill", n, prefill)
    return (layers * HEADER_BYTES + pairs * SELECT_CLASS_BYTES + sparse * held * (2 * head_dim * 4 + SCORED_TOKEN_EXTRA)
            + (pairs - sparse) * dense_pair_bytes(dense, n, head_dim))


def dense_pair_bytes(dense: "Policy | None", n: int, head_dim: int) -> int:
    """Bytes of one dense (layer, KV head) pair of a selective selection after ``n`` tokens: every token's
    float32 K and V, or (``dense``, a uniform storage policy) that storage's bytes for one KV head's
    ``n`` tokens, its header not counted (the layer's is)."""
    if dense is None:
        return n * 2 * head_dim * 4
    return dense.layer_bytes(n, 1, head_dim) - HEADER_BYTES


def pyramid_keep(keep: int, prefill: int, layers: int, beta: int, window: int = 0) -> tuple[int, ...]:
    """PyramidKV's kept prefill tokens per layer (Cai et al., 2024, "PyramidKV: Dynamic KV Cache
    Compression based on Pyramidal Information Funneling"; kvpress 0.5.5's ``PyramidKVPress``
    arithmetic), for a mean of ``keep`` tokens per (layer, KV head) of a ``prefill``-token prefill
    over ``layers`` layers, steepness ``beta`` (>= 1) and ``window`` W, the newest prefill tokens
    the scorer keeps first (snapkv's observation window, 64; 0 for a scorer without one).

    The top layer keeps ``keep / beta`` and the bottom one ``2 keep - keep / beta`` (their mean
    ``keep``); a bottom count above ``prefill - W`` is cut there and the top one raised by as much.
    Layer ``l`` keeps ``round(bottom - l (bottom - top) / (layers - 1))`` (Python's round, half to
    even), counts that fall with depth. Where the bounds ``prefill >= bottom >= top >= W`` fail,
    kvpress falls back to the same ``keep`` at every layer, and so does this (with kvpress's
    defaults, W = 64 and beta = 20, that is every ``keep`` below 1,280 whose bottom count is not cut
    at ``prefill - W``)."""
    if isinstance(beta, bool) or not isinstance(beta, int) or beta < 1:
        raise ValueError(f"the pyramid's beta must be an integer >= 1, got {beta!r}")
    if layers < 1 or keep < 1:
        raise ValueError(f"a pyramid over {layers} layers keeping {keep} tokens on average: both must be >= 1")
    top = keep / beta
    bottom = 2 * keep - top
    if bottom >= prefill - window:
        bottom = prefill - window
        top = 2 * keep - bottom
    if not prefill >= bottom >= top >= window:
        return (keep,) * layers
    step = (bottom - top) / (layers - 1) if layers > 1 else 0.0
    return tuple(round(bottom - i * step) for i in range(layers))


def safeguard_count(keep: int, alpha: float) -> int:
    """The tokens each KV head of an adaptive (Ada-KV) selection keeps of its own top before the
    layer's heads compete for the rest: kvpress 0.5.5's ``AdaKVPress`` rule, ``int(keep * alpha)``
    (Python's float product, truncated), at least 1 when ``alpha > 0`` and ``keep > 0``."""
    n = int(keep * alpha)
    return max(1, n) if alpha > 0 and keep > 0 else n


def sink_candidates(prefill: int, sink: int, window: int) -> int:
    """How many of the prefill's first tokens a ``"mass"`` sink is chosen from: those that will
    leave the float32 window, and at least S."""
    return min(prefill, max(sink, prefill - window))


@dataclass(frozen=True)
class Policy:
    """One cache policy. ``sink``: S first tokens kept float32; ``window``: R newest tokens kept
    float32; ``middle``: the scheme of everything in between (one of ``MIDDLE_SCHEMES``);
    ``key_axis``: ``"channel"`` (K per channel over groups of ``group`` tokens, KIVI) or
    ``"token"`` (K per token over groups of ``feature_group`` features, the axis KIVI reports to
    fail at 2 bits); V is always per token over groups of ``feature_group`` features;
    ``group``: G tokens moved from the window to a quantized middle at a time; ``sink_select``:
    ``"first"`` or ``"mass"`` (the module's docstring); ``key_rope``: ``"post"`` (keys stored as
    the model hands them to the cache, after the rotary embedding) or ``"pre"`` (stored before it,
    in every region, and rotated with each kept token's own position when attention reads them:
    KVQuant's pre-RoPE keys, so K per channel is quantized before the rotation mixes channel
    pairs; :class:`testbed.policies.layers.PolicyLayer` says how the pre-RoPE key is obtained). The
    bytes are the same either way: positions are implied by the layout, as for post-RoPE keys."""

    name: str
    middle: str = "float32"
    sink: int = 0
    window: int = 0
    group: int = 32
    feature_group: int = 32
    key_axis: str = "channel"
    sink_select: str = "first"
    low: str | None = None
    low_share: float = 0.0
    alloc: str | None = None
    alloc_from: str = "prefill"
    heavy: int = 0
    heavy_rule: str = "attention"
    scorer: str | None = None
    scorer_mode: str = "online"
    keep: int = 0
    seed: int = 0
    key_rope: str = "post"
    description: str = ""
    layers: str = "uniform"
    beta: int = 20
    layer_keep: tuple = ()
    heads: str = "uniform"
    alpha: float = ADA_ALPHA
    store: str | None = None
    store_window: int = 0
    rest: str | None = None
    dense: str | None = None
    dense_window: int = 0
    sparse_share: float = 0.0
    codec: dict | None = field(default=None, hash=False)  # a dict: hashed by the other fields
    block: int = 0
    # a codec's calibrated tables, {"k": [table per layer], "v": [...]} for its calibrated parts: the
    # study's calibration hands them on (testbed.live.calibration); rows store them as arrays, not fields
    tables: dict | None = field(default=None, hash=False, compare=False, repr=False)

    def __post_init__(self):
        if self.codec is not None or self.middle == "codec":
            self._check_codec()
        if self.key_rope not in KEY_ROPE:
            raise ValueError(f"policy {self.name}: key_rope must be one of {list(KEY_ROPE)}, got {self.key_rope!r}")
        if self.key_rope == "pre" and (self.scorer is not None or self.sink_select != "first" or self.heavy
                                       or self.low is not None):
            raise ValueError(f"policy {self.name}: key_rope 'pre' is served for a first-S sink, a uniform middle and "
                             "eviction; a scored selection, a sink chosen from attention, heavy hitters and per-head "
                             "bits keep post-RoPE keys (their attention-based choices and evidence read them)")
        if self.scorer is not None:
            self._check_scored()
            return
        if self.store is not None or self.store_window or self.rest is not None or self.dense is not None \
                or self.dense_window:
            raise ValueError(f"policy {self.name}: store, store_window, rest, dense and dense_window belong to a scored "
                             "selection (set scorer)")
        if self.keep or self.seed or self.scorer_mode != "online" or self.layers != "uniform" or self.layer_keep \
                or self.beta != 20 or self.heads != "uniform" or self.alpha != ADA_ALPHA or self.sparse_share or self.block:
            raise ValueError(f"policy {self.name}: keep, seed, scorer_mode, blocks and a per-layer or per-head schedule "
                             "belong to a scored selection (set scorer)")
        if self.middle not in MIDDLE_SCHEMES:
            raise ValueError(f"policy {self.name}: middle {self.middle!r} is not one of {list(MIDDLE_SCHEMES)}")
        for label in ("sink", "window"):
            v = getattr(self, label)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"policy {self.name}: {label} must be a non-negative integer, got {v!r}")
        for label in ("group", "feature_group"):
            v = getattr(self, label)
            if not isinstance(v, int) or isinstance(v, bool) or v < 2 or v & (v - 1):
                raise ValueError(f"policy {self.name}: {label} must be a power of two >= 2, got {v!r}")
        if self.key_axis not in ("channel", "token"):
            raise ValueError(f"policy {self.name}: key_axis must be 'channel' or 'token', got {self.key_axis!r}")
        if self.sink_select not in SINK_SELECT:
            raise ValueError(f"policy {self.name}: sink_select must be one of {list(SINK_SELECT)}, got {self.sink_select!r}")
        if self.sink_select != "first" and (self.sink == 0 or not self.quantized):
            raise ValueError(f"policy {self.name}: sink_select {self.sink_select!r} needs a sink and a quantized middle")
        if self.middle == "drop" and self.window == 0:
            raise ValueError(f"policy {self.name}: a dropped middle needs a window of at least one token")
        if not isinstance(self.heavy, int) or isinstance(self.heavy, bool) or self.heavy < 0:
            raise ValueError(f"policy {self.name}: heavy must be a non-negative integer, got {self.heavy!r}")
        if self.heavy and (self.middle not in ("int2", "int4", "int8") or self.key_axis != "channel" or self.sink
                           or self.low is not None):
            raise ValueError(f"policy {self.name}: heavy hitters are built for a uniform integer middle with K per "
                             "channel and no sink")
        if self.heavy_rule not in HEAVY_RULES:
            raise ValueError(f"policy {self.name}: heavy_rule must be one of {list(HEAVY_RULES)}, got {self.heavy_rule!r}")
        if self.low is None:
            if self.alloc is not None or self.low_share:
                raise ValueError(f"policy {self.name}: alloc and low_share need a low scheme")
            return
        ints = ("int2", "int4", "int8")
        if self.middle not in ints or self.low not in ints or int(self.low[3:]) >= int(self.middle[3:]):
            raise ValueError(f"policy {self.name}: mixed precision needs integer middle and low schemes, low of fewer bits "
                             f"(got middle {self.middle!r}, low {self.low!r})")
        if self.key_axis != "channel" or self.sink_select != "first":
            raise ValueError(f"policy {self.name}: mixed precision is built for K per channel and a first-S sink")
        if not isinstance(self.low_share, float) or not 0.0 < self.low_share < 1.0:
            raise ValueError(f"policy {self.name}: low_share must be a float in (0, 1), got {self.low_share!r}")
        if self.alloc not in ALLOC:
            raise ValueError(f"policy {self.name}: alloc must be one of {list(ALLOC)}, got {self.alloc!r}")
        if self.alloc_from not in ALLOC_FROM:
            raise ValueError(f"policy {self.name}: alloc_from must be one of {list(ALLOC_FROM)}, got {self.alloc_from!r}")
        if self.alloc_from == "oracle" and self.alloc not in ("concentrated", "diffuse"):
            raise ValueError(f"policy {self.name}: an oracle allocation needs a rule that reads attention")

    def _check_codec(self) -> None:
        if self.middle != "codec":
            raise ValueError(f"policy {self.name}: codec (the quantizers of K and V) is the middle of middle 'codec', "
                             f"got middle {self.middle!r}")
        if self.codec is None:
            raise ValueError(f"policy {self.name}: middle 'codec' needs codec = {{\"k\": quantizer, \"v\": quantizer}}")
        object.__setattr__(self, "codec", codec_of.normalize(self.codec, f"policy {self.name}: codec"))
        parts = codec_of.calibrated_parts(self.codec)
        if self.tables is not None and set(self.tables) != set(parts):
            raise ValueError(f"policy {self.name}: tables are given for {sorted(self.tables)}, its calibrated parts are "
                             f"{list(parts)}")

    @property
    def calibrated(self) -> tuple[str, ...]:
        """The parts (``"k"``, ``"v"``) of a codec middle whose codebooks are calibrated per layer."""
        return codec_of.calibrated_parts(self.codec)

    def table_bytes(self, head_dim: int) -> int:
        """Float16 bytes of one layer's calibrated tables (K's and V's), stored once per layer."""
        return sum(codec_of.table_bytes(self.codec[part], head_dim) for part in self.calibrated)

    def _check_scored(self) -> None:
        if not isinstance(self.scorer, str) or not self.scorer:
            raise ValueError(f"policy {self.name}: scorer must be a scorer's name, got {self.scorer!r}")
        if self.middle != "drop" or self.sink or self.heavy or self.low is not None or self.sink_select != "first":
            raise ValueError(f"policy {self.name}: a scored selection keeps its top-scored tokens float32 and nothing "
                             "else (no sink, heavy hitters or per-head bits)")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or not 0 <= self.window < max(self.keep, 1):
            raise ValueError(f"policy {self.name}: a scored selection's window (the newest tokens it always keeps) must "
                             f"be an integer in [0, keep), got {self.window!r} with keep {self.keep!r}")
        if self.scorer_mode not in SCORER_MODES:
            raise ValueError(f"policy {self.name}: scorer_mode must be one of {list(SCORER_MODES)}, "
                             f"got {self.scorer_mode!r}")
        for label in ("keep", "seed"):
            v = getattr(self, label)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if label == "keep" else 0) or v >= 2 ** 24:
                raise ValueError(f"policy {self.name}: {label} must be an integer in [{1 if label == 'keep' else 0}, "
                                 f"2**24), got {v!r}")
        self._check_layers()
        self._check_heads()
        self._check_store()
        self._check_block()

    def _check_block(self) -> None:
        """Structured blocks (``block`` B): the prefill cut to its top ``keep / B`` blocks of B tokens."""
        b = self.block
        if b == 0:
            return
        if isinstance(b, bool) or not isinstance(b, int) or b < 2 or b & (b - 1):
            raise ValueError(f"policy {self.name}: block (tokens per kept block) must be a power of two >= 2, got {b!r}")
        if self.scorer_mode != "prefill" or self.layers != "uniform" or self.heads != "uniform" \
                or self.store is not None or self.rest is not None:
            raise ValueError(f"policy {self.name}: blocks are built for a prefill cut of one count at every layer and KV "
                             f"head, kept float32 (mode 'prefill', layers and heads 'uniform', no store or rest)")
        if self.keep % b:
            raise ValueError(f"policy {self.name}: a block selection keeps whole blocks: keep ({self.keep}) must be a "
                             f"multiple of block ({b})")

    def _check_store(self) -> None:
        if self.dense is None:
            if self.dense_window:
                raise ValueError(f"policy {self.name}: dense_window belongs to a stored dense class (set dense)")
        else:
            if self.heads != "selective" or self.dense not in STORE_SCHEMES[1:]:
                raise ValueError(f"policy {self.name}: dense (how a selective selection's dense pairs are stored) must be "
                                 f"one of {list(STORE_SCHEMES[1:])} on a selective selection (heads 'selective'), got "
                                 f"{self.dense!r} with heads {self.heads!r}")
            if not isinstance(self.dense_window, int) or isinstance(self.dense_window, bool) or self.dense_window < 0:
                raise ValueError(f"policy {self.name}: dense_window must be a non-negative integer, got "
                                 f"{self.dense_window!r}")
            self.dense_policy()  # validates group, feature_group and key_axis
        if self.rest is not None:
            if self.rest not in STORE_SCHEMES[1:]:
                raise ValueError(f"policy {self.name}: rest (how the tokens the selection does not keep are stored) must be "
                                 f"one of {list(STORE_SCHEMES[1:])}, got {self.rest!r}")
            if self.scorer_mode != "prefill" or self.layers != "uniform" or self.heads != "uniform" or self.window:
                raise ValueError(f"policy {self.name}: a quantized rest (MiKV) is built for a prefill-mode selection of one "
                                 "count at every layer and KV head, no window")
        if self.store is None:
            if self.store_window:
                raise ValueError(f"policy {self.name}: store_window belongs to a stored kept set (set store)")
            return
        if self.store not in STORE_SCHEMES:
            raise ValueError(f"policy {self.name}: store (the kept tokens' storage) must be one of "
                             f"{list(STORE_SCHEMES)}, got {self.store!r}")
        if not isinstance(self.store_window, int) or isinstance(self.store_window, bool) or self.store_window < 0:
            raise ValueError(f"policy {self.name}: store_window must be a non-negative integer, got {self.store_window!r}")
        if self.scorer_mode != "prefill" or self.layers != "uniform" or self.heads != "uniform":
            raise ValueError(f"policy {self.name}: a kept set stored quantized is cut once at the prefill, the same count "
                             f"at every layer and KV head (mode 'prefill', layers and heads 'uniform'), got mode "
                             f"{self.scorer_mode!r}, layers {self.layers!r}, heads {self.heads!r}")
        self.storage_policy()  # validates group, feature_group and key_axis

    def storage_policy(self) -> "Policy":
        """A stored kept set's storage (``store`` set): the uniform policy that stores the kept tokens of
        each (layer, KV head), in arrival order, as it would store a sequence of that length (its middle
        ``store``, the newest ``store_window`` float32, groups of ``group``)."""
        return Policy(self.name + ".store", self.store, 0, self.store_window, self.group, self.feature_group,
                      self.key_axis)

    def dense_policy(self) -> "Policy | None":
        """A selective selection's dense pairs' storage (``dense`` set; None: float32): the uniform policy
        that stores every token of each dense (layer, KV head) pair as a sequence (its middle ``dense``, the
        newest ``dense_window`` float32, groups of ``group``, no sink)."""
        if self.dense is None:
            return None
        return Policy(self.name + ".dense", self.dense, 0, self.dense_window, self.group, self.feature_group,
                      self.key_axis)

    def rest_policy(self) -> "Policy":
        """A quantized rest's storage (``rest`` set, MiKV): the uniform policy that stores the prefill tokens
        the selection does not keep, in arrival order, as a sequence of that length (no window: whole
        groups of ``group`` packed, the fewer than ``group`` left float32)."""
        return Policy(self.name + ".rest", self.rest, 0, 0, self.group, self.feature_group, self.key_axis)

    def _check_heads(self) -> None:
        if self.heads not in HEAD_SCHEDULES:
            raise ValueError(f"policy {self.name}: heads must be one of {list(HEAD_SCHEDULES)}, got {self.heads!r}")
        if self.heads == "selective":
            self._check_selective()
            return
        if self.sparse_share or self.alloc is not None or self.alloc_from != "prefill":
            raise ValueError(f"policy {self.name}: sparse_share, alloc and alloc_from of a scored selection belong to the "
                             "selective rule (heads 'selective')")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, float) or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"policy {self.name}: alpha (the per-head safeguard's share of keep) must be a number in "
                             f"[0, 1], got {self.alpha!r}")
        if self.heads == "uniform":
            if self.alpha != ADA_ALPHA:
                raise ValueError(f"policy {self.name}: alpha belongs to a per-head schedule (heads 'adaptive')")
            return
        if self.scorer_mode != "prefill":
            raise ValueError(f"policy {self.name}: adaptive per-head budgets (Ada-KV, kvpress's AdaKVPress) cut the "
                             f"prefill once; scorer_mode must be 'prefill', got {self.scorer_mode!r}")

    def _check_selective(self) -> None:
        """The seed's selective rule (:data:`SELECT_FIELDS`): a prefill cut of one ``keep`` for the sparse pairs."""
        if self.scorer_mode != "prefill" or self.layers != "uniform" or self.store is not None or self.rest is not None:
            raise ValueError(f"policy {self.name}: the selective rule cuts the prefill once, the sparse pairs to keep "
                             f"tokens of float32 (mode 'prefill', layers 'uniform', no store or rest), got mode "
                             f"{self.scorer_mode!r}, layers {self.layers!r}, store {self.store!r}, rest {self.rest!r}")
        if self.alpha != ADA_ALPHA:
            raise ValueError(f"policy {self.name}: alpha belongs to Ada-KV (heads 'adaptive'), not the selective rule")
        if isinstance(self.sparse_share, bool) or not isinstance(self.sparse_share, float) \
                or not 0.0 <= self.sparse_share <= 1.0:
            raise ValueError(f"policy {self.name}: sparse_share (the share of (layer, KV head) pairs kept sparse) must be "
                             f"a float in [0, 1], got {self.sparse_share!r}")
        if self.alloc not in ALLOC:
            raise ValueError(f"policy {self.name}: the selective rule's alloc (which pairs are sparse) must be one of "
                             f"{list(ALLOC)}, got {self.alloc!r}")
        if self.alloc_from not in ALLOC_FROM:
            raise ValueError(f"policy {self.name}: alloc_from must be one of {list(ALLOC_FROM)}, got {self.alloc_from!r}")
        if self.alloc_from == "oracle" and self.alloc not in ("concentrated", "diffuse"):
            raise ValueError(f"policy {self.name}: an oracle class needs a rule that reads attention (concentrated or "
                             f"diffuse), got {self.alloc!r}")

    def _check_layers(self) -> None:
        if self.layers not in LAYER_SCHEDULES:
            raise ValueError(f"policy {self.name}: layers must be one of {list(LAYER_SCHEDULES)}, got {self.layers!r}")
        if isinstance(self.beta, bool) or not isinstance(self.beta, int) or self.beta < 1:
            raise ValueError(f"policy {self.name}: the pyramid's beta must be an integer >= 1, got {self.beta!r}")
        if self.layers == "uniform":
            if self.layer_keep or self.beta != 20:
                raise ValueError(f"policy {self.name}: layer_keep and beta belong to a per-layer schedule "
                                 "(layers 'pyramid')")
            return
        if self.scorer_mode != "prefill":
            raise ValueError(f"policy {self.name}: a pyramid of per-layer budgets cuts the prefill once (PyramidKV, "
                             f"kvpress); scorer_mode must be 'prefill', got {self.scorer_mode!r}")
        lk = self.layer_keep
        if (not isinstance(lk, tuple) or not lk
                or not all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x < 2 ** 24 for x in lk)):
            raise ValueError(f"policy {self.name}: a pyramid needs its kept count per layer (layer_keep, a tuple of "
                             f"positive integers; derived from keep, the prefill and the model's layers), got {lk!r}")
        if any(a < b for a, b in zip(lk, lk[1:])):
            raise ValueError(f"policy {self.name}: a pyramid keeps fewer tokens with depth, got layer_keep {list(lk)}")
        if self.window >= min(lk):
            raise ValueError(f"policy {self.name}: the window ({self.window}) must be below every layer's kept count "
                             f"(the smallest is {min(lk)})")

    # -- what the middle is ------------------------------------------------------------------
    @property
    def scored(self) -> bool:
        """Tokens kept by a scorer's top-``keep`` per (layer, KV head) (:mod:`testbed.policies.scorers`)."""
        return self.scorer is not None

    @property
    def adaptive(self) -> bool:
        """A prefill scored selection whose layer's kept count is shared unevenly among its KV heads
        (``heads="adaptive"``, Ada-KV)."""
        return self.heads == "adaptive"

    @property
    def selective(self) -> bool:
        """The seed's selective rule: some (layer, KV head) pairs keep the scorer's top ``keep``, the rest
        every token (``heads="selective"``)."""
        return self.heads == "selective"

    def sparse_count(self, pairs: int) -> int:
        """How many of ``pairs`` (layer, KV head) pairs a selective selection keeps sparse (Python's round,
        half to even, as :meth:`low_count`)."""
        return round(self.sparse_share * pairs) if self.selective else 0

    @property
    def per_layer(self) -> bool:
        """A scored selection whose kept count varies over layers (``layers="pyramid"``)."""
        return bool(self.layer_keep)

    def always_kept(self, kept_first=(0, 0)) -> tuple[int, int]:
        """``(first, last)``: the prefill's first and last tokens each KV head of an adaptive selection
        ranks above every score: its scorer's own (``kept_first``, the scorer's
        :attr:`~testbed.policies.scorers.Scorer.KEPT_FIRST`, built-in or a user's loaded class) and the
        policy's ``window``, the more of the two at the end. Raises ``ValueError`` when a layer's keep
        cannot hold them."""
        first, last = (int(x) for x in kept_first)
        last = max(last, self.window)
        if self.adaptive and min(self.layer_keep or (self.keep,)) < first + last:
            raise ValueError(f"policy {self.name}: an adaptive selection ranks the {first + last} tokens each head "
                             f"always keeps (window {self.window}, and {self.scorer}'s own {kept_first[0]} first / "
                             f"{kept_first[1]} last) above every score; keep must hold them, got "
                             f"{list(self.layer_keep) or self.keep}")
        return first, last

    def keep_of(self, layer: int | None) -> int:
        """The kept count of ``layer`` (every layer's ``keep`` under a uniform schedule)."""
        if not self.layer_keep:
            return self.keep
        if layer is None or not 0 <= layer < len(self.layer_keep):
            raise ValueError(f"policy {self.name}: a per-layer schedule over {len(self.layer_keep)} layers has no "
                             f"layer {layer!r}")
        return self.layer_keep[layer]

    def scored_held(self, n: int, prefill: int, layer: int | None = None) -> int:
        """Tokens a scored selection holds per KV head of ``layer`` after ``n`` tokens (:func:`scored_held`)."""
        return scored_held(self.keep_of(layer), self.scorer_mode, n, prefill)

    @property
    def quantized(self) -> bool:
        return self.middle not in ("float32", "drop")

    @property
    def evicts(self) -> bool:
        return self.middle == "drop"

    @property
    def mixed(self) -> bool:
        """Per-head precision: some (layer, KV head) pairs store the middle with ``low``'s bits."""
        return self.low is not None

    @property
    def observes(self) -> bool:
        """The prefill's attention decides something (the sink, the allocation or the heavy hitters)."""
        return self.sink_select == "mass" or self.heavy > 0 or ((self.mixed or self.selective)
                                                                 and self.alloc_from == "prefill"
                                                                 and self.alloc in ("concentrated", "diffuse"))

    @property
    def heavy_oracle(self) -> bool:
        """Heavy hitters ranked by the whole segment's attention (given in advance: not online)."""
        return self.heavy > 0 and self.heavy_rule == "oracle"

    @property
    def oracle(self) -> bool:
        """The policy decides from the whole segment's float32 attention, measured by a pass over the
        segment in advance: a mixed oracle allocation or a heavy-hitter oracle."""
        return ((self.mixed or self.selective) and self.alloc_from == "oracle") or self.heavy_oracle

    def heavy_held(self, n: int) -> int:
        """Heavy hitters held per (sequence, KV head) after ``n`` tokens: C, or every packed token
        while fewer than C are packed."""
        return min(self.heavy, self.packed_tokens(n))

    def low_count(self, pairs: int) -> int:
        """How many of ``pairs`` (layer, KV head) pairs get the low bits (Python's round, half to even)."""
        return round(self.low_share * pairs) if self.mixed else 0

    def quantizers(self, layer: int | None = None) -> tuple[Quantizer, Quantizer] | None:
        """(key quantizer, value quantizer) of the middle (of layer ``layer``: a calibrated codebook is
        its layer's), or None when it is not quantized."""
        if not self.quantized:
            return None
        if self.middle in _MX_ELEMENT:
            q = MX(_MX_ELEMENT[self.middle], 32)
            return q, q
        if self.middle == "codec":
            return codec_of.quantizers(self.codec, self.tables, layer)
        return self._int_quantizers(int(self.middle[3:]))

    def low_quantizers(self) -> tuple[Quantizer, Quantizer] | None:
        """(key quantizer, value quantizer) of a mixed policy's low-precision heads, else None."""
        return self._int_quantizers(int(self.low[3:])) if self.mixed else None

    def _int_quantizers(self, bits: int) -> tuple[Quantizer, Quantizer]:
        kg = self.group if self.key_axis == "channel" else self.feature_group
        return IntGrouped(bits, kg, self.key_axis), IntGrouped(bits, self.feature_group, "token")

    def config(self) -> dict:
        """The fields as a dict; a uniform policy's without the mixed ones (``low``, ``low_share``,
        ``alloc``, ``alloc_from``), so its rows read as they did before mixed policies existed."""
        out = asdict(self)
        if not self.mixed:
            for key in MIXED_FIELDS:
                if not (self.selective and key in SELECT_FIELDS):
                    del out[key]
        if not self.selective:  # rows read as they did before the selective rule existed
            del out["sparse_share"]
        if not self.heavy:
            for key in HEAVY_FIELDS:
                del out[key]
        if not self.scored:
            for key in SCORER_FIELDS:
                del out[key]
        if self.key_rope == "post":  # the default: rows read as they did before pre-RoPE keys existed
            del out["key_rope"]
        if not self.per_layer:  # the uniform schedule: rows read as they did before per-layer budgets existed
            for key in LAYER_FIELDS:
                del out[key]
        else:
            out["layer_keep"] = list(self.layer_keep)
        if self.selective:  # its class fields beside heads; alpha is Ada-KV's
            del out["alpha"]
        elif not self.adaptive:  # the uniform per-head count: rows read as they did before per-head budgets existed
            for key in HEAD_FIELDS:
                del out[key]
        if self.store is None:  # a kept set of float32 tokens: rows read as they did before stored kept sets existed
            for key in STORE_FIELDS:
                del out[key]
        if self.rest is None:  # the rest dropped: rows read as they did before a quantized rest existed
            del out["rest"]
        if self.dense is None:  # float32 dense pairs: rows read as they did before stored dense pairs existed
            for key in DENSE_FIELDS:
                del out[key]
        if self.codec is None:  # a built-in middle: rows read as they did before codec middles existed
            del out["codec"]
        if not self.block:  # per-token indices: rows read as they did before blocks existed
            del out["block"]
        del out["tables"]  # a calibrated codec's tables: arrays of the row, not fields
        return out

    def with_(self, **changes) -> "Policy":
        return replace(self, **changes)

    # -- the schedule ------------------------------------------------------------------------
    def packed_tokens(self, n: int) -> int:
        """Tokens of the middle held quantized after ``n`` tokens have been appended."""
        if not self.quantized:
            return 0
        aged = n - self.sink - self.window
        return self.group * (aged // self.group) if aged > 0 else 0

    def kept_spans(self, n: int) -> dict[str, tuple[int, int]]:
        """Token spans ``[start, stop)`` of each stored region after ``n`` tokens."""
        s = min(self.sink, n)
        if self.evicts:
            return {"sink": (0, s), "packed": (s, s), "float": (max(s, n - self.window), n)}
        p = self.packed_tokens(n)
        return {"sink": (0, s), "packed": (s, s + p), "float": (s + p, n)}

    def next_change(self, n: int, masked: bool = False) -> int:
        """How many tokens, appended to a cache holding ``n``, can go through one forward call exactly.

        With ``k`` tokens appended in one call, each attends the state after ``n`` tokens plus the
        float32 new tokens before it; one token per call attends the state after ``n + i``. They are
        equal while no flush or eviction happens inside the call: a quantized middle changes only
        when a whole group ages out (so a call may run up to and including the token whose append
        flushes), an evicting policy on every token once its window is full -- unless ``masked``:
        the cache then hands attention a per-token mask that hides what each token would already
        have evicted, which is exact for any chunk -- and a float32 one never."""
        if self.middle == "float32":
            return math.inf
        if self.store is not None:  # a stored kept set flushes at held counts the prefill's length sets: one token
            return math.inf if self.store == "float32" else 1  # per forward (a float32 storage never changes)
        if self.dense is not None:  # the dense pairs' storage holds every token: it flushes as a uniform cache would
            return self.dense_policy().next_change(n)
        if self.scored:  # online: the append that makes the cache exceed keep evicts, after its own attention
            return math.inf if self.scorer_mode == "prefill" else max(1, self.keep + 1 - n)
        if self.evicts:  # the append that makes the cache exceed S + W evicts (without a mask)
            return math.inf if masked else max(1, self.sink + self.window + 1 - n)
        # smallest m > n with m - S - R a positive multiple of G: the append that flushes
        base = self.sink + self.window
        if n < base + self.group:
            m = base + self.group
        else:
            m = base + self.group * ((n - base) // self.group + 1)
        return m - n

    # -- bytes -------------------------------------------------------------------------------
    def packed_bytes_per_token(self, heads: int, head_dim: int) -> float:
        """Bytes of K + V per packed token of one layer (codes, scales, zero-points); of a mixed
        policy, with every head at ``middle``'s bits."""
        if not self.quantized:
            return 0.0
        if self.middle == "codec":  # one payload per group of G tokens, K's and V's
            return sum(codec_of.group_bytes(self.codec[part], heads, self.group, head_dim) for part in ("k", "v")) \
                / self.group
        return scheme_bytes_per_token(self.middle, heads, head_dim, self.group, self.feature_group, self.key_axis)

    def layer_bytes(self, n: int, heads: int, head_dim: int, prefill: int | None = None,
                    layer: int | None = None) -> int:
        """Exact bytes of one layer's cache (one sequence) after ``n`` tokens (not for a mixed
        policy, whose layers differ: :meth:`cache_bytes`); a scored selection's, after a prefill of
        ``prefill`` tokens: every held token's float32 K and V, int32 index and float32 score (of
        layer ``layer`` under a per-layer schedule)."""
        if self.selective:
            raise ValueError(f"policy {self.name}: a selective selection's layer bytes depend on its classes; use "
                             "cache_bytes")
        if self.scored:
            if prefill is None:
                raise ValueError(f"policy {self.name}: a scored selection's bytes depend on the prefill length")
            held = self.scored_held(n, prefill, layer)
            rest = 0  # a quantized rest: the prefill tokens not kept, stored as a sequence of that length (no header)
            if self.rest is not None:
                rest = self.rest_policy().layer_bytes(max(0, prefill - self.keep_of(layer)), heads, head_dim) - HEADER_BYTES
            if self.store is not None:  # the storage's bytes for the held tokens (one header), index and score
                return self.storage_policy().layer_bytes(held, heads, head_dim) + heads * held * SCORED_TOKEN_EXTRA + rest
            if self.block:  # an int32 index and a float32 score per block of B held tokens
                return HEADER_BYTES + heads * (held * 2 * head_dim * 4 + -(-held // self.block) * SCORED_TOKEN_EXTRA)
            return HEADER_BYTES + heads * held * (2 * head_dim * 4 + SCORED_TOKEN_EXTRA) + rest
        if self.mixed:
            raise ValueError(f"policy {self.name}: a mixed policy's layer bytes depend on its allocation; use cache_bytes")
        spans = self.kept_spans(n)
        floats = sum(b - a for key, (a, b) in spans.items() if key != "packed")
        p = spans["packed"][1] - spans["packed"][0]
        # heavy hitters: per KV head, each held one's float32 K and V, index and score, and a float32
        # score for every float32 window token (a candidate until it enters the middle)
        heavy = (heads * (self.heavy_held(n) * (2 * head_dim * 4 + HEAVY_TOKEN_EXTRA) + floats * 4)
                 if self.heavy else 0)
        return int(HEADER_BYTES + floats * 2 * heads * head_dim * 4 + round(p * self.packed_bytes_per_token(heads, head_dim))
                   + heavy + (self.table_bytes(head_dim) if self.quantized else 0))

    def cache_bytes(self, n: int, layers: int, heads: int, head_dim: int, prefill: int | None = None) -> int:
        """Exact bytes of the whole cache (one sequence, ``layers`` layers) after ``n`` tokens; a
        mixed policy's: ``low_count`` head middles at ``low``'s bits, the rest at ``middle``'s, one
        byte of bits per (layer, KV head) pair."""
        if self.selective:
            if prefill is None:
                raise ValueError(f"policy {self.name}: a scored selection's bytes depend on the prefill length")
            return selective_bytes(self.sparse_count(layers * heads), self.keep, n, prefill, layers, heads, head_dim,
                                   self.dense_policy())
        if self.per_layer:
            if layers != len(self.layer_keep):
                raise ValueError(f"policy {self.name}: its per-layer schedule has {len(self.layer_keep)} layers, not "
                                 f"{layers}")
            return sum(self.layer_bytes(n, heads, head_dim, prefill, i) for i in range(layers))
        if not self.mixed:
            return layers * self.layer_bytes(n, heads, head_dim, prefill)
        spans = self.kept_spans(n)
        floats = sum(b - a for key, (a, b) in spans.items() if key != "packed")
        p = spans["packed"][1] - spans["packed"][0]
        pairs = layers * heads
        lo = self.low_count(pairs)
        per = (lo * scheme_bytes_per_token(self.low, 1, head_dim, self.group, self.feature_group)
               + (pairs - lo) * scheme_bytes_per_token(self.middle, 1, head_dim, self.group, self.feature_group))
        return int(layers * (HEADER_BYTES + floats * 2 * heads * head_dim * 4) + round(p * per) + pairs)
