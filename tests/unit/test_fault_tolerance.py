"""The pieces of fault tolerance that need no second group: the config's own rules, the layout
fingerprint's exact sums, and the state a live group sends a joining one (local shards only, placed
back into the receiver's DTensors). Groups training together: tests/e2e/test_fault_tolerance_runs.py."""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from components.checkpoint.states import ModelState, OptimizerState
from components.config.sections import FaultTolerance
from components.fault_tolerance.heal_state import heal_state_fns
from components.fault_tolerance.replica_groups import check_fault_tolerance, layout_fingerprint
from components.runtime.errors import KilnError


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def sharded_model(mesh, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = fully_shard(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_joining_group_takes_the_sent_state_into_its_own_dtensors(one_rank):
    sender, sender_opt = sharded_model(one_rank, 0)
    receiver, receiver_opt = sharded_model(one_rank, 1)
    def states(model, opt):
        return {"model": ModelState([model]), "optimizer": OptimizerState([model], [opt])}

    _, save = heal_state_fns(states(sender, sender_opt), lambda: None)
    healed = []
    load, _ = heal_state_fns(states(receiver, receiver_opt), lambda: healed.append(1))
    sent = save()
    assert not any(isinstance(leaf, DTensor) for leaf in tree_leaves(sent))  # no mesh goes over the wire
    buffer = io.BytesIO()
    torch.save(sent, buffer)
    buffer.seek(0)
    load(torch.load(buffer, weights_only=True))
    assert healed == [1]
    for a, b in zip(sender.parameters(), receiver.parameters(), strict=True):
        assert isinstance(b, DTensor) and torch.equal(a.to_local(), b.to_local())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sender_opt.state[a][key].to_local(), receiver_opt.state[b][key].to_local())


def test_a_state_of_another_model_is_refused(one_rank):
    sender, _ = sharded_model(one_rank, 0)
    torch.manual_seed(0)
    other = fully_shard(nn.Sequential(nn.Linear(4, 3)), mesh=one_rank)
    _, save = heal_state_fns({"model": ModelState([sender])}, lambda: None)
    load, _ = heal_state_fns({"model": ModelState([other])}, lambda: None)
    with pytest.raises(KilnError, match="every replica group must run the same model and layout"):
        load(save())


def test_fingerprints_of_groups_sum_exactly_in_float64():
    prints = [layout_fingerprint(f"llama3/8B world {n}") for n in range(64)]
    assert len(set(prints)) == 64 and all(p < 2**40 for p in prints)
    total = torch.tensor(prints, dtype=torch.float64).sum().item()
    assert total == sum(int(p) for p in prints)  # a sum equals n × one print only when all agree
    assert layout_fingerprint("a") == layout_fingerprint("a")


@pytest.mark.parametrize(("options", "words"), [
    ({"replica_id": 3, "group_size": 3}, "replica_id = 3 but group_size = 3"),
    ({"group_size": 2, "min_replicas": 3}, "group_size = 2 is below min_replicas = 3"),
])
def test_the_section_s_own_rules(options, words):
    with pytest.raises(KilnError, match=words):
        check_fault_tolerance(FaultTolerance(enable=True, **options))
    check_fault_tolerance(FaultTolerance(enable=False, **options))  # off: nothing to check
