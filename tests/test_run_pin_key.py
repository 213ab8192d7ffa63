"""A training run carries its adapter pin key through Ray: no node but the driver's needs a key file.

Versions are pinned with a MAC under a key kept outside the store (`diprl.inference.adapters.pins`). The
driver reads (or makes) its machine's key once and hands it to every actor that publishes or checks
versions, which installs it for its process in place of the file. The first tests pin that down on one
process and on the factories; the last runs real learners on the worker node of a two-node Ray cluster on
this machine whose nodes have no key file: one accepts a version the driver's key pinned and publishes
its own under it, a learner group's ranks refuse a version pinned under another key, and a learner
handed no key refuses what the driver pinned, as every replica on another node did before.
"""

from __future__ import annotations

import contextlib
import pickle
import stat
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from diprl.inference.adapters import AdapterStore, CorruptAdapter, pins
from diprl.inference.adapters.pins import PinKey
from diprl.inference.config import ServerConfig
from diprl.learn.site import LearnerSite
from tests.inference.lora_fixtures import make_lora_dir
from tests.test_multinode import _private_home

KEY_A, KEY_B, KEY_C = (PinKey((digit * 64).encode()) for digit in "abc")


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """This process starts with no installed key and a key file path where there is none."""
    path = tmp_path / "this-node" / "pin.key"
    monkeypatch.setenv(pins.KEY_ENV, str(path))
    monkeypatch.setattr(pins, "_installed", None)
    return path


def test_an_installed_key_takes_the_place_of_the_key_file(no_key: Path, tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "store")
    pins.use_key(KEY_A)
    store.publish("p", make_lora_dir(tmp_path, seed=1))
    assert not no_key.exists()  # publishing under a handed key makes no key file on this node
    pins.use_key(None)  # installs nothing: the handed key stays
    assert store.resolve("p@v1").name == "p@v1"

    pins._installed = None  # a process nobody handed the key to, on a node without the file
    with pytest.raises(CorruptAdapter, match="p@v1: its pin is keyed and this process has no pin key"):
        store.resolve("p@v1")
    no_key.parent.mkdir()
    no_key.write_bytes(KEY_B.secret + b"\n")  # another key in this node's file
    with pytest.raises(CorruptAdapter, match="pinned under another pin key"):
        store.resolve("p@v1")
    pins.use_key(KEY_A)  # the handed key wins over the file
    assert store.resolve("p@v1").name == "p@v1"
    pins.use_key(KEY_C)
    with pytest.raises(CorruptAdapter, match="p@v1: its files do not match the fingerprint pinned"):
        store.resolve("p@v1")


def test_a_pin_key_shows_no_digit_of_itself() -> None:
    secret = KEY_A.secret.decode()
    for shown in (repr(KEY_A), str(KEY_A), repr({"pin_key": KEY_A}), f"{KEY_A!r}"):
        assert "a" * 8 not in shown.replace("PinKey", ""), shown
    assert pickle.loads(pickle.dumps(KEY_A)) == KEY_A  # how Ray carries it to an actor
    for bad in (b"A" * 64, b"a" * 63, b"a" * 64 + b"\n", "a" * 64):
        with pytest.raises(ValueError, match="64 lowercase hex digits") as refused:
            PinKey(bad)  # type: ignore[arg-type]
        assert secret[:8] not in str(refused.value)


def test_the_driver_reads_its_key_once_and_installs_nothing(no_key: Path) -> None:
    from diprl.run.actors import run_pin_key

    key = run_pin_key()  # made on first use, where this node's key lives
    assert no_key.read_bytes().strip() == key.secret
    assert stat.S_IMODE(no_key.stat().st_mode) == 0o600
    assert pins._installed is None  # installed by the run, for its length (the next test)
    assert run_pin_key() == key  # a resumed run: the same key


@pytest.mark.usefixtures("no_key")
def test_a_scoped_key_is_installed_for_the_block_and_the_previous_one_is_back_after() -> None:
    with pins.key_installed(KEY_A):
        with pins.key_installed(KEY_B), contextlib.suppress(RuntimeError):
            assert pins._installed == KEY_B
            raise RuntimeError("the run failed")
        assert pins._installed == KEY_A
    assert pins._installed is None


