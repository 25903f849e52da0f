"""Distributed from Python under torchrun (Gloo), at world 2 and 3: DDPDistributedConfig
(tests/python/ddp_worker.py), FSDP2 with FullyShardDistributedConfig (fsdp2_worker.py),
torch.distributed.checkpoint save and resume under both (dcp_worker.py); the errors a user meets
without a process group. SHAMPOO_TORCHRUN names the launcher."""

import os
import subprocess
import sys
import tempfile
import unittest

import torch

import distributed_shampoo_cpp as ds
from support import env, make_model

HERE = os.path.dirname(os.path.abspath(__file__))


class DistributedFromPython(unittest.TestCase):
    def _launch(self, worker, world, *args):
        torchrun = env("SHAMPOO_TORCHRUN")
        launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
        result = subprocess.run(
            launcher + ["--standalone", "--nproc-per-node", str(world),
                        os.path.join(HERE, worker), *args],
            capture_output=True, text=True, timeout=300)
        return result.returncode, result.stdout + result.stderr

    def test_ddp_config_equals_one_process_with_one_allgather_per_step(self):
        for world in (2, 3):
            with self.subTest(world=world):
                code, output = self._launch("ddp_worker.py", world)
                self.assertEqual(code, 0, output[-4000:])
                for rank in range(world):
                    self.assertIn(f"rank {rank} of {world} ok", output)

    def test_fsdp2_model_steps_its_shards_as_the_reference_does(self):
        for world in (2, 3):
            with self.subTest(world=world):
                code, output = self._launch("fsdp2_worker.py", world)
                self.assertEqual(code, 0, output[-4000:])
                for rank in range(world):
                    self.assertIn(f"fsdp2 rank {rank} of {world} ok", output)

    def test_dcp_save_and_resume_under_ddp_and_fsdp2(self):
        for mode in ("ddp", "fsdp2"):
            for world in (2, 3):
                with self.subTest(mode=mode, world=world), \
                        tempfile.TemporaryDirectory() as directory:
                    code, output = self._launch("dcp_worker.py", world, mode, directory)
                    self.assertEqual(code, 0, output[-4000:])
                    for rank in range(world):
                        self.assertIn(f"dcp {mode} rank {rank} of {world} ok", output)

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
        class HybridShardDistributedConfig:  # a stand-in for the reference's class
            def __init__(self):
                self.num_trainers_per_group = -1

        with self.assertRaisesRegex(ValueError, "HybridShardDistributedConfig"):
            ds.DistributedShampoo(make_model().parameters(),
                                  distributed_config=HybridShardDistributedConfig())
        with self.assertRaisesRegex(ValueError, "ROUND_ROBIN"):
            ds.DistributedShampoo(make_model().parameters(),
                                  distributed_config=ds.FullyShardDistributedConfig(
                                      param_assignment_strategy=(
                                          ds.FSDPParamAssignmentStrategy.ROUND_ROBIN)))
        with self.assertRaisesRegex(ValueError, "not a DTensor"):
            ds.DistributedShampoo(make_model().parameters(),
                                  distributed_config=ds.FullyShardDistributedConfig())


if __name__ == "__main__":
    unittest.main()
