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


def _run_ranks(tmp_path, world, mode):
    """Runs shard_worker.py as WORLD processes (fresh ones: dos's Go runtime does not survive a fork) and
    returns each rank's saved result."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(here, ".."), here, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "shard_worker.py"), str(r), str(world),
                               str(tmp_path / f"rendezvous-{mode}"), str(tmp_path / f"{mode}-{r}.pt"), mode],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"rank {r} failed:\n{out.decode(errors='replace')}"
    return [torch.load(tmp_path / f"{mode}-{r}.pt") for r in range(world)]


def test_sharded_two_ranks(tmp_path):
    """Two gloo ranks, each with dos.torch.AdamW over its shards of the same tensors (as FSDP2 gives them)
    and process_group: every step clips by the whole model's norm and a NaN in rank 1's shard skips the
    step on both ranks, so the shards follow torch.optim.AdamW with clip_grad_norm_ on the whole tensors
    within 1e-6. Without process_group each rank clips by its own shards' norm and they do not."""
    import shard_worker as sw
    params, grads = sw.sharded_case()
    ref = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ref, foreach=False, **sw.KW)
    want_skipped = []
    for gs in grads:
        for p, g in zip(ref, gs):
            p.grad = g.clone()
        skip = not all(torch.isfinite(g).all() for g in gs)
        want_skipped.append(skip)
        if not skip:  # dos skips a non-finite step whole, as GradScaler does
            torch.nn.utils.clip_grad_norm_(ref, 1.0)
            opt.step()
    assert want_skipped.count(True) == 1
    got = _run_ranks(tmp_path, 2, "group")
    for r, res in enumerate(got):
        assert res["skipped"] == want_skipped, f"rank {r} skipped {res['skipped']}"
        for i, (p, q) in enumerate(zip(ref, res["params"])):
            torch.testing.assert_close(q, p.detach().chunk(2)[r], rtol=1e-6, atol=1e-6, msg=lambda m: f"rank {r} tensor {i}: {m}")
    alone = _run_ranks(tmp_path, 2, "none")
    assert alone[0]["skipped"] != want_skipped, "rank 0 skipped without seeing rank 1's NaN"
    assert any(not torch.allclose(q, p.detach().chunk(2)[0], rtol=1e-4, atol=1e-4)
               for p, q in zip(ref, alone[0]["params"])), "clipping by one rank's shards matched the whole model's"


