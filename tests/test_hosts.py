"""lanegate as several hosts: network namespaces built by the test (``tests/hosts.py``).

Redis on one host, a gateway on each of two, a realtime worker on each of two, a
batch worker on one, and the test's client on its own host; each process started
inside its namespace, bound to that host's address, the workers advertising it.
Faults, one test each: a realtime worker SIGKILLed or SIGSTOPped, a gateway
SIGKILLed, a realtime or a gateway host's link cut, the batch worker SIGKILLed
mid-job, Redis restarted from its AOF, latency and loss on a link (netem, or
nftables' random drops where the kernel has no netem). For
each: no completed job lost or duplicated, no stream on a healthy path
interrupted, streams on a lost worker failed over, and a client of a lost gateway
gets a close it can act on.

Needs root and ``ip netns``; skipped with the reason otherwise. Slow: about two
minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import redis
from conftest import read_pcm
from hosts import Hosts, netem_problem, nft_loss_rules, nft_problem, remove_stale, why_unavailable
from livestream import Seen, check_transcript, receive_all, send_speech, until
from phrases import MEETING, MOST, RAIN, RELIABLE, SENTENCE_RECALL, TRAFFIC, recall, spoken
from stack import REPO

from lanegate.constants import WORKER_KEY, WORKERS_KEY
from lanegate.supervisor import lanegate_argv

pytestmark = pytest.mark.slow

T = TypeVar("T")
SENTENCES = (TRAFFIC, RAIN, MEETING)
SPEECH = spoken(*SENTENCES)
#: as in tests/test_failover.py (same speech; measured there)
FAILOVER_RECALL = 0.45
GATEWAY_PORT = 8080
WORKER_PORT = 9000
REDIS_PORT = 6379
START_TIMEOUT_S = 90.0
SLOTS = 2
REALTIME = ("rt1", "rt2")
API_KEY = "several-hosts"
#: a dead batch worker's job is reclaimed after this (the default is a minute)
CLAIM_IDLE_S = 5


def get_json(url: str, timeout: float = 2.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"null")
    except (OSError, ValueError):
        return None


@dataclass
class HostProc:
    """A process on a host. Not the supervisor's ``Child``: that one dies with the thread
    that started it (``PR_SET_PDEATHSIG``), and a fault test restarts Redis from the
    client's thread while its stream runs."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            self.proc.send_signal(sig)

    def tail(self, lines: int = 25) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.name} (exit {self.proc.poll()}) ---\n" + "\n".join(
            text.splitlines()[-lines:])


