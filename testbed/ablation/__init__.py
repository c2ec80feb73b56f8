"""Causal ablations of the KV cache: remove a region, renormalize, measure the damage.

Observation says where attention mass sits; only intervention says what the cache is worth.
An ablation drops a set of contiguous key spans and recomputes the softmax over the keys that
are left (a masked, renormalized softmax), with the causal mask still applied: a query never
sees a later key. This is the "local output ablation" recommended by the video KV-cache
attention study (docs/studies.md): drop the sink, the recent window or all history, and
measure the pre-projection attention-output relative L2 and cosine against the full output.

Ablations (small frozen dataclasses, each ``dropped(case) -> spans | None``; None means the
Case's layout does not have what the ablation needs, and the ablation is reported as not
applicable rather than run on something else):

- ``none``: nothing dropped (the full attention; with quantized K/V it is the quantization error);
- ``drop_sink``, ``drop_recent`` (any ``drop_<region>``): the named region;
- ``drop_history``: every key before the ``current`` region (the whole cache);
- ``keep_current_only``: every key outside the ``current`` region;
- ``control_sink``, ``control_recent`` (any ``control_<region>``): as many keys as the region
  holds, drawn (seeded) from the history outside it — a block of the middle region where one
  fits, else a block elsewhere beside the target, else scattered keys (see `control_block`) —
  so that "the sink matters" can be told apart from "any that many keys matter". Where the
  history outside the region is smaller than the region, there is no valid control and it is
  not applicable;
- ``mass_control_sink``, ``mass_control_recent`` (any ``mass_control_<region>``): per row (head x
  query), keys of the history outside the region whose reference attention mass matches the
  region's within 1 % (see `select_mass_matched`), so that "the sink matters" can be told apart
  from "removing that much mass matters". The key set differs from row to row; a row with no
  such set is *unmatched* (NaN, counted, left out of every mean). Run by `mass_control`, a
  per-row-mask path (the atoms below are shared by all rows).

With dropped mass ``tau = sum_{j dropped} P_j`` the ablated row is ``P' = P / (1 - tau)`` on the
kept keys, so ``TV(P, P') = tau`` and ``O' - O = tau (mu_kept - mu_dropped)`` where ``mu`` are the
P-weighted value means of each side (tests hold both). A row whose kept visible set is empty
has no softmax: it is NaN, counted in ``undefined`` and left out of every mean, never zero.

The computation (`ablate`) runs over tiles of one KV head x a slice of queries (at most about
``max_scores`` scores alive). Keys are cut into *atoms* at every region and span boundary; per
atom the tile keeps its running max ``m_a``, ``Z_a = sum exp(s - m_a)`` and ``N_a = sum exp(s -
m_a) v`` (one P.V product in total, whatever the number of ablations), and every ablation merges
the atoms it keeps the way flash attention merges blocks. TV is summed over the keys atom by
atom from the two normalizers (not set to ``tau``); the tests and the audit recompute both from
an independent masked softmax.

The package, by responsibility: :mod:`~testbed.ablation.ablations` (what each ablation drops: the
region ablations, the same-size and mass-matched controls' key sets, `make_ablation`),
:mod:`~testbed.ablation.mass_select` (the mass-matched selection, `select_mass_matched`, and its
numba and numpy paths), :mod:`~testbed.ablation.rows` (the per-row masked renormalized softmax,
`drop_rows`), :mod:`~testbed.ablation.results` (`ArmResult`, `MassResult`, `MassSelections`),
:mod:`~testbed.ablation.arm` (one K/V arm's pass over the score tiles, `ablate_arm`) and
:mod:`~testbed.ablation.stats` (the per-row statistics a partial archive is audited from). The
names other modules use are re-exported here (``from testbed.ablation import ablate_arm_case``).
"""

from .ablations import (ABLATION_NAMES, MASS_ATTEMPTS, MASS_TOLERANCE, Control, DropHistory, DropRegion, Full,
                        KeepCurrentOnly, MassControl, control_block, kept_mask, make_ablation, mass_control_order)
from .arm import ablate, ablate_arm, ablate_arm_case, ablate_case, cut_points, mass_control, mass_control_case
from .mass_select import select_mass_matched
from .results import ArmResult, MassResult, MassSelections
from .rows import drop_rows
from .stats import STAT_FIELDS, row_statistics

__all__ = ["Full", "DropRegion", "DropHistory", "KeepCurrentOnly", "Control", "MassControl", "make_ablation",
           "ABLATION_NAMES", "control_block", "mass_control_order", "select_mass_matched", "mass_control", "MassResult",
           "kept_mask", "ablate", "ArmResult", "MASS_TOLERANCE", "MASS_ATTEMPTS", "ablate_case", "drop_rows",
           "mass_control_case", "MassSelections", "ablate_arm", "ablate_arm_case", "cut_points", "STAT_FIELDS",
           "row_statistics"]
