"""Heavy hitters at int2's bytes (issue #36, item 2): ``int2_hh`` keeps, per (layer, KV head), the C
packed tokens with the largest accumulated attention (H2O's score) float32 beside an int2 middle.

Checked here against computations written out in the tests: the accumulated score against an
explicit softmax(QK^T) loop; the held set against the rule replayed over those scores (a flush's
tokens and the held ones compete, the top C stay, ties to the lower index); what attention reads
(heavy hitters exactly float32, the other packed tokens int2-decoded); the bytes against uniform
int2 on SmolLM2's shape (30 layers, 3 KV heads, D = 64) within 1 %, measured and in the audit's
closed form; a case built so that one old token carries the attention, where keeping it float32
brings the attention output closer to float32's than int2 does; and a finished run whose forged
indices, held K/V or byte counts the audit refuses.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from testbed.policies import handoff, preset
from testbed.policies.causal import accumulated_attention
from testbed.policies.selection import observe_concentration
from testbed.quant import IntGrouped

cache_mod = pytest.importorskip("testbed.policies.cache", reason="the live cache needs transformers: pip install -e '.[capture]'")
from testbed.policies.layers import PolicyLayer  # noqa: E402  (after the importorskip: it needs transformers)

H, D, G_Q = 3, 64, 3  # KV heads, head dim, query heads per KV head (SmolLM2's shape per layer)


pytestmark = pytest.mark.usefixtures("attention_block")  # tests/conftest.py


def _kv(n, seed=0, batch=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, H, n, D, generator=g) * 2.0, torch.randn(batch, H, n, D, generator=g)


def _np_received(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``[B, H, n]``: the attention each key received from the t queries (the last t positions),
    summed over queries and the KV head's query heads; an explicit loop over float64 rows."""
    b, hq, t, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    out = np.zeros((b, hkv, n))
    for bi in range(b):
        for h in range(hq):
            for i in range(t):
                pos = n - t + i
                s = k[bi, h // g, :pos + 1].astype(np.float64) @ q[bi, h, i].astype(np.float64) / math.sqrt(d)
                w = np.exp(s - s.max())
                out[bi, h // g, :pos + 1] += w / w.sum()
    return out


def test_accumulated_attention_is_the_sum_of_softmax_rows():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, H * G_Q, 5, D, generator=g), torch.randn(2, H, 12, D, generator=g)
    got = accumulated_attention(q, k, D ** -0.5, block=2).numpy()
    want = _np_received(q.numpy(), k.numpy())
    assert np.allclose(got, want, rtol=1e-10, atol=1e-12)
    # every query row gives out exactly one unit of attention per query head
    assert np.allclose(got.sum(-1), 5 * G_Q)


def _drive(pol, n_prefill, steps, seed=0, batch=2, oracle=None):
    """A PolicyLayer under ``pol``, fed a prefill then chunks up to each flush (the live study's
    schedule), each update followed by the attention call with random queries. Returns the layer and,
    per update, (the keys and values attention read, the queries, the token count after it).
    ``oracle [B, H, n]``: an oracle policy's whole-segment scores, given in advance."""
    layer = PolicyLayer(pol, layer_idx=0)
    layer.oracle_received = oracle
    k, v = _kv(n_prefill + steps, seed, batch)
    gen = torch.Generator().manual_seed(seed + 100)
    calls, n = [], 0
    chunks = [n_prefill]
    while n_prefill + sum(chunks[1:]) < n_prefill + steps:
        done = n_prefill + sum(chunks[1:])
        chunks.append(int(min(pol.next_change(done), n_prefill + steps - done)))
    for c in chunks:
        keys, values = layer.update(k[..., n:n + c, :], v[..., n:n + c, :])
        assert handoff.SELECT.pop(0) is layer  # every update of a heavy-hitter layer asks for its attention
        q = torch.randn(batch, H * G_Q, c, D, generator=gen)
        layer.observe_prefill(q, keys, D ** -0.5)
        n += c
        calls.append((keys.clone(), values.clone(), q, n))
    return layer, k, v, calls


def test_the_held_tokens_are_the_rules_top_count_of_the_accumulated_score():
    """Replayed independently: scores from explicit softmax rows over the keys each call read; at each
    flush the held tokens and the flushed ones compete and the C largest stay (ties to the lower
    index); a token that left the window unchosen, or was dropped, never comes back."""
    pol = preset("int2_hh", window=24, group=8)
    assert pol.window == 16 and pol.heavy > 0
    C = pol.heavy
    layer, k, v, calls = _drive(pol, 40, 50)
    score = np.zeros((2, H, 90))
    held = [[[] for _ in range(H)] for _ in range(2)]
    packed = 0
    for keys, _, q, n in calls:
        score[..., :n] += _np_received(q.numpy(), keys.numpy())
        now = pol.packed_tokens(n)
        for b in range(2):
            for h in range(H):
                cand = held[b][h] + list(range(packed, now))
                order = sorted(cand, key=lambda j: (-np.float32(score[b, h, j]), j))  # noqa: B023
                held[b][h] = sorted(order[:C])
        packed = now
    want = np.array(held)
    assert want.shape == (2, H, C)
    assert np.array_equal(layer.hh_index.numpy(), want)
    # the held scores are those accumulated ones (float32 storage)
    assert np.allclose(layer.hh_score.numpy(), np.take_along_axis(score, want, -1), rtol=1e-5)
    # the rule is not trivially the most recent or the oldest packed tokens
    assert not np.array_equal(want[0, 0], np.arange(packed - C, packed))
    assert not np.array_equal(want[0, 0], np.arange(C))


def test_the_content_blind_control_holds_the_first_packed_tokens_at_the_same_bytes():
    pol, hh = preset("int2_hh_first", window=24, group=8), preset("int2_hh", window=24, group=8)
    assert (pol.heavy, pol.window) == (hh.heavy, hh.window)
    layer, k, v, calls = _drive(pol, 40, 50)
    assert np.array_equal(layer.hh_index.numpy(), np.broadcast_to(np.arange(pol.heavy), (2, H, pol.heavy)))
    other, *_ = _drive(hh, 40, 50)
    assert layer.stored_bytes() == other.stored_bytes() == pol.layer_bytes(90, H, D)
    assert not torch.equal(layer.hh_index, other.hh_index)


def test_a_prefill_choice_is_the_top_count_of_its_own_softmax():
    """A prefill alone: the held tokens are the C largest prefill scores among the tokens it packed."""
    pol = preset("int2_hh", window=24, group=8)
    layer, k, v, calls = _drive(pol, 64, 0)
    keys, _, q, n = calls[0]
    received = _np_received(q.numpy(), k[..., :64, :].numpy())
    p = pol.packed_tokens(64)
    want = np.sort(np.argsort(-received[..., :p], axis=-1, kind="stable")[..., :pol.heavy], axis=-1)
    assert np.array_equal(layer.hh_index.numpy(), want)


def test_heavy_hitters_are_read_exactly_and_the_rest_with_int2_error():
    pol = preset("int2_hh", window=24, group=8)
    layer, k, v, calls = _drive(pol, 40, 50)
    keys, values, _, n = calls[-1]  # what the last call read: the state before its own tokens + them
    p = layer.mid_k.tokens
    idx = layer.hh_index
    assert idx.shape[-1] == pol.heavy and p > pol.heavy
    at = idx[..., None].expand(-1, -1, -1, D)
    for got, x in ((keys, k), (values, v)):
        assert torch.equal(torch.gather(got, 2, at), torch.gather(x, 2, at))  # float32, exactly
    kq, vq = IntGrouped(2, pol.group, "channel"), IntGrouped(2, 32, "token")
    dk = kq.dequantize(kq.quantize(k[..., :p, :].contiguous()))
    dv = vq.dequantize(vq.quantize(v[..., :p, :].contiguous()))
    other = torch.ones(2, H, p, dtype=torch.bool)
    other.scatter_(-1, idx, False)
    assert torch.equal(keys[..., :p, :][other], dk[other]) and torch.equal(values[..., :p, :][other], dv[other])
    err = (keys[..., :p, :][other] - k[..., :p, :][other]).abs()
    assert err.mean() > 0.1  # int2 error on what is not held
    # the evidence: indices, K/V and scores of batch row 0
    ev = layer.evidence()
    assert ev["hh.index"].dtype == torch.int32 and torch.equal(ev["hh.index"].long(), idx[0])
    assert torch.equal(ev["hh.k"], torch.gather(k, 2, at)[0]) and torch.equal(ev["hh.v"], torch.gather(v, 2, at)[0])


def _measured_bytes(name: str, n: int) -> int:
    pol = preset(name)  # the defaults: R=128, G=32
    layer = PolicyLayer(pol, layer_idx=0)
    k, v = _kv(n, seed=n, batch=1)
    keys, _ = layer.update(k, v)
    if handoff.SELECT.pop(0, None) is not None:
        layer.observe_prefill(torch.randn(1, H * G_Q, n, D), keys, D ** -0.5)
    return 30 * layer.stored_bytes()


@pytest.mark.parametrize("n", [256, 1024, 1280, 2048])
def test_bytes_match_uniform_int2_on_smollm2s_shape(n):
    """30 layers, 3 KV heads, D = 64: within 1 % of uniform int2 (R=128, G=32) and never above it,
    measured from the stored tensors and in the audit's own closed form."""
    from testbed.audit_checks import live_policies as lq

    hh, u = _measured_bytes("int2_hh", n), _measured_bytes("int2", n)
    assert hh <= u and (u - hh) / u < 0.01, (n, hh, u)
    dims = lq.MODELS["SmolLM2-135M-Instruct.Q4_1"]
    live = {"window": 128, "group": 32}
    assert lq.policy_bytes(lq.policy_of("int2_hh", live), n, dims) == hh
    assert lq.policy_bytes(lq.policy_of("int2", live), n, dims) == u
    assert preset("int2_hh").heavy == 27  # what those bytes buy at R=128, G=32


def test_a_heavy_hitter_brings_attention_closer_to_float32_than_int2():
    """One old token carries the attention and its value stands out: int2 blurs it; keeping it
    float32 (it is the top accumulated score) puts the attention output closer to float32's."""
    pol_h, pol_u = preset("int2_hh", window=24, group=8), preset("int2", window=24, group=8)
    n = 96
    k, v = _kv(n, seed=7, batch=1)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(1, H * G_Q, n, D, generator=gen) * 0.1
    star = 10  # every query looks at token 10, whose value is far from the others
    direction = torch.randn(H, D, generator=gen)
    k[0, :, star] = direction
    q[0] += direction.repeat_interleave(G_Q, 0)[:, None, :] * 0.5
    v[0, :, star] = torch.randn(H, D, generator=gen) * 6.0
    outs = {}
    for name, pol in (("hh", pol_h), ("int2", pol_u)):
        layer = PolicyLayer(pol, layer_idx=0)
        keys, values = layer.update(k[..., :n - 1, :], v[..., :n - 1, :])
        if handoff.SELECT.pop(0, None) is not None:
            layer.observe_prefill(q[..., :n - 1, :], keys, D ** -0.5)
        keys, values = layer.update(k[..., n - 1:, :], v[..., n - 1:, :])
        handoff.SELECT.pop(0, None)
        kk, vv = keys.repeat_interleave(G_Q, 1), values.repeat_interleave(G_Q, 1)
        outs[name] = torch.softmax(q[..., n - 1:, :] @ kk.transpose(-1, -2) * D ** -0.5, -1) @ vv
        if name == "hh":
            assert (layer.hh_index == star).any(-1).all()  # it is held in every head
    kk, vv = k.repeat_interleave(G_Q, 1), v.repeat_interleave(G_Q, 1)
    ref = torch.softmax(q[..., n - 1:, :] @ kk.transpose(-1, -2) * D ** -0.5, -1) @ vv
    e_hh, e_u = (outs["hh"] - ref).norm().item(), (outs["int2"] - ref).norm().item()
    assert e_hh < 0.5 * e_u, (e_hh, e_u)


def test_a_missing_attention_call_is_an_error_at_the_next_update():
    layer = PolicyLayer(preset("int2_hh", window=24, group=8), layer_idx=0)
    k, v = _kv(50)
    layer.update(k[..., :40, :], v[..., :40, :])
    handoff.SELECT.clear()  # the attention call never reports
    with pytest.raises(RuntimeError, match="never reported its attention"):
        layer.update(k[..., 40:41, :], v[..., 40:41, :])


def test_heavy_hitters_refuse_what_they_are_not_built_for():
    from testbed.policies import Policy

    with pytest.raises(ValueError, match="heavy hitters are built for"):
        Policy("x", "mxfp4", 0, 16, 16, heavy=4)
    with pytest.raises(ValueError, match="heavy hitters are built for"):
        Policy("x", "int2", 4, 16, 16, heavy=4)
    with pytest.raises(ValueError, match="direct attention"):
        PolicyLayer(preset("int2_hh"), layer_idx=0, direct=True)

def test_the_oracle_holds_the_top_count_of_the_whole_segments_score_at_int2_hhs_bytes():
    """int2_hh_oracle ranks by scores given in advance for every token of the segment: whatever the
    order in which groups are packed, the held set at the end is the C largest of those scores among
    the packed tokens (ties to the lower index), and the storage is int2_hh's, byte for byte."""
    pol, hh = preset("int2_hh_oracle", window=24, group=8), preset("int2_hh", window=24, group=8)
    assert (pol.heavy, pol.window, pol.middle) == (hh.heavy, hh.window, hh.middle)
    g = torch.Generator().manual_seed(11)
    score = torch.rand(2, H, 90, generator=g, dtype=torch.float64)
    score[0, 0, 3] = score[0, 0, 70] = 5.0  # a tie, held by both or the lower index first
    layer, *_ = _drive(pol, 40, 50, oracle=score)
    p = pol.packed_tokens(90)
    want = np.sort(np.argsort(-score[..., :p].numpy(), axis=-1, kind="stable")[..., :pol.heavy], axis=-1)
    assert np.array_equal(layer.hh_index.numpy(), want)
    other, *_ = _drive(hh, 40, 50)
    assert layer.stored_bytes() == other.stored_bytes() == pol.layer_bytes(90, H, D)
    assert not torch.equal(layer.hh_index, other.hh_index)  # the oracle's choice is not the online one


def test_an_oracle_cache_without_the_segments_scores_is_refused():
    pol = preset("int2_hh_oracle", window=24, group=8)
    with pytest.raises(ValueError, match="whole segment's accumulated attention"):
        cache_mod.PolicyCache(pol, 2)
    with pytest.raises(ValueError, match="one \\[B, KV heads, tokens\\] tensor per layer"):
        cache_mod.PolicyCache(pol, 2, received=[torch.zeros(1, H, 4)])


# -- a finished run: the audit re-derives the bytes from the stored indices --------------------------



@pytest.fixture(scope="module")
def hh_run(tmp_path_factory):
    from testbed.run import main as run_main
    from testbed.sources import models

    try:
        models.load_model()
    except models.CaptureUnavailable as e:
        pytest.skip(f"capture unavailable: {e}; install with: {models.INSTALL_HINT}")
    tmp = tmp_path_factory.mktemp("hh")
    proto = json.loads((Path(__file__).resolve().parent.parent / "protocols" / "smollm2_quality.json").read_text())
    proto["name"], proto["default"] = "live_tiny", False
    proto["live"].update({"evidence_layer": 2, "segments": 2, "prefill": 48, "steps": 40, "batch": 2, "window": 24,
                          "group": 8, "policies": ["int2", "int2_hh", "int2_hh_first", "int2_hh_oracle"],
                          "peers": []})
    (tmp / "p.json").write_text(json.dumps(proto))
    out = tmp / "run"
    assert run_main(["--quiet", "--out", str(out), "--protocol", str(tmp / "p.json")]) == 0
    return out


@pytest.mark.capture
@pytest.mark.slow
def test_a_heavy_hitter_run_passes_the_audit(hh_run):
    from testbed.audit import audit

    ok, failures, _ = audit(hh_run)
    assert ok, failures[:5]
    rows = json.loads((hh_run / "results.json").read_text())["rows"]
    hh = [r for r in rows if r["arm"] == "int2_hh"]
    assert len(hh) == 2 and all(r["policy"]["heavy"] == preset("int2_hh", window=24, group=8).heavy for r in hh)
    assert all("heavy" not in r["policy"] for r in rows if r["arm"] == "int2")  # uniform rows read as before
    assert "hh.index" in hh[0]["evidence"]["arrays"]


@pytest.mark.capture
@pytest.mark.slow
@pytest.mark.parametrize("what", ["duplicate", "out_of_range", "bytes", "held_k", "evidence_index", "first_rule",
                                  "oracle_rule"])
def test_forged_heavy_hitters_fail_the_audit(hh_run, tmp_path, what):
    from testbed.audit import audit
    from tests import _arrays
    from tests._helpers import forge_results
    from tests.test_live import _rehash

    run = tmp_path / "copy"
    shutil.copytree(hh_run, run)
    res = json.loads((run / "results.json").read_text())
    arm = {"first_rule": "int2_hh_first", "oracle_rule": "int2_hh_oracle"}.get(what, "int2_hh")
    row = next(r for r in res["rows"] if r["arm"] == arm and r["case"] == "seg000")

    def forge(rel, edit):
        x = _arrays.load(run, rel).copy()
        edit(x)
        _arrays.save(run, rel, x)
        _rehash(run, rel)

    if what == "duplicate":  # a token held twice (one fewer distinct heavy hitter, same bytes)
        forge(row["arrays"]["hh_index"], lambda x: x.__setitem__((5, 1, 1), x[5, 1, 0]))
        expect = "hh_index repeats a token"
    elif what == "out_of_range":  # a heavy hitter that is no packed token
        forge(row["arrays"]["hh_index"], lambda x: x.__setitem__((7, 0, -1), 10_000))
        expect = "outside the"
    elif what == "bytes":  # fewer bytes claimed, consistently in the bytes array, the row and its rate
        forge(row["arrays"]["bytes"], lambda x: x.__setitem__(-1, x[-1] - 1000))
        row["bytes_final"] -= 1000
        row["bytes_per_token"] = row["bytes_final"] / row["context_final"]
        forge_results(run, res)
        expect = "bytes after each forward"
    elif what == "held_k":  # a held key that is not the token's float32 input
        forge(row["evidence"]["arrays"]["hh.k"], lambda x: x.__setitem__((0, 0, 0), x[0, 0, 0] + 1.0))
        expect = "hh.k"
    elif what == "first_rule":  # the control's last held token swapped for a later packed one (distinct, ascending)
        forge(row["arrays"]["hh_index"], lambda x: x.__setitem__((3, 2, -1), x[3, 2, -1] + 5))
        expect = "content-blind rule 'first'"
    elif what == "oracle_rule":  # at the evidence layer, a held token swapped for the unheld packed token beside
        # it, consistently in the row, the evidence's indices and the held K/V: only the choice is wrong
        ev = row["evidence"]["arrays"]
        held = _arrays.load(run, row["arrays"]["hh_index"])[2, 0]
        i = next(i for i in range(len(held) - 1) if held[i + 1] - held[i] > 1)
        new = int(held[i]) + 1
        x_k, x_v = _arrays.load(run, ev["input.k"]), _arrays.load(run, ev["input.v"])
        forge(row["arrays"]["hh_index"], lambda x: x.__setitem__((2, 0, i), new))
        forge(ev["hh.index"], lambda x: x.__setitem__((0, i), new))
        forge(ev["hh.k"], lambda x: x.__setitem__((0, i), x_k[0, new]))
        forge(ev["hh.v"], lambda x: x.__setitem__((0, i), x_v[0, new]))
        expect = "over the segment but is not held"
    else:  # the evidence layer's indices moved off the row's (row and evidence disagree)
        forge(row["evidence"]["arrays"]["hh.index"], lambda x: x.__setitem__((0, 0), x[0, 0] + 1))
        expect = "hh.index"
    ok, failures, _ = audit(run)
    assert not ok
    assert any(expect in f for f in failures), failures[:5]


@pytest.mark.capture
@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="known gap: int2_hh's held set follows the attention of every decode query, "
                   "which the run does not record, so the audit checks the indices (distinct, ascending, packed, C of "
                   "them), the bytes and the held K/V, not the choice: another packed token held in place of a chosen "
                   "one, outside the evidence layer, passes (int2_hh_first's choice is re-derived, and int2_hh_oracle's at the "
                   "evidence layer; a replay of the "
                   "model with python -m testbed.replay is the check for int2_hh)")
