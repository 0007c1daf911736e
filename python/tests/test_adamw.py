"""dos.torch.AdamW against torch.optim.AdamW on CPU tensors (issue 18's CPU tests, first part).

Run by `make test` (after `make python`) with a python3 that has torch and pytest; where CI is set, a missing
torch or pytest fails.
"""
import os
import re

import pytest
import torch

import dos
import dos.torch as dt
from dos import _native

SHAPES = [(7,), (33, 17), (4, 5, 6), (1,), (256, 3)]


def make(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def run(kind, steps, groups_of, opt_kwargs, group_kwargs=None, sched=None, seed=0):
    """Trains fresh copies of the same tensors with dos or torch for steps steps on the same gradients."""
    ps = [torch.nn.Parameter(t.clone()) for t in make(seed)]
    groups = groups_of(ps)
    if group_kwargs:
        for g, kw in zip(groups, group_kwargs):
            g.update(kw)
    if kind == "dos":
        opt = dt.AdamW(groups, **opt_kwargs)
    else:
        opt = torch.optim.AdamW(groups, foreach=False, **opt_kwargs)
    s = sched(opt) if sched else None
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen) * 0.1
        opt.step()
        opt.zero_grad()
        if s:
            s.step()
    return ps


def assert_close(a, b, rel=1e-6):
    worst = 0.0
    for x, y in zip(a, b):
        d = (x.data - y.data).abs().max().item()
        scale = max(y.data.abs().max().item(), 1e-30)
        worst = max(worst, d / scale)
    assert worst <= rel, f"worst relative difference {worst:.3g} > {rel}"
    return worst


one_group = lambda ps: [{"params": ps}]
two_groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:]}]


@pytest.mark.parametrize("opt_kwargs", [
    dict(lr=1e-3),
    dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
    dict(lr=1e-2, amsgrad=True),
    dict(lr=1e-3, maximize=True, weight_decay=0.0),
    dict(lr=5e-3, amsgrad=True, maximize=True, weight_decay=0.05),
])
def test_matches_torch(opt_kwargs):
    a = run("dos", 100, one_group, opt_kwargs)
    b = run("torch", 100, one_group, opt_kwargs)
    assert_close(a, b)


def test_param_groups_and_scheduler():
    kw = dict(lr=2e-3, weight_decay=0.01)
    groups = [dict(lr=1e-2, weight_decay=0.0), dict(weight_decay=0.2)]
    sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.05 * s))
    a = run("dos", 100, two_groups, kw, groups, sched)
    b = run("torch", 100, two_groups, kw, groups, sched)
    assert_close(a, b)
    # The scheduler really changed the rates: without it the weights differ.
    c = run("dos", 100, two_groups, kw, groups)
    assert max((x.data - y.data).abs().max().item() for x, y in zip(a, c)) > 1e-4


