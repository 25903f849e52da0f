"""One rank of test_distributed.py, launched by torchrun: DDPDistributedConfig over Gloo ≡ one
process bit for bit, one AllGather per step whatever the number of groups, and a group passed in
from torch.distributed.new_subgroups. Prints "rank R ok" on success; raises otherwise."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import distributed_shampoo_cpp as ds  # noqa: E402
from support import make_model, params_of, train  # noqa: E402
from worker_settings import ROBUST, SHAMPOO, exact_average, same  # noqa: E402

def groups_of(model):
    """Four groups that differ in lr and weight decay (one virtual group in the engine)."""
    params = list(model.parameters())
    return [{"params": [p], "lr": 0.01 * (i + 1), "weight_decay": 1e-3 * i}
            for i, p in enumerate(params)]


def run(distributed_config, settings=SHAMPOO):
    model = make_model()
    optimizer = ds.DistributedShampoo(groups_of(model), distributed_config=distributed_config,
                                      **settings)
    train(model, optimizer, range(1, 10))  # every rank: the same batches
    return params_of(model), optimizer


def check(condition, message):
    if not condition:
        raise AssertionError(f"rank {dist.get_rank()}: {message}")


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    single, _ = run(None)
    distributed, optimizer = run(ds.DDPDistributedConfig())
    for i, (a, e) in enumerate(zip(distributed, single)):
        check(torch.equal(a, e), f"parameter {i} differs from one process by "
                                 f"{(a - e).abs().max().item():.3e}")
    stats = optimizer.stats()
    check(stats["virtual_groups"] == 1, f"virtual groups {stats['virtual_groups']}")
    check(stats["collectives_last_step"] == 1,
          f"{stats['collectives_last_step']} collectives in the last step, expected 1")
    check(stats["bytes_sent_per_step"] > 0, "nothing sent")

    # Trainer groups of one rank each (the reference's num_trainers_per_group, HSDP's analogue
    # for DDP): every rank holds every block, and the run is still one process's.
    grouped, optimizer = run(ds.DDPDistributedConfig(num_trainers_per_group=1))
    check(all(torch.equal(a, e) for a, e in zip(grouped, single)), "num_trainers_per_group=1")

    # The model wrapped in PyTorch's DDP (as a user does): the same batches on every rank, so
    # DDP's average is the gradient itself (exactly so at world 2) and the run is one process's.
    exact = exact_average(world)
    settings = SHAMPOO if exact else ROBUST
    expected = single if exact else run(None, settings)[0]
    model = make_model()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = ds.DistributedShampoo(groups_of(model), distributed_config=ds.DDPDistributedConfig(),
                                      **settings)
    train(wrapped, optimizer, range(1, 10))
    for i, (a, e) in enumerate(zip(params_of(model), expected)):
        check(same(a, e, exact), f"under DDP, parameter {i} differs by "
                                 f"{(a - e).abs().max().item():.3e}")

    # A group passed in: every rank its own subgroup of one (dist.new_subgroups(1)).
    subgroup, _ = dist.new_subgroups(group_size=1)
    alone, optimizer = run(ds.DDPDistributedConfig(process_group=subgroup))
    check(all(torch.equal(a, e) for a, e in zip(alone, single)), "subgroup run differs")
    alone_stats = optimizer.stats()
    # Over a group of one, a rank receives what it sends; over the world, the other rank's too.
    check(alone_stats["bytes_received_per_step"] == alone_stats["bytes_sent_per_step"],
          f"a group of one: {alone_stats}")
    check(stats["bytes_received_per_step"] > stats["bytes_sent_per_step"], f"world: {stats}")
    print(f"rank {rank} of {world} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
