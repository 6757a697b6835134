"""Checkpoints while a step's noise is drawn ahead: no noise replayed, none read half drawn.

The optimizers draw each step's noise during its backward (a background thread on CPU). A
checkpoint loaded in the same process after a backward whose step never ran kept that pending
draw: the next step added it, and the loaded generator state drew it again one step later, so
two released updates carried the same noise (their difference cancels it). A checkpoint saved
while the draw ran read the generator wherever the thread was, so a resume could draw again
noise the original run went on to use.
"""

from __future__ import annotations

import pytest
import torch

from opacus_fsdp_sync.testing import run_ranks
from tests import workers_noise_ahead as wn

LAYOUTS = ["fsdp2_root", "fsdp1_root", "ddp_root"]


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1].item()


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_load_after_a_backward_drops_the_noise_drawn_ahead(tmp_path, layout):
    for res in run_ranks(wn.reload_after_a_backward, 2, layout, str(tmp_path / "ck"), timeout=300):
        a, b = res["a"], res["b"]
        assert a[2].numel() > 1000
        assert abs(_corr(b[2], b[3])) < 0.1  # steps 3 and 4 after the load: independent noise
        for step in (2, 3):  # and exactly the uninterrupted run's
            assert torch.allclose(b[step], a[step], rtol=1e-4, atol=1e-3), (layout, step)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["fsdp2_root", "ddp_root"])
def test_a_save_while_noise_is_drawn_keeps_the_state_after_the_draw(tmp_path, layout):
    for res in run_ranks(wn.save_while_drawing, 2, layout, str(tmp_path / "ck"), timeout=300):
        # the step draws nothing more: the mid-step state is the one after the step's draw
        assert torch.equal(res["mid"], res["post"]), layout