def test_errors():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="float32"):
        dt.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="mix dtypes"):
        dt.AdamW([torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="shares betas"):
        dt.AdamW([{"params": [p]}, {"params": [torch.nn.Parameter(torch.zeros(2))], "betas": (0.5, 0.9)}])
    o = dt.AdamW([p], lr=1e-3)
    with pytest.raises(ValueError, match="no gradient"):
        o.step()
    p.grad = torch.ones(3)
    o.param_groups[0]["lr"] = -1.0  # checked before dos is called (Go checks it too)
    with pytest.raises(ValueError, match="param group 0: invalid lr -1.0: want a finite number >= 0"):
        o.step()
    o.param_groups[0]["lr"] = 1e-3
    o.step()
    p.data = torch.zeros(4)
    p.grad = torch.ones(4)
    with pytest.raises(ValueError, match="changed shape"):
        o.step()
    o.close()
    p.data, p.grad = torch.zeros(3), torch.ones(3)
    with pytest.raises(dos.DosError, match="closed"):
        o.step()


def test_exported_symbols_match():
    """The functions _native declares are the ones libdos.h (written by go build -buildmode=c-shared) exports."""
    header = os.path.join(os.path.dirname(_native.library_path()), "libdos.h")
    if not os.path.exists(header):
        pytest.skip(f"{header} missing (make python writes it)")
    text = open(header).read()
    exported = set(re.findall(r"^extern [^(]*?\b(dos_\w+)\(", text, re.M))
    assert exported == set(_native.SIGNATURES), (exported, set(_native.SIGNATURES))
    for name, (_, args) in _native.SIGNATURES.items():
        decl = re.search(r"^extern [^(]*\b" + name + r"\(([^)]*)\)", text, re.M).group(1)
        n = 0 if decl.strip() in ("", "void") else decl.count(",") + 1
        assert n == len(args), f"{name}: the header has {n} parameters, _native declares {len(args)}"


def train_steps(opt, ps, gen, steps):
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen) * 0.1
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("amsgrad", [False, True])
def test_state_dict_both_ways(amsgrad):
    """dos -> torch and torch -> dos: 20 steps in one, the state dict into the other, 20 more steps in both:
    the same weights and moments (within 1e-6)."""
    kw = dict(lr=3e-3, weight_decay=0.05, amsgrad=amsgrad)
    for first, second in [(dt.AdamW, torch.optim.AdamW), (torch.optim.AdamW, dt.AdamW)]:
        ps = [torch.nn.Parameter(t.clone()) for t in make(3)]
        a = first([{"params": ps[:2]}, {"params": ps[2:], "lr": 1e-2}], **kw)
        gen = torch.Generator().manual_seed(7)
        train_steps(a, ps, gen, 20)
        sd = a.state_dict()
        assert set(sd["state"][0]) >= {"step", "exp_avg", "exp_avg_sq"}
        assert float(sd["state"][0]["step"]) == 20
        qs = [torch.nn.Parameter(p.data.clone()) for p in ps]
        b = second([{"params": qs[:2]}, {"params": qs[2:], "lr": 1e-2}], **kw)
        b.load_state_dict(sd)
        g1, g2 = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
        train_steps(a, ps, g1, 20)
        train_steps(b, qs, g2, 20)
        assert_close(ps, qs)
        sa, sb = a.state_dict(), b.state_dict()
        for k in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            # Relative over the whole state of kind k: a moment is a sum of terms of both signs, so one
            # small element's own relative error says little.
            x = torch.cat([sa["state"][i][k].flatten() for i in range(len(ps))])
            y = torch.cat([sb["state"][i][k].flatten() for i in range(len(ps))])
            rel = ((x - y).norm() / y.norm()).item()
            assert rel <= 1e-6, (first.__module__, k, rel)
        for i in range(len(ps)):
            assert float(sa["state"][i]["step"]) == float(sb["state"][i]["step"]) == 40


def test_load_state_dict_refuses_other_hyperparameters():
    p = torch.nn.Parameter(torch.zeros(3))
    sd = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], weight_decay=0.5).state_dict()
    with pytest.raises(ValueError, match="weight_decay"):
        dt.AdamW([p], weight_decay=0.01).load_state_dict(sd)


def test_save_load(tmp_path):
    """A lazy save after 10 steps, durable; a new optimizer loads it and takes the next 10 steps bit for bit
    as the first one does; the files are safetensors with the state's tensors."""
    import json as _json
    import struct
    ps = [torch.nn.Parameter(t.clone()) for t in make(4)]
    a = dt.AdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 2e-3}], lr=1e-3, amsgrad=True)
    train_steps(a, ps, torch.Generator().manual_seed(1), 10)
    h = a.save(tmp_path / "ck")
    d = h.wait()
    assert h.done() and os.path.isdir(d) and d.endswith("step-000000010"), d
    saved = [p.data.clone() for p in ps]
    train_steps(a, ps, torch.Generator().manual_seed(2), 10)
    qs = [torch.nn.Parameter(torch.zeros_like(p)) for p in ps]
    b = dt.AdamW([{"params": qs[:3]}, {"params": qs[3:], "lr": 0.5}], lr=1e-3, amsgrad=True)
    b.load(tmp_path / "ck")
    assert all(torch.equal(q.data, s) for q, s in zip(qs, saved))
    assert b.param_groups[1]["lr"] == 2e-3
    train_steps(b, qs, torch.Generator().manual_seed(2), 10)
    assert all(torch.equal(p.data, q.data) for p, q in zip(ps, qs))
    names = set()
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            with open(os.path.join(d, f), "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                names |= set(_json.loads(fh.read(n))) - {"__metadata__"}
    assert {"p0.master", "p0.exp_avg", "p0.exp_avg_sq", "p0.max_exp_avg_sq"} <= names, sorted(names)[:8]
    with pytest.raises(dos.DosError):
        b.load(tmp_path / "missing")


def test_save_keep(tmp_path):
    """save(root, keep=2) retires all but the newest two checkpoints after each commit; the latest loads;
    a negative keep is refused."""
    ps = [torch.nn.Parameter(t.clone()) for t in make(7)]
    a = dt.AdamW(ps, lr=1e-3)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        train_steps(a, ps, g, 1)
        a.save(tmp_path / "ck", keep=2).wait()
    steps = sorted(f for f in os.listdir(tmp_path / "ck") if f.startswith("step-"))
    assert steps == ["step-000000004", "step-000000005"], steps
    b = dt.AdamW([torch.nn.Parameter(torch.zeros_like(p)) for p in ps], lr=1e-3)
    b.load(tmp_path / "ck")
    assert all(torch.equal(b.master_weights(i), a.master_weights(i)) for i in range(len(ps)))
    train_steps(a, ps, g, 1)
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="keep="):
            a.save(tmp_path / "ck", keep=bad)
        with pytest.raises(ValueError, match="ring_bytes="):
            a.save(tmp_path / "ck", ring_bytes=bad)
    a.save(tmp_path / "ring", ring_bytes=64 << 20).wait()  # a larger ring: the same checkpoint
    r = dt.AdamW([torch.nn.Parameter(torch.zeros_like(p)) for p in ps], lr=1e-3)
    r.load(tmp_path / "ring")
    assert all(torch.equal(r.master_weights(i), a.master_weights(i)) for i in range(len(ps)))
    train_steps(a, ps, g, 1)
    with pytest.raises(ValueError, match=r"ring_bytes=4096: want 0 .* 33554432"):  # below two chunks: refused before dos
        a.save(tmp_path / "tiny", ring_bytes=4096)
    assert not os.path.exists(tmp_path / "tiny")