def test_gap_another_held_token_outside_the_evidence_layer(hh_run, tmp_path):
    from testbed.audit import audit
    from tests import _arrays
    from tests.test_live import _rehash

    run = tmp_path / "copy"
    shutil.copytree(hh_run, run)
    res = json.loads((run / "results.json").read_text())
    row = next(r for r in res["rows"] if r["arm"] == "int2_hh" and r["case"] == "seg000")
    rel = row["arrays"]["hh_index"]
    x = _arrays.load(run, rel).copy()
    held = x[3, 1]  # layer 3 (the evidence layer is 2), KV head 1
    gaps = [i for i in range(len(held) - 1) if held[i + 1] - held[i] > 1]
    assert gaps, "every packed token is held: nothing to swap"
    held[gaps[0]] += 1  # a token beside a chosen one, still distinct, ascending and packed
    _arrays.save(run, rel, x)
    _rehash(run, rel)
    ok, failures, _ = audit(run)
    assert not ok, "the swapped heavy hitter passed the audit"


def test_heavy_hitter_presets_refuse_a_window_that_cannot_pay_for_them():
    for window, group in ((32, 32), (16, 32), (8192, 32)):
        with pytest.raises(ValueError, match="window R larger than the group G and room for at least one"):
            preset("int2_hh", window=window, group=group)
    assert preset("int2_hh", window=128, group=32).heavy >= 1


