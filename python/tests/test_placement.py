"""dos.torch.AdamW's offload options (device, gpu_budget, profile, schedule, pin_memory) on the simulated device.

The simulated device executes the interleaved engine's operations on the CPU, so the update phase placed as
asked (every subgroup on the CPU, a static split, forced counts, the model's choice) must give the bits of the
CPU-only optimizer. The same options with device="cuda" run it on GPU 0.
"""
import warnings

import pytest
import torch

import dos
import dos.torch as dt

SHAPES = [(300,), (64, 17), (5, 40), (1,), (256, 3)]  # 2,357 elements: 5 subgroups of 500 (6 in the two groups below)


def params(dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in SHAPES]


def train(opt, ps, steps, seed=7):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(p.dtype)
        opt.step()
        opt.zero_grad()


def masters(opt, n):
    return [opt.master_weights(i) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("schedule,budget,want", [
    ("cpu", 0, (6, 0, 0)),
    ("static", 2 * 12 * 500, (4, 0, 2)),
    ("2,2,2", 0, (2, 2, 2)),
    ("0,6,0", 0, (0, 6, 0)),
    ("0,0,6", 0, (0, 0, 6)),
])
def test_sim_matches_cpu(dtype, schedule, budget, want):
    """Every placement on the simulated device gives the CPU-only optimizer's master weights and 16-bit
    parameters bit for bit over 12 steps with clipping, weight decay and two parameter groups; placement()
    reports the split."""
    kw = dict(lr=1e-3, weight_decay=0.05, sub_group_size=500, max_grad_norm=0.5)
    ref_ps, ps = params(dtype), params(dtype)
    groups = lambda p: [{"params": p[:3]}, {"params": p[3:], "weight_decay": 0.0}]
    ref = dt.AdamW(groups(ref_ps), **kw)
    opt = dt.AdamW(groups(ps), device="sim", schedule=schedule, gpu_budget=budget, **kw)
    pl = opt.placement()
    assert (pl["cpu"], pl["gpu"], pl["resident"]) == want, pl
    assert pl["device"] == "sim" and pl["subgroups"] == 6 and pl["gpu_budget"] == budget
    assert ref.placement()["device"] == "" and ref.placement()["cpu"] == 6
    train(ref, ref_ps, 12)
    train(opt, ps, 12)
    for a, b in zip(masters(ref, len(ps)), masters(opt, len(ps))):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(ref_ps, ps):
        assert torch.equal(a.data.view(torch.int16), b.data.view(torch.int16))
    opt.close()


def test_auto_calibrates():
    """schedule="auto" without a profile measures this machine at construction: the simulated device has no
    rates to measure, so the model keeps every subgroup on the CPU, with a predicted time."""
    opt = dt.AdamW(params(torch.bfloat16), device="sim", gpu_budget=1 << 30, sub_group_size=500, threads=1)
    pl = opt.placement()
    assert (pl["cpu"], pl["gpu"], pl["resident"]) == (5, 0, 0) and pl["predicted_s"] > 0, pl


@pytest.mark.parametrize("kwargs,match", [
    (dict(device="sim", pin_memory=False), "pin_memory=False"),
    (dict(device="sim", dtype=torch.float32), "float32 parameters on the CPU"),
    (dict(schedule="static"), "needs a device"),
    (dict(gpu_budget=1 << 20), "need a device"),
    (dict(device="sim", schedule="fast"), "schedule \"fast\""),
    (dict(device="sim", schedule="1,1"), "schedule \"1,1\""),
    (dict(device="sim", schedule="1,1,1"), "add up"),
    (dict(device="sim", gpu_budget=-1), "gpu_budget -1"),
    (dict(device="sim", profile="/nonexistent/profile.json"), "profile.json"),
])
def test_placement_errors(kwargs, match):
    """Bad placements are refused at construction with a message that names the option."""
    dtype = kwargs.pop("dtype", torch.bfloat16)
    with pytest.raises(dos.DosError, match=match):
        dt.AdamW(params(dtype), sub_group_size=500, **kwargs)


def test_python_side_refusals():
    """What the binding refuses before Go sees it, each saying what to do: an unknown device (torch.device
    values are taken: cpu is None), a parameter given twice or frozen, a missing gradient, and betas changed
    after construction (as OneCycleLR's momentum cycling does); the step before the change still ran."""
    for device in ("tpu", "cuda:x", "cuda:-1"):
        with pytest.raises(ValueError, match="want None"):
            dt.AdamW(params(torch.bfloat16), device=device)
    assert dt.AdamW(params(torch.bfloat16), device=torch.device("cpu")).placement()["device"] == ""
    ps = params(torch.float32)
    with pytest.raises(ValueError, match="given twice"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own warning about the duplicate
        dt.AdamW([ps[0], ps[1], ps[0]])
    ps[2].requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        dt.AdamW(ps)
    ps[2].requires_grad_(True)
    opt = dt.AdamW(ps, lr=1e-3)
    train(opt, ps, 1)
    ps[0].grad = None
    for p in ps[1:]:
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="no gradient at this step"):
        opt.step()
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.param_groups[0]["betas"] = (0.85, 0.999)
    with pytest.raises(ValueError, match=r"changed betas \(0.9, 0.999\) -> \(0.85, 0.999\)"):
        opt.step()
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    opt.step()


def test_schedule_spelling_and_budget():
    """Schedules take any case and spaces; forced counts over a non-zero gpu_budget are refused with the bytes
    they need, and gpu_budget 0 sets no limit for them."""
    kw = dict(device="sim", sub_group_size=500)
    pl = dt.AdamW(params(torch.bfloat16), schedule=" 1, 2, 2 ", **kw).placement()
    assert (pl["cpu"], pl["gpu"], pl["resident"]) == (1, 2, 2), pl
    assert dt.AdamW(params(torch.bfloat16), schedule="CPU", **kw).placement()["cpu"] == 5
    with pytest.raises(dos.DosError, match=r"needs \d+ bytes of device memory.*gpu_budget is 1000"):
        dt.AdamW(params(torch.bfloat16), schedule="0,0,5", gpu_budget=1000, **kw)
    assert dt.AdamW(params(torch.bfloat16), schedule="0,0,5", **kw).placement()["resident"] == 5
