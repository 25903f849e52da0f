"""DDPDistributedConfig from Python: tests/python/ddp_worker.py at world 2 under torchrun (Gloo),
and the errors a user meets without a process group. SHAMPOO_TORCHRUN names the launcher."""

import os
import subprocess
import sys
import unittest

import torch

import distributed_shampoo_cpp as ds
from support import env, make_model

HERE = os.path.dirname(os.path.abspath(__file__))


class DistributedFromPython(unittest.TestCase):
    def test_world_2_equals_one_process_with_one_allgather_per_step(self):
        torchrun = env("SHAMPOO_TORCHRUN")
        launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
        result = subprocess.run(
            launcher + ["--standalone", "--nproc-per-node", "2",
                        os.path.join(HERE, "ddp_worker.py")],
            capture_output=True, text=True, timeout=300)
        output = result.stdout + result.stderr
        self.assertEqual(result.returncode, 0, output[-4000:])
        self.assertIn("rank 0 of 2 ok", output)
        self.assertIn("rank 1 of 2 ok", output)

    def test_without_torch_distributed_the_error_says_what_to_do(self):
        with self.assertRaisesRegex(ValueError, "init_process_group"):
            ds.DistributedShampoo(make_model().parameters(),
                                  distributed_config=ds.DDPDistributedConfig())

    def test_a_group_without_a_cpu_backend_is_refused_with_what_to_pass(self):
        class NcclOnlyGroup:  # answers as a ProcessGroup with only a CUDA backend does
            def _get_backend(self, device):
                raise RuntimeError(f"No backend type associated with device type {device}")

        with self.assertRaisesRegex(ValueError, "backend='gloo'"):
            ds.DistributedShampoo(make_model().parameters(),
                                  distributed_config=ds.DDPDistributedConfig(
                                      process_group=NcclOnlyGroup()))

    def test_sharded_configs_are_refused_by_name(self):
        class FullyShardDistributedConfig:  # a stand-in for the reference's class
            def __init__(self):
                self.param_assignment_strategy = None

        with self.assertRaisesRegex(ValueError, "FullyShardDistributedConfig"):
            ds.DistributedShampoo(make_model().parameters(),
                                  distributed_config=FullyShardDistributedConfig())


if __name__ == "__main__":
    unittest.main()