def test_a_model_whose_head_dim_cannot_pay_for_the_heavy_hitters_is_refused():
    from testbed import live
    from testbed.policies.presets import heavy_count
    from testbed.schema import ProtocolError

    p = {"model": "m", "evidence_layer": None, "window": 128, "group": 32, "evict_window": 256, "sink": 4,
         "policies": ["int2", "int2_hh"], "peers": []}
    dims = {"layers": 2, "full_layers": [0, 1], "head_dim": 32, "kv_heads": 1}
    assert heavy_count(128, 32, head_dim=32) < preset("int2_hh").heavy  # sized for 64: too many at 32
    with pytest.raises(ProtocolError, match=r"int2_hh hold \d+ heavy hitters .* head dim 32 only \d+ fit"):
        live.check_model(p, dims, "s: live")
    live.check_model(p, {**dims, "head_dim": 64}, "s: live")  # SmolLM2's: the sizing's own
    live.check_model(p, {**dims, "head_dim": 256}, "s: live")  # Gemma-3's: more than enough room


def test_the_oracle_is_refused_on_a_model_with_sliding_layers_and_its_pass_refuses_shrinking_keys():
    """A sliding layer keeps at most its window of keys, so a whole segment's accumulated attention
    does not add up there: int2_hh_oracle is refused when the protocol is read (Gemma-3's shape: head
    dim 256 pays for C, so only the sliding layers refuse it), and the oracle pass itself refuses an
    attention call over fewer keys than the one before (it once failed deep in the pass)."""
    from testbed import live
    from testbed.schema import ProtocolError

    p = {"model": "g", "evidence_layer": None, "window": 128, "group": 32, "evict_window": 256, "sink": 4,
         "policies": ["int2", "int2_hh", "int2_hh_oracle"], "peers": []}
    dims = {"layers": 6, "full_layers": [5], "head_dim": 256, "kv_heads": 1, "sliding_window": 512}
    with pytest.raises(ProtocolError, match=r"int2_hh_oracle ranks tokens by the whole segment's attention.*sliding"):
        live.check_model(p, dims, "s: live")
    live.check_model({**p, "policies": ["int2", "int2_hh"]}, dims, "s: live")  # the online rule is served
    with observe_concentration(None, concentration_too=False, received=True) as seen:
        observe = handoff.OBSERVER[0]
        g = torch.Generator().manual_seed(0)
        observe(0, torch.randn(1, 3, 8, D, generator=g), torch.randn(1, 1, 8, D, generator=g), D ** -0.5)
        with pytest.raises(RuntimeError, match="no sliding window"):
            observe(0, torch.randn(1, 3, 1, D, generator=g), torch.randn(1, 1, 5, D, generator=g), D ** -0.5)
    assert seen.received[0].shape == (1, 1, 8)
