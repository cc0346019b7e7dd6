"""The Docker Compose demo swarm (deploy/docker-compose.yml), checked without a Docker engine.

The topology, the wiring through the bootstrap's address file, the volume, the ports and
the build inputs are checked from the YAML and the Dockerfile; every service's command is
parsed with the real CLI parser, so a renamed or missing flag fails here, not in a user's
`docker compose up`.
"""

from __future__ import annotations

import collections
import fnmatch
import shlex
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser from PyPI (a test extra)
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
VOLUME_MOUNT = "shared:/shared"


def _flag(argv: list[str], name: str) -> str | None:
    """The value after ``name`` in ``argv`` (None when absent); a repeated flag is an error."""
    hits = [i for i, arg in enumerate(argv) if arg == name]
    assert len(hits) <= 1, f"{name} given {len(hits)} times in {argv}"
    return argv[hits[0] + 1] if hits else None


def _swarm_commands() -> dict[str, list[str]]:
    """service -> argv after `swarm`, for services that run the swarm CLI."""
    out = {}
    for name, svc in SERVICES.items():
        cmd = svc.get("command")
        assert isinstance(cmd, list), f"{name}: use the exec (list) form of command, got {cmd!r}"
        if cmd[0] == "swarm":
            out[name] = [str(a) for a in cmd[1:]]
    return out


def _by_subcommand(sub: str) -> dict[str, list[str]]:
    return {name: argv for name, argv in _swarm_commands().items() if argv[0] == sub}


def test_topology_bootstrap_two_stages_of_two_peers_one_trainer():
    assert len(_by_subcommand("dht")) == 1
    assert len(_by_subcommand("train")) == 1
    peers = _by_subcommand("peer")
    stages = collections.Counter(int(_flag(argv, "--stage")) for argv in peers.values())
    assert stages == {0: 2, 1: 2}, stages
    run_ids = {_flag(argv, "--run-id") for argv in {**peers, **_by_subcommand("train")}.values()}
    assert run_ids == {"demo"}
    # Peers publish the run (model preset) if the DHT has none; the trainer reads it from there.
    assert {_flag(argv, "--preset") for argv in peers.values()} == {"tiny"}


def test_every_service_mounts_the_shared_volume():
    assert "shared" in COMPOSE["volumes"]
    for name, svc in SERVICES.items():
        assert VOLUME_MOUNT in svc.get("volumes", []), f"{name} does not mount {VOLUME_MOUNT}"


def test_everyone_bootstraps_from_the_file_the_bootstrap_writes():
    ((dht_name, dht_argv),) = _by_subcommand("dht").items()
    address_file = _flag(dht_argv, "--address-file")
    assert address_file and address_file.startswith("/shared/"), address_file
    clients = {**_by_subcommand("peer"), **_by_subcommand("train")}
    assert len(clients) == 5
    for name, argv in clients.items():
        assert _flag(argv, "--initial-peers") == f"@{address_file}", name
        # Started only once this run's address file exists (the check tests that file).
        dep = SERVICES[name]["depends_on"][dht_name]
        assert dep["condition"] == "service_healthy", name
    health = SERVICES[dht_name]["healthcheck"]["test"]
    assert address_file in health, health
    # The stale file of a previous run is removed before the bootstrap starts.
    (cleaner,) = [n for n, s in SERVICES.items() if s["command"] == ["rm", "-f", address_file]]
    assert (
        SERVICES[dht_name]["depends_on"][cleaner]["condition"] == "service_completed_successfully"
    )


def test_peers_restart_on_failure_and_announce_their_own_hostname():
    for name, argv in _by_subcommand("peer").items():
        svc = SERVICES[name]
        assert svc["restart"] == "on-failure", name
        assert _flag(argv, "--announce-host") == svc.get("hostname", name) == name
        assert _flag(argv, "--host") == "0.0.0.0", f"{name} must listen on all container interfaces"


def test_announced_hosts_have_fixed_dht_ports():
    # libp2p cannot announce port 0: `--announce-host` without `--dht-port` fails at start.
    for name, argv in _swarm_commands().items():
        if _flag(argv, "--announce-host") is not None:
            assert int(_flag(argv, "--dht-port") or 0) > 0, (
                f"{name} announces a host but no --dht-port"
            )
            assert _flag(argv, "--announce-host") == SERVICES[name].get("hostname", name) == name, (
                name
            )


def test_ports_do_not_collide():
    listen = [
        (name, int(_flag(argv, flag)))
        for name, argv in _swarm_commands().items()
        for flag in ("--port", "--dht-port")
        if _flag(argv, flag) is not None
    ]
    assert len(listen) == 9  # bootstrap's DHT + 4 peers' gRPC and DHT
    ports = [p for _, p in listen]
    assert len(set(ports)) == len(ports), listen
    for name, port in listen:
        exposed = [str(p) for p in SERVICES[name].get("expose", [])]
        assert str(port) in exposed, f"{name} listens on {port} but exposes {exposed}"
    published = [
        str(p).rsplit(":", 1)[0] for svc in SERVICES.values() for p in svc.get("ports", [])
    ]
    assert len(set(published)) == len(published), published


