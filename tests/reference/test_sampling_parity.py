"""Our logits chain against the HF processors upstream ``T3.inference`` chains, on random logits/histories."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopPLogitsWarper,
)

from mlx_chatterbox import sampling
from mlx_chatterbox.sampling import SamplingParams, process_logits, softmax
from tests.conftest import assert_same_ids_kept

pytestmark = pytest.mark.reference

V = 8194
BOS = 6561
# Max |p_ours - p_upstream|: with our exp and sum (the CPU's chain), and with MLX's (a GPU's chain, here run on
# the CPU, whose MLX exp is a fast approximation off by up to ~4e-6: on a GPU it is within a few ulps).
PROB_TOL = {"ours": 1e-6, "mlx": 1e-5}


def upstream_chain(cond, uncond, history, p: SamplingParams) -> torch.Tensor:
    """Exactly the lines of upstream ``T3.inference`` between the logits and ``torch.multinomial``."""
    logits = cond + torch.as_tensor(p.cfg_weight) * (cond - uncond)
    logits = RepetitionPenaltyLogitsProcessor(penalty=float(p.repetition_penalty))(history, logits)
    if p.temperature != 1.0:
        logits = logits / p.temperature
    logits = MinPLogitsWarper(min_p=p.min_p)(history, logits)
    logits = TopPLogitsWarper(top_p=p.top_p)(history, logits)
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize(
    "knobs",
    [
        {},  # upstream defaults
        dict(top_p=0.8),
        dict(top_p=0.3, min_p=0.0),
        dict(min_p=0.0, temperature=1.0),
        dict(min_p=0.2, temperature=0.5, repetition_penalty=2.0),
        dict(temperature=1.7, cfg_weight=1.5, repetition_penalty=1.0, top_p=0.95),
        dict(cfg_weight=0.0, min_p=0.1, top_p=0.5),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("math", ["ours", "mlx"])
def test_distribution_and_mask_equal_upstream(knobs, seed, math, monkeypatch):
    monkeypatch.setattr(sampling, "mlx_math", lambda: math == "mlx")
    params = SamplingParams(**knobs)
    rng = np.random.default_rng(seed)
    logits = ((1 + seed) * rng.standard_normal((2, V))).astype(np.float32)  # scaled so min_p and top_p cut
    history = np.concatenate([[BOS], rng.integers(0, V, rng.integers(1, 300))])
    ref = upstream_chain(
        torch.from_numpy(logits[:1]), torch.from_numpy(logits[1:]), torch.from_numpy(history)[None], params
    ).numpy()
    seen = np.zeros((1, V), bool)
    seen[0, history] = True
    ours_in = logits if params.cfg_weight > 0 else logits[:1]  # cfg_weight 0 runs batch 1
    ours = np.array(softmax(process_logits(mx.array(ours_in), mx.array(seen), params)))
    assert_same_ids_kept(ours, ref, math)
    kept = int((ref > 0).sum())
    assert 1 <= kept < V or (params.min_p == 0 and params.top_p == 1)
    err = np.abs(ours - ref).max()
    print(f"{knobs} seed {seed} {math}: {kept} ids kept, max |p_ours - p_upstream| {err:.1e}")
    assert err < PROB_TOL[math]
