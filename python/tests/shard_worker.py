"""One rank of test_distributed.py's sharded runs: python3 shard_worker.py RANK WORLD RENDEZVOUS OUT MODE.

MODE "fsdp2" trains a model under FSDP2 on the CPU over gloo (fsdp2()), "fsdp2-cuda" on GPU RANK over NCCL,
"dcp" takes it through a torch.distributed.checkpoint round trip (dcp_round_trip()); the others are below.

Rank r holds shard r (torch.chunk along dim 0) of every tensor of sharded_case(), trains it with
dos.torch.AdamW(max_grad_norm=1.0) over a gloo group of WORLD ranks, and saves its shards and the skip
flags to OUT. MODE "group" passes process_group (the fix under test), "none" leaves it out (each rank
clips by its own shards' norm: what the test must tell apart).
"""
import sys

import torch
import torch.distributed as dist

import dos.torch as dt

STEPS, NAN_STEP, NAN_RANK = 8, 5, 1
KW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def sharded_case():
    """The whole tensors and, per step, their gradients: large (clipping is active at every step), with a
    NaN at step NAN_STEP in rank NAN_RANK's shard of the first tensor."""
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(6, 5, generator=g), torch.randn(9, generator=g), torch.randn(4, 3, 2, generator=g)]
    grads = []
    for step in range(STEPS):
        gs = [10 * torch.randn(p.shape, generator=g) for p in params]
        if step == NAN_STEP:
            gs[0].chunk(2)[NAN_RANK].view(-1)[0] = float("nan")
        grads.append(gs)
    return params, grads


