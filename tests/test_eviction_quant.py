"""Eviction with quantization at equal bytes (issue 45, step 4): a prefill-mode scored selection whose
kept tokens are stored by a quantized storage (selection a scorer, ``storage.middle`` int4 etc.).

- the policy: declared by its fields (storage ``middle`` on a scored selection), ``store`` and
  ``store_window`` in a row's config only for such an arm; refused online, with a pyramid or adaptive
  heads; a budget ``{"as": preset}`` is that preset's bytes per token at the segment's end, and the
  kept count derived from it lands within the tolerance below it;
- inside a tiny random Llama: stored float32 is the plain scored arm, log-prob for log-prob; stored
  int4 is, token for token, a reference built here from the plain arm's kept set and the existing
  int4 PolicyLayer fed that shorter sequence; the bytes are the closed form's at every step;
- end to end on SmolLM2 (slow): the arms run and pass the audit; a forged kept set, forged codes and
  forged bytes each fail it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers.cache_utils import Cache, DynamicLayer

from testbed.policies.compose import compose, declared, decompose
from testbed.policies.policy import Policy
from testbed.policies.presets import preset
from tests import _arrays
from tests._helpers import audited_rows, rows_by_arm, tiny_live_run

REPO = Path(__file__).resolve().parent.parent
KW = dict(window=16, group=16, evict_window=16)
SMOL = dict(layers=30, kv_heads=3, head_dim=64)


def _llama(layers=4, heads=4, kv=2, d=16, seed=1):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=heads * d, intermediate_size=96, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=d, num_hidden_layers=layers, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _scored(scorer="snapkv", keep=140, **kw):
    return Policy("s", "drop", scorer=scorer, scorer_mode="prefill", keep=keep, group=16, **kw)


def _run(model, cache, ids, prefill):
    """Log-probs of the prefill's last token and every later one, one token per forward."""
    from testbed.policies.hook import policy_attention

    out = []
    with torch.no_grad(), policy_attention(model):
        out.append(model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits[:, -1:])
        for i in range(prefill, ids.shape[1]):
            out.append(model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits)
    return torch.log_softmax(torch.cat(out, 1), -1)


class _Reference(DynamicLayer):
    """The test's own statement of a kept set stored quantized: the prefill attends itself in float32,
    then the tokens ``kept [B, H, keep]`` (in arrival order) are handed to the existing uniform int4
    storage as a fresh sequence, and every later token to it too (positions continue from the prefill)."""

    def __init__(self, kept: torch.Tensor, storage: Policy):
        super().__init__()
        from testbed.policies.layers import PolicyLayer

        self.kept, self.store, self.seen = kept, PolicyLayer(storage), 0

    def lazy_initialization(self, key_states, value_states):
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.seen == 0:
            self.seen = key_states.shape[-2]
            at = self.kept[..., None].expand(-1, -1, -1, key_states.shape[-1])
            self.store.update(torch.gather(key_states, 2, at), torch.gather(value_states, 2, at))
            return key_states, value_states
        self.seen += key_states.shape[-2]
        return self.store.update(key_states, value_states)

    def get_seq_length(self):
        return self.seen

    def get_mask_sizes(self, query_length):
        return self.store.held_tokens() + query_length, 0


