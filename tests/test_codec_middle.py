"""A live policy's middle stored by any quantizer (``middle = "codec"``, testbed.policies.codec).

Stated here from the definition, not read back from the code: a codec middle stores every group of
G tokens as its own payload of the given quantizer. So (1) a codec of the built-in KIVI quantizers
is the built-in middle, bit for bit in log-probs and bytes (their groups are whole within any
flush); (2) a dense-and-sparse codec's decoded middle is each group of G tokens quantized alone,
and its bytes are int3's plus 4 bytes (a float16 value, a uint16 index) per outlier, the outliers
of one group being floor(1 % x G x D + 1/2); (3) a user's own quantizer kind, registered from
outside the package, runs as a live middle; (4) what cannot be priced or audited is refused with an
error that names it; (5) end to end on SmolLM2 the audit passes a codec arm and fails a forged one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from testbed.policies import Policy
from testbed.policies.compose import declared
from testbed.quant import DenseSparse, IntGrouped, Packed, Quantizer, register_kind
from testbed.quant.base import make_header
from tests import _arrays
from tests._helpers import forge_array, tiny_llama, audited_rows, tiny_live_run

INT4 = {"k": {"kind": "int_grouped", "bits": 4, "group_size": 16, "axis": "channel"},
        "v": {"kind": "int_grouped", "bits": 4, "group_size": 32, "axis": "token"}}
DS3 = {"k": "int3_ds100_channel_g32", "v": "int3_ds100_token_g32"}


def _llama(layers=2, heads=4, kv=2, d=16, seed=1):
    return tiny_llama(layers, heads, kv, d, seed)


def _run(model, policy, ids, prefill):
    """Log-probs of the prefill's last token and every later one (one token per forward), and the cache."""
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    cache = PolicyCache.for_model(policy, model.config)
    out = []
    with torch.no_grad(), policy_attention(model):
        out.append(model(input_ids=ids[:, :prefill], cache=cache, use_cache=True).logits[:, -1:])
        for i in range(prefill, ids.shape[1]):
            out.append(model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits)
    return torch.log_softmax(torch.cat(out, 1), -1), cache


def test_a_codec_of_the_kivi_quantizers_is_the_builtin_middle():
    model = _llama()
    ids = torch.randint(0, 256, (2, 190), generator=torch.Generator().manual_seed(2))
    a, ca = _run(model, Policy("int4", "int4", 0, 16, 16), ids, 150)
    b, cb = _run(model, Policy("c4", "codec", 0, 16, 16, codec=INT4), ids, 150)
    assert torch.equal(a, b)
    assert ca.stored_bytes() == cb.stored_bytes()
    # the MX element formats likewise (one block of 32 per token, whatever the grouping)
    mx = {"kind": "mx", "element": "e2m1", "block_size": 32, "rotation": None}
    c, cc = _run(model, Policy("mx", "mxfp4", 0, 16, 16), ids, 150)
    d, cd = _run(model, Policy("cmx", "codec", 0, 16, 16, codec={"k": mx, "v": mx}), ids, 150)
    assert torch.equal(c, d) and cc.stored_bytes() == cd.stored_bytes()


