"""The named policies the studies run (``PRESETS``, :func:`preset`), and what sizes and pairs them.

A preset is a :class:`~testbed.policies.policy.Policy` built at a study's float32 window R, group G,
eviction window W and sink S (:func:`preset`). The heavy-hitter presets (:data:`HEAVY_PRESETS`) hold
as many float32 heavy hitters as int2's bytes pay for (:func:`heavy_count`); the equal-bytes budgets
(:data:`EQUAL_BYTES_VERSUS`) name, for a budget's arms, the arm of the same bytes a study compares them
with. The definition of a policy (fields, validation, schedule, closed-form bytes) is
:mod:`testbed.policies.policy`; this module is its catalogue.
"""

from __future__ import annotations

from .policy import HEAVY_TOKEN_EXTRA, Policy, scheme_bytes_per_token

__all__ = ["PRESETS", "preset", "HEAVY_PRESETS", "heavy_count", "EQUAL_BYTES_VERSUS", "equal_bytes_budget",
           "equal_bytes_versus"]

HEAVY_PRESETS = ("int2_hh", "int2_hh_first", "int2_hh_oracle")
# equal-bytes budgets: a budget's arms are the presets named so or name_*; each is compared with the
# first of its candidates a study runs, an arm of the same bytes (the uniform one; mix24_random, the
# content-blind allocation, where no uniform int3 is run)
EQUAL_BYTES_VERSUS = {"mix28": ("int4",), "mix24": ("int3", "mix24_random"), "int2_hh": ("int2",)}


def equal_bytes_budget(arm: str) -> str | None:
    """The budget of :data:`EQUAL_BYTES_VERSUS` an arm belongs to (its name or name_*), else None."""
    return next((b for b in EQUAL_BYTES_VERSUS if arm == b or arm.startswith(b + "_")), None)


def equal_bytes_versus(budget: str, arms) -> str | None:
    """The arm of ``budget``'s bytes that the study's ``arms`` hold, first of its candidates, else None."""
    return next((a for a in EQUAL_BYTES_VERSUS[budget] if a in arms), None)


