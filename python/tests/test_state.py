"""dos.torch.AdamW.state and the tools of PyTorch's that read it (issue 29, item 4).

torch.distributed.checkpoint.state_dict's helpers take an empty ``optim.state`` for an optimizer never stepped
and step it once (zero gradients, lr 0) to make its state: with dos that step would be real (the step count and
the moments). dos's ``state`` holds every parameter from construction, so they never step it; state dicts built,
saved and loaded by them leave the trajectory as it was, bit for bit.
"""
import io
import os

import pytest
import torch

import dos.torch as dt

SHAPES = [(7,), (33, 17), (4, 5, 6), (1,)]


def dcp_init_optim_state(optim):
    """What torch.distributed.checkpoint.state_dict._init_optim_state does (torch 2.2 to 2.11), restated: it
    returns when optim.state is not empty, or when a parameter has a gradient (older versions raise there);
    else it gives every parameter requiring gradients a zero gradient, sets each group's lr to 0, calls
    step(), restores the lrs and sets the gradients to None."""
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"]]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optim.param_groups]
    for g in optim.param_groups:
        g["lr"] = 0.0
    optim.step()
    for g, lr in zip(optim.param_groups, lrs):
        g["lr"] = lr
    optim.zero_grad(set_to_none=True)


def fresh(dtype, amsgrad=False):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in SHAPES]
    return ps, dt.AdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 2e-3}], lr=1e-3, weight_decay=0.1, amsgrad=amsgrad)


def train(opt, ps, gen, steps):
    for _ in range(steps):
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype)
        opt.step()
        for p in ps:
            p.grad = None  # as zero_grad(set_to_none=True), torch 2's default


def snapshot(opt, ps):
    sd = opt.state_dict()
    return ([p.data.clone() for p in ps], [opt.master_weights(i) for i in range(len(ps))],
            {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()})


def assert_same(a, b):
    (pa, ma, sa), (pb, mb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb)), "the parameters differ"
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(ma, mb)), "the master weights differ"
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_dcp_logic_keeps_the_trajectory(dtype, amsgrad):
    """DCP's init step, a state dict through torch.save and torch.load, and load_state_dict, before the first
    step and after some, change nothing: the same weights, master weights, step and moments as a run without
    them, bit for bit."""
    ps, ref = fresh(dtype, amsgrad)
    gen = torch.Generator().manual_seed(1)
    train(ref, ps, gen, 6)
    want = snapshot(ref, ps)

    qs, opt = fresh(dtype, amsgrad)
    gen = torch.Generator().manual_seed(1)
    for steps in (0, 3):  # before the first step, and after 3
        train(opt, qs, gen, steps)
        dcp_init_optim_state(opt)
        assert float(opt.state[qs[0]]["step"]) == steps  # no step of its own
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        opt.load_state_dict(torch.load(buf))
    train(opt, qs, gen, 3)
    assert_same(snapshot(opt, qs), want)


def test_state_reflects_dos():
    """opt.state holds every parameter from construction; its values are dos's (copies); setting one writes
    it into dos, checked; it cannot be deleted or replaced."""
    ps, opt = fresh(torch.float32, amsgrad=True)
    assert len(opt.state) == len(ps) and list(opt.state) == ps and ps[1] in opt.state
    assert torch.nn.Parameter(torch.zeros(1)) not in opt.state
    st = opt.state[ps[1]]
    assert sorted(st) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
    assert float(st["step"]) == 0 and torch.equal(st["exp_avg"], torch.zeros(33, 17))
    train(opt, ps, torch.Generator().manual_seed(2), 2)
    sd = opt.state_dict()
    for i, p in enumerate(ps):
        for k, v in opt.state[p].items():
            assert torch.equal(v, sd["state"][i][k]), (i, k)
    assert float(opt.state[ps[0]]["step"]) == 2
    st["exp_avg"].add_(1.0)  # a copy: dos's is unchanged
    assert torch.equal(st["exp_avg"], sd["state"][1]["exp_avg"])
    st["exp_avg"] = torch.full((33, 17), 0.25)
    assert torch.equal(opt.state_dict()["state"][1]["exp_avg"], torch.full((33, 17), 0.25))
    opt.state[ps[0]] = {"exp_avg_sq": torch.full((7,), 2.0), "step": 9}
    sd = opt.state_dict()
    assert torch.equal(sd["state"][0]["exp_avg_sq"], torch.full((7,), 2.0))
    assert all(float(s["step"]) == 9 for s in sd["state"].values())  # dos keeps one step count
    with pytest.raises(ValueError, match="shape"):
        st["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="negative"):
        opt.state[ps[0]] = {"exp_avg": torch.zeros(7), "exp_avg_sq": -torch.ones(7)}
    assert torch.equal(opt.state[ps[0]]["exp_avg"], sd["state"][0]["exp_avg"])  # checked before any change
    with pytest.raises(KeyError, match="dos keeps"):
        st["momentum_buffer"] = torch.zeros(33, 17)
    with pytest.raises(TypeError, match="deleted"):
        del opt.state[ps[0]]
    with pytest.raises(TypeError, match="deleted"):
        opt.state.clear()
    with pytest.raises(TypeError, match="replaced"):
        opt.state = {}


def test_real_dcp_keeps_the_trajectory(tmp_path):
    """torch.distributed.checkpoint's get_optimizer_state_dict / set_optimizer_state_dict (and dcp.save and
    dcp.load between them), before the first step and after some, on one gloo rank: the trajectory is a run's
    without them, bit for bit."""
    try:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    except ImportError:
        pytest.skip(f"needs torch >= 2.2 (torch.distributed.checkpoint.state_dict); this torch is {torch.__version__}")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    def model():
        torch.manual_seed(5)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))

    def run(m, opt, gen, steps):
        for _ in range(steps):
            m(torch.randn(4, 8, generator=gen)).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        ref_m = model()
        ref = dt.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.1)
        run(ref_m, ref, torch.Generator().manual_seed(6), 6)
        want = snapshot(ref, list(ref_m.parameters()))

        m = model()
        opt = dt.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        gen = torch.Generator().manual_seed(6)
        for steps in (0, 3):
            run(m, opt, gen, steps)
            osd = get_optimizer_state_dict(m, opt)
            assert float(opt.state[next(m.parameters())]["step"]) == steps
            dcp.save({"optim": osd}, checkpoint_id=str(tmp_path / f"dcp{steps}"))
            target = {"optim": get_optimizer_state_dict(m, opt)}
            dcp.load(target, checkpoint_id=str(tmp_path / f"dcp{steps}"))
            set_optimizer_state_dict(m, opt, target["optim"])
            assert float(opt.state[next(m.parameters())]["step"]) == steps
        run(m, opt, gen, 3)
        assert_same(snapshot(opt, list(m.parameters())), want)
    finally:
        dist.destroy_process_group()
