"""A real process that owns hugepage L2 slabs (allocated through our allocator), for the
reclaim tests: it prints "ready" once its slabs exist, then either exits without any
cleanup (``crash``, as after SIGKILL) or stays alive for two minutes (``live``)."""

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    from sglang_cp.l2.allocator import HugepageHostAllocator, HugepageL2Config
    a = HugepageHostAllocator(HugepageL2Config(sys.argv[1], 480, sys.argv[2], 0))
    t = a.allocate((2, 64 * 32, 1, 576), torch.bfloat16, label="kv-mla", layout="layer_first",
                   unit_bytes=64 * 576 * 2)
    print("ready", flush=True)
    if sys.argv[3] == "crash":
        os._exit(9)  # no cleanup, as after SIGKILL
    time.sleep(120)
    """
)


def slab_owner(directory, namespace, mode):
    return subprocess.Popen([sys.executable, "-c", CHILD, directory, namespace, mode],
                            stdout=subprocess.PIPE, text=True)
