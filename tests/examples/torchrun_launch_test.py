#!/usr/bin/env python3
"""The trainer launched the ways torchrun launches jobs on several machines, with two torchrun
agents on this machine acting as two nodes (c10d rendezvous on localhost):

  multinode  --nnodes 2, one rank per node, trains exactly as one node with two ranks: the
             losses of every iteration and the test losses are identical.
  elastic    --nnodes 1:2 --max-restarts 1 with checkpoints: once a checkpoint of the two-node
             job is committed, one node is lost (its agent and its worker get SIGKILL); the
             other agent restarts its worker at world size 1, which resumes from that checkpoint
             and finishes. The run's losses continue from the checkpoint without a jump: every
             iteration equals an uninterrupted one-process run within the world-size tolerance.

Needs only the standard library. Exit code 0: passed; 1: failed; 77: skipped (no torchrun). Every
process it starts is killed when it ends, also on failure and after its own deadline.

  torchrun_launch_test.py {multinode,elastic} --torchrun PATH --trainer PATH --work-dir DIR
"""

import argparse
import csv
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

SKIPPED = 77
# Relative tolerance of losses at another number of ranks (trainer_parity_test's kWorldSizeRtol):
# the ranks' gradients are averaged in another order; measured there at most 2.5e-7.
WORLD_SIZE_RTOL = 1e-5


class Failure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


# ---- data ----------------------------------------------------------------------------------

def write_cifar10(directory, seed=20240611):
    """CIFAR-10 binary files (5 x 64 training records, 128 test records of 3073 bytes): noise over
    a faint class template, a fifth of the labels random."""
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    templates = [rng.randbytes(3072) for _ in range(10)]

    def write(name, records):
        with open(os.path.join(directory, name), "wb") as out:
            for _ in range(records):
                image_class = rng.randrange(10)
                label = rng.randrange(10) if rng.randrange(100) < 20 else image_class
                noise = rng.randbytes(3072)
                pixels = bytes((20 * t + 236 * n) >> 8
                               for t, n in zip(templates[image_class], noise))
                out.write(bytes([label]) + pixels)

    for i in range(1, 6):
        write("data_batch_%d.bin" % i, 64)
    write("test_batch.bin", 128)


def trainer_flags(data_dir, epochs):
    """Shampoo on the small data set: global batch 32 (10 iterations per epoch) at any number of
    ranks, roots every 5 steps from step 10 (as in trainer_parity_test)."""
    return ["--dataset", "cifar10", "--data-dir", data_dir, "--model", "convnet",
            "--epochs", str(epochs), "--global-batch-size", "32", "--seed", "7",
            "--window-size", "5", "--log-every", "1000", "--progress", "off", "--threads", "1",
            "--optimizer", "shampoo", "--lr", "1e-4", "--betas", "0.9,0.999",
            "--epsilon", "1e-10", "--grafting", "adam", "--max-preconditioner-dim", "64",
            "--precondition-frequency", "5", "--start-preconditioning-step", "10",
            "--device", "cpu"]


def read_csv(path):
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return {name: [row[name] for row in rows] for name in (rows[0].keys() if rows else [])}


def numbers(column):
    return [float(value) for value in column]


def compare_close(actual, expected, rtol, what):
    check(len(actual) == len(expected),
          "%s: %d rows, expected %d" % (what, len(actual), len(expected)))
    worst, where = 0.0, 0
    for i, (a, e) in enumerate(zip(actual, expected)):
        relative = abs(a - e) / abs(e)
        if relative > worst:
            worst, where = relative, i
    check(worst <= rtol, "%s: relative difference %.3g at row %d (%r vs %r), tolerance %g"
          % (what, worst, where + 1, actual[where], expected[where], rtol))
    return worst


# ---- processes -----------------------------------------------------------------------------

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid):
    """The processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry) as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces: the fields after its closing parenthesis.
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def descendants(pid):
    result = []
    for child in children(pid):
        result.append(child)
        result.extend(descendants(child))
    return result


class Launcher:
    """Processes started in sessions of their own (torchrun also starts each worker in a session
    of its own), so that a node can be killed whole; kill_all() ends everything started."""

    def __init__(self):
        self.processes = []

    def start(self, command, log_path, env=None):
        log = open(log_path, "w")
        log.write("+ " + " ".join(command) + "\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=env)
        self.processes.append((process, log))
        return process

    @staticmethod
    def kill_tree(process):
        """SIGKILL to the process's session and to every descendant (workers included)."""
        victims = descendants(process.pid)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in victims:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_all(self):
        for process, log in self.processes:
            if process.poll() is None:
                self.kill_tree(process)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            log.close()


