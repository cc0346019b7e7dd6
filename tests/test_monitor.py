"""`swarm monitor`: the live dashboard of a run, loaded in a real headless Chromium against a real local swarm."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import SOLO_PEER_FLAGS, TEST_TRAINER

from swarm.coordinator.localswarm import finished

pytestmark = pytest.mark.swarm

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _install_chromium() -> str | None:
    """Install Debian's chromium and its driver when they are missing and this is root with apt (the package
    lists refreshed if the first try fails). Returns None once they are there, else why they cannot be."""
    if shutil.which("chromium") and shutil.which("chromedriver"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "no chromium/chromedriver, and no root apt-get to install them (apt install chromium chromium-driver)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]
    done = subprocess.run(install, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600, env=env)
        done = subprocess.run(install, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0 or not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.fail(f"installing chromium failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return None


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by Selenium. Skipped (with the reason) only where no browser can be installed;
    where the suite must run everything (SWARM_REQUIRE_ROOT_TESTS, as in CI) that is a failure."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    why_not = _install_chromium()
    if why_not:
        if os.environ.get("SWARM_REQUIRE_ROOT_TESTS"):
            pytest.fail(why_not)
        pytest.skip(why_not)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(
        options=options, service=Service(executable_path=shutil.which("chromedriver"))
    )
    try:
        yield driver
    finally:
        driver.quit()


def _wait(condition, what: str, timeout_s: float = 60.0):
    """Poll ``condition()`` (a page the browser redraws, a remote process) until it is truthy."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)  # the page redraws once a second: there is no event to wait on from here
    return value


