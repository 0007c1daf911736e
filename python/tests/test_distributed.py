"""dos.torch.AdamW under torch.distributed on one rank (issue 18, item 3; the multi-GPU runs are issue 19's).

DDP keeps every parameter whole on every rank, so each rank's dos optimizer holds the full state and steps on
the all-reduced gradients. On one gloo rank (CPU), a DDP-wrapped model trained with dos.torch.AdamW follows the
same model trained with torch.optim.AdamW within 1e-6.
"""
import os

import pytest
import torch
import torch.distributed as dist

import dos.torch as dt

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))


def test_ddp_one_rank(one_rank):
    ref, ours = model(1), model(1)
    ddp_ref = torch.nn.parallel.DistributedDataParallel(ref)
    ddp_ours = torch.nn.parallel.DistributedDataParallel(ours)
    kw = dict(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    a = torch.optim.AdamW(ddp_ref.parameters(), foreach=False, **kw)
    b = dt.AdamW(ddp_ours.parameters(), **kw)
    g = torch.Generator().manual_seed(2)
    for _ in range(30):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        for m, opt in ((ddp_ref, a), (ddp_ours, b)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    for p, q in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