def test_torch_switches():
    """torch.optim.AdamW's foreach and fused are taken and change nothing (the same bits as without them);
    capturable and differentiable, which dos cannot do, raise."""
    runs = []
    for kw in ({}, dict(fused=True), dict(foreach=False, fused=None)):
        ps = [torch.nn.Parameter(t.clone()) for t in make(9)]
        opt = dt.AdamW(ps, lr=1e-3, **kw)
        train_steps(opt, ps, torch.Generator().manual_seed(11), 3)
        runs.append([p.detach().clone() for p in ps])
    assert all(torch.equal(x, y) for r in runs[1:] for x, y in zip(runs[0], r))
    for kw, match in ((dict(capturable=True), "capturable"), (dict(differentiable=True), "differentiable")):
        with pytest.raises(ValueError, match=match):
            dt.AdamW([torch.nn.Parameter(torch.zeros(3))], **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_parameters(dtype):
    """16-bit parameters: dos keeps fp32 master weights and takes 16-bit gradients. torch.optim.AdamW on fp32
    copies fed the same (16-bit) gradients is the reference: the masters agree within 1e-6, and where a master
    agrees bit for bit, the 16-bit parameter is its rounding, bit for bit."""
    kw = dict(lr=1e-3, weight_decay=0.01)
    init = [t.to(dtype) for t in make(5)]
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.float()) for t in init]
    a, b = dt.AdamW(ps, **kw), torch.optim.AdamW(ref, foreach=False, **kw)
    gen = torch.Generator().manual_seed(11)
    for _ in range(50):
        for p, r in zip(ps, ref):
            g = (torch.randn(p.shape, generator=gen) * 0.1).to(dtype)
            p.grad, r.grad = g, g.float()
        a.step()
        b.step()
    masters = [a.master_weights(i) for i in range(len(ps))]
    assert_close([torch.nn.Parameter(m) for m in masters], ref)
    agree = total = 0
    for p, m, r in zip(ps, masters, ref):
        same = m.view(torch.int32) == r.data.view(torch.int32)
        assert torch.equal(p.data[same], r.data[same].to(dtype))
        agree, total = agree + int(same.sum()), total + same.numel()
    assert agree > total // 2, (agree, total)


def test_max_grad_norm_and_nonfinite_skip():
    """max_grad_norm clips as torch.nn.utils.clip_grad_norm_ before torch.optim.AdamW does; a non-finite
    gradient skips the whole step (nothing changes, the step count stays), as GradScaler's skip."""
    ps = [torch.nn.Parameter(t.clone()) for t in make(6)]
    ref = [torch.nn.Parameter(t.clone()) for t in make(6)]
    a = dt.AdamW(ps, lr=1e-2, max_grad_norm=0.5)
    b = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(30):
        for p, r in zip(ps, ref):
            g = torch.randn(p.shape, generator=gen)
            p.grad, r.grad = g.clone(), g.clone()
        a.step()
        torch.nn.utils.clip_grad_norm_(ref, 0.5)
        b.step()
    assert_close(ps, ref)
    before = [p.data.clone() for p in ps]
    for p in ps:
        p.grad = torch.zeros_like(p)
    ps[1].grad[0, 0] = float("inf")
    a.step()
    assert all(torch.equal(p.data, q) for p, q in zip(ps, before))
    assert float(a.state_dict()["state"][0]["step"]) == 30


