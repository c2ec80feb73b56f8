"""One float32 oracle pass per batch of the live study, shared by every oracle arm of the batch.

A tiny random Llama (a Hugging Face folder with a byte-level tokenizer, no downloaded weights) runs
small live studies through the serial driver (`testbed.units.run_serial`): the arrays of each
oracle arm in a study with several oracle arms are the bytes the same arm gives in a study of its
own, where its pass serves it alone; and the pass runs once per batch.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow  # live runs of a tiny random Llama

tf = pytest.importorskip("transformers", reason="the live study needs transformers: pip install -e '.[capture]'")

from testbed.context import RunContext  # noqa: E402  (after the importorskip above)
from testbed.evidence import RecordingStore, array_rel  # noqa: E402
from testbed.protocol import validate_protocol  # noqa: E402
from testbed.units import run_serial  # noqa: E402

LAYERS = 2
ORACLES = ["mix24_oracle_diffuse", "mix28_oracle_concentrated", "int2_hh_oracle"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A folder with a 2-layer random Llama (vocabulary 256: one token per byte) and a corpus file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("oracle_tiny")
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, num_hidden_layers=LAYERS, max_position_embeddings=512,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder / "model")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder / "model")
    words = ["cache", "key", "value", "token", "head", "layer", "attention", "query", "window", "group"]
    rng = random.Random(0)
    text = " ".join(rng.choice(words) for _ in range(2000))
    (folder / "corpus.txt").write_text(text, encoding="utf-8")
    return folder


def _study(folder: Path, policies: list[str]) -> tuple[dict, list, dict]:
    """One live study of ``policies`` on the tiny model: (arrays by (case, arm, name) as SHA-256 of
    their .npy bytes, the timings, the rows by (case, arm))."""
    raw = {"name": "oracle_tiny", "kind": "live", "default": False, "description": "tiny oracle study",
           "live": {"model": str(folder / "model"), "corpus": {"builtin": None, "files": [str(folder / "corpus.txt")]},
                    "segments": 2, "prefill": 40, "steps": 24, "batch": 2, "mode": "chunked", "window": 16,
                    "group": 8, "sink": 4, "evict_window": 16, "policies": policies, "peers": [],
                    "reference_chunk": 256, "evidence_layer": 1},
           "timing": {"repeats": 0, "seed": 0}}
    proto = validate_protocol(raw)
    store = RecordingStore()
    ctx = RunContext(store, study=proto["name"], timing_repeats=0, timing_seed=0, progress=lambda m: None,
                     base=folder)
    _, rows = run_serial(proto, ctx)
    saved = {array_rel(rel)[1]: hashlib.sha256(data).hexdigest() for rel, data in store.saves}
    arrays = {}
    for r in rows:
        named = dict(r["arrays"])
        named.update({f"evidence.{k}": v for k, v in r.get("evidence", {}).get("arrays", {}).items()})
        for name, rel in named.items():
            arrays[(r["case"], r["arm"], name)] = saved[rel]
    return arrays, ctx.timings, {(r["case"], r["arm"]): r for r in rows}


def _numbers(row: dict) -> str:
    """Every number and setting of a row (its arrays aside), as canonical JSON."""
    return json.dumps({k: v for k, v in row.items() if k not in ("arrays", "evidence")}, sort_keys=True)


def test_one_pass_serves_every_oracle_arm_of_a_batch_bit_for_bit(tiny):
    together, timings, rows = _study(tiny, ["int4"] + ORACLES)
    passes = [t for t in timings if t["op"] == "oracle"]
    # one batch (2 segments, batch 2), one schedule shared by the three oracle arms: one pass
    assert len(passes) == 1 and sorted(passes[0]["arms"]) == sorted(ORACLES) and passes[0]["arm"] is None
    assert passes[0]["forwards"] == 1 + 24 // 8  # the prefill, then the arms' chunks of G = 8 tokens
    for arm in ORACLES:
        alone, alone_timings, alone_rows = _study(tiny, [arm])
        assert [t["arms"] for t in alone_timings if t["op"] == "oracle"] == [[arm]]
        mine = {k: v for k, v in together.items() if k[1] == arm}
        theirs = {k: v for k, v in alone.items() if k[1] == arm}
        # the evidence's oracle inputs are stored (evidence layer 1), and so is what each kind decides
        names = {k[2] for k in mine}
        assert {"evidence.input.q", "evidence.oracle.q", "evidence.oracle.k", "logprob", "kl", "argmax",
                "bytes"} <= names, names
        assert ("hh_index" in names) == (arm == "int2_hh_oracle")
        assert ("alloc_bits" in names and "alloc_score" in names) == arm.startswith("mix")
        assert mine == theirs, arm
        for case in ("seg000", "seg001"):
            assert _numbers(rows[(case, arm)]) == _numbers(alone_rows[(case, arm)]), (case, arm)
    # the non-oracle arm and the reference are untouched by the oracle arms beside them
    plain, _, _ = _study(tiny, ["int4"])
    assert {k: v for k, v in together.items() if k[1] in ("int4", "dynamic_cache")} == plain


def _units(folder: Path, policies: list[str], evidence_layer: int | None = None):
    """The validated protocol, a context and the units of a one-batch tiny study of ``policies``."""
    from testbed import live

    raw = {"name": "oracle_tiny", "kind": "live", "default": False, "description": "tiny oracle study",
           "live": {"model": str(folder / "model"), "corpus": {"builtin": None, "files": [str(folder / "corpus.txt")]},
                    "segments": 2, "prefill": 40, "steps": 24, "batch": 2, "mode": "chunked", "window": 16,
                    "group": 8, "sink": 4, "evict_window": 16, "policies": policies, "peers": [],
                    "reference_chunk": 256, "evidence_layer": evidence_layer},
           "timing": {"repeats": 0, "seed": 0}}
    proto = validate_protocol(raw)
    store = RecordingStore()
    ctx = RunContext(store, study="oracle_tiny", timing_repeats=0, timing_seed=0, progress=lambda m: None,
                     base=folder)
    _, units = live.plan(proto, ctx)
    return proto, ctx, units


def test_the_shared_pass_is_each_arms_own_pass(tiny):
    """What the arms read of the shared pass is what a pass of the arm's own (as each oracle arm ran
    before: its forward calls through a DynamicCache inside policy_attention, observing only what it
    needs) computes: the mixed oracle's allocation scores and the evidence layer's queries and keys."""
    from transformers import DynamicCache

    from testbed import live
    from testbed.policies import preset
    from testbed.policies.hook import policy_attention
    from testbed.policies.selection import observe_concentration
    from testbed.sources.models import forward_kwargs, load_model

    proto, ctx, units = _units(tiny, ORACLES, evidence_layer=1)
    p = proto["live"]
    model, _, _ = load_model(model=p["model"], base=tiny)
    kw = forward_kwargs(model)
    ids = torch.tensor(units[0]["tokens"], dtype=torch.int64)
    _, out, _ = live.run_unit(proto, units[0], ctx)
    for j, arm in enumerate(ORACLES, 1):
        pol = preset(arm, window=p["window"], group=p["group"], evict_window=p["evict_window"], sink=p["sink"])
        chunks = [p["prefill"]] + live.chunk_schedule(pol, p["prefill"], p["steps"], p["mode"], p["reference_chunk"])
        with policy_attention(model), torch.no_grad(), observe_concentration(
                model, record_layer=1, concentration_too=not pol.heavy_oracle, received=pol.heavy_oracle) as seen:
            cache, pos = DynamicCache(config=model.config), 0
            for c in chunks:
                model(input_ids=ids[:, pos:pos + c], use_cache=True, logits_to_keep=1, **{kw["cache"]: cache})
                pos += c
        ctx.store.saves.clear()
        rows, _, _ = live.run_unit(proto, units[j], ctx, out)
        data = {array_rel(rel)[1]: np.load(io.BytesIO(d), allow_pickle=False) for rel, d in ctx.store.saves}
        ev = {k: data[v] for k, v in rows[0]["evidence"]["arrays"].items()}
        assert np.array_equal(ev["input.q"], seen.q[0].numpy()), arm
        assert np.array_equal(ev["oracle.q"], torch.cat(seen.q[1:], dim=1).numpy()), arm
        assert np.array_equal(ev["oracle.k"], seen.k.numpy()), arm
        for b, r in enumerate(rows if pol.mixed else []):
            assert np.array_equal(data[r["arrays"]["alloc_score"]], seen.scores(LAYERS)[b].numpy()), arm


def test_the_oracle_arms_decide_from_the_pass_they_are_handed(tiny):
    """The comparison above can fail: an oracle arm handed a pass whose scores rank the other way
    (negated: the least attended keys, the other end of the concentration order) decides otherwise,
    so an arm that read another pass than its own would not match."""
    from testbed import live

    arms = ["int2_hh_oracle", "mix24_oracle_diffuse"]
    proto, ctx, units = _units(tiny, arms)
    _, out, _ = live.run_unit(proto, units[0], ctx)
    flipped = out[:3] + (out[3]._map(lambda t: -t if t.dtype == torch.float64 else t),)
    for j, (arm, name) in enumerate((("int2_hh_oracle", "hh_index"), ("mix24_oracle_diffuse", "alloc_score")), 1):
        assert units[j]["label"].endswith(arm)
        got = {}
        for ref in (out, flipped):
            ctx.store.saves.clear()
            rows, _, _ = live.run_unit(proto, units[j], ctx, ref)
            data = {array_rel(rel)[1]: d for rel, d in ctx.store.saves}
            got[len(got)] = [data[r["arrays"][name]] for r in rows]
        assert got[0][0] != got[1][0] and got[0][1] != got[1][1], arm


def test_an_oracle_arm_without_its_pass_is_refused(tiny):
    """An arm handed a reference output without the batch's oracle pass names what is missing."""
    from testbed import live

    proto, ctx, units = _units(tiny, ["int2_hh_oracle"])
    _, out, _ = live.run_unit(proto, units[0], ctx)
    with pytest.raises(RuntimeError, match="int2_hh_oracle: the batch's reference handed on no oracle pass"):
        live.run_unit(proto, units[1], ctx, out[:3] + (None,))
