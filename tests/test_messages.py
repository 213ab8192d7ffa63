"""The one PolicyRef parser and the typed messages' wire forms."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace

import pytest
import ray.cloudpickle

from diprl.messages import (
    BASE_REF,
    Generation,
    GenerationRequest,
    GroupRestart,
    Match,
    MatchResult,
    PolicyRef,
    QuarantinedRecord,
    RefKind,
    StepFault,
    StepReport,
    TrainingRecord,
    TrajectoryGroup,
    UnknownPolicyRef,
    parse_seats,
    validate_policy_name,
)


@pytest.mark.parametrize(
    ("text", "kind", "name", "version"),
    [
        ("bot:dumbbot", RefKind.BOT, "dumbbot", 0),
        ("base", RefKind.BASE, "", 0),
        ("main@v1", RefKind.ADAPTER, "main", 1),
        ("league_exploiter@v123", RefKind.ADAPTER, "league_exploiter", 123),
    ],
)
def test_parse_round_trips(text: str, kind: RefKind, name: str, version: int) -> None:
    ref = PolicyRef.parse(text)
    assert (ref.kind, ref.name, ref.version) == (kind, name, version)
    assert str(ref) == text
    assert PolicyRef.parse(str(ref)) == ref


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Base",
        "main",
        "main@v0",
        "main@v01",
        "main@1",
        "base@v1",
        "../x@v1",
        "main@v1 ",
        "bot:",
        "bot:Dumb",
        "bot:../x",
        "MAIN@v1",
        "main@v1000000000",
        None,
        3,
    ],
)
def test_malformed_refs_are_one_error(text: object) -> None:
    with pytest.raises(UnknownPolicyRef):
        PolicyRef.parse(text)


def test_predicates_and_policy() -> None:
    assert PolicyRef.parse("bot:random").is_bot and not PolicyRef.parse("bot:random").is_llm
    assert BASE_REF.is_llm and BASE_REF.policy == ""
    assert PolicyRef.parse("main@v7").policy == "main"
    group = {
        v: TrajectoryGroup("g", "m", "FRANCE", "S1901M", PolicyRef.parse(v), [], [], 0.0) for v in ("main@v7", "base")
    }
    assert {v: g.policy for v, g in group.items()} == {"main@v7": "main", "base": ""}  # routed by its version's policy
    assert PolicyRef.adapter("main", 3) == PolicyRef.parse("main@v3")
    with pytest.raises(UnknownPolicyRef):
        PolicyRef.adapter("main", True)  # type: ignore[arg-type]
    assert validate_policy_name("main") == "main"
    for bad in ("base", "main@v1", "Main", ""):
        with pytest.raises(UnknownPolicyRef):
            validate_policy_name(bad)


def test_parse_adapter_takes_only_a_trained_policys_version() -> None:
    assert PolicyRef.parse_adapter("main@v3") == PolicyRef.adapter("main", 3)
    for text, why in (("base", "the base model"), ("bot:random", "a rule bot"), ("zoo:best", "a zoo entry")):
        with pytest.raises(UnknownPolicyRef, match=f"is {why}, not a version"):
            PolicyRef.parse_adapter(text)
    with pytest.raises(UnknownPolicyRef, match="invalid adapter name"):
        PolicyRef.parse_adapter("main@v01")


def test_match_checks_its_seats() -> None:
    seats = parse_seats({"FRANCE": "main@v2", "ENGLAND": "bot:random"})
    match = Match("m0", seats, hero="FRANCE", seed=1, train=("FRANCE",))
    assert match.trains and match.ref("ENGLAND").is_bot
    with pytest.raises(TypeError, match=r"ENGLAND .* must be a PolicyRef"):
        Match("m3", {"FRANCE": PolicyRef.parse("main@v2"), "ENGLAND": "bot:random"}, hero="FRANCE", seed=1)
    with pytest.raises(ValueError, match="no seat"):
        Match("m1", seats, hero="ITALY", seed=1)
    with pytest.raises(ValueError, match="nothing to train"):
        Match("m2", seats, hero="FRANCE", seed=1, train=("ENGLAND",))


def test_wire_forms() -> None:
    request = GenerationRequest(policy="base", prompt=(1, 2, 3), legal=None, sample_seed=None)
    assert request.to_dict() == {"policy": "base", "prompt": [1, 2, 3], "temperature": 1.0, "max_tokens": 384}
    answer = Generation(policy="base", prompt_ids=[1], token_ids=[2], logprobs=[-0.1], complete=True)
    assert answer.trainable and not answer.bad
    failed = Generation.failed("main@v1", "UnknownAdapter: no such version")
    assert not failed.trainable and failed.bad
    assert pickle.loads(pickle.dumps(answer)) == answer
    seats = parse_seats({"FRANCE": "main@v2", "ENGLAND": "bot:random"})
    centres, ranks = {"FRANCE": 5, "ENGLAND": 4}, {"FRANCE": 1, "ENGLAND": 2}
    result = MatchResult("m0", 0, seats, "FRANCE", centres, ranks, "W1901A", None)
    assert result.to_dict()["seats"] == {"FRANCE": "main@v2", "ENGLAND": "bot:random"}  # refs are text only in JSON
    assert pickle.loads(pickle.dumps(result)) == result


def _record() -> TrainingRecord:
    v3 = PolicyRef.adapter("main", 3)
    return TrainingRecord([1, 2], [3], [-0.5], {"power": "FRANCE"}, [1.0], v3, 1.0, "FRANCE", "S1901M")


def _group() -> TrajectoryGroup:
    return TrajectoryGroup(
        "m/S1901M/FRANCE", "m", "FRANCE", "S1901M", PolicyRef.adapter("main", 3), [_record()], [1.0], 1.0
    )


def test_refs_cross_the_ray_boundary_parsed_and_become_text_only_in_json() -> None:
    """Ray's serializer (cloudpickle, what its object store and actor calls use) keeps a group's, its records'
    and a step report's versions parsed refs; their JSON forms (the pending batch, the metrics log) hold the text."""
    group = _group()
    report = StepReport("main", 4, True, PolicyRef.parse("main@v5"), published=PolicyRef.parse("main@v5"))
    for message in (group, report):
        back = ray.cloudpickle.loads(ray.cloudpickle.dumps(message))
        assert back == message
    assert isinstance(back.version, PolicyRef) and back.published == PolicyRef.adapter("main", 5)
    assert json.loads(json.dumps(report.record()))["published"] == "main@v5"
    wire = json.loads(json.dumps(group.to_dict()))
    assert wire["policy_version"] == wire["records"][0]["policy_version"] == "main@v3"
    again = TrajectoryGroup.from_dict(wire)
    assert again == group and isinstance(again.records[0].policy_version, PolicyRef)
    record = json.loads(json.dumps(_record().to_dict()))
    assert record["policy_version"] == "main@v3" and TrainingRecord.from_dict(record) == _record()