def test_review_cases():
    """What a review of the binding found: each misuse raises (never crashes), and torch's semantics hold."""
    # A dtype changed after construction (model.half()): refused before any byte moves.
    a, b = torch.nn.Parameter(torch.randn(1000)), torch.nn.Parameter(torch.randn(10))
    o = dt.AdamW([a, b])
    a.data, b.data = a.data.bfloat16(), b.data.bfloat16()
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    with pytest.raises(ValueError, match="changed dtype"):
        o.step()
    # A parameter changed in place between steps is taken, as torch.optim.AdamW sees it.
    m1, m2 = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    m2.load_state_dict(m1.state_dict())
    o1, o2 = dt.AdamW(m1.parameters(), lr=0.1), torch.optim.AdamW(m2.parameters(), lr=0.1, foreach=False)
    for m in (m1, m2):
        with torch.no_grad():
            m.weight.fill_(5.0)
        m(torch.ones(1, 3)).sum().backward()
    o1.step()
    o2.step()
    assert torch.allclose(m1.weight, m2.weight, rtol=1e-6) and torch.allclose(m1.bias, m2.bias, rtol=1e-6)
    # Before the first step every parameter has state, step 0 and zero moments (torch's has none, and starts
    # from the same): torch.optim.AdamW loads it and steps bit for bit as a fresh one.
    p, q0 = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    sd = dt.AdamW([p]).state_dict()
    assert set(sd["state"]) == {0} and float(sd["state"][0]["step"]) == 0
    assert torch.equal(sd["state"][0]["exp_avg"], torch.zeros(3)) and torch.equal(sd["state"][0]["exp_avg_sq"], torch.zeros(3))
    t, t0 = torch.optim.AdamW([p], foreach=False), torch.optim.AdamW([q0], foreach=False)
    t.load_state_dict(sd)
    p.grad, q0.grad = torch.ones(3), torch.ones(3)
    t.step()
    t0.step()
    assert torch.equal(p.data, q0.data) and torch.equal(t.state[p]["exp_avg_sq"], t0.state[q0]["exp_avg_sq"])
    # A failed load_state_dict changes nothing.
    q = torch.nn.Parameter(torch.ones(4))
    o = dt.AdamW([q], lr=1e-3)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.ones(5))], lr=0.5)
    other.param_groups[0]["params"][0].grad = torch.ones(5)
    other.step()
    with pytest.raises(ValueError, match="shape"):
        o.load_state_dict(other.state_dict())
    assert o.param_groups[0]["lr"] == 1e-3 and float(o.state_dict()["state"][0]["step"]) == 0
    assert torch.equal(o.state_dict()["state"][0]["exp_avg"], torch.zeros(4))
    # No group added later; no NaN hyperparameters; no empty parameters.
    with pytest.raises(NotImplementedError):
        o.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    with pytest.raises(ValueError, match="invalid lr"):
        dt.AdamW([torch.nn.Parameter(torch.ones(2))], lr=float("nan"))
    with pytest.raises(ValueError, match="empty"):
        dt.AdamW([torch.nn.Parameter(torch.empty(0, 5))])
    # A non-finite gradient: the step is skipped, and says so.
    q.grad = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    o.step()
    assert o.skipped and torch.equal(q.data, torch.ones(4))
    q.grad = torch.ones(4)
    o.step()
    assert not o.skipped and not torch.equal(q.data, torch.ones(4))


def test_save_twice_refused(tmp_path):
    p = torch.nn.Parameter(torch.ones(5))
    o = dt.AdamW([p], lr=0.1)
    o.save(tmp_path / "ck").wait()
    with pytest.raises(ValueError, match="saved"):
        o.save(tmp_path / "ck")
    p.grad = torch.ones(5)
    o.step()  # a refused save does not break the next step
    assert o.save(tmp_path / "ck").wait().endswith("step-000000001")