def wait_for(process, deadline, what):
    remaining = deadline - time.monotonic()
    try:
        return process.wait(timeout=max(remaining, 0.1))
    except subprocess.TimeoutExpired:
        raise Failure("%s did not finish before the test's deadline" % what)


def read(path):
    with open(path, errors="replace") as f:
        return f.read()


def env_one_thread():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def agent_command(args, node_rank, nnodes, port, run_id, rdzv_conf, extra):
    return ([args.torchrun, "--no-python", "--nnodes", nnodes, "--nproc-per-node", "1",
             "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", "127.0.0.1:%d" % port, "--rdzv-id", run_id,
             # Node 0 hosts the rendezvous store (the surviving node in the elastic test).
             "--rdzv-conf", "is_host=%d%s" % (1 if node_rank == 0 else 0, rdzv_conf)]
            + extra + [args.trainer])


# ---- scenarios -----------------------------------------------------------------------------

def multinode(args, launcher, work, deadline):
    data = os.path.join(work, "data")
    write_cifar10(data)
    flags = trainer_flags(data, epochs=2)

    one_node = os.path.join(work, "one_node")
    os.makedirs(one_node)
    reference = launcher.start(
        [args.torchrun, "--no-python", "--standalone", "--nproc-per-node", "2", args.trainer]
        + flags + ["--metrics-dir", os.path.join(one_node, "metrics")],
        os.path.join(one_node, "log.txt"), env_one_thread())
    check(wait_for(reference, deadline, "the one-node run") == 0,
          "the one-node run failed:\n" + read(os.path.join(one_node, "log.txt")))

    two_nodes = os.path.join(work, "two_nodes")
    os.makedirs(two_nodes)
    port, run_id = free_port(), "multinode-%d" % os.getpid()
    agents = []
    for node in (0, 1):
        command = agent_command(args, node, "2", port, run_id, "", [])
        agents.append(launcher.start(
            command + flags + ["--metrics-dir", os.path.join(two_nodes, "metrics")],
            os.path.join(two_nodes, "node%d.txt" % node), env_one_thread()))
    logs = []
    for node, agent in enumerate(agents):
        code = wait_for(agent, deadline, "node %d's agent" % node)
        logs.append(read(os.path.join(two_nodes, "node%d.txt" % node)))
        check(code == 0, "node %d's agent exited with %d:\n%s" % (node, code, logs[-1]))

    # Each node ran one of the two ranks (every rank prints its loss lines with its rank).
    ranks = [set(re.findall(r"\[rank (\d)\] Epoch", log)) for log in logs]
    check(sorted(ranks, key=sorted) == [{"0"}, {"1"}],
          "expected rank 0 on one node and rank 1 on the other, got %s" % ranks)
    check(any("ranks: 2 | global batch 32 (16 per rank)" in log for log in logs),
          "no setup line of a two-rank job:\n" + "".join(logs))

    expected = read_csv(os.path.join(one_node, "metrics", "train.csv"))
    actual = read_csv(os.path.join(two_nodes, "metrics", "train.csv"))
    for column in ("loss", "global_loss", "global_lifetime_loss", "global_window_loss", "lr"):
        check(actual.get(column) == expected.get(column) and len(expected[column]) == 20,
              "column %s differs between two nodes and one node" % column)
    check(read_csv(os.path.join(two_nodes, "metrics", "eval.csv"))["test_loss"]
          == read_csv(os.path.join(one_node, "metrics", "eval.csv"))["test_loss"],
          "the test losses differ between two nodes and one node")
    print("multinode: two torchrun agents (--nnodes 2, one rank each) = one agent with two ranks: "
          "20 iterations and 2 test losses identical")


def wait_for_checkpoint(checkpoints, world_size, agents, deadline):
    """Waits until the MANIFEST in `checkpoints` names a checkpoint saved at `world_size`."""
    manifest = os.path.join(checkpoints, "MANIFEST")
    while time.monotonic() < deadline:
        try:
            if re.search(r"^world_size %d$" % world_size, read(manifest), re.M):
                return
        except OSError:
            pass
        for node, agent in enumerate(agents):
            check(agent.poll() is None,
                  "node %d's agent ended (code %s) before a checkpoint of world size %d"
                  % (node, agent.returncode, world_size))
        time.sleep(0.02)
    raise Failure("no checkpoint of world size %d before the test's deadline" % world_size)