def test_fsdp2_two_ranks(tmp_path):
    """FSDP2 (fully_shard) over two gloo ranks on the CPU: dos.torch.AdamW takes each rank's shards, finds the
    device mesh's group itself, and follows torch.optim.AdamW with clip_grad_norm_ over the DTensors (clipping
    active at every step) within 1e-5 at every step; a model sharded only in part is refused."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except Exception as e:  # ImportError; Debian's torch 1.13 fails to import fsdp on Python 3.11 (ValueError)
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2): {type(e).__name__}")
    got = _run_ranks(tmp_path, 2, "fsdp2")
    for r, res in enumerate(got):
        assert res["group"], f"rank {r}: dos found no shard group"
        assert min(res["norms"]) > 1.0, f"clipping inactive: norms {res['norms']}"
        assert max(res["diffs"]) < 1e-5, f"rank {r}: differences per step {res['diffs']}"
        assert "sharded DTensors and the others are not" in res["mixed"], f"rank {r}: a partly sharded model: {res['mixed']}"


def test_fsdp2_two_gpus(tmp_path):
    """FSDP2 over two NCCL ranks, rank r on GPU r (issue 19's done-when, on a machine with two GPUs or more):
    each rank's dos.torch.AdamW updates its shards on its own GPU and follows torch.optim.AdamW with
    clip_grad_norm_ over the DTensors within 1e-5 at every step, clipping active; a model sharded only in
    part is refused."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except Exception as e:
        pytest.skip(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2): {type(e).__name__}")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip(f"needs two GPUs and NCCL: {torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s)")
    got = _run_ranks(tmp_path, 2, "fsdp2-cuda")
    for r, res in enumerate(got):
        assert res["group"], f"rank {r}: dos found no shard group"
        assert res["placement"]["device"], f"rank {r}: dos did not update on the GPU: {res['placement']}"
        assert min(res["norms"]) > 1.0, f"clipping inactive: norms {res['norms']}"
        assert max(res["diffs"]) < 1e-5, f"rank {r}: differences per step {res['diffs']}"
        assert "sharded DTensors and the others are not" in res["mixed"], f"rank {r}: a partly sharded model: {res['mixed']}"


def test_fsdp2_dcp_round_trip(tmp_path):
    """FSDP2 over two gloo ranks on the CPU: dos.torch.AdamW's state through torch.distributed.checkpoint
    (get_optimizer_state_dict, dcp.save, a fresh model and optimizer, dcp.load, set_optimizer_state_dict) and
    more steps ends bit for bit where a run without the round trip does, on each rank (its shards of the
    weights and moments, the step). get_optimizer_state_dict gives the moments as DTensors of the parameter's
    mesh, placements and shape (as torch.optim.AdamW's), step a plain tensor: plain moments DCP takes for
    replicated and keeps one rank's, so every other rank would load that rank's shards."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.checkpoint import load, save  # noqa: F401
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except Exception as e:  # ImportError, AttributeError; torch 1.13's fsdp fails to import on Python 3.11 (ValueError)
        pytest.skip(f"needs torch >= 2.6 with torch.distributed.fsdp.fully_shard (FSDP2), torch.distributed.tensor "
                    f"and torch.distributed.checkpoint.state_dict; torch {torch.__version__}: {type(e).__name__}: {e}")
    got = _run_ranks(tmp_path, 2, "dcp")
    assert not torch.equal(got[0]["saved_exp_avg"], got[1]["saved_exp_avg"]), "the ranks' shards are alike: the test cannot tell"
    for r, res in enumerate(got):
        wrong = [e for e in res["entries"] if not e[3]]
        assert not wrong, f"rank {r}: get_optimizer_state_dict's entries not as torch.optim.AdamW's: {wrong}"
        assert len(res["entries"]) == 3 * 6, f"rank {r}: {res['entries']}"  # 6 parameters: step, exp_avg, exp_avg_sq
        assert res["loaded_same"], f"rank {r}: the loaded state is not the saved one"
        assert res["moved"], f"rank {r}: the steps after the load changed nothing"
        assert res["same"], f"rank {r}: the run through DCP ends apart from the straight run: weights {res['diffs']}"


class _Placement:
    """A stand-in for a DTensor placement: replicated (dos finds no shard group), equal to its kind."""

    def __init__(self, kind="R"):
        self.kind = kind

    def is_shard(self):
        return False

    def __eq__(self, other):
        return isinstance(other, _Placement) and other.kind == self.kind

    def __repr__(self):
        return f"_Placement({self.kind!r})"


class _FakeDTensor:
    """What dos reads and gives of a DTensor, for torch without one (Debian's 1.13): from_local's arguments,
    to_local, shape, placements."""

    def __init__(self, local, mesh, placements, shape, stride):
        self.local, self.device_mesh, self.placements, self.shape, self.strides = local, mesh, tuple(placements), shape, stride

    @staticmethod
    def from_local(local, device_mesh, placements, *, run_check, shape, stride):
        assert run_check is False
        return _FakeDTensor(local, device_mesh, placements, shape, stride)

    def to_local(self):
        return self.local


def _fake_dtensor_param(t):
    """A parameter dos takes as a DTensor: to_local (t's storage), placements and a device mesh."""
    P = torch.nn.Parameter(t)
    P.placements, P.device_mesh = (_Placement(),), "mesh"
    P.to_local = P.detach
    return P


def test_dtensor_parameters_give_dtensor_moments(monkeypatch):
    """For a parameter dos takes as a DTensor, state_dict() and opt.state[p] give each moment through
    DTensor.from_local with the parameter's mesh, placements, shape and stride (the local tensor: dos's
    moment, as for a plain parameter), step a plain tensor; load_state_dict and opt.state[p][k] = v take such
    a DTensor back, and refuse one whose local shard has another shape, or of other placements, naming it."""
    monkeypatch.setattr(dt, "_dtensor_type", lambda: _FakeDTensor, raising=False)  # raising: absent before the fix
    g = torch.Generator().manual_seed(5)
    w = torch.randn(6, 5, generator=g)
    P, plain = _fake_dtensor_param(w.clone()), torch.nn.Parameter(w.clone())
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, amsgrad=True)
    ours, ref = dt.AdamW([P], **kw), dt.AdamW([plain], **kw)
    for _ in range(3):
        grad = torch.randn(6, 5, generator=g)
        for p, opt in ((P, ours), (plain, ref)):
            p.grad = grad.clone()
            opt.step()
    assert torch.equal(P.detach(), plain.detach())
    sd, want = ours.state_dict(), ref.state_dict()
    assert type(sd["state"][0]["step"]) is torch.Tensor and float(sd["state"][0]["step"]) == 3.0
    for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        for v in (sd["state"][0][k], ours.state[P][k]):
            assert isinstance(v, _FakeDTensor), f"{k}: {type(v).__name__}"
            assert (v.device_mesh, v.placements, v.shape, v.strides) == ("mesh", P.placements, P.shape, P.stride())
            assert torch.equal(v.to_local(), want["state"][0][k]), k
    fresh = dt.AdamW([_fake_dtensor_param(w.clone())], **kw)
    fresh.load_state_dict(sd)
    for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert torch.equal(fresh.state_dict()["state"][0][k].to_local(), want["state"][0][k]), k
    before = ours.state[P]["exp_avg"].to_local()
    with pytest.raises(ValueError, match=r"parameter 0's exp_avg is a DTensor whose local shard has shape \(7, 5\), "
                                         r"this rank's shard of the parameter \(6, 5\)"):
        ours.state[P]["exp_avg"] = _FakeDTensor(torch.zeros(7, 5), "mesh", P.placements, P.shape, P.stride())
    with pytest.raises(ValueError, match=r"parameter 0's exp_avg is a DTensor of shape \(6, 5\) placed \(_Placement\('S'\),\)"):
        ours.state[P]["exp_avg"] = _FakeDTensor(torch.zeros(6, 5), "mesh", (_Placement("S"),), P.shape, P.stride())
    bad = {"state": {0: dict(sd["state"][0], exp_avg_sq=_FakeDTensor(torch.zeros(3, 5), "mesh", P.placements, P.shape, P.stride()))},
           "param_groups": sd["param_groups"]}
    with pytest.raises(ValueError, match=r"load_state_dict: parameter 0's exp_avg_sq is a DTensor whose local shard"):
        ours.load_state_dict(bad)
    assert torch.equal(ours.state[P]["exp_avg"].to_local(), before), "a refused moment changed dos's state"
    ours.state[P]["exp_avg"] = _FakeDTensor(torch.full((6, 5), 0.5), "mesh", P.placements, P.shape, P.stride())
    assert torch.equal(ours.state[P]["exp_avg"].to_local(), torch.full((6, 5), 0.5))
    for opt in (ours, ref, fresh):
        opt.close()


def test_plain_parameters_keep_plain_moments():
    """Parameters that are not DTensors (DDP's, one device's): state_dict() and opt.state[p] give plain
    tensors, as before."""
    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = dt.AdamW(ps, amsgrad=True)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    for i, p in enumerate(ps):
        for k in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert type(sd["state"][i][k]) is torch.Tensor, (i, k, type(sd["state"][i][k]))
            assert type(opt.state[p][k]) is torch.Tensor, (i, k, type(opt.state[p][k]))
        assert sd["state"][i]["exp_avg"].shape == p.shape
    opt.close()


def test_dtensor_moments_one_rank(one_rank):
    """A DTensor parameter on a one-rank gloo mesh (Shard(0), as FSDP2 places them): dos.torch.AdamW's
    state_dict() and opt.state[p] give the moments as torch.optim.AdamW's state_dict does, DTensors of the
    parameter's mesh, placements and shape (values within 1e-6), and step a plain tensor as torch's;
    load_state_dict takes torch's; a DTensor moment whose local shard has another shape, or Replicate() for a
    Shard(0) parameter, is refused with a ValueError naming it."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    except ImportError as e:
        pytest.skip(f"needs torch.distributed.tensor's DTensor and torch.distributed.device_mesh; torch {torch.__version__}: {e}")
    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 5, generator=g)
    ours = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
    theirs = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    a, b = torch.optim.AdamW([theirs], foreach=False, **kw), dt.AdamW([ours], **kw)
    for _ in range(3):
        grad = torch.randn(6, 5, generator=g)
        for p, opt in ((theirs, a), (ours, b)):
            p.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
            opt.step()
    sa, sb = a.state_dict()["state"][0], b.state_dict()["state"][0]
    assert not isinstance(sa["step"], DTensor) and not isinstance(sb["step"], DTensor), (type(sa["step"]), type(sb["step"]))
    assert float(sb["step"]) == float(sa["step"]) == 3.0
    for k in ("exp_avg", "exp_avg_sq"):
        assert isinstance(sa[k], DTensor), f"torch's {k} is {type(sa[k]).__name__}"
        for v in (sb[k], b.state[ours][k]):
            assert isinstance(v, DTensor), f"{k}: {type(v).__name__}"
            assert v.device_mesh == mesh and tuple(v.placements) == tuple(sa[k].placements) == (Shard(0),)
            assert v.shape == ours.shape
            torch.testing.assert_close(v.to_local(), sa[k].to_local(), rtol=1e-6, atol=1e-7)
    c = dt.AdamW([torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))], **kw)
    c.load_state_dict(a.state_dict())
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(c.state_dict()["state"][0][k].to_local(), sa[k].to_local()), k
    before = b.state[ours]["exp_avg"].to_local()
    wrong = DTensor.from_local(torch.zeros(7, 5), mesh, [Shard(0)], run_check=False, shape=ours.shape, stride=ours.stride())
    with pytest.raises(ValueError, match=r"exp_avg is a DTensor whose local shard has shape \(7, 5\)"):
        b.state[ours]["exp_avg"] = wrong
    with pytest.raises(ValueError, match=r"exp_avg is a DTensor of shape \(6, 5\) placed \(Replicate\(\),\)"):
        b.state[ours]["exp_avg"] = DTensor.from_local(torch.zeros(6, 5), mesh, [Replicate()], run_check=False)
    assert torch.equal(b.state[ours]["exp_avg"].to_local(), before), "a refused moment changed dos's state"
    b.state[ours]["exp_avg"] = DTensor.from_local(torch.full((6, 5), 0.5), mesh, [Shard(0)], run_check=False)
    assert torch.equal(b.state[ours]["exp_avg"].to_local(), torch.full((6, 5), 0.5))
    b.close()
    c.close()