def test_a_dense_and_sparse_codec_stores_each_group_alone():
    model = _llama()
    P, T, R, G = 150, 40, 16, 32
    ids = torch.randint(0, 256, (1, P + T), generator=torch.Generator().manual_seed(3))
    pol = Policy("ds3", "codec", 0, R, G, codec=DS3)
    lp, cache = _run(model, pol, ids, P)
    ref, _ = _run(model, Policy("int3", "int3", 0, R, G), ids, P)
    assert not torch.equal(lp, ref)  # the outliers change what attention reads
    n = P + T
    packed = G * ((n - R) // G)
    qk, qv = DenseSparse(3, 32, "channel"), DenseSparse(3, 32, "token")
    for layer in cache.layers:
        ev = layer.evidence()
        assert layer.mid_k.tokens == layer.mid_v.tokens == packed
        # the stored arrays hold the groups along the axis after the KV heads: 5 outliers per group of 32 x 16
        assert ev["key.outlier_values"].shape == (2, packed // G, math.floor(0.01 * G * 16 + 0.5))
        assert ev["value.codes"].shape[:2] == (2, packed // G)
    # the decode against each group quantized alone, from K/V of a float32 pass
    from testbed.policies.cache import PolicyCache
    from testbed.policies.hook import policy_attention

    rec = PolicyCache.for_model(Policy("f", "float32"), model.config)
    with torch.no_grad(), policy_attention(model):
        model(input_ids=ids[:, :P], cache=rec, use_cache=True)
        for i in range(P, n):
            model(input_ids=ids[:, i:i + 1], cache=rec, use_cache=True)
    for layer, plain in zip(cache.layers[:1], rec.layers[:1]):  # layer 0's K/V: the embeddings', in both runs
        k = plain.tail_k[..., :packed, :]
        v = plain.tail_v[..., :packed, :]
        want_k = torch.cat([qk.dequantize(qk.quantize(k[..., j:j + G, :])) for j in range(0, packed, G)], -2)
        want_v = torch.cat([qv.dequantize(qv.quantize(v[..., j:j + G, :])) for j in range(0, packed, G)], -2)
        assert torch.equal(layer.mid_k.decode(), want_k) and torch.equal(layer.mid_v.decode(), want_v)
    # bytes: int3's, and per group, KV head and tensor floor(1 % x 32 x 16 + 1/2) = 5 outliers of 2 + 2 bytes
    extra = 2 * 2 * (packed // G) * 5 * 4 * 2  # layers x tensors x groups x outliers x bytes x KV heads
    assert cache.stored_bytes() == Policy("int3", "int3", 0, R, G).cache_bytes(n, 2, 2, 16) + extra
    assert cache.stored_bytes() == pol.cache_bytes(n, 2, 2, 16)


@dataclass(frozen=True)
class _Sym8(Quantizer):
    """A user's own quantizer, defined outside the package: symmetric int8 per token (a float16 absmax scale)."""

    KIND: ClassVar[str] = "test_sym8"
    note: str = "toy"

    @property
    def name(self) -> str:
        return "test_sym8"

    @property
    def label(self) -> str:
        return "sym8"

    def quantize_reference(self, x, *, name="x"):
        scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-8).to(torch.float16)
        codes = torch.round(x / scale.float()).clamp(-127, 127).to(torch.int8)
        return Packed(self.name, tuple(x.shape), x.dtype,
                      {"codes": codes, "scale": scale, "header": make_header(x.shape[-2], x.shape[-1])}, self.config())

    def dequantize(self, p):
        return (p.tensors["codes"].float() * p.tensors["scale"].float()).to(p.dtype)


register_kind("test_sym8", _Sym8)


def test_a_users_own_quantizer_runs_as_a_live_middle():
    model = _llama()
    ids = torch.randint(0, 256, (1, 170), generator=torch.Generator().manual_seed(4))
    pol = Policy("sym8", "codec", 0, 16, 16, codec={"k": _Sym8(), "v": {"kind": "test_sym8", "note": "toy"}})
    assert pol.config()["codec"] == {"k": {"kind": "test_sym8", "note": "toy"}, "v": {"kind": "test_sym8", "note": "toy"}}
    lp, cache = _run(model, pol, ids, 150)
    ref, _ = _run(model, Policy("f", "float32"), ids, 150)
    assert 0 < float((lp - ref).abs().max()) < 0.05  # int8 per token: close, not equal
    # per token and KV head: 16 int8 codes and a float16 scale, for K and V; 16 header bytes per layer
    packed = 16 * ((170 - 16) // 16)
    assert cache.stored_bytes() == 2 * (16 + (170 - packed) * 2 * 2 * 16 * 4 + packed * 2 * 2 * (16 + 2))
    # the audit encodes only the kinds it states itself: this one is refused, by name
    from testbed.audit_checks.schemes import scheme

    with pytest.raises(ValueError, match="test_sym8"):
        scheme({"kind": "test_sym8"})


@dataclass(frozen=True)
class _Shrinking(_Sym8):
    """Stores only the nonzero codes' count: a payload whose size depends on the values."""

    KIND: ClassVar[str] = "test_shrinking"

    def quantize_reference(self, x, *, name="x"):
        p = super().quantize_reference(x, name=name)
        keep = int((x.abs() > 1).sum())
        p.tensors["codes"] = p.tensors["codes"].flatten()[:keep]
        return p


register_kind("test_shrinking", _Shrinking)


@pytest.mark.parametrize("kw, match", [
    ({"middle": "codec"}, "needs codec"),
    ({"middle": "int4", "codec": INT4}, "middle 'codec'"),
    ({"middle": "codec", "codec": {"k": INT4["k"]}}, r"\{\"k\": quantizer, \"v\": quantizer\}"),
    ({"middle": "codec", "codec": {"k": "no_such_scheme", "v": "int3_ds100_token_g32"}}, "unknown scheme"),
    ({"middle": "codec", "codec": {"k": {"kind": "int_grouped", "bits": 5}, "v": INT4["v"]}}, "bits must be"),
    ({"middle": "codec", "codec": {"k": 3, "v": INT4["v"]}}, "a quantizer is its config"),
    ({"middle": "codec", "codec": INT4, "heavy": 4}, "heavy hitters"),
    ({"middle": "codec", "codec": {"k": "int3_nf_channel_g32", "v": "int3_cb9c85b1f3_token_g32"}}, "table given in the config"),
    ({"middle": "codec", "codec": INT4, "low": "int2", "low_share": 0.5, "alloc": "random"}, "mixed precision"),
])
def test_bad_codecs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Policy("x", **{"window": 16, "group": 16, **kw})


def test_a_payload_whose_size_follows_the_values_cannot_be_priced():
    pol = Policy("shr", "codec", 0, 16, 16, codec={"k": _Shrinking(), "v": _Shrinking()})
    with pytest.raises(ValueError, match="depends on the values"):
        pol.cache_bytes(64, 1, 2, 16)


def test_a_protocol_states_each_quantizer_by_its_config():
    entry = {"name": "ds3", "storage": {"middle": "codec", "codec": DS3}}
    with pytest.raises(ValueError, match="by its config"):
        declared(entry, window=16, group=32, evict_window=16)
    cfg = {part: DenseSparse(3, 32, axis).config() for part, axis in (("k", "channel"), ("v", "token"))}
    with pytest.raises(ValueError, match="state every field"):  # defaults left out: the audit would read less
        declared({"name": "ds3", "storage": {"middle": "codec", "codec": {
            "k": {"kind": "int_dense_sparse", "bits": 3}, "v": cfg["v"]}}}, window=16, group=32, evict_window=16)
    pol = declared({"name": "ds3", "storage": {"middle": "codec", "codec": cfg}}, window=16, group=32, evict_window=16)
    assert pol.codec == cfg and pol.config()["codec"] == cfg
    with pytest.raises(ValueError, match="'all' selection"):
        declared({"name": "s", "selection": {"kind": "knorm", "keep": 40, "mode": "prefill"},
                  "storage": {"middle": "codec", "codec": cfg}}, window=16, group=32, evict_window=16)
    from testbed.audit_checks.live_policies import declared_policy

    live = {"window": 16, "group": 32}
    assert declared_policy({"name": "ds3", "storage": {"middle": "codec", "codec": cfg}}, live)["codec"] == cfg
    with pytest.raises(ValueError, match="test_sym8"):
        declared_policy({"name": "u", "storage": {"middle": "codec", "codec": {"k": {"kind": "test_sym8"},
                                                                               "v": {"kind": "test_sym8"}}}}, live)


# -- end to end on SmolLM2 ---------------------------------------------------------------------------

DS_CFG = {"k": DenseSparse(3, 16, "channel").config(), "v": DenseSparse(3, 32, "token").config()}
HAD_CFG = {part: DenseSparse(3, g, axis, rotation="hadamard", seed=7).config()
           for part, g, axis in (("k", 16, "channel"), ("v", 32, "token"))}
ARMS = ["int3", {"name": "ds3", "storage": {"middle": "codec", "codec": DS_CFG}},
        {"name": "ds3_had", "storage": {"middle": "codec", "codec": HAD_CFG}},
        {"name": "ds3_pre", "storage": {"middle": "codec", "codec": DS_CFG, "key_rope": "pre"}},
        {"name": "nf3", "storage": {"middle": "codec", "codec": {
            "k": {"kind": "int_codebook", "bits": 3, "group_size": 16, "axis": "channel", "levels": "nf"},
            "v": {"kind": "int_codebook", "bits": 3, "group_size": 32, "axis": "token", "levels": "nf"}}}},
        {"name": "c_int3", "storage": {"middle": "codec", "codec": {
            "k": IntGrouped(3, 16, "channel").config(), "v": IntGrouped(3, 32, "token").config()}}}]


@pytest.fixture(scope="module")
def codec_run(tmp_path_factory):
    return tiny_live_run(tmp_path_factory, "codec_tiny", ARMS, prefill=160, steps=16)


@pytest.mark.slow
def test_codec_arms_pass_the_audit(codec_run):
    rows = audited_rows(codec_run)
    assert rows["c_int3"]["nll"] == rows["int3"]["nll"] and rows["c_int3"]["bytes_final"] == rows["int3"]["bytes_final"]
    # 30 layers x 3 KV heads x 2 tensors x 9 groups of 16 (160 + 16 - 16 tokens aged out) x 10 outliers x 4 bytes
    extra = 30 * 3 * 2 * (16 * ((176 - 16) // 16) // 16) * math.floor(0.01 * 16 * 64 + 0.5) * 4
    for arm in ("ds3", "ds3_had", "ds3_pre"):
        assert rows[arm]["bytes_final"] == rows["int3"]["bytes_final"] + extra
        assert rows[arm]["policy"]["codec"] == (HAD_CFG if arm == "ds3_had" else DS_CFG)
    assert rows["ds3_pre"]["policy"]["key_rope"] == "pre" and rows["ds3_pre"]["nll"] != rows["ds3"]["nll"]
    # NormalFloat levels: the same codes, scales and zero-points per group as int3 (other levels), so the same bytes
    assert rows["nf3"]["bytes_final"] == rows["int3"]["bytes_final"] and rows["nf3"]["nll"] != rows["int3"]["nll"]


@pytest.mark.slow
@pytest.mark.parametrize("arr", ["key.outlier_values", "value.outlier_index", "key.codes"])
def test_a_forged_codec_middle_fails_the_audit(codec_run, tmp_path, arr):
    import shutil

    from testbed.audit import audit

    run = Path(shutil.copytree(codec_run, tmp_path / "run"))
    row = next(r for r in json.loads((run / "results.json").read_text())["rows"] if r["arm"] == "ds3"
               and "evidence" in r)
    rel = row["evidence"]["arrays"][arr]
    x = _arrays.load(run, rel).copy()
    flat = x.reshape(-1)
    if x.dtype == np.float16:
        flat[0] = np.float16(float(flat[0]) * 0.5 + 1.0)
    else:
        flat[0] ^= 1
    forge_array(run, rel, lambda y: np.copyto(y, x))
    ok, failures, _ = audit(run)
    assert not ok and any("ds3" in f for f in failures), failures[:3]