class _MiKVReference(_Reference):
    """MiKV stated here: after the float32 prefill, the tokens not in ``kept`` (in arrival order) go to
    the existing uniform storage (no window) as a fresh sequence, the kept ones stay float32, and every
    later token is kept float32; attention reads the rest, the kept tokens, the new ones."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, n, d = key_states.shape
        if self.seen == 0:
            self.seen = n
            at = self.kept[..., None].expand(-1, -1, -1, d)
            self.k, self.v = torch.gather(key_states, 2, at), torch.gather(value_states, 2, at)
            rest = torch.ones(b, h, n, dtype=torch.bool)
            rest.scatter_(-1, self.kept, False)
            m = n - self.kept.shape[-1]
            self.store.update(key_states[rest].view(b, h, m, d), value_states[rest].view(b, h, m, d))
            return key_states, value_states
        self.seen += n
        rk, rv = self.store.update(key_states[..., :0, :], value_states[..., :0, :])  # the rest, decoded
        self.k, self.v = torch.cat([self.k, key_states], -2), torch.cat([self.v, value_states], -2)
        return torch.cat([rk, self.k], -2), torch.cat([rv, self.v], -2)

    def get_mask_sizes(self, query_length):
        return self.store.held_tokens() + (self.k.shape[-2] if self.seen else 0) + query_length, 0


# -- the policy ------------------------------------------------------------------------------------


def test_declared_store_fields_only_for_stored_arms():
    budget = dict(prefill=1792, steps=256, **SMOL)
    e = {"name": "snapkv_int4", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 600},
         "storage": {"middle": "int4"}}
    pol = declared(e, **KW, budget=budget)
    assert (pol.store, pol.store_window, pol.group, pol.middle) == ("int4", 16, 16, "drop")
    assert pol.config()["store"] == "int4" and pol.config()["store_window"] == 16
    assert compose(pol.name, *decompose(pol), pol.description) == pol
    plain = declared({"name": "snapkv_pre", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 600}}, **KW)
    assert plain.store is None and not {"store", "store_window"} & set(plain.config())
    for name in ("int4", "int2_hh", "streaming", "mix24_random"):  # presets' rows read as before
        assert not {"store", "store_window", "rest"} & set(preset(name).config())


@pytest.mark.parametrize("sel, sto, match", [
    ({"kind": "snapkv", "mode": "online", "keep": 100}, {"middle": "int4"}, "prefill"),
    ({"kind": "knorm", "keep": 100}, {"middle": "int4"}, "prefill"),
    ({"kind": "snapkv", "mode": "prefill", "keep": 100, "heads": "adaptive"}, {"middle": "int4"}, "uniform"),
    ({"kind": "knorm", "mode": "prefill", "keep": 100}, {"middle": "float32", "window": 8}, "no window"),
    ({"kind": "knorm", "mode": "prefill", "keep": 100}, {"middle": "int4", "key_rope": "pre"}, "post-RoPE"),
])
def test_bad_stored_kept_sets_are_refused(sel, sto, match):
    with pytest.raises(ValueError, match=match):
        declared({"name": "x", "selection": sel, "storage": sto}, **KW)
    with pytest.raises(ValueError, match="belong to a scored selection"):
        Policy("x", "int4", window=16, store="int4")


@pytest.mark.parametrize("middle, versus", [("int4", "int2"), ("int4", "int3"), ("int8", "int4"), ("int2", "int2"),
                                            ("mxfp4", "int3")])
def test_a_budget_as_a_preset_lands_within_one_percent_below(middle, versus):
    P, T = 1792, 256
    budget = dict(prefill=P, steps=T, **SMOL)
    e = {"name": "x", "selection": {"kind": "snapkv", "mode": "prefill"}, "storage": {"middle": middle},
         "budget": {"as": versus}}
    pol = declared(e, window=128, group=32, evict_window=256, budget=budget)
    target = preset(versus).cache_bytes(P + T, 30, 3, 64)
    got = pol.cache_bytes(P + T, 30, 3, 64, prefill=P)
    assert got <= target and (target - got) / target < 0.01
    # the largest count that fits: one more token per (layer, KV head) does not
    assert pol.with_(keep=pol.keep + 1).cache_bytes(P + T, 30, 3, 64, prefill=P) > target
    # the bytes: the storage's for a sequence of the held tokens, and 8 B (index, score) per held token
    held = pol.keep + T
    store = Policy("store", middle, 0, 128, 32)  # the uniform storage at the protocol's R and G
    assert got == 30 * (store.layer_bytes(held, 3, 64) + 3 * held * 8)


def test_a_budget_as_refuses_what_it_cannot_price():
    budget = dict(prefill=1792, steps=256, **SMOL)
    for name in ("snapkv_pre_half", "stream", "nonsense", "int2_hh_oracle"):
        e = {"name": "x", "selection": {"kind": "snapkv", "mode": "prefill"}, "storage": {"middle": "int4"},
             "budget": {"as": name}}
        with pytest.raises(ValueError, match="as"):
            declared(e, window=128, group=32, evict_window=256, budget=budget)


# -- inside a tiny random Llama ----------------------------------------------------------------------


@pytest.mark.parametrize("scorer", ["snapkv", "knorm", "expected_attention"])
def test_float32_storage_is_the_plain_scored_arm(scorer):
    from testbed.policies.cache import PolicyCache

    model = _llama()
    P, T = 320, 24
    ids = torch.randint(0, 256, (2, P + T), generator=torch.Generator().manual_seed(2))
    plain, stored = _scored(scorer), _scored(scorer, store="float32", store_window=16)
    ca, cb = PolicyCache.for_model(plain, model.config), PolicyCache.for_model(stored, model.config)
    a, b = _run(model, ca, ids, P), _run(model, cb, ids, P)
    assert torch.equal(a, b)
    assert ca.stored_bytes() == cb.stored_bytes() == stored.cache_bytes(P + T, 4, 2, 16, prefill=P)
    for x, y in zip(ca.layers, cb.layers):
        assert torch.equal(x.kept_index, y.kept_index)


@pytest.mark.parametrize("scorer, middle", [("snapkv", "int4"), ("knorm", "int3"), ("random", "mxfp4")])
def test_quantized_storage_is_the_kept_set_fed_to_the_storage(scorer, middle):
    from testbed.policies.cache import PolicyCache

    model = _llama()
    P, T = 320, 40  # the storage flushes 2 groups of 16 during the decode (held 140 .. 180, R 16)
    ids = torch.randint(0, 256, (2, P + T), generator=torch.Generator().manual_seed(3))
    plain, stored = _scored(scorer), _scored(scorer, store=middle, store_window=16)
    ca = PolicyCache.for_model(plain, model.config)
    _run(model, ca, ids[:, :P + 1], P)  # the plain arm's kept set of the prefill (its first keep indices)
    kept = [layer.kept_index[..., :140] for layer in ca.layers]
    storage = Policy("ref", middle, 0, 16, 16)
    ref = Cache(layers=[_Reference(k, storage) for k in kept])
    want = _run(model, ref, ids, P)
    cb = PolicyCache.for_model(stored, model.config)
    got = _run(model, cb, ids, P)
    assert torch.equal(got, want)
    plain_lp = _run(model, PolicyCache.for_model(plain, model.config), ids, P)
    assert not torch.equal(got, plain_lp)  # the storage does change the outputs
    for layer, r, k in zip(cb.layers, ref.layers, kept):
        assert torch.equal(layer.kept_index[..., :140], k)
        assert torch.equal(layer.kept_index[..., 140:], torch.arange(P, P + T).expand(2, 2, T))
        assert layer.stored.mid_k.tokens == r.store.mid_k.tokens == 16 * ((140 + T - 16) // 16)
    assert cb.stored_bytes() == stored.cache_bytes(P + T, 4, 2, 16, prefill=P)


def test_bytes_follow_the_closed_form_at_every_step():
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    model = _llama()
    P, T = 200, 36
    ids = torch.randint(0, 256, (1, P + T), generator=torch.Generator().manual_seed(4))
    pol = _scored("knorm", keep=90, store="int4", store_window=16)
    cache = PolicyCache.for_model(pol, model.config)
    with torch.no_grad(), policy_attention(model):
        model(input_ids=ids[:, :P], cache=cache, use_cache=True)
        for i in range(P, P + T):
            assert cache.stored_bytes() == pol.cache_bytes(i, 4, 2, 16, prefill=P)
            model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True)
    # per layer and KV head: K as int4 per channel over groups of 16 tokens (8 B of codes per token, a
    # float16 scale and zero per channel per group), V as int4 per token over 32 features (D = 16 padded
    # to 32: 16 B of codes, a float16 scale and zero), the newest 16 to 31 float32, and per held token an
    # int32 index and a float32 score; one 16-byte header per layer
    held = 90 + T
    packed = 16 * ((held - 16) // 16)
    head = packed * 8 + (packed // 16) * 16 * 4 + packed * (16 + 4) + (held - packed) * 2 * 16 * 4 + held * 8
    assert cache.stored_bytes() == 4 * (16 + 2 * head)
    assert pol.next_change(P) == 1 and _scored("knorm", store="float32").next_change(P) == float("inf")


# -- end to end on SmolLM2 ---------------------------------------------------------------------------

ARMS = ["int2", "int3",
        {"name": "snapkv_int4_at_int2", "selection": {"kind": "snapkv", "mode": "prefill"},
         "storage": {"middle": "int4"}, "budget": {"as": "int2"}},
        {"name": "random_int4_at_int2", "selection": {"kind": "random", "mode": "prefill", "seed": 1},
         "storage": {"middle": "int4"}, "budget": {"as": "int2"}},
        {"name": "ea_int4_at_int3", "selection": {"kind": "expected_attention", "mode": "prefill"},
         "storage": {"middle": "int4"}, "budget": {"as": "int3"}},
        {"name": "knorm_int4", "selection": {"kind": "knorm", "mode": "prefill", "keep": 60},
         "storage": {"middle": "int4", "window": 32}},
        {"name": "snapkv_pre", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 100}},
        {"name": "snapkv_mikv", "selection": {"kind": "snapkv", "mode": "prefill"},
         "storage": {"rest": "int2"}, "budget": {"fp16_fraction": 1.38}},
        {"name": "knorm_mikv", "selection": {"kind": "knorm", "mode": "prefill", "keep": 60},
         "storage": {"rest": "int2"}},
        {"name": "knorm_int4_mikv_at_int3", "selection": {"kind": "knorm", "mode": "prefill"},
         "storage": {"middle": "int4", "rest": "int2"}, "budget": {"as": "int3"}}]


@pytest.fixture(scope="module")
def evq_run(tmp_path_factory):
    return tiny_live_run(tmp_path_factory, "evq_tiny", ARMS, prefill=160, steps=16, budget_tolerance=0.03)



@pytest.mark.slow
def test_stored_arms_run_at_their_budget_and_pass_the_audit(evq_run):
    rows = audited_rows(evq_run)
    for arm, versus in (("snapkv_int4_at_int2", "int2"), ("random_int4_at_int2", "int2"), ("ea_int4_at_int3", "int3")):
        got, target = rows[arm]["bytes_final"], rows[versus]["bytes_final"]
        assert got <= target and (target - got) / target < 0.01, (arm, got, target)
        assert rows[arm]["policy"]["store"] == "int4" and rows[arm]["policy"]["store_window"] == 16
    # MiKV at 1.38 of float16's bytes (at 176 tokens, R = 16, int3's bytes are below its 1 kept token's: the 16
    # decode tokens are float32 beside the whole int2 rest)
    mikv, target = rows["snapkv_mikv"], 1.38 * 176 * 30 * 4 * 3 * 64
    assert mikv["policy"]["rest"] == "int2" and mikv["bytes_final"] <= target
    assert (target - mikv["bytes_final"]) / target < 0.01
    # kept int4, rest int2 at int3's bytes: at 176 tokens with G = 16 the rest's float32 remainder leaves the
    # nearest count 2.6 % below (the protocol's tolerance here is 3 %; at frontier.json's shape 0.14 %)
    both, target = rows["knorm_int4_mikv_at_int3"], rows["int3"]["bytes_final"]
    assert both["policy"]["rest"] == "int2" and both["policy"]["store"] == "int4"
    assert both["bytes_final"] <= target and (target - both["bytes_final"]) / target < 0.03
    ev = rows["knorm_mikv"]["evidence"]["arrays"]
    assert _arrays.load(evq_run, ev["rest.key.codes"]).shape[1] == 96  # 100 prefill tokens not kept: 6 groups
    assert _arrays.load(evq_run, ev["rest.float.k"]).shape[1] == 4
    assert rows["snapkv_int4_at_int2"]["policy"]["keep"] == rows["random_int4_at_int2"]["policy"]["keep"]
    from testbed.report_html import policy_family

    # each its own family on the frontier figure (the audit's own rule re-derives the figure's data: passed above)
    assert [policy_family(rows[a]) for a in ("snapkv_int4_at_int2", "snapkv_pre", "snapkv_mikv",
                                             "knorm_int4_mikv_at_int3")] == \
        ["snapkv (prefill, int4)", "snapkv (prefill)", "snapkv (prefill, rest int2)", "knorm (prefill, int4, rest int2)"]
    assert not {"store", "store_window"} & (set(rows["snapkv_pre"]["policy"]) | set(rows["int2"]["policy"]))
    ev = rows["knorm_int4"]["evidence"]["arrays"]
    held = 60 + 16
    assert _arrays.load(evq_run, ev["kept.index"]).shape == (3, held)
    # the storage holds the kept tokens as a sequence of 76: 32 float32, 32 packed (two groups of 16), and
    # the 12 more that wait for a whole group beyond the window
    assert _arrays.load(evq_run, ev["key.codes"]).shape[1] == 32 and _arrays.load(evq_run, ev["float.k"]).shape[1] == 44


def _forge_array(run: Path, rel: str, x) -> None:
    _arrays.save(run, rel, x)
    m = json.loads((run / "manifest.json").read_text())
    x = np.asarray(x)  # a consistent forger records the new shape too
    m["arrays"][rel].update(sha256=_arrays.sha(run, rel), shape=list(x.shape), nbytes=int(x.nbytes), dtype=x.dtype.str)
    (run / "manifest.json").write_text(json.dumps(m, indent=1))


@pytest.mark.slow
@pytest.mark.parametrize("forgery", ["kept_set", "codes", "bytes", "rest_codes"])
def test_a_forged_stored_kept_set_fails(evq_run, tmp_path, forgery):
    """``kept_set``: head 0's best kept prefill token swapped for its worst dropped one, and the storage's
    arrays re-encoded from the forged kept set with the audit's own encoder (a consistent forger);
    ``codes``: one byte of the packed K codes changed; ``bytes``: the row's bytes claimed without the
    per-token scores (every count rewritten alike). The audit fails the arm every time."""
    from testbed.audit import audit
    from testbed.audit_checks.schemes import encode_tensor
    from testbed.audit_checks.live_policies import middle_config

    run = tmp_path / "copy"
    shutil.copytree(evq_run, run)
    arm = "knorm_int4"
    row = rows_by_arm(run)[arm]
    ev = row["evidence"]["arrays"]
    a = {k: _arrays.load(run, v) for k, v in ev.items()}
    if forgery == "kept_set":
        idx = a["kept.index"].copy()
        table = -np.sqrt((a["input.k"].astype(np.float64) ** 2).sum(-1)).astype(np.float32)
        kept0 = [int(i) for i in idx[0] if i < 160]
        dropped0 = [i for i in range(160) if i not in kept0]
        kept0.remove(max(kept0, key=lambda i: table[0, i]))
        kept0.append(min(dropped0, key=lambda i: table[0, i]))
        idx[0, :60] = sorted(kept0)
        new = {"kept.index": idx, "kept.score": np.take_along_axis(table, idx.astype(np.int64), axis=1)}
        st = {"middle": "int4", "key_axis": "channel", "group": 16, "feature_group": 32}
        for name, label in (("k", "key"), ("v", "value")):
            seq = np.take_along_axis(a[f"input.{name}"], idx.astype(np.int64)[..., None], axis=1)
            new[f"float.{name}"] = seq[:, 32:]
            for arr, w in encode_tensor(seq[:, :32], middle_config(st, name)).items():
                if arr != "header":
                    new[f"{label}.{arr}"] = w
        for name, x in new.items():
            _forge_array(run, ev[name], x)
        want = "kept set"
    elif forgery == "rest_codes":
        arm = "knorm_mikv"
        ev = rows_by_arm(run)[arm]["evidence"]["arrays"]
        codes = _arrays.load(run, ev["rest.value.codes"]).copy()
        codes[1, 3, 0] ^= 0x03
        _forge_array(run, ev["rest.value.codes"], codes)
        want = "rest.value.codes"
    elif forgery == "codes":
        codes = a["key.codes"].copy()
        codes[0, 0, 0] ^= 0x11
        _forge_array(run, ev["key.codes"], codes)
        want = "key.codes"
    else:
        res = json.loads((run / "results.json").read_text())
        for r in res["rows"]:
            if r["arm"] == arm:
                by = _arrays.load(run, r["arrays"]["bytes"])
                ctx = np.asarray(_arrays.load(run, r["arrays"]["context"]), dtype=np.int64)
                fewer = by - 30 * 3 * 4 * (60 + ctx - 160)  # no float32 score per held token
                _forge_array(run, r["arrays"]["bytes"], fewer.astype(by.dtype))
                r["bytes_final"] = int(fewer[-1])
                r["bytes_per_token"] = float(fewer[-1]) / float(ctx[-1])
        (run / "results.json").write_text(json.dumps(res))
        want = "bytes"
    ok, failures, _ = audit(run)
    assert not ok
    assert any(arm in f and want in f for f in failures), failures[:5]


# -- MiKV: the tokens a scorer drops kept at a lower precision ------------------------------------------


@pytest.mark.parametrize("scorer, rest", [("snapkv", "int2"), ("knorm", "int4")])
def test_mikv_is_the_rest_fed_to_the_storage_beside_the_kept_set(scorer, rest):
    from testbed.policies.cache import PolicyCache

    model = _llama()
    P, T = 320, 12
    ids = torch.randint(0, 256, (2, P + T), generator=torch.Generator().manual_seed(5))
    plain, mikv = _scored(scorer), _scored(scorer, rest=rest)
    ca = PolicyCache.for_model(plain, model.config)
    _run(model, ca, ids[:, :P + 1], P)
    kept = [layer.kept_index[..., :140] for layer in ca.layers]
    ref = Cache(layers=[_MiKVReference(k, Policy("ref", rest, 0, 0, 16)) for k in kept])
    want = _run(model, ref, ids, P)
    cb = PolicyCache.for_model(mikv, model.config)
    got = _run(model, cb, ids, P)
    assert torch.equal(got, want)
    full = _run(model, PolicyCache.for_model(Policy("f", "float32"), model.config), ids, P)
    plain_lp = _run(model, PolicyCache.for_model(plain, model.config), ids, P)
    # keeping the rest at low precision is closer to the float32 cache than dropping it
    assert (got - full).abs().max() < (plain_lp - full).abs().max()
    # bytes: the plain arm's, and the 180 tokens of the rest as a sequence: 176 packed (11 groups), 4 float32
    assert cb.stored_bytes() == mikv.cache_bytes(P + T, 4, 2, 16, prefill=P)
    rp = Policy("r", rest, 0, 0, 16)
    assert cb.stored_bytes() == _run_bytes(plain, P, T) + 4 * (rp.layer_bytes(P - 140, 2, 16) - 16)
    assert mikv.next_change(P) == float("inf")


def _run_bytes(pol, P, T):
    return pol.cache_bytes(P + T, 4, 2, 16, prefill=P)


def test_mikv_at_int3s_bytes_lands_within_one_percent_below():
    P, T = 1792, 256
    budget = dict(prefill=P, steps=T, **SMOL)
    e = {"name": "mikv", "selection": {"kind": "snapkv", "mode": "prefill"}, "storage": {"rest": "int2"},
         "budget": {"as": "int3"}}
    # kept float32: the 256 decode tokens alone, float32, cost more than int3's whole cache
    with pytest.raises(ValueError, match="out of reach"):
        declared(e, window=128, group=32, evict_window=256, budget=budget)
    e["storage"]["middle"] = "int4"  # kept int4 (and every decode token), the rest int2
    pol = declared(e, window=128, group=32, evict_window=256, budget=budget)
    assert pol.rest == "int2" and pol.config()["rest"] == "int2" and pol.store == "int4"
    target = preset("int3").cache_bytes(P + T, 30, 3, 64)
    got = pol.cache_bytes(P + T, 30, 3, 64, prefill=P)
    assert got <= target and (target - got) / target < 0.01
    assert pol.with_(keep=pol.keep + 1).cache_bytes(P + T, 30, 3, 64, prefill=P) > target
    assert compose(pol.name, *decompose(pol), pol.description) == pol
    assert "rest" not in declared({"name": "p", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 90}},
                                  **KW).config()
    for bad in ({"kind": "snapkv", "keep": 90}, {"kind": "all"}):
        with pytest.raises(ValueError):
            declared({"name": "x", "selection": bad, "storage": {"rest": "int2"}}, **KW)


def test_kept_int4_and_rest_int2_is_both_storages_fed_their_sequences():
    """Kept set stored int4 (window 16) and the rest int2: attention reads the rest, then the kept storage,
    then the new tokens; stated here with two existing storage layers fed the two sequences."""
    from testbed.policies.cache import PolicyCache
    from testbed.policies.layers import PolicyLayer

    class _Both(_Reference):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            b, h, n, d = key_states.shape
            if self.seen == 0:
                self.rest = PolicyLayer(Policy("r", "int2", 0, 0, 16))
                out = torch.ones(b, h, n, dtype=torch.bool)
                out.scatter_(-1, self.kept, False)
                m = n - self.kept.shape[-1]
                self.rest.update(key_states[out].view(b, h, m, d), value_states[out].view(b, h, m, d))
                return super().update(key_states, value_states)
            rk, rv = self.rest.update(key_states[..., :0, :], value_states[..., :0, :])
            k, v = super().update(key_states, value_states)
            return torch.cat([rk, k], -2), torch.cat([rv, v], -2)

        def get_mask_sizes(self, query_length):
            return (self.rest.held_tokens() if self.seen else 0) + self.store.held_tokens() + query_length, 0

    model = _llama()
    P, T = 320, 20
    ids = torch.randint(0, 256, (2, P + T), generator=torch.Generator().manual_seed(7))
    plain = _scored("snapkv")
    ca = PolicyCache.for_model(plain, model.config)
    _run(model, ca, ids[:, :P + 1], P)
    kept = [layer.kept_index[..., :140] for layer in ca.layers]
    want = _run(model, Cache(layers=[_Both(k, Policy("s", "int4", 0, 16, 16)) for k in kept]), ids, P)
    pol = _scored("snapkv", store="int4", store_window=16, rest="int2")
    cb = PolicyCache.for_model(pol, model.config)
    assert torch.equal(_run(model, cb, ids, P), want)
    assert cb.stored_bytes() == pol.cache_bytes(P + T, 4, 2, 16, prefill=P)
    assert cb.stored_bytes() == (_scored("snapkv", store="int4", store_window=16).cache_bytes(P + T, 4, 2, 16, prefill=P)
                                 + 4 * (Policy("r", "int2", 0, 0, 16).layer_bytes(P - 140, 2, 16) - 16))


@pytest.mark.slow
def test_stored_arms_in_the_retrieval_study(tmp_path):
    """The retrieval study (the question and answer fed after the compressed prefill) runs a kept set
    stored int4 and a rest kept int2, given a kept count, and one at int3's bytes ({"as": "int3"}, derived
    per trial), and its audit passes."""
    from testbed.audit import audit
    from testbed.run import main as run_main
    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}")
    proto = json.loads((REPO / "protocols" / "retrieval_small.json").read_text())
    proto.update(name="retrieval_evq", default=False)
    arms = [{"name": "snapkv_int4_k96", "selection": {"kind": "snapkv", "mode": "prefill", "keep": 96},
             "storage": {"middle": "int4", "window": 16, "group": 16}},
            {"name": "knorm_mikv_k96", "selection": {"kind": "knorm", "mode": "prefill", "keep": 96},
             "storage": {"middle": "int4", "window": 16, "group": 16, "rest": "int2"}},
            {"name": "knorm_int4_at_int3", "selection": {"kind": "knorm", "mode": "prefill"},
             "storage": {"middle": "int4"}, "budget": {"as": "int3"}}]
    proto["retrieval"].update({"tasks": ["passkey"], "lengths": [160], "depths": [0.0, 1.0], "trials": 1, "batch": 2,
                               "policies": arms, "peers": [], "budget_tolerance": 0.05})
    path = tmp_path / "retrieval_evq.json"
    path.write_text(json.dumps(proto))
    out = tmp_path / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(path)]) == 0
    ok, failures, _ = audit(out)
    assert ok, failures[:5]
    rows = [r for r in json.loads((out / "results.json").read_text())["rows"] if r.get("kind") == "policy"]
    assert {r["arm"] for r in rows} == {"snapkv_int4_k96", "knorm_mikv_k96", "knorm_int4_at_int3"}
