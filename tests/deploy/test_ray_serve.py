"""``g4serve serve --ray`` on a local Ray cluster: two replicas of the embedded tiny model on CPU behind the
affinity router. Sessions and shared prefixes land on one replica and hit its prefix cache; killing a
replica mid-stream fails only its own stream, with an error event; scaling down drains a replica's running
stream before the replica goes."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest
from conversation import second_turn_hits_the_first_turns_replica

pytestmark = pytest.mark.distributed
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from g4serve.cli import build_parser  # noqa: E402
from g4serve.deploy.ray_app import APP_NAME, build_application  # noqa: E402

SYSTEM = "You are the assistant of a bank. Answer briefly and never invent an account number. " * 4
# Small limits on the bodies the ingress holds, for test_the_ingress_bounds_the_bodies_it_holds without a
# second application: one 40 KB body fits, two do not; every other test's bodies are under 1 KB.
BODY_LIMITS = (
    *("--max-request-body-bytes", str(48 << 10)),
    *("--max-buffered-body-bytes", str(64 << 10)),
    *("--request-body-timeout", "3"),
)


def serve_args(port: int, *flags: str):
    return build_parser().parse_args(
        [
            "serve",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--kv-cache-bytes",
            str(32 << 20),
            "--port",
            str(port),
            "--ray",
            "--drain-timeout",
            "60",
            *BODY_LIMITS,
            *flags,
        ]
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """Ray with 4 CPUs here, Serve's proxy on a free port, two engine replicas."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the replica processes: 2 cores, 3 processes
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning", log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_application(serve_args(port, "--num-replicas", "2"), 0.0), name=APP_NAME, route_prefix="/"
    )
    url = f"http://127.0.0.1:{port}"
    # serve.run returns once both replicas run, but the ingress's router learns the replica set from Ray's
    # controller a little later: until then it ranks the one it knows (a CI run sent 24 sessions to one).
    with httpx.Client(base_url=url, timeout=60) as client:
        wait_until(
            lambda: len(set(homes(client, [f"warm-{i}" for i in range(16)]).values())) == 2,
            90,
            "the router to know both replicas",
        )
    yield url, port
    serve.shutdown()
    ray.shutdown()


def chat(session: str, text: str, **fields) -> tuple[dict, dict]:
    body = {
        "model": "g4serve-tiny",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
        "max_tokens": 2,
        **fields,
    }
    return body, {"X-Session-Id": session}


def replica_states() -> dict[str, int]:
    status = serve.status().applications[APP_NAME].deployments["EngineReplica"]
    return {str(state): n for state, n in status.replica_states.items()}


def running_replicas() -> int:
    return sum(n for state, n in replica_states().items() if state.endswith("RUNNING"))


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def homes(client: httpx.Client, sessions) -> dict[str, str]:
    """session -> the replica that answers it (each asked once, two tokens)."""
    out = {}
    for session in sessions:
        body, headers = chat(session, "hello")
        response = client.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        out[session] = response.headers["x-g4serve-replica"]
    return out


class Stream(threading.Thread):
    """One streamed chat completion read in a thread: its events, and when the first one arrived."""

    def __init__(self, url: str, session: str, max_tokens: int, replica: str = ""):
        super().__init__(daemon=True)
        self.url, self.session, self.max_tokens, self.pin = url, session, max_tokens, replica
        self.events: list = []
        self.replica = ""
        self.started = threading.Event()

    def run(self) -> None:
        body, headers = chat(self.session, "tell me a story", stream=True, max_tokens=self.max_tokens)
        body["ignore_eos"] = True
        if self.pin:
            headers["X-G4Serve-Replica"] = self.pin
        with httpx.Client(base_url=self.url, timeout=120) as client:
            with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
                self.replica = response.headers.get("x-g4serve-replica", "")
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        self.started.set()

    @property
    def error(self) -> dict | None:
        return next((e["error"] for e in self.events if isinstance(e, dict) and "error" in e), None)

    @property
    def finish_reason(self) -> str | None:
        reasons = [
            c.get("finish_reason") for e in self.events if isinstance(e, dict) for c in e.get("choices", [])
        ]
        return next((r for r in reversed(reasons) if r), None)


def sessions_on_two_replicas(client: httpx.Client) -> dict[str, str]:
    """One session per replica: replica -> session."""
    by_replica: dict[str, str] = {}
    for session, replica in homes(client, [f"pick-{i}" for i in range(16)]).items():
        by_replica.setdefault(replica, session)
    assert len(by_replica) == 2, f"16 sessions all on one replica: {by_replica}"
    return by_replica


