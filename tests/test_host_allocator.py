"""``memory.release_freed``: freed host buffers go back to the OS, so RSS follows what is held.

Each case runs in a child interpreter (the allocator setting is the process's). The child makes glibc's
floating mmap threshold rise (one 4 MiB buffer freed), then allocates 64 buffers of 4 MiB, touches them
and frees all but the last: from a heap, that last one pins the freed ones below it. The RSS left over
is what the allocator kept.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = """
import json, torch
from zerooffload.host_allocator import release_freed_memory

def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) * 1024

changed = release_freed_memory() if {release} else False
torch.ones(1 << 20)  # 4 MiB, freed at once: glibc raises its threshold past it
before = rss()
buffers = [torch.ones(1 << 20) for _ in range(64)]
last = buffers.pop()
del buffers
print(json.dumps(dict(changed=changed, kept=rss() - before)))
"""


def _kept(release: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD.format(release=release)], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_buffers_leave_the_process_with_release_freed_and_stay_without():
    released, kept = _kept(True), _kept(False)
    assert released["changed"] is True
    assert released["kept"] < 16 << 20, released  # the last buffer, and little else
    assert kept["kept"] > 128 << 20, kept  # the allocator's default keeps most of the 252 MiB freed
