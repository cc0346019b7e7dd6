"""Run the Docker Compose demo swarm (deploy/docker-compose.yml) from start to end, and look inside it.

``python -m deploy.compose`` (``make compose``) builds the image, starts the swarm, prints the trainer's progress,
says whether the replicas of each stage hold the same parameters, and takes everything down again (containers,
network, volume; with a Docker engine it started, the engine too). ``--offline`` builds without Docker Hub and
through this host's pip setup: a base image from Debian's packages (deploy/baseimage.py), and in deploy/site/
this host's CA bundle and torch wheel with a pip.conf naming them (deploy/README.md, "Without Docker Hub").
tests/test_compose_live.py drives the same pieces and kills a peer on the way.

The compose file is read by Compose v2 (``docker compose``) where the Docker CLI has it, else by Compose v1
(``docker-compose``, Debian's package); both read the same file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from deploy.engine import DockerEngine, EngineError, compose_command

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "deploy" / "docker-compose.yml"
SITE = REPO / "deploy" / "site"
TORCH_REQUIREMENT = "torch==2.13.0"  # what deploy/Dockerfile installs
IMAGE_PYTHON = "3.11"  # the Python of python:3.11-slim and of Debian bookworm (deploy/baseimage.py)
RUN_ID = "demo"  # the run the compose file's peers publish
# Where the build stage sees deploy/site/ (deploy/Dockerfile).
SITE_IN_BUILD = "/etc/swarm-build"
# How far apart two replicas' parameters may be and still hold the same model. Replicas that average apply the
# same all-reduced gradient, but hivemind hands each the average as a difference to add to its own values, so
# they differ by float32 rounding (~1e-7 per step; tests/test_averaging.py allows the same).
REPLICA_ATOL = 1e-5

PROGRESS = re.compile(r"^step (\d+)/(\d+)", re.MULTILINE)


def host_ca_bundle() -> Path:
    """The CA bundle pip on this host trusts: $PIP_CERT, else the one OpenSSL uses."""
    for candidate in (os.environ.get("PIP_CERT"), ssl.get_default_verify_paths().cafile):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise RuntimeError(
        "no CA bundle found ($PIP_CERT, OpenSSL's default); nothing to give the build"
    )


def prepare_site(site: Path = SITE, *, log) -> None:
    """Fill ``site`` (deploy/site/) so that the build uses this host's pip setup: its CA bundle, the torch wheel
    pip here would install (``pip download``, through this host's configuration: from local disk where it lists
    one), and a pip.conf that names both. Files already equal are left as they are."""
    wheels = site / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    _write_if_changed(site / "ca-certificates.crt", host_ca_bundle().read_bytes())
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
            *("--python-version", IMAGE_PYTHON, "--dest", str(wheels), TORCH_REQUIREMENT),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        check=True,
    )
    conf = (
        "# Written by deploy/compose.py (--offline): this host's CA bundle and torch wheel.\n"
        f"[global]\ncert = {SITE_IN_BUILD}/ca-certificates.crt\nfind-links = {SITE_IN_BUILD}/wheels\n"
    )
    _write_if_changed(site / "pip.conf", conf.encode())


def _write_if_changed(path: Path, data: bytes) -> None:
    if not path.is_file() or path.read_bytes() != data:
        path.write_bytes(data)


def offline_environment(base_image: str) -> dict[str, str]:
    """The variables the compose file reads for a build without Docker Hub (deploy/README.md)."""
    # Empty: torch comes from wherever deploy/site/pip.conf says, not from an index this host cannot reach.
    return {"SWARM_BASE_IMAGE": base_image, "SWARM_TORCH_INDEX_URL": ""}


def steps_override(path: Path, steps: int) -> Path:
    """Write a compose file to ``path`` that runs the real file's trainer command for ``steps`` steps (the only
    change), for use after the real file (``-f docker-compose.yml -f path``)."""
    import yaml

    argv = [
        str(a) for a in yaml.safe_load(COMPOSE_FILE.read_text())["services"]["trainer"]["command"]
    ]
    argv[argv.index("--steps") + 1] = str(steps)
    path.write_text(json.dumps({"services": {"trainer": {"command": argv}}}))  # JSON is YAML
    return path


@dataclass
class ComposeProject:
    """One Compose project of the demo: the real compose file plus ``overrides``, under the name ``name``, with
    ``environment`` added to this process's for the compose command."""

    name: str
    overrides: tuple[Path, ...] = ()
    environment: dict[str, str] | None = None
    # service -> its container's id: asking Compose costs seconds (v1), and a killed and started container keeps
    # its id, so watching a service's log is one `docker logs` a poll
    _containers: dict[str, str] = field(default_factory=dict, repr=False)

    def compose(self, *args: str, check: bool = True, capture: bool = False, log=None):
        files = [arg for path in (COMPOSE_FILE, *self.overrides) for arg in ("-f", str(path))]
        command = compose_command()
        if command is None:
            raise RuntimeError("neither `docker compose` nor `docker-compose` is installed")
        return subprocess.run(
            [*command, "-p", self.name, *files, *args],
            env={**os.environ, **(self.environment or {})},
            check=check,
            text=True,
            stdout=subprocess.PIPE if capture else log,
            stderr=subprocess.STDOUT if log is not None else None,
        )

    def container(self, service: str) -> str:
        """The id of the service's container (it must exist)."""
        if service not in self._containers:
            out = self.compose("ps", "-q", service, capture=True).stdout.split()
            if len(out) != 1:
                raise RuntimeError(f"service {service} of {self.name} has {len(out)} containers")
            self._containers[service] = out[0]
        return self._containers[service]

    def inspect(self, service: str) -> dict:
        done = subprocess.run(
            ["docker", "inspect", self.container(service)],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(done.stdout)[0]

    def logs(self, service: str) -> str:
        done = subprocess.run(
            ["docker", "logs", self.container(service)],
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout + done.stderr

    def address(self, service: str) -> str:
        """The service's address on the project's network, as this host reaches it."""
        networks = self.inspect(service)["NetworkSettings"]["Networks"]
        (network,) = networks.values()
        return network["IPAddress"]

    def resources(self) -> dict[str, list[str]]:
        """What the engine holds of this project: containers, networks, volumes (by Compose's label)."""
        label = f"label=com.docker.compose.project={self.name}"
        out = {}
        for kind, argv in (
            ("containers", ["docker", "ps", "-aq", "--filter", label]),
            ("networks", ["docker", "network", "ls", "-q", "--filter", label]),
            ("volumes", ["docker", "volume", "ls", "-q", "--filter", label]),
        ):
            out[kind] = subprocess.run(
                argv, capture_output=True, text=True, check=True
            ).stdout.split()
        return out

    def down(self, log=None) -> None:
        """Remove the project's containers, network and volume."""
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", log=log)
        self._containers.clear()


def trainer_step(logs: str) -> int:
    """The last step the trainer's progress lines report (0 before the first)."""
    steps = PROGRESS.findall(logs)
    return int(steps[-1][0]) if steps else 0


def wait_for_trainer(project: ComposeProject, *, step: int | None = None, timeout_s: float) -> str:
    """Poll the trainer's container until it reports ``step`` (None: until it exits); its log. TimeoutError past
    ``timeout_s``; RuntimeError if it exits before ``step``."""
    deadline = time.monotonic() + timeout_s
    while True:
        logs = project.logs("trainer")
        running = project.inspect("trainer")["State"]["Running"]
        if step is not None and trainer_step(logs) >= step:
            return logs
        if not running:
            if step is None:
                return logs
            raise RuntimeError(
                f"the trainer exited at step {trainer_step(logs)} (< {step}):\n{logs[-2000:]}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the trainer did not reach {'its end' if step is None else f'step {step}'} within "
                f"{timeout_s:.0f}s; it is at step {trainer_step(logs)}"
            )
        time.sleep(1.0)


def peer_services() -> dict[str, tuple[int, int]]:
    """service -> (stage, gRPC port) of every peer in the compose file."""
    import yaml

    out = {}
    for name, service in yaml.safe_load(COMPOSE_FILE.read_text())["services"].items():
        argv = [str(a) for a in service["command"]]
        if argv[:2] == ["swarm", "peer"]:
            out[name] = (int(argv[argv.index("--stage") + 1]), int(argv[argv.index("--port") + 1]))
    return out


@dataclass(frozen=True)
class StageReplicas:
    stage: int
    steps: dict[str, int]  # service -> the optimizer step its state is at
    max_abs_diff: float  # largest difference of one parameter between any replica and the first


def compare_replicas(project: ComposeProject, *, timeout_s: float = 120.0) -> list[StageReplicas]:
    """Each stage's replicas' parameters (GetState of every peer, from this host), once every replica of a stage
    answers and all report the same step (polled until ``timeout_s``: a peer may still be starting, stepping or
    loading its peers' state). The result names each replica's step and how far its parameters are from its
    stage's first. TimeoutError if some replica never answers."""
    from swarm.errors import SwarmError, TransportError
    from swarm.transport.client import PeerClient
    from swarm.transport.security import address_by_handshake

    stages: dict[int, dict[str, int]] = {}  # stage -> service -> its gRPC port
    for service, (stage, port) in sorted(peer_services().items()):
        stages.setdefault(stage, {})[service] = port

    async def states(ports: dict[str, int]):
        out = {}
        for service, port in ports.items():
            # asked each time: a container that restarted may have another address (and, restarted without its
            # identity volume, another certificate: this host started the peers, so it trusts what they present)
            endpoint = f"{project.address(service)}:{port}"
            try:
                address = await asyncio.to_thread(address_by_handshake, endpoint)
            except OSError as e:
                raise TransportError(f"peer {endpoint}: no TLS handshake ({e})") from None
            client = PeerClient(address)
            try:
                out[service] = await client.get_state(RUN_ID, timeout_s=30)
            finally:
                await client.close()
        return out

    result = []
    deadline = time.monotonic() + timeout_s
    for stage, ports in sorted(stages.items()):
        while True:
            try:
                replies = asyncio.run(states(ports))
            except SwarmError as e:  # not serving yet (every transport error arrives as one)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"stage {stage}'s replicas did not all answer: {e}") from e
                time.sleep(1.0)
                continue
            steps = {service: reply.meta.step for service, reply in replies.items()}
            if len(set(steps.values())) == 1 or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        first, *others = replies.values()
        diff = max(
            (
                float((reply.tensors[name] - tensor).abs().max())
                for reply in others
                for name, tensor in first.tensors.items()
            ),
            default=0.0,
        )
        result.append(StageReplicas(stage=stage, steps=steps, max_abs_diff=diff))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.compose", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="build without Docker Hub, through this host's pip setup (deploy/README.md)",
    )
    parser.add_argument("--steps", type=int, default=0, help="trainer steps (default: the file's)")
    parser.add_argument("--project", default="swarm-demo", help="Compose project name")
    parser.add_argument(
        "--timeout-s", type=float, default=1800.0, help="seconds to wait for the trainer's end"
    )
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (EngineError, RuntimeError, TimeoutError, subprocess.CalledProcessError) as e:
        print(f"deploy.compose: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="swarm-compose-"))
    print(f"deploy.compose: logs in {workdir}", flush=True)
    overrides = (steps_override(workdir / "steps.yml", args.steps),) if args.steps else ()
    environment = None
    engine = DockerEngine(workdir, install=os.geteuid() == 0, offline=args.offline)
    with open(workdir / "setup.log", "w") as log, engine:
        if args.offline:
            from deploy.baseimage import TAG, ensure_base_image

            ensure_base_image(TAG, log=log)
            prepare_site(log=log)
            environment = offline_environment(TAG)
        project = ComposeProject(args.project, overrides, environment)
        try:
            print("deploy.compose: building the image (docker compose build)", flush=True)
            project.compose("build", "trainer")
            project.compose("up", "--detach")
            follow = subprocess.Popen(["docker", "logs", "--follow", project.container("trainer")])
            try:
                wait_for_trainer(project, timeout_s=args.timeout_s)
            finally:
                follow.terminate()
                follow.wait()
            code = project.inspect("trainer")["State"]["ExitCode"]
            if code == 0:
                for stage in compare_replicas(project):
                    print(
                        f"stage {stage.stage}: replicas at steps {stage.steps}, parameters within "
                        f"{stage.max_abs_diff:.1e} of each other",
                        flush=True,
                    )
            else:
                print(f"deploy.compose: the trainer failed (exit {code})", file=sys.stderr)
        except KeyboardInterrupt:
            code = 130
        finally:
            print("deploy.compose: taking the swarm down", flush=True)
            project.down(log=log)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
