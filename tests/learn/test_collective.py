"""The learner group's own messages cross process boundaries as JSON + safetensors bytes, never as pickles;
rank 0 writes and the other ranks learn the outcome, or fail alike.

Two real gloo ranks in subprocesses; torch's unpickler is replaced by one that fails, so a collective that
fell back to `gather_object`/`all_gather_object` would go red here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diprl.learn.state_files import StateFileError, state_bytes, state_from_bytes

_RANK = """
import json, sys
import torch
import torch.distributed.distributed_c10d as c10d
from diprl.learn.ranks import Collective, RankSpec

class _NoUnpickling:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a learner collective unpickled a message")

c10d._unpickler = _NoUnpickling
rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
dist = Collective(RankSpec(rank, 2, init))
mine = {"rank": rank, "moments": {0: torch.full((3 + rank,), float(rank))}, "betas": (0.9, 0.99)}
gathered = dist.gather_plain(mine)
everyone = dist.all_plain({"tokens": 10 * (rank + 1), "name": "r%d" % rank})
if rank == 0:
    assert [g["rank"] for g in gathered] == [0, 1]
    assert gathered[1]["moments"][0].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert gathered[1]["betas"] == (0.9, 0.99)
else:
    assert gathered is None
assert everyone == [{"tokens": 10, "name": "r0"}, {"tokens": 20, "name": "r1"}]
written, number = dist.rank0_writes(lambda: "main@v7", lambda name: int(name.split("@v")[1]), "publish")
assert number == 7 and written == ("main@v7" if rank == 0 else None)
def full_disk():
    raise OSError(28, "No space left on device")
try:
    dist.rank0_writes(full_disk, lambda _: 1, "write checkpoint step-3")
    raise AssertionError("a failed write on rank 0 went unnoticed on rank %d" % rank)
except OSError as err:
    assert ("No space left" if rank == 0 else "rank 0 could not write checkpoint step-3") in str(err), err
open(out, "w").write(json.dumps({"rank": rank, "ok": True}))
torch.distributed.destroy_process_group()
"""


def test_two_ranks_gather_their_state_without_unpickling_anything(tmp_path: Path) -> None:
    init = (tmp_path / "rendezvous").as_uri()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    env_script = tmp_path / "rank.py"
    env_script.write_text(_RANK)
    procs = [
        subprocess.Popen(
            [sys.executable, str(env_script), str(r), init, str(outs[r])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
        )
        for r in range(2)
    ]
    results = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert [json.loads(o.read_text())["ok"] for o in outs] == [True, True]


def test_a_lone_rank_writes_and_its_errors_raise_as_they_are() -> None:
    from diprl.learn.ranks import Collective

    alone = Collective(None)
    assert alone.rank0_writes(lambda: "main@v3", lambda name: int(name[-1]), "publish") == ("main@v3", 3)

    def full_disk() -> str:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        alone.rank0_writes(full_disk, lambda _: 1, "publish")


def test_state_bytes_round_trip_and_refuse_damage() -> None:
    tree = {"step": 3, 7: [torch.arange(4.0), (1, "a")], "empty": torch.zeros(0, 2)}
    back = state_from_bytes(state_bytes(tree))
    assert back["step"] == 3 and back[7][1] == (1, "a") and torch.equal(back[7][0], torch.arange(4.0))
    assert back["empty"].shape == (0, 2)
    data = state_bytes(tree)
    with pytest.raises(StateFileError, match="truncated"):
        state_from_bytes(data[:20])
    with pytest.raises(StateFileError, match="undecodable"):
        state_from_bytes(data[:-5])
