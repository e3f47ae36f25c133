"""Cloud preemption notices: a spot/preemptible node about to be taken away stops the run like the signal does.

Slurm clusters on AWS (ParallelCluster), GCP (Cluster Toolkit) and Azure (CycleCloud) lose spot and
preemptible nodes with a notice on the instance metadata service, often without any Slurm signal. With
``train.preemption_notice`` set, local rank 0 of each node polls its provider's documented endpoint every
``train.preemption_notice_interval`` seconds in a daemon thread (never on the training thread); on a notice it
records it on the preemption handler and sends the handler's signal (``train.exit_signal``) to its own
process. From there everything is the signal path (``preemption.py``): during setup the process exits 0 at
once; later the ranks agree on the stop after the step, save a checkpoint, write ``stop_reason.json`` (reason
``signal``, with the notice in its ``signal`` entry) and exit 0, so the job is requeued without spending a
retry. The other ranks of the node and the other nodes learn it through that per-step agreement.

What each provider serves (the URL's host can be replaced with ``train.preemption_notice_url``, e.g. a proxy;
the paths and headers stay the provider's):

* aws: ``PUT /latest/api/token`` (an IMDSv2 token, ``X-aws-ec2-metadata-token-ttl-seconds``), then
  ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token``: 404 while there is no
  notice; 200 ``{"action": "terminate", "time": "..."}`` (or ``stop``, ``hibernate``) two minutes before;
* gcp: ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google`` (the answer carries the
  same header): ``FALSE``, then ``TRUE`` once the VM is being preempted;
* azure: ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``: JSON whose
  ``Events`` list holds a ``"EventType": "Preempt"`` event (Spot eviction) whose ``Resources`` name this VM
  (``/metadata/instance/compute/name``; events of other VMs in its availability set show up too).

AWS falls back to IMDSv1 (no token) when the token request is refused with 403/404/405, and fetches a new
token when one is rejected (401). A body that does not parse (a proxy's error page, a truncated answer) is no
notice: it is logged once per kind of answer, and polling goes on; so is an endpoint that cannot be reached.

No torch here: imported by the trainer right after the preemption handler.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from megatron_resilience.config.training import PREEMPTION_NOTICE_PROVIDERS
from megatron_resilience.resilience.log import get_logger

DEFAULT_URL = {"aws": "http://169.254.169.254", "gcp": "http://metadata.google.internal",
               "azure": "http://169.254.169.254"}
AWS_TOKEN_TTL_S = 21600
TIMEOUT_S = 2.0  # per request: the metadata service answers in milliseconds on the instance


class MalformedAnswer(Exception):
    """The endpoint answered, but not in the provider's documented form."""


@dataclass(frozen=True)
class Notice:
    provider: str
    detail: str  # what the provider said, e.g. "action=terminate time=2026-11-25T08:00:00Z"

    def describe(self) -> dict[str, str]:
        return {"provider": self.provider, "detail": self.detail}


def _request(url: str, *, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body); HTTP error statuses are answers too. Network failures raise OSError."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:  # noqa: S310 - a fixed http URL
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers or {}), err.read() or b""


class AwsSpotNotice:
    """EC2 instance metadata: ``spot/instance-action`` (IMDSv2 token first, IMDSv1 when tokens are refused)."""

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")
        self._token: str | None = None
        self._token_expires = 0.0
        self._v1 = False

    def _fetch_token(self) -> str | None:
        if self._v1:
            return None
        if self._token is not None and time.monotonic() < self._token_expires:
            return self._token
        status, _, body = _request(f"{self.base}/latest/api/token", method="PUT",
                                   headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)})
        if status in (403, 404, 405):
            self._v1 = True
            return None
        if status != 200 or not body.strip():
            raise MalformedAnswer(f"token request answered {status} {body[:80]!r}")
        self._token, self._token_expires = body.decode().strip(), time.monotonic() + AWS_TOKEN_TTL_S / 2
        return self._token

    def poll(self) -> Notice | None:
        for _ in range(2):  # a rejected (expired) token is fetched once more
            token = self._fetch_token()
            headers = {"X-aws-ec2-metadata-token": token} if token else {}
            status, _, body = _request(f"{self.base}/latest/meta-data/spot/instance-action", headers=headers)
            if status == 401 and token:
                self._token = None
                continue
            break
        if status == 404:
            return None
        if status != 200:
            raise MalformedAnswer(f"spot/instance-action answered {status} {body[:80]!r}")
        try:
            answer = json.loads(body)
            action, when = answer["action"], answer["time"]
        except (ValueError, KeyError, TypeError):
            raise MalformedAnswer(f"spot/instance-action: not the documented JSON: {body[:80]!r}") from None
        return Notice("aws", f"spot/instance-action: action={action} time={when}")