def heavy_count(window: int, group: int, head_dim: int = 64, key_axis: str = "channel") -> int:
    """The heavy-hitter count C that a heavy-hitter int2 policy with window ``window - group`` pays for
    out of uniform int2's bytes at window ``window`` (same G): moving G window tokens into the int2
    middle frees G (8 D - int2 bytes per token) per KV head; each heavy hitter costs its float32 K
    and V, its int32 index and float32 score (8 D + 8), and every float32 window token's score
    (4 B, at most ``window - 1`` of them) is paid from the same. Per KV head, independent of the
    head count; never more bytes than uniform int2 once the middle holds C tokens."""
    freed = group * (8 * head_dim - scheme_bytes_per_token("int2", 1, head_dim, group, 32, key_axis))
    return max(0, int((freed - 4 * (window - 1)) // (8 * head_dim + HEAVY_TOKEN_EXTRA)))


def _presets(window: int = 128, group: int = 32, evict_window: int = 256, sink: int = 4) -> dict[str, Policy]:
    """The named policies, for a given float32 window R, group G, eviction window W and sink S."""
    out = [
        Policy("float32", "float32", group=group, description="every token float32 through the policy's own cache (a check "
               "against the DynamicCache reference: KL should be ~0)"),
        Policy("int4", "int4", 0, window, group, description=f"KIVI-style: K per channel, V per token, 4 bits, "
               f"window R={window}, groups G={group}"),
        Policy("int2", "int2", 0, window, group, description=f"KIVI-style 2 bits, R={window}, G={group}"),
        Policy("int3", "int3", 0, window, group, description=f"KIVI-style 3 bits (eight codes in three bytes), "
               f"R={window}, G={group}: the uniform arm at the bytes of the mix24_* policies (half int2, half int4)"),
        Policy("int4_sink4", "int4", sink, window, group, description=f"int4 with the first {sink} tokens float32"),
        Policy("int2_sink4", "int2", sink, window, group, description=f"int2 with the first {sink} tokens float32"),
        Policy("int4_sinkmass4", "int4", sink, window, group, sink_select="mass",
               description=f"int4 with {sink} float32 sink tokens chosen online at the prefill (per layer and KV head: "
               "the most attended by the prefill's queries); the bytes of int4_sink4"),
        Policy("int2_sinkmass4", "int2", sink, window, group, sink_select="mass",
               description=f"int2 with {sink} float32 sink tokens chosen online at the prefill; the bytes of int2_sink4"),
        Policy("int2_ktoken", "int2", 0, window, group, key_axis="token",
               description="control: 2-bit K per token (the axis KIVI says fails), V per token"),
        Policy("mxfp8", "mxfp8", 0, window, group, description=f"MXFP8 E4M3 (block 32) K and V, R={window}"),
        Policy("mxfp4", "mxfp4", 0, window, group, description=f"MXFP4 E2M1 (block 32) K and V, R={window}"),
        Policy("streaming", "drop", sink, evict_window, group,
               description=f"StreamingLLM-style eviction: sink {sink} + newest {evict_window}, middle dropped"),
        Policy("window_only", "drop", 0, evict_window, group,
               description=f"the newest {evict_window} only: StreamingLLM without its sink (drop-sink, live)"),
    ]
    # per-head precision at the bytes of a 3-bit KIVI layout (half the pairs int2, half int4) and of
    # int4 (two thirds int2, one third int8); R and G as the uniform policies
    budgets = {"mix24": ("int4", "int2", 0.5, "the bytes of a 3-bit layout: half of the (layer, KV head) pairs int2, "
                         "half int4"),
               "mix28": ("int8", "int2", 2 / 3, "the bytes of int4: two thirds of the (layer, KV head) pairs int2, "
                         "one third int8")}
    rules = {"concentrated": ("concentrated", "prefill", "int2 to the pairs whose prefill attention is most concentrated "
                              "(lowest effective support), decided online"),
             "diffuse": ("diffuse", "prefill", "int2 to the most diffuse pairs at the prefill (highest effective "
                         "support), decided online"),
             "late": ("late", "prefill", "int2 to the last layers (content-blind depth prior)"),
             "random": ("random", "prefill", "int2 to a fixed pseudo-random set of pairs (content-blind control)"),
             "oracle_concentrated": ("concentrated", "oracle", "ORACLE, impossible online: the concentrated rule from "
                                     "the whole segment's float32 attention"),
             "oracle_diffuse": ("diffuse", "oracle", "ORACLE, impossible online: the diffuse rule from the whole "
                                "segment's float32 attention")}
    # heavy hitters at int2's bytes: the window gives G float32 tokens to the middle, which pays for C
    # float32 heavy hitters per (layer, KV head) (heavy_count: sized for head_dim 64, SmolLM2's)
    hw = max(1, window - group)
    c = heavy_count(window, group)
    out.append(Policy("int2_hh", "int2", 0, hw, group, heavy=c,
                      description=f"int2 (KIVI-style) with the {c} heavy hitters per (layer, KV head) kept float32: the "
                      "packed tokens with the largest accumulated attention (H2O: the sum of the attention each key "
                      "received over the KV head's query heads, from the prefill and every decode step), chosen when "
                      f"a group enters the middle; window R={hw} (R - G) so the bytes match int2's at R={window}, "
                      f"G={group}"))
    out.append(Policy("int2_hh_first", "int2", 0, hw, group, heavy=c, heavy_rule="first",
                      description=f"the content-blind control of int2_hh at its bytes: the same storage, but the {c} "
                      "held tokens are the first packed ones (a float32 sink of C tokens), whatever their attention"))
    out.append(Policy("int2_hh_oracle", "int2", 0, hw, group, heavy=c, heavy_rule="oracle",
                      description=f"ORACLE, impossible online: int2_hh's storage and bytes, but the {c} held tokens are "
                      "chosen by the attention each received over the whole segment (a float32 pass over the prefill "
                      "and every step to come, in advance): an upper bound for int2_hh's online rule, not a policy"))
    for b, (high, low, share, what) in budgets.items():
        for r, (alloc, source, how) in rules.items():
            out.append(Policy(f"{b}_{r}", high, 0, window, group, low=low, low_share=share, alloc=alloc,
                              alloc_from=source, description=f"{what}; {how}; R={window}, G={group}"))
    return {p.name: p for p in out}


PRESETS = tuple(_presets())


def preset(name: str, *, window: int = 128, group: int = 32, evict_window: int = 256, sink: int = 4) -> Policy:
    """A named policy (``PRESETS``) at the given window, group, eviction window and sink size."""
    table = _presets(window, group, evict_window, sink)
    if name not in table:
        raise ValueError(f"unknown policy {name!r}; presets: {', '.join(PRESETS)}")
    if name in HEAVY_PRESETS and (window <= group or heavy_count(window, group) < 1):
        raise ValueError(f"{name} pays for its heavy hitters with G float32 window tokens at int2's bytes: it needs "
                         f"a window R larger than the group G and room for at least one heavy hitter (R={window}, "
                         f"G={group}: {heavy_count(window, group) if window > group else 0} fit)")
    return table[name]
