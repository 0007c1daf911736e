"""dos.torch.AdamW with CUDA parameters (issue 18): the GPU machine's tests.

Skipped without a CUDA device, except where DOS_REQUIRE_GPU=1 (the GPU machine's convention): there a missing
GPU is a failure. The update phase runs on dos's engine on cuda:0 under several placements; torch.optim.AdamW
on the same parameters and gradients is the reference.
"""
import os

import pytest
import torch

import dos.torch as dt

if not torch.cuda.is_available():
    if os.environ.get("DOS_REQUIRE_GPU") == "1":
        raise RuntimeError("DOS_REQUIRE_GPU=1 but torch sees no CUDA device")
    pytest.skip("no CUDA device", allow_module_level=True)

CUDA = torch.device("cuda", 0)
SHAPES = [(300,), (64, 17), (5, 40), (1,), (256, 3)]  # 2,357 elements: 5 subgroups of 500
PLACEMENTS = [dict(schedule="cpu"), dict(schedule="0,5,0"), dict(schedule="0,0,5"), dict(schedule="2,2,1"),
              dict(schedule="static", gpu_budget=2 * 12 * 500)]


def make(dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype) for s in SHAPES]


def grads(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(*s, generator=g) * 0.1).to(dtype) for s in SHAPES]


def rel(a, b):
    return max((x - y).abs().max().item() / max(y.abs().max().item(), 1e-30) for x, y in zip(a, b))


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_cuda_fp32_matches_torch(placement):
    """float32 parameters on cuda:0: dos steps its fp32 master weights on the device; 30 steps with clipping
    and weight decay agree with torch.optim.AdamW (single-tensor, on the GPU) within 1e-6 relative, on every
    placement; placement() reports it."""
    kw = dict(lr=1e-3, weight_decay=0.05)
    ps = [torch.nn.Parameter(t.to(CUDA)) for t in make(torch.float32)]
    ref = [torch.nn.Parameter(t.to(CUDA)) for t in make(torch.float32)]
    a = dt.AdamW(ps, sub_group_size=500, **kw, **placement)
    b = torch.optim.AdamW(ref, foreach=False, **kw)
    pl = a.placement()
    assert pl["device"] and pl["subgroups"] == 5, pl
    for step in range(30):
        for p, r, g in zip(ps, ref, grads(step, torch.float32)):
            p.grad, r.grad = g.to(CUDA), g.to(CUDA)
        torch.nn.utils.clip_grad_norm_(ps, 0.5)
        torch.nn.utils.clip_grad_norm_(ref, 0.5)
        a.step()
        b.step()
    assert rel([p.data for p in ps], [r.data for r in ref]) <= 1e-6
    for i, p in enumerate(ps):  # p.data is the master weights' device copy, bit for bit
        assert torch.equal(a.master_weights(i).to(CUDA), p.data)
    a.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_16bit(dtype):
    """16-bit parameters on cuda:0: the fp32 masters agree with torch.optim.AdamW on fp32 copies fed the same
    16-bit gradients within 1e-6, and each 16-bit parameter is its master's rounding where they agree bit for
    bit."""
    kw = dict(lr=1e-3, weight_decay=0.01)
    init = make(dtype)
    ps = [torch.nn.Parameter(t.to(CUDA)) for t in init]
    ref = [torch.nn.Parameter(t.float()) for t in init]
    a = dt.AdamW(ps, sub_group_size=500, schedule="2,2,1", **kw)
    b = torch.optim.AdamW(ref, foreach=False, **kw)
    for step in range(30):
        for p, r, g in zip(ps, ref, grads(step, dtype)):
            p.grad, r.grad = g.to(CUDA), g.float()
        a.step()
        b.step()
    masters = [a.master_weights(i) for i in range(len(ps))]
    assert rel(masters, [r.data for r in ref]) <= 1e-6
    for p, m, r in zip(ps, masters, ref):
        same = m.view(torch.int32) == r.data.view(torch.int32)
        assert torch.equal(p.data.cpu()[same], r.data[same].to(dtype))


def test_cuda_grad_scaler_and_changes():
    """torch.amp.GradScaler: an Inf gradient makes it skip the step (the weights stay) and lower its scale;
    a model.load_state_dict between steps is taken, as torch.optim.AdamW sees it."""
    torch.manual_seed(0)
    m1 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)).to(CUDA)
    m2 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)).to(CUDA)
    m2.load_state_dict(m1.state_dict())
    a = dt.AdamW(m1.parameters(), lr=1e-3, schedule="0,0,1")
    b = torch.optim.AdamW(m2.parameters(), lr=1e-3, foreach=False)
    sa, sb = torch.amp.GradScaler("cuda", init_scale=2.0**10), torch.amp.GradScaler("cuda", init_scale=2.0**10)
    g = torch.Generator(device=CUDA).manual_seed(1)
    for step in range(12):
        x, y = torch.randn(8, 16, generator=g, device=CUDA), torch.randn(8, 4, generator=g, device=CUDA)
        if step == 5:
            x[0, 0] = float("inf")  # an overflow: both scalers skip
        if step == 8:
            fresh = torch.nn.Linear(32, 4).to(CUDA).state_dict()
            m1[2].load_state_dict(fresh)
            m2[2].load_state_dict(fresh)
        for m, opt, sc in ((m1, a, sa), (m2, b, sb)):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(m(x).float(), y)
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
    assert sa.get_scale() == sb.get_scale() < 2.0**10
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_cuda_refusals():
    """Misuse raises with a message that says what to do."""
    p = torch.nn.Parameter(torch.zeros(10, device=CUDA))
    for device in ("sim", "cuda:7", torch.device("cuda", 7)):
        with pytest.raises(ValueError, match="are on cuda:0, device=.*want \"cuda:0\""):
            dt.AdamW([p], device=device)
    for device in ("cuda", "cuda:0", torch.device("cuda")):  # the parameters' GPU, named or not
        assert dt.AdamW([p], device=device).placement()["device"]
    q = torch.nn.Parameter(torch.zeros(10))
    with pytest.raises(ValueError, match="are on"):
        dt.AdamW([p, q])


def test_fsdp2_one_rank(tmp_path):
    """FSDP2 (fully_shard) on one NCCL rank: dos takes the local shards (here the whole tensors) and trains as
    torch.optim.AdamW on the same sharded model."""
    dist = torch.distributed
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ms = []
        for _ in range(2):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(CUDA)
            fully_shard(m)
            ms.append(m)
        a = dt.AdamW(ms[0].parameters(), lr=1e-3, schedule="cpu")
        b = torch.optim.AdamW(ms[1].parameters(), lr=1e-3, foreach=False)
        g = torch.Generator(device=CUDA).manual_seed(2)
        for _ in range(10):
            x, y = torch.randn(8, 16, generator=g, device=CUDA), torch.randn(8, 4, generator=g, device=CUDA)
            for m, opt in zip(ms, (a, b)):
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                opt.step()
        for p, q in zip(ms[0].parameters(), ms[1].parameters()):
            torch.testing.assert_close(p.to_local(), q.to_local(), rtol=1e-6, atol=1e-7)
    finally:
        dist.destroy_process_group()
