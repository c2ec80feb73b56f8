"""Teacher-forced decoding of one arm through one cache: the tokens per forward
(:func:`chunk_schedule`), a forward call, per-token log-probability, KL and argmax, and the prefill
then decode loop of an arm (:func:`run_arm`)."""

from __future__ import annotations

import numpy as np
import torch

from ..policies import Policy


def chunk_schedule(policy: Policy | None, start: int, steps: int, mode: str, ref_chunk: int) -> list[int]:
    """Tokens per forward for ``steps`` decode tokens after a cache of ``start`` tokens: one each
    in step mode; else up to the policy's next change of stored state (the reference: any), at
    most ``ref_chunk`` (the logits of a chunk are held in float32 and its KL summed in float64)."""
    out, n = [], start
    while n < start + steps:
        # a chunk never exceeds ref_chunk (exact in any chunking below a change point; bounds memory)
        c = 1 if mode == "step" else ref_chunk if policy is None else min(policy.next_change(n, masked=True), ref_chunk)
        c = int(min(c, start + steps - n))
        out.append(c)
        n += c
    return out


def _metrics(logits: torch.Tensor, targets: torch.Tensor, ref_logp: torch.Tensor | None, piece: int = 32):
    """Per token: log-prob of the target, KL(ref || this) (float64 sums), argmax, and the float32
    log-probabilities; KL is summed ``piece`` positions at a time to bound its float64 temporaries."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    am = logp.argmax(dim=-1)
    kl = torch.zeros(lp.shape, dtype=torch.float64)
    if ref_logp is not None:
        for a in range(0, logp.shape[1], piece):
            r = ref_logp[:, a:a + piece].to(torch.float64)
            kl[:, a:a + piece] = (r.exp() * (r - logp[:, a:a + piece].to(torch.float64))).sum(-1)
    return lp, kl, am, logp


def forward(model, ids, cache, kw, last_only=False):
    """Logits of every position of ``ids`` (``last_only``: of the last position only, where the
    model takes ``logits_to_keep``: a prefill whose predictions nobody scores)."""
    extra = kw.get("extra", {}) if last_only else {}
    return model(input_ids=ids, use_cache=True, **{kw["cache"]: cache}, **extra).logits


def run_arm(model, kw, ids, p, cache, schedule, ref_logp, keep_logp=False, bytes_of=None, prefill=None):
    """The prefill (its own forward, or ``prefill``: a :class:`~testbed.live.prefill.SharedPrefill`
    loaded into the cache, or ``True``: the cache already holds it), then the decode tokens in
    ``schedule``; returns per-token arrays and per-forward bytes."""
    P = p["prefill"]
    lps, kls, ams, logps, nbytes, context = [], [], [], [], [], []
    with torch.no_grad():
        if prefill is None:
            forward(model, ids[:, :P], cache, kw, last_only=True)
            if hasattr(cache, "finish_prefill"):  # a mixed policy allocates its bits over the whole model now
                cache.finish_prefill()
        elif prefill is not True:  # True: the reference's DynamicCache already holds it
            prefill.load_into(cache)  # and finishes it
        nbytes.append(bytes_of(cache))
        context.append(P)
        pos = P
        for c in schedule:
            logits = forward(model, ids[:, pos:pos + c], cache, kw)
            targets = ids[:, pos + 1:pos + c + 1]
            ref = None if ref_logp is None else ref_logp[:, pos - P:pos - P + c]
            lp, kl, am, logp = _metrics(logits, targets, ref)
            lps.append(lp)
            kls.append(kl)
            ams.append(am)
            if keep_logp:
                logps.append(logp)
            pos += c
            nbytes.append(bytes_of(cache))
            context.append(pos)
    out = {"logprob": torch.cat(lps, 1), "kl": torch.cat(kls, 1), "argmax": torch.cat(ams, 1).to(torch.int32),
           "bytes": np.asarray(nbytes, dtype=np.int64), "context": np.asarray(context, dtype=np.int64)}
    if keep_logp:
        out["logp"] = torch.cat(logps, 1)
    return out
