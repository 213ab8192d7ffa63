"""`python -m diprl.plan`: every term checked against a hand computation on a tiny fake model, one at a time,
then the command on the shipped configurations.

The fake model: hidden 8, intermediate 16, 2 layers, 2 heads and 1 KV head of 4, vocabulary 10, tied
embeddings. Its linear layers per block: q 8x8, k 8x4, v 8x4, o 8x8, gate/up/down 8x16 = 576 weights;
with two RMSNorms of 8 and q/k norms of 4 a block is 600 parameters; the model 10 x 8 + 2 x 600 + 8 = 1288.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from diprl import plan
from diprl.inference.config import ServerConfig
from diprl.learn.config import LearnerConfig
from diprl.plan import ClusterConfig, ModelShape, Workload, sourced_fields

REPO = Path(__file__).resolve().parents[1]
TINY = ModelShape(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10, tied_embeddings=True)


def cluster(**overrides: object) -> ClusterConfig:
    values: dict[str, object] = dict(
        name="toy",
        nodes=1,
        gpus_per_node=4,
        cpus_per_node=8,
        gpu_memory_gib=1.0,
        bf16_flops=1e6,
        hbm_bytes_per_s=1e4,
        intra_node_bytes_per_s=100.0,
        inter_node_bytes_per_s=10.0,
        train_utilisation=0.5,
        decode_hbm_utilisation=0.5,
        storage_bytes_per_s=1000.0,
        runtime_reserve_gib=0.0,
    )
    values.update(overrides)
    values["sources"] = {name: "hand-made" for name in sourced_fields(ClusterConfig)}
    return ClusterConfig(**values)  # type: ignore[arg-type]


def workload(**overrides: object) -> Workload:
    values: dict[str, object] = dict(
        prompt_tokens=12,
        completion_tokens=4,
        shared_prompt_share=0.5,
        group_size=2,
        decisions_per_fork=1,
        llm_seats=2,
        warmup_phases=2,
        phases_per_fork=3,
        groups_per_match=1,
        stale_share=0.5,
        constraint_s_per_request_step=0.01,
        rollout_s_per_phase=0.5,
        rollout_workers=2,
    )
    values.update(overrides)
    values["sources"] = {name: "hand-made" for name in sourced_fields(Workload)}
    return Workload(**values)  # type: ignore[arg-type]


def learner(**overrides: object) -> LearnerConfig:
    values: dict[str, object] = dict(
        bf16=True, gradient_checkpointing=True, use_gpu=True, micro_batch_tokens=64, groups_per_step=2
    )
    values.update(overrides)
    return LearnerConfig(**values)  # type: ignore[arg-type]


def server(**overrides: object) -> ServerConfig:
    values: dict[str, object] = dict(
        max_num_seqs=4,
        max_lora_rank=8,
        max_loras=2,
        replica_gpus=1.0,
        engine_extra={"max_num_batched_tokens": 32, "gpu_memory_utilization": 0.5},
    )
    values.update(overrides)
    return ServerConfig(**values)  # type: ignore[arg-type]


def learner_terms(**overrides: object) -> dict[str, float]:
    memory = plan.learner_memory(TINY, 2, ["q_proj", "v_proj"], learner(**overrides), workload(), cluster())
    return {t.name: t.bytes for t in memory.terms}


# ------------------------------------------------------------------------------------------ shapes
def test_parameter_counts_of_the_fake_model() -> None:
    assert TINY.layer_params == 576 + 2 * 8 + 2 * 4 == 600
    assert TINY.total_params == 10 * 8 + 2 * 600 + 8 == 1288
    assert replace(TINY, tied_embeddings=False).total_params == 1288 + 80
    # LoRA r2 on q (8 in, 8 out) and v (8 in, 4 out): 2 x (16 + 12) per block, 2 blocks
    assert TINY.lora_params(2, ["q_proj", "v_proj"]) == 2 * (2 * 16 + 2 * 12) == 112
    assert TINY.kv_bytes_per_token() == 2 * 2 * 4 * 2  # K and V, 2 layers, one 4-wide head, bf16
    with pytest.raises(plan.PlanError, match="lm_head"):
        TINY.lora_params(2, ["lm_head"])


def test_the_qwen3_shapes_give_the_published_parameter_counts() -> None:
    assert round(plan.KNOWN_SHAPES["Qwen/Qwen3-8B"].total_params / 1e9, 2) == 8.19
    assert round(plan.KNOWN_SHAPES["Qwen/Qwen3-14B"].total_params / 1e9, 2) == 14.77


def test_model_shape_reads_a_tiny_spec_a_checkpoint_or_the_known_table(tmp_path: Path) -> None:
    from diprl.policy.models import load_preset

    tiny = plan.model_shape(load_preset("tiny"))
    assert (tiny.hidden, tiny.layers, tiny.vocab, tiny.tied_embeddings) == (64, 2, 1024, True)
    assert plan.model_shape(load_preset("qwen3_14b")) == plan.KNOWN_SHAPES["Qwen/Qwen3-14B"]
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, '
        '"num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10, "tie_word_embeddings": true}'
    )
    local = replace(load_preset("qwen3_8b"), path=str(tmp_path))
    assert plan.model_shape(local) == TINY
    with pytest.raises(plan.PlanError, match="no shape for 'org/unknown'"):
        plan.model_shape(replace(load_preset("qwen3_8b"), path="org/unknown"))


# ------------------------------------------------------------------------------------------ learner memory
def test_learner_weights_gradients_and_optimizer_state_one_rank() -> None:
    t = learner_terms()
    assert t["base_weights"] == 1288 * 2  # bf16
    assert t["lora_weights"] == 112 * 2
    assert t["lora_grads"] == 112 * 4  # DeepSpeed's fp32 gradient partition
    assert t["optimizer"] == 112 * 12  # fp32 master, Adam m and v
    assert t["grad_bucket"] == 500_000_000 * 2  # reduce_bucket_size elements in bf16, allocated whole


def test_learner_activations_with_gradient_checkpointing() -> None:
    t = learner_terms()
    assert t["checkpoints"] == 2 * 64 * 8 * 2  # one bf16 hidden state per layer and token
    # one layer's saved tensors per token: norms 4h + 2h, q/k norm inputs in fp32 2q + 2kv, q k v after
    # RoPE q + 2kv, attention out q, its copy q, MLP 4I, LoRA A outputs r x 2 modules, lse 2 x heads
    saved = 6 * 8 + (2 * 8 + 2 * 4) + (8 + 2 * 4) + 8 + 8 + 4 * 16 + 2 * 2 + 2 * 2
    backward = 2 * 16 + 2 * 8  # gate and up gradients, the layer's input and output gradients
    assert saved + backward == 224
    assert t["layer_recompute"] == 224 * 64 * 2
    # LM head: completion positions only (4 of 16 tokens of a record: 16 of 64), bf16 + fp32 logits + fp32 grad
    assert t["lm_head"] == 16 * 10 * (2 + 4 + 4)


def test_without_gradient_checkpointing_every_layer_keeps_its_activations() -> None:
    t = learner_terms(gradient_checkpointing=False)
    assert t["checkpoints"] == 0
    assert t["layer_recompute"] == 224 * 64 * 2 * 2


def test_the_lm_head_chunk_caps_its_rows() -> None:
    assert learner_terms(logprob_chunk_tokens=5)["lm_head"] == 5 * 10 * 10


def test_a_learner_host_counts_the_base_once_and_each_adapter_its_own_state() -> None:
    one = learner_terms()
    memory = plan.learner_memory(TINY, 2, ["q_proj", "v_proj"], learner(), workload(), cluster(), adapters=3)
    three = {t.name: t.bytes for t in memory.terms}
    assert three["base_weights"] == one["base_weights"] == 1288 * 2  # one frozen base for every policy
    assert three["lora_weights"] == 3 * 112 * 2  # each adapter's bf16 LoRA
    assert three["optimizer"] == 3 * 112 * 12  # each engine's fp32 master, Adam m and v
    # DeepSpeed frees an engine's fp32 gradients and its bucket after its step; the host steps one adapter
    # at a time, so they, like the activations, are one step's
    for once in ("runtime_reserve", "lora_grads", "grad_bucket", "checkpoints", "layer_recompute", "lm_head"):
        assert three[once] == one[once], once
    assert memory.total == sum(one.values()) + 2 * 112 * (2 + 12)
    assert memory.per_adapter == 112 * 14 and memory.once == sum(one.values()) - 112 * 14
    with pytest.raises(plan.PlanError, match="at least one adapter"):
        plan.learner_memory(TINY, 2, ["q_proj", "v_proj"], learner(), workload(), cluster(), adapters=0)


def test_adapters_fit_is_the_largest_count_whose_memory_fits() -> None:
    base = plan.learner_memory(TINY, 2, ["q_proj", "v_proj"], learner(), workload(), cluster())
    room = cluster(gpu_memory_gib=(base.once + 5.5 * base.per_adapter) / 2**30)

    def held(k: int) -> plan.Memory:
        return plan.learner_memory(TINY, 2, ["q_proj", "v_proj"], learner(), workload(), room, adapters=k)

    assert held(1).adapters_fit() == 5
    assert held(5).overflow() is None and held(6).overflow() is not None
    assert held(1).once > cluster(gpu_memory_gib=1e-6).gpu_memory_gib * 2**30
    tight = plan.learner_memory(TINY, 2, ["q_proj"], learner(), workload(), cluster(gpu_memory_gib=1e-6))
    assert tight.adapters_fit() == 0  # not even the base and one step fit


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        # stage: base, lora weights, grads, optimizer, bucket -- split over 2 ranks where ZeRO partitions
        (0, (1288 * 2, 112 * 2, 112 * 4, 112 * 12, 0)),
        (1, (1288 * 2, 112 * 2, 112 * 4, 112 * 12 / 2, 500_000_000 * 4)),
        (2, (1288 * 2, 112 * 2, 112 * 4 / 2, 112 * 12 / 2, 500_000_000 * 2)),
        (3, (1288 * 2 / 2, 112 * 2 / 2, 112 * 4 / 2, 112 * 12 / 2, 500_000_000 * 2)),
    ],
)
def test_zero_stages_partition_what_they_should_over_two_ranks(stage: int, expected: tuple[float, ...]) -> None:
    learner_cfg = learner(ranks=2)
    learner_cfg.zero_stage = stage
    memory = plan.learner_memory(TINY, 2, ["q_proj", "v_proj"], learner_cfg, workload(), cluster())
    t = {x.name: x.bytes for x in memory.terms}
    got = (t["base_weights"], t["lora_weights"], t["lora_grads"], t["optimizer"], t["grad_bucket"])
    assert got == expected
    # ZeRO-3 holds the tied head (the 80-parameter embedding) gathered through the pass, one 600-parameter
    # block at a time beside it, and prefetches
    assert t.get("zero3_gathered") == ((80 + 600 + 50_000_000) * 2 if stage == 3 else None)


def test_an_overflow_names_the_term_that_crosses_the_capacity() -> None:
    memory = plan.Memory(
        (plan.Term("a", 3 * 2**30), plan.Term("b", 2 * 2**30), plan.Term("c", 1 * 2**30)), capacity=4.5 * 2**30
    )
    term = memory.overflow()
    assert term is not None and term.name == "b"
    assert plan.Memory(memory.terms, capacity=6 * 2**30).overflow() is None


# ------------------------------------------------------------------------------------------ replica memory
def test_replica_memory_terms_at_tensor_parallel_1_and_2() -> None:
    memory = plan.replica_memory(TINY, server(), workload(), cluster())
    t = {x.name: x.bytes for x in memory.terms}
    assert t["weights"] == 1288 * 2
    # 2 slots of rank 8 on every linear layer: 8 x (16 + 12 + 12 + 16 + 24 + 24 + 24) per block, 2 blocks, bf16
    assert t["lora_slots"] == 2 * (8 * 128 * 2) * 2
    # 32 batched tokens x (3I + 2q + 2kv + 2h) bf16, plus fp32 logits and sampler noise of 4 rows x 10
    assert t["activations"] == 32 * (48 + 16 + 8 + 16) * 2 + 4 * 10 * 4 * 2
    # 4 sequences x 16 tokens (12 + 4, one 16-token block) x 32 bytes of K and V per token
    assert t["kv_cache"] == 4 * 16 * 32
    assert memory.capacity == 0.5 * 2**30  # gpu_memory_utilization of 1 GiB, no reserve

    tp2 = {
        x.name: x.bytes for x in plan.replica_memory(TINY, server(tensor_parallel_size=2), workload(), cluster()).terms
    }
    assert tp2["weights"] == 1288 and tp2["lora_slots"] == t["lora_slots"] / 2
    assert tp2["kv_cache"] == t["kv_cache"]  # one KV head cannot be split: each shard keeps it
    assert tp2["activations"] == 32 * 88 * 2 / 2 + 320  # the logits are whole on the first shard


def test_replicas_sharing_a_gpu_each_need_their_memory() -> None:
    one = plan.replica_memory(TINY, server(), workload(), cluster())
    two = plan.replica_memory(TINY, server(), workload(), cluster(), per_gpu=2)
    assert two.total == 2 * one.total


# ------------------------------------------------------------------------------------------ placement
def test_learner_ranks_first_then_replicas_of_tp_gpus_on_one_node() -> None:
    toy = cluster(nodes=2, gpus_per_node=4)
    p = plan.place(toy, ranks=3, tp=2, replica_gpus=1.0, low=1, high=8)
    assert p.learner == ((0, 0), (0, 1), (0, 2))
    assert p.replicas == (((1, 0), (1, 1)), ((1, 2), (1, 3)))  # node 0's last GPU cannot hold a TP-2 replica
    assert p.problem is None and plan.gpu_list(p.learner) == "node0:0-2"
    assert plan.gpu_list([g for r in p.replicas for g in r]) == "node1:0-3"
    refused = plan.place(toy, ranks=3, tp=2, replica_gpus=1.0, low=3, high=8)
    assert refused.problem is not None and "room for 2" in refused.problem
    assert plan.place(toy, ranks=9, tp=1, replica_gpus=1.0, low=1, high=1).problem == (
        "9 learner ranks need 9 GPUs; the cluster has 8"
    )


def test_replicas_are_capped_by_the_configured_maximum_and_may_share_gpus_only_when_configured() -> None:
    toy = cluster(gpus_per_node=4)
    assert len(plan.place(toy, 1, 1, 1.0, 1, 2).replicas) == 2
    shared = plan.place(toy, 1, 1, 0.5, 1, 8)
    assert shared.replicas_per_gpu == 2 and len(shared.replicas) == 6
    assert (0, 0) not in {g for r in shared.replicas for g in r}  # never on the learner's GPU


def test_learners_of_a_league_take_one_group_of_ranks_each_and_a_host_frees_the_rest() -> None:
    toy = cluster(gpus_per_node=4)
    separate = plan.place(toy, ranks=1, tp=1, replica_gpus=1.0, low=1, high=8, learners=3)
    hosted = plan.place(toy, ranks=1, tp=1, replica_gpus=1.0, low=1, high=8, learners=1)
    assert separate.learner == ((0, 0), (0, 1), (0, 2)) and len(separate.replicas) == 1
    assert hosted.learner == ((0, 0),) and len(hosted.replicas) == 3
    # each learner of 2 ranks on one node where one has room, so its exchange stays on NVLink
    two_nodes = cluster(nodes=2, gpus_per_node=3)
    pairs = plan.place(two_nodes, ranks=2, tp=1, replica_gpus=1.0, low=1, high=8, learners=2)
    assert pairs.learner_groups() == [((0, 0), (0, 1)), ((1, 0), (1, 1))] and pairs.learner_nodes == 1
    assert plan.place(toy, 2, 1, 1.0, 0, 8, learners=3).problem == (
        "6 learner ranks (3 learners of 2) need 6 GPUs; the cluster has 4"
    )


# ------------------------------------------------------------------------------------------ time
def test_learner_time_one_term_at_a_time() -> None:
    lora = 112
    t = plan.learner_time(TINY, lora, learner(publish_every=1, checkpoint_every=2), workload(), cluster(), nodes=1)
    tokens = 2 * 2 * 16  # groups x (G forks x 1 decision) x (12 + 4) tokens
    assert t.tokens_per_rank == tokens
    # 6 for forward and backward, 2 x stale share 0.5 for old logprobs, at 1e6 x 0.5 FLOP/s
    assert t.compute_s == pytest.approx((6 + 1) * 1288 * tokens / 5e5)
    assert t.optimizer_s == pytest.approx(112 * (8 + 16 + 2) / 1e4)  # fp32 grad read, master/m/v read+write, bf16 out
    assert t.exchange_s == 0  # one rank
    # the bf16 adapter every step, a checkpoint (adapter + fp32 master, m, v, EMA) every second step
    assert t.storage_s == pytest.approx(112 * 2 / 1000 + (112 * 2 + 112 * 16) / 2 / 1000)
    assert t.tokens_per_s == pytest.approx(tokens / t.step_s)
    with_kl = plan.learner_time(TINY, lora, learner(kl_coef=0.1), workload(), cluster(), nodes=1)
    assert with_kl.compute_s == pytest.approx((6 + 1 + 2) * 1288 * tokens / 5e5)


def test_two_ranks_split_the_tokens_and_exchange_gradients_over_the_right_link() -> None:
    one = plan.learner_time(TINY, 112, learner(), workload(), cluster(), nodes=1)
    two = plan.learner_time(TINY, 112, learner(ranks=2), workload(), cluster(), nodes=1)
    assert two.tokens_per_rank == one.tokens_per_rank / 2 and two.compute_s == pytest.approx(one.compute_s / 2)
    # reduce-scatter of bf16 grads + all-gather of weights, a ring moving 2 (N-1)/N of each
    assert two.exchange_s == pytest.approx(2 * 112 * 2 * 1.0 / 100)
    across = plan.learner_time(TINY, 112, learner(ranks=2), workload(), cluster(), nodes=2)
    assert across.exchange_s == pytest.approx(2 * 112 * 2 * 1.0 / 10)  # the inter-node link
    zero3 = learner(ranks=2)
    zero3.zero_stage = 3
    z3 = plan.learner_time(TINY, 112, zero3, workload(), cluster(), nodes=1)
    # plus the base weights gathered for forward, recompute and backward of each micro-batch (1 of 32 tokens)
    assert z3.exchange_s == pytest.approx(two.exchange_s + 3 * 1 * 1288 * 2 * 0.5 / 100)


def test_replica_decode_step_one_term_at_a_time() -> None:
    r = plan.replica_rate(TINY, server(), workload(), cluster())
    slots = 2 * 2048 * 2
    kv = 4 * (12 + 2) * 32  # 4 requests at the mean context mid-completion
    assert r.memory_s == pytest.approx((1288 * 2 + slots + kv) / (1e4 * 0.5))
    assert r.compute_s == pytest.approx(2 * 1288 * 4 / 5e5)
    assert r.allreduce_s == 0 and r.constraint_s == pytest.approx(4 * 0.01)
    assert r.bound == "hbm" and r.decode_step_s == pytest.approx(r.memory_s + r.constraint_s)
    # prefill: the unshared half of 12 tokens, and the shared half once per 2 seats
    assert r.prefill_s_per_request == pytest.approx(2 * 1288 * (6 + 3) / 5e5)
    tp2 = plan.replica_rate(TINY, server(tensor_parallel_size=2), workload(), cluster())
    assert tp2.allreduce_s == pytest.approx(2 * 2 * 4 * 8 * 2 * 2 * 0.5 / 100)  # 2 per layer, ring of 2


# ------------------------------------------------------------------------------------------ the command
def run_plan(*overrides: str) -> tuple[int, list[str], str]:
    """The command in this process (what `python -m diprl.plan` runs): exit code, stdout lines, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan.main(list(overrides))
    return code, out.getvalue().splitlines(), err.getvalue()


def fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def test_the_command_prints_one_line_per_role_and_the_verdict_last() -> None:
    code, lines, _ = run_plan("model=qwen3_14b", "cluster=h100x8")
    assert code == 0
    learner_line = fields(next(line for line in lines if line.startswith("role=learner")))
    replica_line = fields(next(line for line in lines if line.startswith("role=replica")))
    assert float(learner_line["learner_gpu_gib"]) < float(learner_line["capacity_gib"])
    assert float(learner_line["learner_tokens_per_s"]) > 0 and learner_line["gpus"] == "node0:0"
    assert replica_line["replicas"] == "7" and replica_line["gpus"] == "node0:1-7"
    assert float(replica_line["replica_gpu_gib"]) > 0
    verdict = fields(lines[-1])
    assert lines[-1].startswith("fits=1 ") and verdict["limiting"] in ("learner", "inference", "rollout")
    assert float(verdict["step_s"]) == max(
        float(learner_line["learner_step_s"]),
        float(replica_line["inference_step_s"]),
        float(fields(lines[-2])["rollout_step_s"]),
    )


def test_a_configuration_that_does_not_fit_is_refused_naming_the_term() -> None:
    code, lines, err = run_plan(
        "model=qwen3_14b", "learner.micro_batch_tokens=16384", "inference.tensor_parallel_size=2"
    )
    assert code == 1 and lines[-1].startswith("fits=0 ")
    assert "does not fit: learner GPU needs" in err and "layer_recompute" in err
    code, _, err = run_plan("model=qwen3_14b")  # 40 GB A100s, one GPU per replica
    assert code == 1 and "replica GPU needs" in err and "kv_cache" in err and "tensor_parallel_size" in err