def test_affinity_sends_sessions_and_prefixes_to_a_warm_replica(cluster):
    url, _ = cluster
    with httpx.Client(base_url=url, timeout=60) as client:
        sessions = [f"s{i}" for i in range(12)]
        first = homes(client, sessions)
        assert homes(client, sessions) == first  # every session stays where it started
        assert len(set(first.values())) == 2  # and the sessions spread over both replicas
        # a second turn of one conversation (no session id: the prefix key) reuses its replica's KV blocks
        body = {
            "model": "g4serve-tiny",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is my balance?"},
            ],
            "max_tokens": 2,
        }
        second_turn_hits_the_first_turns_replica(client, body)


def test_killing_a_replica_mid_stream_fails_only_its_streams(cluster):
    url, _ = cluster
    with httpx.Client(base_url=url, timeout=60) as client:
        by_replica = sessions_on_two_replicas(client)
    doomed_replica, survivor_replica = sorted(by_replica)
    doomed = Stream(url, by_replica[doomed_replica], max_tokens=600)
    survivor = Stream(url, by_replica[survivor_replica], max_tokens=200)
    doomed.start()
    survivor.start()
    assert doomed.started.wait(60) and survivor.started.wait(60)
    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#EngineReplica#{doomed_replica}", namespace="serve")
    ray.kill(actor, no_restart=True)
    doomed.join(60)
    survivor.join(120)
    assert doomed.replica == doomed_replica and survivor.replica == survivor_replica
    assert doomed.error is not None and doomed.error["code"] == 502, doomed.events[-3:]
    assert "failed while streaming" in doomed.error["message"] and doomed.events[-1] == "[DONE]"
    assert survivor.error is None and survivor.finish_reason == "length" and survivor.events[-1] == "[DONE]"
    # the dead replica's session is served again (by the survivor or the replacement Ray starts)
    with httpx.Client(base_url=url, timeout=60) as client:
        body, headers = chat(by_replica[doomed_replica], "are you there?")
        deadline = time.monotonic() + 30
        while (
            response := client.post("/v1/chat/completions", json=body, headers=headers)
        ).status_code != 200:
            assert time.monotonic() < deadline, response.text
            time.sleep(0.5)


def test_pins_naming_no_replica_hold_up_nobody(cluster):
    """Any client may send ``X-G4Serve-Replica``. A pin naming no replica stayed in Ray's routing loop,
    holding one of its routing tasks (two per replica) even after the ingress answered its 503 (at 10 s):
    eight such requests stalled every later request through the ingress for good (none answered in 120 s)."""
    url, _ = cluster
    answers: list[httpx.Response] = []

    def pinned(i: int) -> None:
        headers = {"X-G4Serve-Replica": f"no-such-replica-{i}"}
        answers.append(httpx.get(f"{url}/v1/models", headers=headers, timeout=60))

    hostile = [threading.Thread(target=pinned, args=(i,), daemon=True) for i in range(8)]
    for thread in hostile:
        thread.start()
    time.sleep(0.5)
    with httpx.Client(base_url=url, timeout=20) as client:
        started = time.monotonic()
        try:
            response = client.post("/v1/chat/completions", json=chat("bystander", "hello")[0])
        except httpx.TimeoutException:
            pytest.fail("a request after eight pins naming no replica got no answer in 20 s")
        waited_s = time.monotonic() - started
    assert response.status_code == 200 and waited_s < 5, f"{response.status_code} after {waited_s:.1f} s"
    for thread in hostile:
        thread.join(60)
    assert [a.status_code for a in answers] == [503] * 8
    assert all("no-such-replica" in a.json()["error"]["message"] for a in answers)


def test_the_ingress_bounds_the_bodies_it_holds(cluster):
    """The ingress reads every body whole to key it, as ``g4serve router`` does, under the same limits
    (``body_budget``): a body that never arrives whole holds its declared length of the budget until the
    deadline, then gets a 408 and its connection closed; a body that does not fit in what is left meanwhile
    gets a 503 at once; and what the first held comes back."""
    url, port = cluster
    body, headers = chat("budget", "hello")
    padded = json.dumps({**body, "padding": "x" * 40_000}).encode()  # a field the replica ignores
    headers = {**headers, "Content-Type": "application/json"}
    with socket.create_connection(("127.0.0.1", port), timeout=60) as slow:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: ray\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(padded)}\r\n\r\n"
        )
        slow.sendall(head.encode() + padded[:100])
        sent = time.monotonic()
        with httpx.Client(base_url=url, timeout=60) as client:
            # until the ingress has the slow request (and its claim), a second body goes through
            refused = None
            while time.monotonic() - sent < 2.5 and refused is None:
                answer = client.post("/v1/chat/completions", content=padded, headers=headers)
                refused = answer if answer.status_code == 503 else None
            assert refused is not None, "no 503 while another body held the budget"
            assert refused.headers["retry-after"] == "1"
            assert "buffered request bodies" in refused.json()["error"]["message"]
            answer = b""
            while data := slow.recv(1 << 16):  # until the ingress closes the connection
                answer += data
            waited_s = time.monotonic() - sent
            status_line, _, rest = answer.partition(b"\r\n")
            response_headers, _, error = rest.partition(b"\r\n\r\n")
            assert status_line.split()[1] == b"408", answer[:300]
            assert b"connection: close" in response_headers.lower()
            assert "whole request body" in json.loads(error)["error"]["message"]
            assert 3.0 <= waited_s < 20, waited_s
            served = client.post("/v1/chat/completions", content=padded, headers=headers)
            assert served.status_code == 200 and served.headers["x-g4serve-replica"], served.text


