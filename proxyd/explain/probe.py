"""`kubectl knit explain --verify`'s probes, run from the source pod itself: an ephemeral
container in the pod (as `kubectl debug` adds one) shares its network namespace, so its
connections are the pod's to every policy and to the proxy. It runs agnhost's `connect` once
per probe and prints one line per probe; this module adds it, waits for it to end and reads
its log. An ephemeral container cannot be removed from its pod: it stays, ended, in the pod's
spec, under a name that says what it was (knit-verify-...).

What the user needs: `patch` on `pods/ephemeralcontainers`, `get` on `pods` and `pods/log`
in the source's namespace.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

from kubernetes import client

from proxyd.explain.explain import ExplainError
from proxyd.explain.verify import Answer, Probe

IMAGE = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
PROBE_TIMEOUT = 2
"""Seconds each probe waits for its connection (agnhost connect --timeout)."""
START_TIMEOUT = 120.0
"""Seconds for the ephemeral container to start (its image pulled) and end."""
STUCK = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerError")
"""Waiting reasons of a container that will not start without someone's help."""
NO_ANSWER = "no answer"
# each probe given as ADDRESS PORT PROTOCOL; one line out per probe: ADDRESS PORT OUTCOME
SCRIPT = r"""
timeout=$1; shift
while [ $# -ge 3 ]; do
    address=$1 port=$2 protocol=$3; shift 3
    case $address in *:*) dest="[$address]:$port" ;; *) dest="$address:$port" ;; esac
    if err=$(/agnhost connect --timeout="${timeout}s" --protocol="$protocol" "$dest" 2>&1)
    then outcome=connected
    else
        case $err in
            TIMEOUT*) outcome="timed out" ;;
            REFUSED*) outcome=refused ;;
            *) outcome="error: $(echo "$err" | head -n 1)" ;;
        esac
    fi
    echo "$address $port $outcome"
done
"""


def _container(name: str, image: str, probes: Sequence[Probe]) -> dict[str, object]:
    argv = [
        str(part)
        for probe in probes
        for part in (probe.address, probe.port, probe.protocol.lower())
    ]
    return {
        "name": name,
        "image": image,
        "command": ["sh", "-c", SCRIPT, "sh", str(PROBE_TIMEOUT), *argv],
    }


def parse(printed: str, probes: Sequence[Probe]) -> list[Answer]:
    """The probes' answers from the container's log, in the probes' order; a probe without a
    line (the container ended early) is answered NO_ANSWER."""
    outcomes = {}
    for line in printed.splitlines():
        fields = line.split(" ", 2)
        if len(fields) == 3:
            outcomes[fields[0], fields[1]] = fields[2]
    return [
        Answer(probe, outcomes.get((probe.address, str(probe.port)), NO_ANSWER)) for probe in probes
    ]


def run(
    api: client.ApiClient, namespace: str, pod: str, probes: Sequence[Probe], image: str = IMAGE
) -> tuple[str, list[Answer]]:
    """The ephemeral container's name, and each probe's answer."""
    core = client.CoreV1Api(api)
    name = f"knit-verify-{secrets.token_hex(4)}"
    body = {"spec": {"ephemeralContainers": [_container(name, image, probes)]}}
    try:
        core.patch_namespaced_pod_ephemeralcontainers(
            pod, namespace, body, _content_type="application/strategic-merge-patch+json"
        )
        _wait_ended(core, namespace, pod, name, START_TIMEOUT + len(probes) * PROBE_TIMEOUT)
        printed = core.read_namespaced_pod_log(pod, namespace, container=name)
    except client.ApiException as err:
        message = f"probing from {namespace}/{pod}: {err.status} {err.reason}"
        raise ExplainError(message) from err
    return name, parse(printed, probes)


def _wait_ended(
    core: client.CoreV1Api, namespace: str, pod: str, name: str, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status = core.read_namespaced_pod(pod, namespace).status
        states = [
            each.state
            for each in ((status.ephemeral_container_statuses or []) if status else [])
            if each.name == name and each.state is not None
        ]
        if states and states[0].terminated:
            return
        waiting = states[0].waiting if states else None
        if waiting is not None and waiting.reason in STUCK:
            raise ExplainError(f"the probe container {name} cannot start: {waiting.reason}")
        if time.monotonic() > deadline:
            raise ExplainError(f"the probe container {name} in {namespace}/{pod} did not end")
        time.sleep(0.5)