def _dockerfile_copies(dockerfile: Path) -> list[str]:
    """Source paths in the build context of the COPY/ADD instructions (single-line instructions; a COPY
    --from=STAGE copies from an earlier stage, not from the context)."""
    sources = []
    for line in dockerfile.read_text().splitlines():
        if line.split(maxsplit=1)[:1] not in (["COPY"], ["ADD"]):
            continue  # other instructions may hold shell syntax shlex cannot read
        words = shlex.split(line, comments=True)
        if any(w.startswith("--from") for w in words):
            continue
        sources += [w for w in words[1:] if not w.startswith("--")][:-1]
    return sources


def test_build_context_and_dockerfile_inputs_exist():
    builds = {yaml.safe_dump(svc["build"], sort_keys=True) for svc in SERVICES.values()}
    assert len(builds) == 1, "every service should share one image build"
    build = next(iter(SERVICES.values()))["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == REPO, context
    dockerfile = context / build["dockerfile"]
    assert dockerfile.is_file(), dockerfile
    sources = _dockerfile_copies(dockerfile)
    assert sources, "the Dockerfile copies nothing"
    for src in sources:
        assert (context / src).exists(), f"Dockerfile copies {src}, missing from the repository"
    # `pip install .` fails without the readme pyproject names.
    readme = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get("readme")
    if readme is not None:
        assert readme in sources, f"pyproject needs {readme} but the Dockerfile does not copy it"
    # The context's ignore file (at its root: Compose v1 and the classic builder read no other) must not hide
    # what the Dockerfile copies, and must keep the virtualenv out.
    assert not Path(str(dockerfile) + ".dockerignore").exists(), "BuildKit would read only that one"
    ignore = _ignore_patterns(context / ".dockerignore")
    for src in sources:
        assert not _ignored(src.rstrip("/"), ignore), f"{src} is excluded by the .dockerignore"
    assert _ignored(".venv", ignore), "the virtualenv would be sent as build context"
    assert _ignored("tests", ignore) and _ignored("deploy/netns", ignore)


def test_compose_v1_reads_the_file_too():
    # Compose v1 (Debian's docker-compose 1.29) refuses a top-level `name:`: the project's name comes from the
    # .env file next to the compose file, which v1 and v2 both read.
    assert "name" not in COMPOSE, "Compose v1 refuses a top-level name:"
    env = dict(
        line.split("=", 1)
        for line in (DEPLOY / ".env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert env == {"COMPOSE_PROJECT_NAME": "swarm-demo"}


def test_the_build_takes_its_base_image_and_torch_index_as_arguments():
    # A site without Docker Hub or behind a proxy sets these (deploy/README.md, "Without Docker Hub").
    build = next(iter(SERVICES.values()))["build"]
    dockerfile = (DEPLOY / build["context"] / build["dockerfile"]).read_text()
    declared = {
        line.split()[1].split("=")[0] for line in dockerfile.splitlines() if line.startswith("ARG ")
    }
    assert set(build["args"]) <= declared, (set(build["args"]), declared)
    assert build["args"]["BASE_IMAGE"] == "${SWARM_BASE_IMAGE:-python:3.11-slim}"
    # both stages start from it: the first installs the dependencies, the second takes their environment
    froms = [line for line in dockerfile.splitlines() if line.startswith("FROM")]
    assert froms == ["FROM ${BASE_IMAGE} AS deps", "FROM ${BASE_IMAGE}"]


def test_the_replicas_of_a_stage_average():
    # Without --average each replica steps on its own share of the batches and they drift apart;
    # tests/test_compose_live.py checks that they hold the same parameters at the end.
    for name, argv in _by_subcommand("peer").items():
        assert "--average" in argv, name


def _ignore_patterns(path: Path) -> list[str]:
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def _ignored(path: str, patterns: list[str]) -> bool:
    # Docker semantics for the patterns used here: last match wins, "!" re-includes.
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        if (
            pat == "**"
            or fnmatch.fnmatch(path, pat)
            or fnmatch.fnmatch(path, pat.removeprefix("**/"))
        ):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("service", sorted(_swarm_commands()))
def test_command_parses_with_the_cli(service):
    # No skip: until swarm.cli.build_parser exists this fails, on purpose.
    from swarm.cli import build_parser

    argv = _swarm_commands()[service]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:  # argparse reports unknown/missing flags by exiting
        pytest.fail(f"`swarm {' '.join(argv)}` of service {service} does not parse (exit {e.code})")