def test_a_step_reports_faults_and_quarantined_records_cross_ray_typed_and_log_the_same_lines() -> None:
    """The fault lines the driver writes (`record()`) keep the keys, order and values of the dicts the
    report carried before these were typed: a run's metrics.jsonl reads the same."""
    restart = GroupRestart(1, "rank_lost", "RayActorError('rank 1 died')", 2, 2, 1_700_000_000.5)
    bad = QuarantinedRecord("constraint", "record 2: rejected", "m/S1901M/FRANCE", "main@v2", 2)
    report = StepReport(
        "main",
        3,
        True,
        PolicyRef.parse("main@v4"),
        faults=[
            replace(restart, replayed_step=3),
            StepFault("publish_failed", 3, "OSError: full"),
            StepFault("nonfinite_gradients", 4),
        ],
        quarantined=[bad],
    )
    back = ray.cloudpickle.loads(ray.cloudpickle.dumps(report))
    assert back == report and isinstance(back.faults[0], GroupRestart) and back.quarantined == [bad]
    lines = [json.loads(json.dumps(f.record())) for f in report.faults]
    assert lines == [
        {
            "fault": "learner_group_restarted",
            "rank": 1,
            "cause": "rank_lost",
            "error": "RayActorError('rank 1 died')",
            "step_before": 2,
            "restored_step": 2,
            "time": 1_700_000_000.5,
            "replayed_step": 3,
        },
        {"fault": "publish_failed", "step": 3, "error": "OSError: full"},
        {"fault": "nonfinite_gradients", "step": 4},  # no error key, as before
    ]
    assert list(lines[0]) == [
        "fault",
        "rank",
        "cause",
        "error",
        "step_before",
        "restored_step",
        "time",
        "replayed_step",
    ]
    assert "replayed_step" not in restart.record()  # a restart whose step was not trained again
    assert list(bad.record().items()) == [
        ("reason", "constraint"),
        ("error", "record 2: rejected"),
        ("group_id", "m/S1901M/FRANCE"),
        ("policy_version", "main@v2"),
        ("index", 2),
    ]


def test_a_record_written_as_json_before_its_version_was_a_parsed_ref_still_loads() -> None:
    """What `asdict` wrote of a record while its version was text (a pending batch, a quarantine file):
    the same form `to_dict` writes now, read back with the version parsed."""
    old = {
        "prompt_ids": [1, 2], "completion_ids": [3], "behaviour_logprobs": [-0.5], "legal": {"power": "FRANCE"},
        "advantages": [1.0], "policy_version": "main@v3", "temperature": 1.0, "power": "FRANCE", "phase": "S1901M",
        "reward": 0.0, "reward_components": {}, "order_rewards": {},
    }  # fmt: skip
    assert TrainingRecord.from_dict(old) == _record()
    assert TrainingRecord.from_dict(old).to_dict() == old
    with pytest.raises(UnknownPolicyRef):
        TrainingRecord.from_dict({**old, "policy_version": "main@v03"})


def test_a_version_given_as_text_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="policy_version of group g must be a PolicyRef"):
        TrajectoryGroup("g", "m", "FRANCE", "S1901M", "main@v3", [], [], 0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="policy_version of record FRANCE S1901M must be a PolicyRef"):
        TrainingRecord([1], [2], [0.0], {}, [1.0], "main@v3", 1.0, "FRANCE", "S1901M")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"StepReport\.published of main must be a PolicyRef"):
        StepReport("main", 1, True, None, published="main@v1")  # type: ignore[arg-type]


def test_a_group_id_names_its_seat_and_fork_point() -> None:
    from diprl.messages import GroupSeat, group_id, group_seat

    assert group_id("m/1", "S1901M", "FRANCE") == "m/1/S1901M/FRANCE"  # the first fork point: ids as before
    assert group_seat(group_id("m/1", "S1901M", "FRANCE")) == GroupSeat("m/1", "FRANCE", 0)
    assert group_seat(group_id("m/1", "F1902M", "FRANCE", point=2)) == GroupSeat("m/1", "FRANCE", 2)
    assert group_seat("m/S1901M/FRANCE#x") == GroupSeat("m", "FRANCE#x", 0)  # not ours: its own seat
    assert group_seat("filler") == GroupSeat("filler", "", 0)