@pytest.mark.parametrize(("before", "fails"), [(None, False), (KEY_A, False), (KEY_A, True)])
def test_a_run_holds_its_key_in_the_driver_while_it_lasts_and_puts_back_the_one_it_found(
    no_key: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: PinKey | None, fails: bool
) -> None:
    """`train.run` in this process, with Ray, the PolicyServer and the actors stood in for: the driver's
    process publishes and reads versions under the run's key while the run lasts, and afterwards (after a
    failure too) has back the key it had before, or none. The key used to stay installed for good: the next
    run or store this process touched signed and checked pins with a finished run's key."""
    from diprl import raysession, train
    from diprl.inference import deploy
    from diprl.run import actors
    from diprl.run.config import compose_config

    seen: dict[str, Any] = {}

    class Driver:
        learning = SimpleNamespace(versions={"main": "main@v1"})

        @classmethod
        def for_run(cls, *args: Any) -> Driver:
            return cls()

        def start(self) -> None:
            pass

        def run(self) -> None:
            seen["during"] = pins._installed
            if fails:
                raise RuntimeError("an actor failed")

        def summary(self) -> dict[str, Any]:
            return {}

    def start_actors(config: Any, run_dir: Path, key: PinKey) -> Any:
        seen["handed"] = key
        return SimpleNamespace(learners=["main"])

    @contextlib.contextmanager
    def stand_in(*args: Any, **kwargs: Any) -> Iterator[Any]:  # Ray's session, the deployment, the web app
        yield SimpleNamespace(dashboard_hint=lambda: None, result=lambda: None)

    monkeypatch.setattr(raysession, "ray_session", stand_in)
    monkeypatch.setattr(deploy, "deploying", stand_in)
    monkeypatch.setattr(actors, "check_shared_run_dir", lambda run_dir: 1)
    monkeypatch.setattr(actors, "write_provenance", lambda run_dir: None)
    monkeypatch.setattr(train, "build_model", lambda model: None)
    monkeypatch.setattr(train, "web_app", stand_in)
    monkeypatch.setattr(train, "start_actors", start_actors)
    monkeypatch.setattr(train, "Driver", Driver)
    config, resolved = compose_config(["+experiment=smoke", f"train.run_dir={tmp_path / 'run'}"])

    pins._installed = before
    with pytest.raises(RuntimeError, match="an actor failed") if fails else contextlib.nullcontext():
        train.run(config, resolved)
    run_key = PinKey(no_key.read_bytes().strip())  # this machine's key, made by the run
    assert seen["during"] is seen["handed"]
    assert seen["handed"] == run_key != before
    assert pins._installed is before  # (`is`: a failure's report shows no digit of either key)