def test_the_shipped_cluster_settings_fit_8b_and_name_what_14b_needs() -> None:
    for overrides in (
        ("model=qwen3_8b",),
        ("model=qwen3_14b", "inference.tensor_parallel_size=2"),
        ("model=qwen3_8b", "cluster=a100x16"),
        ("model=qwen3_14b", "cluster=h100x16"),
        (
            "model=qwen3_14b",
            "cluster=a100x16",
            "learner.micro_batch_tokens=8192",
            "learner.ranks=2",
            "learner.zero_stage=3",
            "inference.tensor_parallel_size=2",
        ),
    ):
        code, lines, err = run_plan(*overrides)
        assert code == 0, (overrides, err)
        assert lines[-1].startswith("fits=1 ")


LEAGUE_14B = ("model=qwen3_14b", "cluster=a100x8", "inference.tensor_parallel_size=2", "league=league")


def test_a_three_role_league_on_one_host_takes_the_gpus_of_one_policy_and_names_those_it_frees() -> None:
    code, lines, err = run_plan(*LEAGUE_14B, "learner.adapters_per_actor=3")
    assert code == 0, err
    host_lines = lines
    host = fields(next(line for line in lines if line.startswith("role=learner")))
    assert (host["policies"], host["learners"], host["gpus"], host["freed_gpus"]) == ("3", "1", "node0:0", "node0:1-2")
    assert (
        "# the 3-policy league's learners take GPU(s) node0:0 where one learner per policy would take node0:0-2; "
        "freed for replicas: node0:1, node0:2 (replicas 2 -> 3)"
    ) in lines
    assert fields(next(line for line in lines if line.startswith("role=replica")))["gpus"] == "node0:1-6"
    # the adapters step in turn: a league step is three of one policy's
    assert float(host["learner_round_s"]) == pytest.approx(3 * float(host["learner_step_s"]), abs=0.02)

    code, lines, _ = run_plan(*LEAGUE_14B, "learner.adapters_per_actor=1")
    separate = fields(next(line for line in lines if line.startswith("role=learner")))
    assert (separate["learners"], separate["gpus"], "freed_gpus" in separate) == ("3", "node0:0-2", False)
    assert separate["learner_round_s"] == separate["learner_step_s"]
    _, lines, _ = run_plan(*LEAGUE_14B[:3])
    alone = fields(next(line for line in lines if line.startswith("role=learner")))
    assert (alone["policies"], alone["learner_gpu_gib"]) == ("1", separate["learner_gpu_gib"])

    # the host's GPU: one base (27.51 GiB) and three adapters' weights and optimiser state, not three bases
    config = plan.compose_plan([*LEAGUE_14B, "learner.adapters_per_actor=3"])
    memory = plan.make_plan(config).learner_mem
    lora = plan.KNOWN_SHAPES["Qwen/Qwen3-14B"].lora_params(config.model.lora.rank, config.model.lora.target_modules)
    assert float(host["learner_gpu_gib"]) == pytest.approx(
        float(separate["learner_gpu_gib"]) + 2 * lora * 14 / 2**30, abs=0.01
    )
    assert memory.term("base_weights").gib == pytest.approx(27.51, abs=0.01)
    assert int(host["adapters_fit"]) == memory.adapters_fit() == 4
    assert any(line.startswith("# adapters beside the base on one learner GPU: 4 (") for line in host_lines)
    assert int(separate["adapters_fit"]) == 4