def elastic(args, launcher, work, deadline):
    data = os.path.join(work, "data")
    write_cifar10(data)
    epochs, every = 3, 5
    flags = trainer_flags(data, epochs)

    uninterrupted = os.path.join(work, "uninterrupted")
    os.makedirs(uninterrupted)
    reference = launcher.start([args.trainer] + flags + ["--metrics-dir",
                                                         os.path.join(uninterrupted, "metrics")],
                               os.path.join(uninterrupted, "log.txt"), env_one_thread())
    check(wait_for(reference, deadline, "the uninterrupted run") == 0,
          "the uninterrupted run failed:\n" + read(os.path.join(uninterrupted, "log.txt")))

    run = os.path.join(work, "elastic")
    os.makedirs(run)
    checkpoints = os.path.join(run, "checkpoints")
    port, run_id = free_port(), "elastic-%d" % os.getpid()
    # A short last call: once one node has joined, the rendezvous waits that long for more.
    rdzv = ",last_call_timeout=5,join_timeout=120"
    extra = ["--max-restarts", "1"]
    run_flags = flags + ["--checkpoint-dir", checkpoints, "--checkpoint-every", str(every),
                         "--metrics-dir", os.path.join(run, "metrics")]
    agents = [launcher.start(agent_command(args, node, "1:2", port, run_id, rdzv, extra)
                             + run_flags, os.path.join(run, "node%d.txt" % node),
                             env_one_thread())
              for node in (0, 1)]

    wait_for_checkpoint(checkpoints, 2, agents, deadline)
    # Node 1 is lost: its agent and its worker, at once.
    Launcher.kill_tree(agents[1])
    killed_at = time.monotonic()
    code = wait_for(agents[0], deadline, "node 0's agent")
    log = read(os.path.join(run, "node0.txt"))
    check(code == 0, "node 0's agent exited with %d:\n%s" % (code, log))

    resumed = re.search(r"Resumed from .*: (\d+) epoch\(s\), (\d+) iterations done; saved at "
                        r"world size 2, now 1 \(torchrun restart (\d+)\)", log)
    check(resumed is not None, "node 0 did not resume at world size 1 from a checkpoint of "
                               "world size 2:\n" + log)
    iteration = int(resumed.group(2))
    total = 10 * epochs
    check(0 < iteration < total and iteration % every == 0,
          "resumed at iteration %d, not at a checkpoint within the run" % iteration)

    expected = read_csv(os.path.join(uninterrupted, "metrics", "train.csv"))
    actual = read_csv(os.path.join(run, "metrics", "train.csv"))
    check(actual.get("iteration") == [str(i) for i in range(1, total + 1)],
          "train.csv does not hold iterations 1..%d once each: %s"
          % (total, actual.get("iteration")))
    worst = 0.0
    for column in ("global_loss", "global_lifetime_loss", "global_window_loss"):
        worst = max(worst, compare_close(numbers(actual[column]), numbers(expected[column]),
                                         WORLD_SIZE_RTOL, column))
    check(actual["lr"] == expected["lr"], "the learning rates differ")
    eval_expected = read_csv(os.path.join(uninterrupted, "metrics", "eval.csv"))
    eval_actual = read_csv(os.path.join(run, "metrics", "eval.csv"))
    compare_close(numbers(eval_actual["test_loss"]), numbers(eval_expected["test_loss"]),
                  WORLD_SIZE_RTOL, "test_loss")
    print("elastic: node 1 killed after a checkpoint of world size 2; node 0's agent restarted its "
          "worker (torchrun restart %s) at world size 1, which resumed at iteration %d of %d and "
          "finished %.1f s after the kill; losses within %.2g of an uninterrupted run "
          "(tolerance %g)" % (resumed.group(3), iteration, total, time.monotonic() - killed_at,
                              worst, WORLD_SIZE_RTOL))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=["multinode", "elastic"])
    parser.add_argument("--torchrun", default="")
    parser.add_argument("--trainer", required=True)
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--deadline", type=float, default=240,
                        help="seconds; then every process is killed and the test fails")
    args = parser.parse_args()
    if not args.torchrun or not os.path.exists(args.torchrun):
        print("torchrun not found (%r; `make deps` installs it): skipped" % args.torchrun)
        return SKIPPED
    work = os.path.join(os.path.abspath(args.work_dir), "torchrun_" + args.scenario)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    deadline = time.monotonic() + args.deadline
    launcher = Launcher()
    # CTest ends a test that runs too long with SIGTERM: still kill what was started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    try:
        (multinode if args.scenario == "multinode" else elastic)(args, launcher, work, deadline)
        return 0
    except Failure as failure:
        print("FAILED: %s" % failure)
        print("logs in %s" % work)
        return 1
    finally:
        launcher.kill_all()


if __name__ == "__main__":
    sys.exit(main())