class GcpPreemptedNotice:
    """GCE metadata server: ``instance/preempted`` is TRUE once the VM is being preempted."""

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")

    def poll(self) -> Notice | None:
        status, headers, body = _request(f"{self.base}/computeMetadata/v1/instance/preempted",
                                         headers={"Metadata-Flavor": "Google"})
        flavor = {k.lower(): v for k, v in headers.items()}.get("metadata-flavor")
        if status != 200 or flavor != "Google":
            raise MalformedAnswer(f"instance/preempted answered {status} (Metadata-Flavor: {flavor}) {body[:80]!r}")
        text = body.decode(errors="replace").strip()
        if text == "FALSE":
            return None
        if text == "TRUE":
            return Notice("gcp", "instance/preempted: TRUE")
        raise MalformedAnswer(f"instance/preempted: neither TRUE nor FALSE: {body[:80]!r}")


class AzurePreemptNotice:
    """Azure Scheduled Events: a ``Preempt`` event (Spot eviction) naming this VM."""

    API = "api-version=2020-07-01"

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")
        self._name: str | None = None
        self._name_known = False

    def _vm_name(self) -> str | None:
        """This VM's name, which events list in ``Resources`` (events of an availability set's other VMs show
        up too); None when the service does not say, and then any Preempt event counts."""
        if not self._name_known:
            status, _, body = _request(f"{self.base}/metadata/instance/compute/name?api-version=2021-02-01"
                                       "&format=text", headers={"Metadata": "true"})
            self._name = (body.decode(errors="replace").strip() or None) if status == 200 else None
            self._name_known = True
        return self._name

    def poll(self) -> Notice | None:
        status, _, body = _request(f"{self.base}/metadata/scheduledevents?{self.API}", headers={"Metadata": "true"})
        if status != 200:
            raise MalformedAnswer(f"scheduledevents answered {status} {body[:80]!r}")
        try:
            events = json.loads(body)["Events"]
            preempts = [e for e in events if e.get("EventType") == "Preempt"]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise MalformedAnswer(f"scheduledevents: not the documented JSON: {body[:80]!r}") from None
        name = self._vm_name() if preempts else None
        mine = [e for e in preempts if name is None or name in (e.get("Resources") or [])]
        if not mine:
            return None
        event = mine[0]
        return Notice("azure", f"scheduledevents: Preempt EventId={event.get('EventId')} "
                               f"NotBefore={event.get('NotBefore')} Resources={','.join(event.get('Resources') or [])}")


CLIENTS = {"aws": AwsSpotNotice, "gcp": GcpPreemptedNotice, "azure": AzurePreemptNotice}
assert tuple(sorted(CLIENTS)) == tuple(sorted(PREEMPTION_NOTICE_PROVIDERS))


class NoticePoller:
    """Polls ``client`` every ``interval`` seconds in a daemon thread; calls ``on_notice`` once, then stops."""

    def __init__(self, client, interval: float, on_notice: Callable[[Notice], None], *, rank: int = 0) -> None:
        self.client, self.interval, self.on_notice = client, interval, on_notice
        self.log = get_logger("preemption", rank)
        self.notice: Notice | None = None
        self.polls = 0
        self._stop = threading.Event()
        self._reported: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="preemption-notice", daemon=True)

    def start(self) -> NoticePoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _once(self, kind: str, message: str) -> None:
        if kind not in self._reported:  # one line per kind of trouble, not one per poll
            self._reported.add(kind)
            self.log.warning(message)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notice = self.client.poll()
            except MalformedAnswer as err:
                notice = None
                self._once(f"malformed:{str(err)[:40]}", f"preemption notice: {err}; not a notice, still polling")
            except OSError as err:
                notice = None
                self._once(f"unreachable:{type(err).__name__}", f"preemption notice: cannot reach the metadata "
                           f"service ({type(err).__name__}: {err}); still polling")
            self.polls += 1
            if notice is not None and not self._stop.is_set():
                self.notice = notice
                self.log.warning(f"preemption notice from {notice.provider}: {notice.detail}")
                self.on_notice(notice)
                return
            self._stop.wait(self.interval)


def start_poller(*, provider: str, interval: float, url: str | None, handler, local_rank: int,
                 rank: int) -> NoticePoller | None:
    """On local rank 0: poll ``provider`` and hand a notice to ``handler`` (the process's preemption handler)
    as its signal. Other local ranks poll nothing (they stop with the others after the step)."""
    if local_rank != 0:
        return None
    client = CLIENTS[provider](url or DEFAULT_URL[provider])

    def deliver(notice: Notice) -> None:
        handler.source = {"cloud_notice": notice.describe()}
        if handler._installed:  # not after training ended (the default action would kill the process)
            os.kill(os.getpid(), handler.signum)

    poller = NoticePoller(client, interval, deliver, rank=rank).start()
    poller.log.info(f"preemption notice: polling {provider} at {client.base} every {interval:g} s "
                    f"(a notice acts as {handler.signal_name})")
    return poller