def test_the_dashboard_shows_the_stages_live_in_a_real_browser(local_swarm, browser, tmp_path):
    run_id = "monitor"
    peers = {
        name: local_swarm.peer(name, int(name[1]), *SOLO_PEER_FLAGS, run_id=run_id, wait=False)
        for name in ("s0", "s1")
    }
    endpoints = {name: local_swarm.wait_ready(proc) for name, proc in peers.items()}
    monitor = local_swarm.group.start(
        "monitor",
        [
            sys.executable,
            "-m",
            "swarm",
            "monitor",
            "--run-id",
            run_id,
            "--port",
            "0",
            "--period-s",
            "0.5",
            *local_swarm.initial_peers,
        ],
    )
    url = monitor.wait_for(r"dashboard of run 'monitor' at (http://\S+/)", timeout_s=120).group(1)
    browser.get(url)

    # Read the page in one script each time: it redraws every second, so elements found earlier go stale.
    def page_text() -> str:
        return browser.execute_script("return document.body.innerText")

    def steps() -> list[int]:
        cells = browser.execute_script(
            "return [...document.querySelectorAll('td.step')].map((cell) => cell.textContent)"
        )
        return [int(cell) for cell in cells]

    text = _wait(
        lambda: all(e in page_text() for e in endpoints.values()) and page_text(),
        "both peers listed",
    )
    assert "stage 0" in text and "stage 1" in text and f"run: {run_id}" in text
    assert text.count("serving") >= 2 and "bottleneck" in text
    assert steps() == [0, 0]

    # The page redraws by itself: steps taken by the stages appear without a reload.
    trainer = local_swarm.trainer(
        f"{run_id}-trainer", run_id=run_id, **TEST_TRAINER, steps=3, eval_batches=1
    )
    finished(trainer, timeout_s=300)
    # (read in one script: cells found first and read after could be gone, the page redrawn in between)
    _wait(lambda: steps() == [3, 3], "both stages at step 3 on the page")
    # The trainer announced its progress: the page lists it, at its last step, while its record lives.
    _wait(
        lambda: (
            browser.execute_script(
                "return [...document.querySelectorAll('tr[data-trainer] td.trainer-step')].map((c) => c.textContent)"
            )
            == ["3"]
        ),
        "the trainer at step 3 on the page",
    )
    # The page shows what /status.json says, which is what `swarm status --json` prints.
    with urllib.request.urlopen(url + "status.json", timeout=10) as reply:
        data = json.loads(reply.read())
    status = data["status"]
    assert data["error"] is None and status["run_id"] == run_id and len(data["history"]) >= 2
    # The run's owner (the key that signed its config) and each record's heartbeat age are on the page.
    assert (
        re.fullmatch(r"[0-9a-f]{32}", status["owner"]) and f"owner {status['owner']}" in page_text()
    )
    ages = [r["heartbeat_age_s"] for stage in status["stages"] for r in stage["replicas"]]
    assert all(0 <= age < 60 for age in ages), ages
    cells = browser.execute_script(
        "return [...document.querySelectorAll('td.age')].map((cell) => cell.textContent)"
    )
    assert len(cells) == 3 and all(re.fullmatch(r"\d+s ago", cell) for cell in cells), cells
    assert [r["device"] for stage in status["stages"] for r in stage["replicas"]] == ["cpu", "cpu"]
    assert "cpu" in page_text()
    (trainer_record,) = status["trainers"]
    assert (trainer_record["step"], trainer_record["microbatches"]) == (3, 3 * 16 // 8)
    assert trainer_record["loss"] > 0 and trainer_record["tokens_per_s"] > 0
    shown = browser.execute_script(
        "return [...document.querySelectorAll('tr[data-peer]')].map((row) => row.dataset.peer)"
    )
    assert sorted(shown) == sorted(
        r["peer_id"] for stage in status["stages"] for r in stage["replicas"]
    )
    # One stage is marked the bottleneck (which one flips as the measured speeds move), named in its title.
    marked = browser.execute_script(
        "return [...document.querySelectorAll('section.stage.bottleneck h2')].map((h) => h.innerText)"
    )
    assert len(marked) == 1 and re.match(r"stage \d+\s", marked[0]) and "bottleneck" in marked[0], (
        marked
    )
    shot = tmp_path / "dashboard.png"
    assert browser.save_screenshot(str(shot)) and shot.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("SWARM_UPDATE_SCREENSHOTS"):  # docs/dashboard.png is made this way
        shutil.copy(shot, DOCS / "dashboard.png")


def _document(when: float, stages: list[list[tuple[str, int]]]) -> dict:
    """A status document whose stage k holds replicas (peer id, step)."""
    return {
        "time": when,
        "stages": [
            {
                "stage": k,
                "throughput": 10.0 * len(replicas),
                "replicas": [{"peer_id": peer, "step": step} for peer, step in replicas],
            }
            for k, replicas in enumerate(stages)
        ],
    }


@pytest.mark.unit
def test_the_monitor_keeps_each_stages_history_and_sees_a_peer_move():
    from swarm.coordinator.monitor import MonitorState

    state = MonitorState()
    assert state.snapshot()["status"] is None and state.snapshot()["error"]
    state.update(_document(1.0, [[("a", 3), ("b", 2)], [("c", 3)]]))
    moved = _document(2.0, [[("a", 4)], [("c", 4), ("b", 4)]])  # b moved to stage 1
    moved["trainers"] = [{"trainer_id": "t1", "loss": 2.5, "tokens_per_s": 100.0}]
    state.update(moved)
    state.failed("reading the DHT failed: timeout")
    snap = state.snapshot()
    assert snap["error"] == "reading the DHT failed: timeout" and snap["status"]["time"] == 2.0
    assert snap["history"] == [
        {"time": 1.0, "throughput": [20.0, 10.0], "step": [3, 3], "trainers": {}},
        {"time": 2.0, "throughput": [10.0, 20.0], "step": [4, 4], "trainers": {"t1": [2.5, 100.0]}},
    ]
    assert snap["moves"] == [{"time": 2.0, "peer_id": "b", "from": 0, "to": 1}]


@pytest.mark.unit
def test_the_dashboard_server_answers_the_page_the_status_and_nothing_else():
    import threading
    import urllib.error
    from http.server import ThreadingHTTPServer

    from swarm.coordinator.monitor import PAGE, MonitorState, _handler

    state = MonitorState()
    state.update(_document(5.0, [[("a", 1)]]))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state, PAGE.read_bytes()))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        with urllib.request.urlopen(base + "/", timeout=10) as page:
            html = page.read().decode()
            assert page.headers["Content-Type"].startswith("text/html")
        # Everything the page needs ships in it: no script, style or font from elsewhere.
        assert (
            "<title>swarm monitor</title>" in html
            and "http" not in html.replace("http://", "").lower()
        )
        with urllib.request.urlopen(base + "/status.json", timeout=10) as reply:
            assert json.loads(reply.read()) == json.loads(json.dumps(state.snapshot()))
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(base + "/other", timeout=10)
        assert missing.value.code == 404
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.unit
def test_status_text_lists_the_trainers_and_names_the_bottleneck():
    from conftest import record_wire

    from swarm.config import RunConfig
    from swarm.coordinator.status import format_status, status_document
    from swarm.discovery.records import StageRecord, TrainerRecord

    run = RunConfig()
    fast = StageRecord.from_wire(
        record_wire(peer_id="p0", stage=0, throughput=30.0, config_hash=run.fingerprint())
    )
    slow = StageRecord.from_wire(
        record_wire(peer_id="p1", stage=1, throughput=20.0, config_hash=run.fingerprint())
    )
    from swarm.discovery.dht import get_dht_time

    trainers = {
        "t2": TrainerRecord(trainer_id="t2", step=0),  # an older trainer: its record has no time
        "t1": TrainerRecord(
            trainer_id="t1",
            step=7,
            loss=2.5,
            val_loss=2.75,
            tokens_per_s=1234.4,
            microbatches=28,
            announced_s=get_dht_time() - 5.0,
        ),
    }
    owner = "ab" * 16
    lines = format_status(
        "r", run, [{"p0": fast}, {"p1": slow}], trainers, owner=owner
    ).splitlines()
    assert lines[0].endswith(f", config {run.fingerprint()}, owner {owner}")
    assert lines[-3:] == [
        "trainer t1: step 7 | loss 2.500 | val 2.750 | 1,234 tokens/s | heartbeat 5s ago",
        "trainer t2: step 0 | loss - | 0 tokens/s | heartbeat -",
        "bottleneck: stage 1 (20.0 samples/s serving)",
    ]
    document = status_document("r", run, [{"p0": fast}, {"p1": slow}], trainers, owner=owner)
    assert document["owner"] == owner
    assert document["trainers"][0].pop("heartbeat_age_s") == pytest.approx(5.0, abs=0.5)
    assert document["trainers"][1]["heartbeat_age_s"] is None
    assert [t["trainer_id"] for t in document["trainers"]] == ["t1", "t2"]
    assert document["trainers"][0] == {
        "trainer_id": "t1",
        "step": 7,
        "loss": 2.5,
        "val_loss": 2.75,
        "tokens_per_s": 1234.4,
        "microbatches": 28,
    }
    assert document["bottleneck"] == 1 and [s["throughput"] for s in document["stages"]] == [
        30.0,
        20.0,
    ]
