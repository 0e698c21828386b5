"""Launching a test worker as one process or under torch.distributed.run on CPU (gloo), shared by the tests of
several processes (test_ddp, test_fsdp, test_fsdp_optimizer), and how a worker leaves."""

import os
import signal
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300  # a worker takes seconds to a minute on 2 cores; a hung collective must not hang the suite


def launch(script, processes: int, *args, cwd=REPO, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """`script` (a path) with `args`, as one process or under torch.distributed.run on CPU (gloo): its exit code and
    output (stdout and stderr together; a timeout ends every process of the launch and returns a non-zero code)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    # --standalone: the rendezvous picks a free port, so parallel test runs do not collide.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command = [*(launcher if processes > 1 else [sys.executable]), str(script), *map(str, args)]
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # own group: a hung collective is ended whole
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n(timed out after {timeout} s)"
    return subprocess.CompletedProcess(command, proc.returncode, output)


def leave_without_teardown() -> None:
    """Exit 0 now, for a worker whose results are written and whose process group is destroyed: in the interpreter's
    teardown a rank was seen to abort after a successful run ("terminate called without an active exception", a C++
    thread destroyed while joinable), which made torchrun fail the launch or end another rank before it had written
    its results."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
