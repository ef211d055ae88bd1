"""How an original-API :class:`~retrain.compat.plugin_specs.TransformSpec` runs on one
prompt group.

h = the configured uncertainty of each completion; ``entropy_transform(h,
planning_mask, sepa_lambda)`` if given (lambda is 0 unless ``uses_sepa_controller``;
the mask is all zeros unless ``needs_planning``); :func:`~retrain.compat.list_helpers.gtpo_list`
when ``use_gtpo`` (else every token gets A_i and the rest is skipped);
:func:`~retrain.compat.list_helpers.hicra_list` when ``apply_hicra``; finally
``post_process(token_advs, raw_h, params) -> (token_advs, metrics)``, whose params are
``[algorithm.transform_params]`` plus ``uncertainty_kind``, ``surprisal_mask_rho`` and
``entropy_mask_rho``. ``compute_context``, when set, replaces all of that by
``compute_context(ctx)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from retrain.compat.contexts import TransformContext
from retrain.compat.list_helpers import gtpo_list, hicra_list
from retrain.compat.outputs import TransformOutput
from retrain.compat.plugin_specs import TransformSpec


def run_transform_spec(spec: TransformSpec, ctx: TransformContext) -> Any:
    """One prompt group through `spec` (see the module docstring)."""
    if spec.compute_context is not None:
        return spec.compute_context(ctx)
    episode = ctx.episode_advantages
    if not spec.use_gtpo:
        return TransformOutput([[a] * n for a, n in zip(episode, ctx.lengths)])
    masks = ctx.planning_masks_G if spec.needs_planning else [[0] * n for n in ctx.lengths]
    lam = ctx.sepa_lambda if spec.uses_sepa_controller else 0.0
    raw = [np.asarray(h, dtype=np.float64).tolist() for h in ctx.uncertainties_G_T]
    advs = []
    for a, h, mask in zip(episode, raw, masks):
        if spec.entropy_transform is not None:
            h = spec.entropy_transform(list(h), list(mask), lam)
        token_advs = gtpo_list(a, h, ctx.gtpo_beta)
        if spec.apply_hicra:
            token_advs = hicra_list(token_advs, mask, ctx.hicra_alpha)
        advs.append(token_advs)
    if spec.post_process is None:
        return TransformOutput(advs)
    params = {
        "uncertainty_kind": ctx.uncertainty_kind,
        "surprisal_mask_rho": ctx.surprisal_mask_rho,
        "entropy_mask_rho": ctx.surprisal_mask_rho,
        **ctx.params,
    }
    out, metrics = spec.post_process(advs, [list(h) for h in raw], params)
    return TransformOutput(out, metrics)


def is_token_varying(spec: TransformSpec) -> bool:
    """Whether `spec` can give tokens of one completion different advantages: all but a
    spec without GTPO and without ``compute_context`` can."""
    return spec.compute_context is not None or spec.use_gtpo