def test_breaker_cases(tmp_path):
    """What an adversarial review found (each crashed, lost state or computed silently wrong before):
    a gradient of another size or an integer gradient raises; threads is bounded; a checkpoint with other
    fixed hyperparameters is refused by load; a state dict without a parameter's state zeroes its moments;
    a bad state dict changes nothing; pickling is refused; absurd schedule counts are refused cleanly;
    a failed save reported by wait() does not fail the next step, and the step can be saved again."""
    import copy
    import pickle

    ps = [torch.nn.Parameter(torch.randn(64))]
    opt = dt.AdamW(ps, lr=1e-2)
    ps[0].grad = torch.ones(64)
    ps[0].grad.data = torch.ones(1)  # .data skips autograd's check
    with pytest.raises(ValueError, match="gradient of shape"):
        opt.step()
    ps[0].grad.data = torch.ones(64, dtype=torch.int64)
    with pytest.raises(ValueError, match="gradient"):
        opt.step()
    with pytest.raises(ValueError, match="threads"):
        dt.AdamW([torch.nn.Parameter(torch.zeros(3))], threads=2**31)
    for bad in (dict(sub_group_size=0), dict(sub_group_size=1.5), dict(betas=(0.9, 0.99, 0.1)), dict(amsgrad="no"),
                dict(lr=-1), dict(eps=-1), dict(betas=(1.0, 0.9)), dict(weight_decay=-0.1)):
        with pytest.raises((ValueError, TypeError)):
            dt.AdamW([torch.nn.Parameter(torch.zeros(3))], **bad)
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(opt)
    with pytest.raises(TypeError, match="pickled"):
        copy.deepcopy(opt)
    with pytest.raises(dos.DosError, match="schedule"):
        dt.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], device="sim",
                 schedule="9223372036854775807,9223372036854775807,3")

    # load refuses other fixed hyperparameters
    ps[0].grad = torch.randn(64)
    opt.step()
    opt.save(tmp_path / "ck").wait()
    other = dt.AdamW([torch.nn.Parameter(torch.zeros(64))], lr=1e-2, weight_decay=0.5)
    with pytest.raises(dos.DosError, match="weight_decay"):
        other.load(tmp_path / "ck")

    # a state dict without state: zero moments, step 0; a bad one changes nothing
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(64))], lr=1e-2).state_dict()
    opt.load_state_dict(fresh)
    st = opt.state_dict()["state"][0]
    assert float(st["step"]) == 0 and torch.equal(st["exp_avg"], torch.zeros(64)) and torch.equal(st["exp_avg_sq"], torch.zeros(64))
    ps[0].grad = torch.full((64,), 0.1)
    opt.step()
    assert torch.allclose(opt.state_dict()["state"][0]["exp_avg"], torch.full((64,), 0.01), rtol=1e-6)
    before = opt.state_dict()
    bad = copy.deepcopy(before)
    bad["state"][0]["step"] = torch.tensor(-3.0)
    bad["state"][0]["exp_avg"] = torch.full((64,), 5.0)
    with pytest.raises(ValueError, match="step"):
        opt.load_state_dict(bad)
    neg = copy.deepcopy(before)
    neg["state"][0]["exp_avg_sq"] = -torch.ones(64)
    with pytest.raises(ValueError, match="negative"):
        opt.load_state_dict(neg)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], before["state"][0]["exp_avg"])

    # a failed lazy save: reported by wait(), then the next step is taken and the step can be saved again
    import shutil

    root = tmp_path / "lazy"
    opt.save(root).wait()  # the root's engine is made
    opt.step()
    shutil.rmtree(root)
    root.write_text("x")  # the root replaced by a file: the next save fails in the background
    h = opt.save(root)
    with pytest.raises(dos.DosError):
        h.wait()
    step = opt.state_dict()["state"][0]["step"].item()
    root.unlink()
    opt.save(root).wait()  # the same step again, into the repaired root
    opt.step()
    assert opt.state_dict()["state"][0]["step"].item() == step + 1


def test_save_refuses_non_finite(tmp_path):
    """Finite but huge gradients overflow exp_avg_sq to Inf, a state load() refuses: the lazy save does not
    commit it, wait() raises naming the tensor, and under keep=1 the checkpoint that loads stays the latest."""
    p = torch.nn.Parameter(torch.ones(64))
    opt = dt.AdamW([p], lr=1e-3)
    p.grad = torch.full((64,), 0.5)
    opt.step()
    root = tmp_path / "ck"
    good = opt.save(root, keep=1).wait()
    p.grad = torch.full((64,), 0.5)
    p.grad[7] = 3e38  # squared: +Inf in fp32
    opt.step()
    with pytest.raises(dos.DosError, match=r"p0\.exp_avg_sq.*element 7 is \+Inf"):
        opt.save(root, keep=1).wait()
    assert sorted(f for f in os.listdir(root) if f.startswith("step-")) == [os.path.basename(good)]
    q = torch.nn.Parameter(torch.zeros(64))
    b = dt.AdamW([q], lr=1e-3)
    b.load(root)
    assert b.state_dict()["state"][0]["step"].item() == 1