def fsdp2(out, device="cpu"):
    """FSDP2 over the group on device ("cpu" over gloo, also where a GPU is present; or this rank's GPU over
    NCCL): the same model twice, fully_shard per layer and at the root, one trained with
    dos.torch.AdamW(max_grad_norm=1.0) (which finds the mesh's group itself; on a GPU it updates there), the
    other with torch.optim.AdamW and clip_grad_norm_ over the DTensors; saves the largest difference of the
    whole parameters (full_tensor) after each step, and the gradient norms torch saw."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))

    def model():
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
        m.to(device)
        for layer in (m[0], m[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m
    ref, ours = model(), model()
    a = torch.optim.AdamW(ref.parameters(), foreach=False, **KW)
    b = dt.AdamW(ours.parameters(), max_grad_norm=1.0, **KW)
    g = torch.Generator().manual_seed(2 + dist.get_rank())  # each rank its own rows of the batch
    diffs, norms = [], []
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g).to(device), (30 * torch.randn(8, 4, generator=g)).to(device)
        for m, opt in ((ref, a), (ours, b)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            if opt is a:
                norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0).full_tensor()))
            opt.step()
        diffs.append(max(float((p.full_tensor() - q.full_tensor()).abs().max()) for p, q in zip(ref.parameters(), ours.parameters())))
    placement = b.placement()
    b.close()
    # Only one layer sharded, the rest plain tensors: refused (the norm would count them once per rank).
    torch.manual_seed(1)
    part = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).to(device)
    fully_shard(part[0], mesh=mesh)
    try:
        dt.AdamW(part.parameters(), max_grad_norm=1.0, **KW).close()
        mixed = "accepted"
    except ValueError as e:
        mixed = str(e)
    torch.save({"diffs": diffs, "norms": norms, "group": b._group is not None, "mixed": mixed, "placement": placement}, out)


DCP_STEPS = 4  # steps before the checkpoint, and as many after


def dcp_round_trip(out):
    """FSDP2 over the group on the CPU, dos.torch.AdamW(max_grad_norm=1.0), through a torch.distributed.checkpoint
    round trip: a straight run of 2 * DCP_STEPS steps; and a run of DCP_STEPS steps whose model and optimizer
    state (get_model_state_dict, get_optimizer_state_dict) go through dcp.save into a directory beside OUT, a
    fresh model (other weights) and optimizer that dcp.load, set_model_state_dict and set_optimizer_state_dict
    them, and DCP_STEPS more steps. Saves whether the two runs end alike bit for bit on this rank (its shards
    of the weights and moments, the step), whether the load gave back the saved state, and what
    get_optimizer_state_dict gave for each parameter's entries (DTensors of the parameter's mesh, placements
    and shape for the moments; step plain)."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    ckpt = os.path.join(os.path.dirname(out), "dcp-checkpoint")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def model(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
        for layer in (m[0], m[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    g = torch.Generator().manual_seed(2 + dist.get_rank())  # each rank its own rows of the batch
    batches = [(torch.randn(8, 16, generator=g), 30 * torch.randn(8, 4, generator=g)) for _ in range(2 * DCP_STEPS)]

    def train(m, opt, steps):
        for x, y in steps:
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()

    def local(m, opt):
        """This rank's shards of m's weights and of opt's moments (copies), and opt's step."""
        st = opt.state_dict()["state"]
        def shard(t):  # a plain tensor (a moment before the fix) as it is
            return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()
        return ([shard(P) for P in m.parameters()],
                [{k: shard(v) for k, v in st[i].items() if k != "step"} for i in range(len(st))],
                float(st[0]["step"]))

    def same(a, b):
        return (all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[2] == b[2]
                and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a[1], b[1])))

    ref = model(1)
    ref_opt = dt.AdamW(ref.parameters(), max_grad_norm=1.0, **KW)
    train(ref, ref_opt, batches)
    want = local(ref, ref_opt)
    ref_opt.close()

    first = model(1)
    first_opt = dt.AdamW(first.parameters(), max_grad_norm=1.0, **KW)
    train(first, first_opt, batches[:DCP_STEPS])
    osd = get_optimizer_state_dict(first, first_opt)
    entries = []  # (fqn, key, what get_optimizer_state_dict gave, as the parameter wants it)
    for fqn, P in first.named_parameters():
        for k, v in osd["state"][fqn].items():
            if k == "step":
                entries.append((fqn, k, type(v).__name__, type(v) is torch.Tensor and v.dim() == 0))
            else:
                entries.append((fqn, k, f"{type(v).__name__} {getattr(v, 'placements', None)} {tuple(v.shape)}",
                                isinstance(v, DTensor) and v.device_mesh == P.device_mesh
                                and tuple(v.placements) == tuple(P.placements) and v.shape == P.shape))
    saved = local(first, first_opt)
    dcp.save({"model": get_model_state_dict(first), "optim": osd}, checkpoint_id=ckpt)
    first_opt.close()

    second = model(5)  # other weights, and a fresh optimizer: step 0, zero moments
    second_opt = dt.AdamW(second.parameters(), max_grad_norm=1.0, **KW)
    state = {"model": get_model_state_dict(second), "optim": get_optimizer_state_dict(second, second_opt)}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(second, state["model"])
    set_optimizer_state_dict(second, second_opt, state["optim"])
    loaded = local(second, second_opt)
    train(second, second_opt, batches[DCP_STEPS:])
    got = local(second, second_opt)
    second_opt.close()
    torch.save({"entries": entries, "loaded_same": same(loaded, saved), "same": same(got, want),
                "moved": not same(got, loaded), "saved_exp_avg": saved[1][0]["exp_avg"],
                "diffs": [float((x - y).abs().max()) for x, y in zip(got[0], want[0])]}, out)


def _teardown():
    """Leaves the group once every rank is done with it: a rank that destroys its gloo group while another
    still talks to it can abort in gloo's threads ("terminate called without an active exception", about one
    run in thirty with Debian's torch 1.13)."""
    dist.barrier()
    dist.destroy_process_group()


def main():
    rank, world, rendezvous, out, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    if mode == "fsdp2-cuda":  # each rank on its own GPU, as torchrun's users place them
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        fsdp2(out, f"cuda:{rank}")
        _teardown()
        return
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    if mode == "fsdp2":
        fsdp2(out)
        _teardown()
        return
    if mode == "dcp":
        dcp_round_trip(out)
        _teardown()
        return
    params, grads = sharded_case()
    mine = [torch.nn.Parameter(p.chunk(world)[rank].clone()) for p in params]
    group = dist.group.WORLD if mode == "group" else None
    opt = dt.AdamW(mine, max_grad_norm=1.0, process_group=group, **KW)
    skipped = []
    for gs in grads:
        for p, g in zip(mine, gs):
            p.grad = g.chunk(world)[rank].clone()
        opt.step()
        skipped.append(opt.skipped)
    torch.save({"params": [p.detach().clone() for p in mine], "skipped": skipped}, out)
    opt.close()
    _teardown()


if __name__ == "__main__":
    main()