def test_more_adapters_than_fit_are_refused_naming_how_many_do() -> None:
    code, _, err = run_plan(*LEAGUE_14B, "learner.adapters_per_actor=3", "learner.micro_batch_tokens=10240")
    assert code == 1 and "does not fit: learner GPU needs" in err and "adapter(s) fit beside the base" in err
    code, _, err = run_plan(*LEAGUE_14B, "learner.adapters_per_actor=3", "learner.ranks=2")
    assert code == 2 and "adapters_per_actor > 1" in err


def test_bad_input_is_a_clear_error() -> None:
    code, _, err = run_plan("cluster=tpu9000")
    assert code == 2 and "tpu9000" in err
    code, _, err = run_plan("inference=local")
    assert code == 2 and "replica_gpus is 0" in err
    code, _, err = run_plan("model=tiny")
    assert code == 2 and "tokenizer" in err
    code, _, err = run_plan("inference.tensor_parallel_size=3")
    assert code == 1 and "tensor_parallel_size 3 does not divide 32 attention heads" in err
    with pytest.raises(ValueError, match="train_utilisation has no source"):
        ClusterConfig(**{**cluster().__dict__, "sources": {}})
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        LearnerConfig(ranks=0)


def test_the_plan_imports_no_heavy_library() -> None:
    code = "import sys, diprl.plan; print(sorted(m for m in ('torch', 'ray', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