@dataclass
class Cluster:
    hosts: Hosts
    workdir: Path
    env: dict[str, str]
    procs: dict[str, HostProc] = field(default_factory=dict)

    def url(self, host: str, port: int = GATEWAY_PORT) -> str:
        return f"http://{self.hosts.addresses[host]}:{port}"

    def spawn(self, host: str, *args: str, env: dict[str, str] | None = None) -> HostProc:
        """A lanegate process (or ``redis-server`` when ``args[0]`` is that) on ``host``."""
        cmd = list(args) if args[0] == "redis-server" else lanegate_argv(*args)
        log = self.workdir / f"{host}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen([*self.hosts.exec_prefix(host), *cmd],
                                     env={**self.env, **(env or {})}, cwd=REPO, stdout=out,
                                     stderr=subprocess.STDOUT)
        self.procs[host] = HostProc(host, popen, log)
        return self.procs[host]

    def popen(self, host: str) -> subprocess.Popen[bytes]:
        return self.procs[host].proc

    def start_redis(self) -> None:
        self.spawn("redis", "redis-server", "--bind", self.hosts.addresses["redis"],
                   "--port", str(REDIS_PORT), "--dir", str(self.workdir / "redis"),
                   "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                   "--protected-mode", "no")

    def start_gateway(self, host: str) -> None:
        self.spawn(host, "gateway", env={"LANEGATE_HOST": self.hosts.addresses[host],
                                         "LANEGATE_PORT": str(GATEWAY_PORT)})

    def start_worker(self, host: str, lane: str) -> None:
        address = self.hosts.addresses[host]
        self.spawn(host, "worker", "--lane", lane, env={
            "LANEGATE_WORKER_HOST": address, "LANEGATE_WORKER_ADVERTISE_HOST": address,
            "LANEGATE_WORKER_PORT": str(WORKER_PORT)})

    def client(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run the coroutine function ``fn`` on the client host."""
        return self.hosts.run_as("client", lambda: asyncio.run(fn()))

    def probe(self, url: str) -> Any:
        return self.client(lambda: asyncio.to_thread(get_json, url))

    def diagnostics(self) -> str:
        return "\n".join(child.tail() for child in self.procs.values())

    def stop(self) -> None:
        for child in self.procs.values():
            child.signal(signal.SIGCONT)
            child.signal(signal.SIGTERM)
        for host in self.procs:
            try:
                self.popen(host).wait(15)
            except subprocess.TimeoutExpired:
                self.popen(host).kill()
                self.popen(host).wait(5)


# --- building and healing the cluster -------------------------------------------------


def build(hosts: Hosts, workdir: Path) -> Cluster:
    hosts.start()
    for host in ("redis", "gw1", "gw2", *REALTIME, "batch", "client"):
        hosts.add(host)
    env = {
        **os.environ,
        "LANEGATE_REDIS_URL": f"redis://{hosts.addresses['redis']}:{REDIS_PORT}/0",
        "LANEGATE_DATA_DIR": str(workdir / "data"),
        "LANEGATE_SLOTS": str(SLOTS),
        "LANEGATE_ENGINE": "pocketsphinx",
        "LANEGATE_LOG_LEVEL": "info",
        "LANEGATE_API_KEYS": API_KEY,  # a gateway off loopback refuses to run without
        # and a worker off loopback without the gateways' shared internal token
        "LANEGATE_INTERNAL_TOKEN": secrets.token_urlsafe(24),
        "LANEGATE_CLAIM_IDLE_S": str(CLAIM_IDLE_S),
        "LANEGATE_MAX_KEY_SHARE": "1",  # every stream here uses the one key
    }
    (workdir / "redis").mkdir(parents=True, exist_ok=True)
    cluster = Cluster(hosts, workdir, env)
    cluster.start_redis()
    for gateway in ("gw1", "gw2"):
        cluster.start_gateway(gateway)
    for worker in REALTIME:
        cluster.start_worker(worker, "realtime")
    cluster.start_worker("batch", "batch")
    return cluster


def heal(cluster: Cluster) -> None:
    """Every process running, every link up, both realtime workers live and idle."""
    for host in cluster.hosts.addresses:
        if host != "client":
            cluster.hosts.link(host, up=True)
    for host, child in list(cluster.procs.items()):
        if child.running:
            child.signal(signal.SIGCONT)
            continue
        if host == "redis":
            cluster.start_redis()
        elif host.startswith("gw"):
            cluster.start_gateway(host)
        else:
            cluster.start_worker(host, "batch" if host == "batch" else "realtime")
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _healthy(cluster):
        for child in cluster.procs.values():
            if not child.running:
                raise RuntimeError(f"{child.name} exited\n{cluster.diagnostics()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"cluster not healthy\n{cluster.diagnostics()}")
        time.sleep(0.3)


def _healthy(cluster: Cluster) -> bool:
    async def check() -> bool:
        gateways = await asyncio.gather(*(asyncio.to_thread(
            get_json, cluster.url(g) + "/readyz") for g in ("gw1", "gw2")))
        batch = await asyncio.to_thread(get_json, cluster.url("batch", WORKER_PORT)
                                        + "/healthz")
        return (all(isinstance(g, dict) and g.get("status") == "ready" for g in gateways)
                and isinstance(batch, dict) and batch.get("status") == "ok"
                and await worker_slots(cluster) == dict.fromkeys(REALTIME, SLOTS))
    return cluster.client(check)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    reason = why_unavailable()
    if reason:
        pytest.skip(f"several hosts need network namespaces: {reason}")
    remove_stale()
    hosts = Hosts(prefix=f"lg{os.getpid()}", net=200 + os.getpid() % 50)
    built: Cluster | None = None
    try:
        built = build(hosts, tmp_path_factory.mktemp("hosts"))
        heal(built)
        yield built
    finally:
        if built is not None:
            built.stop()
        hosts.close()


@pytest.fixture
def healthy(cluster: Cluster) -> Cluster:
    heal(cluster)
    return cluster


@pytest.fixture(scope="module")
def speech_pcm(speech: Callable[..., Path]) -> tuple[bytes, int]:
    return read_pcm(speech(SPEECH))


@pytest.fixture(scope="module")
def job_wav(speech: Callable[..., Path]) -> bytes:
    return speech(TRAFFIC).read_bytes()


LONG_JOB = spoken(*RELIABLE)  # about 21 s: several seconds of batch decoding


@pytest.fixture(scope="module")
def long_job_wav(speech: Callable[..., Path]) -> bytes:
    return speech(LONG_JOB).read_bytes()


# --- what a client does ---------------------------------------------------------------


def client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"})


def ws_url(cluster: Cluster, gateway: str) -> str:
    return cluster.url(gateway).replace("http://", "ws://") + "/v1/stream?sample_rate=16000"


async def submit_job(http: aiohttp.ClientSession, base: str, wav: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("file", wav, filename="speech.wav", content_type="audio/wav")
    form.add_field("async", "true")
    async with http.post(base + "/v1/transcriptions", data=form) as resp:
        assert resp.status == 202, await resp.text()
        return str((await resp.json())["id"])


async def wait_job(http: aiohttp.ClientSession, base: str, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            async with http.get(f"{base}/v1/transcriptions/{job_id}") as resp:
                job = await resp.json()
        except aiohttp.ClientError:
            job = {}
        if job.get("status") in ("completed", "failed", "cancelled"):
            return job
        await asyncio.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish: {job}")


async def completed_jobs(http: aiohttp.ClientSession, cluster: Cluster) -> float:
    """The batch worker's count of jobs it completed (each completion counted once)."""
    async with http.get(cluster.url("batch", WORKER_PORT) + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lanegate_jobs_total{") and 'status="completed"' in line)


async def worker_slots(cluster: Cluster) -> dict[str, int | None]:
    answers = await asyncio.gather(*(asyncio.to_thread(
        get_json, cluster.url(w, WORKER_PORT) + "/readyz", 1.0) for w in REALTIME))
    return {w: (a.get("slots_free") if isinstance(a, dict) else None)
            for w, a in zip(REALTIME, answers, strict=True)}


@dataclass
class Stream:
    """One live stream of SPEECH: its events and its task."""

    seen: Seen
    task: asyncio.Task[None]


async def open_stream(http: aiohttp.ClientSession, url: str, pcm: bytes, rate: int,
                      speed: float, heartbeat: float | None = None) -> Stream:
    seen = Seen()
    ws = await http.ws_connect(url, heartbeat=heartbeat)

    async def run() -> None:
        try:
            receiver = asyncio.create_task(receive_all(ws, seen))
            await until(lambda: bool(seen.events), "ready")
            # the gateway going away ends the sending; the receiver sees the close
            with contextlib.suppress(ConnectionError):
                await send_speech(ws, pcm, rate, speed=speed)
            await receiver
        finally:
            await ws.close()

    stream = Stream(seen, asyncio.create_task(run()))
    await until(lambda: bool(seen.events), "ready")
    return stream


async def busy_worker(cluster: Cluster, exclude: set[str]) -> str:
    """The realtime host whose slot just got taken (waits for it)."""
    found: list[str] = []

    async def check() -> bool:
        slots = await worker_slots(cluster)
        found[:] = [w for w, free in slots.items()
                    if w not in exclude and free is not None and free < SLOTS]
        return bool(found)

    deadline = time.monotonic() + 30
    while not await check():
        assert time.monotonic() < deadline, "no worker took the stream"
        await asyncio.sleep(0.05)
    return found[0]


def registry_free(cluster: Cluster) -> dict[str, int]:
    """Worker URL -> free slots, as the gateways read the registry."""
    client = redis.Redis(host=cluster.hosts.addresses["redis"], port=REDIS_PORT,
                         socket_timeout=2)
    try:
        ids = [i.decode() for i in client.smembers(WORKERS_KEY.format(lane="realtime"))]
        records = [client.get(WORKER_KEY.format(worker_id=i)) for i in ids]
    except redis.RedisError:
        return {}
    finally:
        client.close()
    return {info["url"]: info["slots_free"] for info in map(json.loads, filter(None, records))}


async def place(http: aiohttp.ClientSession, cluster: Cluster, pcm: bytes, rate: int
                ) -> tuple[Stream, str, Stream, str]:
    """A bystander stream on gw2 (slow, on one worker), then, once the registry says
    so, the victim on gw1 (on the other: the least loaded)."""
    bystander = await open_stream(http, ws_url(cluster, "gw2"), pcm, rate, speed=1.0)
    bystander_host = await busy_worker(cluster, set())
    other = next(w for w in REALTIME if w != bystander_host)
    want = {cluster.url(bystander_host, WORKER_PORT): SLOTS - 1,
            cluster.url(other, WORKER_PORT): SLOTS}
    await until_async(lambda: asyncio.to_thread(registry_free, cluster), want,
                      "the registry to show the bystander's slot taken")
    victim = await open_stream(http, ws_url(cluster, "gw1"), pcm, rate, speed=2.0)
    victim_host = await busy_worker(cluster, {bystander_host})
    return bystander, bystander_host, victim, victim_host


async def until_async(probe: Callable[[], Awaitable[Any]], want: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while (got := await probe()) != want:
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {got}"
        await asyncio.sleep(0.05)


async def second_sentence(stream: Stream) -> None:
    await until(lambda: any(e.get("segment") == 1 for e in stream.seen.of("partial")),
                "a partial of the second sentence")


def check_clean(stream: Stream) -> None:
    check_transcript(stream.seen, SENTENCES, FAILOVER_RECALL)


# --- the faults -----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_realtime_worker_dying_fails_its_streams_over_and_spares_the_rest(
    healthy: Cluster, speech_pcm: tuple[bytes, int], job_wav: bytes, how: str
) -> None:
    cluster = healthy
    pcm, rate = speech_pcm

    async def scenario() -> None:
        async with client_session() as http:
            done_before = await completed_jobs(http, cluster)
            job = await submit_job(http, cluster.url("gw1"), job_wav)
            bystander, _, victim, victim_host = await place(http, cluster, pcm, rate)
            await second_sentence(victim)
            cluster.procs[victim_host].signal(getattr(signal, how))
            killed = time.monotonic()
            await victim.task
            print(f"\nhosts {how}: longest wait for an event after the kill "
                  f"{victim.seen.longest_gap_after(killed):.3f} s")
            await bystander.task
            check_clean(victim)
            check_clean(bystander)
            result = await wait_job(http, cluster.url("gw2"), job)
            assert result["status"] == "completed", result
            assert await completed_jobs(http, cluster) == done_before + 1

    try:
        cluster.client(scenario)
    finally:
        for host in REALTIME:  # a stopped worker is killed; heal() starts a new one
            if cluster.procs[host].running and _stopped(cluster.popen(host).pid):
                cluster.popen(host).kill()
                cluster.popen(host).wait(10)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1].startswith("T")
    except OSError:
        return False


def test_a_realtime_hosts_link_cut_fails_over_then_the_host_comes_back(
    healthy: Cluster, speech_pcm: tuple[bytes, int]
) -> None:
    cluster = healthy
    pcm, rate = speech_pcm

    async def scenario() -> str:
        async with client_session() as http:
            bystander, _, victim, victim_host = await place(http, cluster, pcm, rate)
            await second_sentence(victim)
            await asyncio.to_thread(cluster.hosts.link, victim_host, False)
            await victim.task
            await bystander.task
            check_clean(victim)
            check_clean(bystander)
            return victim_host

    cut = cluster.client(scenario)
    cluster.hosts.link(cut, up=True)

    async def back() -> None:
        async with client_session() as http:
            # its heartbeat reaches Redis again and new streams can land on it
            deadline = time.monotonic() + 30
            while (await worker_slots(cluster))[cut] is None:
                assert time.monotonic() < deadline, "the host did not come back"
                await asyncio.sleep(0.2)
            stream = await open_stream(http, ws_url(cluster, "gw1"), pcm, rate, speed=0)
            await stream.task
            assert stream.seen.of("done"), stream.seen.events

    cluster.client(back)


def test_a_client_of_a_killed_gateway_sees_a_close_and_reconnects_elsewhere(
    healthy: Cluster, speech_pcm: tuple[bytes, int]
) -> None:
    cluster = healthy
    pcm, rate = speech_pcm

    async def scenario() -> None:
        async with client_session() as http:
            bystander, _, victim, _ = await place(http, cluster, pcm, rate)
            # the bystander's gateway (gw2) dies: its client sees the socket close
            await until(lambda: bool(bystander.seen.of("partial")), "a partial")
            cluster.procs["gw2"].signal(signal.SIGKILL)
            await bystander.task
            assert bystander.seen.close_code is not None
            assert bystander.seen.close_code != 1000
            assert not bystander.seen.of("done")
            # ... and acts on it: a new stream on the other gateway
            again = await open_stream(http, ws_url(cluster, "gw1"), pcm, rate, speed=0)
            await again.task
            assert again.seen.of("done"), again.seen.events
            # the stream on the healthy gateway went on
            await victim.task
            check_clean(victim)
            # the dead gateway's link closed with it: its worker freed the slot
            deadline = time.monotonic() + 10
            while (await worker_slots(cluster)) != dict.fromkeys(REALTIME, SLOTS):
                assert time.monotonic() < deadline, await worker_slots(cluster)
                await asyncio.sleep(0.2)

    cluster.client(scenario)


def test_a_gateway_hosts_link_cut_its_client_times_out_and_its_slots_are_freed(
    healthy: Cluster, speech_pcm: tuple[bytes, int]
) -> None:
    cluster = healthy
    pcm, rate = speech_pcm
    link_timeout_s = float(cluster.env.get("LANEGATE_LINK_TIMEOUT_S", "10"))

    async def scenario() -> None:
        async with client_session() as http:
            bystander = await open_stream(http, ws_url(cluster, "gw2"), pcm, rate,
                                          speed=1.0, heartbeat=1.0)
            bystander_host = await busy_worker(cluster, set())
            await until(lambda: bool(bystander.seen.of("partial")), "a partial")
            await asyncio.to_thread(cluster.hosts.link, "gw2", False)
            cut = time.monotonic()
            # the client's own heartbeat tells it the gateway is gone ...
            await bystander.task
            assert bystander.seen.close_code not in (None, 1000)
            assert not bystander.seen.of("done")
            # ... and it goes to the other gateway
            again = await open_stream(http, ws_url(cluster, "gw1"), pcm, rate, speed=0)
            await again.task
            check_clean(again)
            # the worker frees the partitioned gateway's slot by itself
            while (await worker_slots(cluster))[bystander_host] != SLOTS:
                assert time.monotonic() - cut < link_timeout_s + 5, await worker_slots(cluster)
                await asyncio.sleep(0.2)

    cluster.client(scenario)


def test_redis_restarted_from_its_aof_loses_no_job_and_no_stream(
    healthy: Cluster, speech_pcm: tuple[bytes, int], job_wav: bytes
) -> None:
    cluster = healthy
    pcm, rate = speech_pcm

    async def scenario() -> None:
        async with client_session() as http:
            done_before = await completed_jobs(http, cluster)
            jobs = [await submit_job(http, cluster.url("gw1"), job_wav) for _ in range(2)]
            stream = await open_stream(http, ws_url(cluster, "gw1"), pcm, rate, speed=1.0)
            await until(lambda: bool(stream.seen.of("partial")), "a partial")
            redis = cluster.popen("redis")
            redis.terminate()
            await asyncio.to_thread(redis.wait, 10)
            await asyncio.to_thread(cluster.start_redis)
            jobs.append(await _submit_retrying(http, cluster, job_wav))
            await stream.task
            check_clean(stream)
            for job in jobs:
                result = await wait_job(http, cluster.url("gw2"), job)
                assert result["status"] == "completed", result
                async with http.get(f"{cluster.url('gw2')}/v1/transcriptions/{job}",
                                    params={"format": "text"}) as resp:
                    text = await resp.text()
                assert recall(TRAFFIC, text) >= SENTENCE_RECALL, text
            assert await completed_jobs(http, cluster) == done_before + len(jobs)

    cluster.client(scenario)


async def _submit_retrying(http: aiohttp.ClientSession, cluster: Cluster, wav: bytes) -> str:
    """A job submitted once Redis answers again (until then the gateway says 503)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await submit_job(http, cluster.url("gw2"), wav)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


def test_a_batch_worker_killed_mid_job_loses_nothing_and_counts_it_once(
    healthy: Cluster, long_job_wav: bytes
) -> None:
    cluster = healthy

    async def scenario() -> None:
        async with client_session() as http:
            job = await submit_job(http, cluster.url("gw1"), long_job_wav)
            await until_async(lambda: job_status(http, cluster, job), "processing",
                              "the batch worker to take the job")
            cluster.procs["batch"].signal(signal.SIGKILL)
            await asyncio.to_thread(cluster.popen("batch").wait, 10)
            await asyncio.to_thread(cluster.start_worker, "batch", "batch")
            result = await wait_job(http, cluster.url("gw2"), job)
            assert result["status"] == "completed", result
            assert result["attempts"] == 2, result  # the killed delivery, then the new one
            async with http.get(f"{cluster.url('gw2')}/v1/transcriptions/{job}",
                                params={"format": "text"}) as resp:
                text = await resp.text()
            assert recall(LONG_JOB, text) >= MOST, text
            # completed once, by the new worker (its counter starts at 0)
            assert await completed_jobs(http, cluster) == 1

    cluster.client(scenario)


async def job_status(http: aiohttp.ClientSession, cluster: Cluster, job_id: str) -> str:
    async with http.get(f"{cluster.url('gw1')}/v1/transcriptions/{job_id}") as resp:
        return str((await resp.json()).get("status"))


@pytest.mark.parametrize("fault", ["netem", "nftables"])
def test_latency_and_loss_on_a_link_slow_the_stream_but_lose_nothing(
    healthy: Cluster, speech_pcm: tuple[bytes, int], job_wav: bytes, fault: str
) -> None:
    """``netem delay 200ms loss 5%`` on the gateway host's link; where the kernel has no
    sch_netem (this VM's), nftables drops 5 % of its packets each way instead (TCP's
    retransmissions then stall segments for 200 ms and more: the loss, without the
    fixed delay)."""
    problem = netem_problem() if fault == "netem" else nft_problem()
    if problem:
        pytest.skip(problem)
    cluster = healthy
    pcm, rate = speech_pcm
    prefix = cluster.hosts.exec_prefix("gw1")
    if fault == "netem":
        dev = cluster.hosts.dev("gw1")
        apply = [*prefix, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay",
                 "200ms", "loss", "5%"]
        undo = [*prefix, "tc", "qdisc", "del", "dev", dev, "root"]
        subprocess.run(apply, check=True, capture_output=True)
    else:
        subprocess.run([*prefix, "nft", "-f", "-"], input=nft_loss_rules(5), check=True,
                       capture_output=True, text=True)
        undo = [*prefix, "nft", "delete", "table", "inet", "lgloss"]

    async def scenario() -> None:
        async with client_session() as http:
            done_before = await completed_jobs(http, cluster)
            job = await submit_job(http, cluster.url("gw1"), job_wav)
            stream = await open_stream(http, ws_url(cluster, "gw1"), pcm, rate, speed=1.0)
            await stream.task
            check_clean(stream)
            assert (await wait_job(http, cluster.url("gw2"), job))["status"] == "completed"
            assert await completed_jobs(http, cluster) == done_before + 1

    try:
        cluster.client(scenario)
    finally:
        subprocess.run(undo, capture_output=True)
