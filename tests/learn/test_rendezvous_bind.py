"""A learner group's rendezvous listens only on the address its `tcp://` init method names.

torch's own `tcp://` rendezvous opens its store on every interface whatever host it is given, so a group
meeting at `tcp://127.0.0.1:P` could be joined from the network. A subprocess, so that the process group it
makes touches no other test.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, os, psutil, torch
from diprl.learn.model import init_distributed
from diprl.learn.ranks import RankSpec
from diprl.ports import free_port

port = free_port("127.0.0.1")
init_distributed(False, RankSpec(0, 1, f"tcp://127.0.0.1:{port}"))
listening = [c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
torch.distributed.destroy_process_group()
print(json.dumps({"port": port, "listening": listening}))
"""


def test_the_group_rendezvous_listens_only_where_its_init_method_says() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["listening"], "nothing listens on the rendezvous port"
    assert set(found["listening"]) == {"127.0.0.1"}, found


RANK = """
import sys, torch
from diprl.learn.model import init_distributed
from diprl.learn.ranks import RankSpec

rank, init = int(sys.argv[1]), sys.argv[2]
init_distributed(False, RankSpec(rank, 2, init))
t = torch.tensor([rank + 1.0])
torch.distributed.all_reduce(t)
print("sum", float(t))
torch.distributed.destroy_process_group()
"""


def test_two_ranks_meet_at_the_bound_rendezvous() -> None:
    from diprl.ports import free_port

    init = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, str(r), init], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for r in (0, 1)
    ]
    outputs = [p.communicate(timeout=300) for p in ranks]
    for process, (out, err) in zip(ranks, outputs, strict=True):
        assert process.returncode == 0 and b"sum 3.0" in out, err.decode()[-3000:]