def replica_names() -> list[str]:
    prefix = f"SERVE_REPLICA::{APP_NAME}#EngineReplica#"
    actors = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"][len(prefix) :] for a in actors if a["name"].startswith(prefix)]


def test_scaling_down_drains_running_streams(cluster):
    """A replica taken away while it streams drains first: deployed at two replicas (autoscaling bounds 1-2),
    then redeployed at one while a stream runs on each; the replica that goes stops taking requests, lets its
    stream finish, then stops. Neither stream loses a token.

    The scale-down is the redeploy's, not the autoscaler's own decision on ongoing requests: that one is
    Ray's and came late on loaded CI machines (once over a minute, once not within three). Both reach the
    same graceful stop (``graceful_shutdown_timeout_s``), which is what this test is about."""
    url, port = cluster
    serve.delete(APP_NAME)
    two = serve_args(port, "--num-replicas", "2", "--min-replicas", "1", "--max-replicas", "2")
    one = serve_args(port, "--num-replicas", "1", "--min-replicas", "1", "--max-replicas", "1")
    for args in (two, one):
        args.drain_timeout = 200.0
    serve.run(build_application(two, 0.0), name=APP_NAME, route_prefix="/")
    names = replica_names()
    assert len(names) == 2, names

    # the tiny model writes 100-200 tokens/s a stream on two cores: 2400 tokens outlast the start of the
    # scale-down by far, and a replica's stream that ends before it is followed by another on that replica
    def stream_on(name: str) -> Stream:
        stream = Stream(url, f"drain-{len(streams)}", max_tokens=2400, replica=name)
        streams.append(stream)
        stream.start()
        assert stream.started.wait(60)
        return stream

    streams: list[Stream] = []
    current = {name: stream_on(name) for name in names}
    target = serve.RunTarget(build_application(one, 0.0), name=APP_NAME, route_prefix="/")
    serve.run_many([target], wait_for_applications_running=False)
    deadline = time.monotonic() + 180
    while not any("STOPPING" in state for state in replica_states()):
        assert time.monotonic() < deadline, "timed out waiting for a replica to start draining"
        for name, stream in current.items():
            if not stream.is_alive():
                current[name] = stream_on(name)
        time.sleep(0.5)
    assert any(stream.is_alive() for stream in current.values()), (
        "the streams ended before the scale-down: nothing drained"
    )
    for stream in streams:  # those that ran across the drain and every one before them: complete
        stream.join(240)
        assert stream.error is None and stream.finish_reason == "length", stream.events[-3:]
        assert stream.events[-1] == "[DONE]"
    wait_until(lambda: len(replica_names()) == 1, 60, "one replica left")


def test_replica_health_check_fails_on_a_dead_or_stalled_engine():
    """Ray Serve restarts a replica whose ``check_health`` raises: it asks what ``GET /health`` asks (the
    engine stopped, or its step has run past G4SERVE_STEP_STALL_S), no cluster needed to see it."""
    from types import SimpleNamespace

    from g4serve.deploy.ray_app import EngineReplica
    from g4serve.engine.async_engine import EngineDeadError

    replica = object.__new__(EngineReplica.func_or_class)
    engine = SimpleNamespace(dead=None, step_running_s=lambda: 2.0)
    replica.app = SimpleNamespace(state=SimpleNamespace(engine=engine))
    replica.check_health()  # serving
    engine.step_running_s = lambda: 90.0
    with pytest.raises(RuntimeError, match="engine is stalled: its current step has run for 90 s"):
        replica.check_health()
    engine.step_running_s, engine.dead = (
        (lambda: 0.0),
        EngineDeadError("engine is not running: it was shut down"),
    )
    with pytest.raises(RuntimeError, match="it was shut down"):
        replica.check_health()