def test_the_driver_hands_its_key_to_every_learner_and_replica(
    no_key: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every path a learner takes (its own actor, a learner group, a host of several adapters) and the
    PolicyServer deployment get the key; the ones that build a `Learner` install it first."""
    import ray

    from diprl.inference import deploy
    from diprl.inference.server import PolicyServer
    from diprl.learn import group, host
    from diprl.run.actors import start_learners
    from diprl.run.config import compose_config

    handed: list[Any] = []

    class Remote:
        def options(self, **options: Any) -> Remote:
            return self

        def remote(self, config: Any, site: LearnerSite, *args: Any) -> None:
            handed.append(site.pin_key)

    monkeypatch.setattr(ray, "remote", lambda cls: Remote())
    monkeypatch.setattr(group, "group_actor", lambda config, site, *args: handed.append(site.pin_key))
    config, _ = compose_config(["+experiment=smoke"])
    for per_actor, ranks in ((1, 1), (1, 2), (2, 1)):
        learner = replace(config.learner, adapters_per_actor=per_actor, ranks=ranks)
        start_learners(replace(config, learner=learner), ["main"], LearnerSite("run", "adapters", pin_key=KEY_A))
    assert handed == [KEY_A] * 3

    # A rank and a host install the key before anything else (a host refusing its configs has it already).
    group.LearnerRank(True, KEY_B)  # (True: leaves this process's torch threads alone)
    assert pins._installed == KEY_B
    with pytest.raises(host.HostError, match="at least one policy"):
        host.LearnerHost([], LearnerSite("run", "adapters", pin_key=KEY_C))
    assert pins._installed == KEY_C

    # The deployment binds the key beside the config, never in it; each replica installs it before its engine.
    bound: list[Any] = []
    monkeypatch.setattr(deploy, "resolve_model", lambda c: (str(tmp_path / "model"), "float32"))
    monkeypatch.setattr(deploy, "_served_adapter_root", lambda name: None)
    monkeypatch.setattr(deploy, "_serve_running", lambda: True)
    monkeypatch.setattr(deploy.serve, "start", lambda **kwargs: None)
    monkeypatch.setattr(deploy.serve, "run", lambda app, **kwargs: bound.append(app._bound_deployment.init_args))
    deploy.serve_policy(ServerConfig(), pin_key=KEY_A)
    ((served_config, served_key),) = bound
    assert served_key == KEY_A and KEY_A.secret.decode() not in str(served_config)

    engines: list[PinKey | None] = []

    class Engine:
        def __init__(self, config: ServerConfig) -> None:
            engines.append(pins._installed)
            self.generate_one = None

    replica_class = PolicyServer.func_or_class.__mro__[1]  # the class `serve.ingress` wraps: a copy of ours,
    monkeypatch.setitem(replica_class.__init__.__globals__, "PolicyEngine", Engine)  # with globals of its own
    replica_class(asdict(ServerConfig()), KEY_B)
    assert engines == [KEY_B]


# ------------------------------------------------------------------------------------ the cluster
def _add_node(cluster: Any, **args: Any) -> Any:
    """`cluster.add_node` (its first node is the head), again when it gave up: Ray waits only 30 s for a node
    to register, which a loaded machine can miss (tests/shared_dir_flow.py retries for the same reason). What a
    failed try started, this process's children since, is ended by process id."""
    import psutil

    me = psutil.Process()
    for attempt in range(5):
        before = {child.pid for child in me.children()}
        try:
            return cluster.add_node(**args)
        except Exception:
            if attempt == 4:
                raise
            for child in me.children():
                if child.pid not in before:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()


@contextlib.contextmanager
def _two_nodes(head_key: Path, worker_key: Path) -> Iterator[Any]:
    """A head and a worker node on this machine, each told its key file is one that does not exist; only the
    worker declares `keyless_node`, so what asks for it runs there."""
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    try:
        with _private_home():  # the head's processes find its `{}` bootstrap file
            common = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
            _add_node(cluster, **common, num_cpus=1, env_vars={pins.KEY_ENV: str(head_key)})
            worker_env = {pins.KEY_ENV: str(worker_key)}
            _add_node(cluster, **common, num_cpus=3, resources={"keyless_node": 1.0}, env_vars=worker_env)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def _refusal(actor: Any) -> str:
    """What a learner actor that died building itself said."""
    import ray

    with pytest.raises(ray.exceptions.RayActorError) as died:
        ray.get(actor.pid_of.remote(), timeout=600)
    return str(died.value)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_learners_on_a_node_without_a_key_file_use_the_key_the_driver_handed_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from diprl.learn.actor import learner_actor
    from diprl.learn.config import LearnerConfig
    from diprl.run.actors import run_pin_key

    driver_key, head_key, worker_key = (tmp_path / n / "pin.key" for n in ("driver", "head", "worker"))
    monkeypatch.setenv(pins.KEY_ENV, str(driver_key))
    monkeypatch.setattr(pins, "_installed", None)
    root = tmp_path / "adapters"
    store = AdapterStore(root)
    key = run_pin_key()
    store.publish("init", make_lora_dir(tmp_path, seed=1))
    pins.use_key(PinKey(b"f" * 64))  # a version pinned under another key (another run's, a forger's)
    store.publish("forged", make_lora_dir(tmp_path, seed=2))
    pins.use_key(key)
    keyless = {"keyless_node": 0.001}

    with _two_nodes(head_key, worker_key) as cluster:
        ray.init(address=cluster.address, namespace="pin-key-test", log_to_driver=False)
        try:
            # Handed no key, a learner on the worker refuses what the driver pinned: the bug this fixes.
            bare = learner_actor(
                LearnerConfig(policy="bare", init_adapter="init@v1"),
                LearnerSite(tmp_path / "run", root),
                resources=keyless,
            )
            assert "init@v1: its pin is keyed and this process has no pin key" in _refusal(bare)
            # A learner group's ranks, handed the key, still refuse a version pinned under another key.
            config = LearnerConfig(policy="group", init_adapter="forged@v1", ranks=2)
            forged = learner_actor(config, LearnerSite(tmp_path / "run", root, pin_key=key), resources=keyless)
            assert "forged@v1: its files do not match the fingerprint pinned" in _refusal(forged)
            # Handed the key, a learner starts from the driver's version and publishes its own under that key.
            config = LearnerConfig(policy="main", init_adapter="init@v1", checkpoint_every=0)
            learner = learner_actor(config, LearnerSite(tmp_path / "run", root, pin_key=key), resources=keyless)
            ray.get(learner.pid_of.remote(), timeout=900)
            on = ray.get(learner.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))
            assert on != cluster.head_node.node_id
            logs = Path(cluster.head_node.get_session_dir_path()) / "logs"
        finally:
            ray.shutdown()
    assert store.resolve("main@v1").name == "main@v1"  # pinned with the driver's key, checked here with it
    assert (root / ".pins" / "main@v1").read_text().startswith(pins.MAC_PREFIX)
    assert not head_key.exists() and not worker_key.exists()  # no node got a key file
    secret = key.secret
    for path in [*tmp_path.rglob("*"), *logs.rglob("*")]:  # nowhere but the driver's key file: no log, no run file
        if path.is_file() and path != driver_key:
            assert secret not in path.read_bytes(), path


def test_a_run_resumed_under_another_key_is_refused_at_start(no_key: Path, tmp_path: Path) -> None:
    from diprl.run.actors import PIN_KEY_ID, run_pin_key
    from diprl.run.config import ConfigError

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    key = run_pin_key(run_dir)
    recorded = (run_dir / PIN_KEY_ID).read_text()
    assert key.secret.decode()[:8] not in recorded  # a digest, never the key
    assert run_pin_key(run_dir) == key  # resumed on the same machine: accepted
    no_key.write_bytes(b"b" * 64 + b"\n")  # the machine's key is another one now
    with pytest.raises(ConfigError, match=r"another adapter pin key.*DIPRL_PIN_KEY_FILE"):
        run_pin_key(run_dir)
    assert (run_dir / PIN_KEY_ID).read_text() == recorded  # the record is kept, not overwritten
