"""One rank of test_distributed.py's FSDP2 case, launched by torchrun: a model wrapped in
torch.distributed.fsdp.fully_shard, stepped with FullyShardDistributedConfig (each rank its own
shards, no communication in the optimizer), equals one process stepping every row chunk of every
parameter as a parameter of its own; one parameter has fewer rows than ranks (empty shards). Prints "fsdp2 rank R ok"; raises otherwise."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import distributed_shampoo_cpp as ds  # noqa: E402
from support import loss_of, make_model, train  # noqa: E402
from worker_settings import ROBUST, SHAMPOO, exact_average, same  # noqa: E402

STEPS = range(1, 10)


class Gain(torch.nn.Module):
    """A [1, 3] scale of the outputs: fewer rows than ranks, so FSDP2 leaves every rank but the
    first an empty shard of it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((1, 3), 1.1))

    def forward(self, x):
        return x * self.weight


def make_sharded_model():
    model = make_model()
    model.append(Gain())
    return model


def one_process(world, settings):
    """Every parameter's row chunks (as FSDP2 shards them) stepped as parameters of their own."""
    model = make_sharded_model()
    chunks = [[c.clone() for c in p.detach().chunk(world, dim=0)] for p in model.parameters()]
    optimizer = ds.DistributedShampoo([c for cs in chunks for c in cs], **settings)
    for t in STEPS:
        model.zero_grad()
        loss_of(model, t).backward()
        for p, cs in zip(model.parameters(), chunks):
            for c, g in zip(cs, p.grad.chunk(world, dim=0)):
                c.grad = g.clone()
        optimizer.step()
        with torch.no_grad():
            for p, cs in zip(model.parameters(), chunks):
                p.copy_(torch.cat(cs, dim=0))
    return [p.detach() for p in model.parameters()]


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # FSDP2 averages the ranks' gradients (the same here): exactly at world 2, not at world 3.
    exact = exact_average(world)
    settings = SHAMPOO if exact else ROBUST
    expected = one_process(world, settings)

    model = make_sharded_model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizer = ds.DistributedShampoo(model.parameters(),
                                      distributed_config=ds.FullyShardDistributedConfig(),
                                      **settings)
    train(model, optimizer, STEPS)  # every rank: the same batches
    for i, (p, e) in enumerate(zip(model.parameters(), expected)):
        full = p.full_tensor()
        if not same(full, e, exact):
            raise AssertionError(f"rank {rank}: parameter {i} differs from one process by "
                                 f"{(full - e).abs().max().item():.3e}")
    # Whole parameters give another run (Shampoo's factors span the rows): the comparison above
    # sees the chunking.
    whole = make_sharded_model()
    train(whole, ds.DistributedShampoo(whole.parameters(), **settings), STEPS)
    if same(next(whole.parameters()).detach(), expected[0], exact):
        raise AssertionError(f"rank {rank}: chunked and whole runs agree; the test sees nothing")
    state = optimizer.state_dict()
    if len(state["state"]) != len(expected):
        raise AssertionError(f"rank {rank}: state_dict has {len(state['state'])} entries")
    print(f"fsdp2 rank {rank} of {world} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
