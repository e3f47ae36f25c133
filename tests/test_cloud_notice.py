"""Issue 25, section 4: cloud preemption notices (AWS spot/instance-action, GCP instance/preempted, Azure Scheduled
Events ``Preempt``) stop the run exactly like the preemption signal.

Every client talks to a real HTTP server on 127.0.0.1 (``resilience_support/metadata_server.py``) that answers as
each provider documents, "no notice" (AWS's 404 page, GCP's ``FALSE``, Azure's events without a Preempt for this
VM) and malformed answers included; nothing in the client is mocked. The last test runs the real trainer under
torchrun (2 ranks, gloo) with ``train.preemption_notice=aws`` against that server: once training is under way the
server starts answering with a spot notice, and the ranks stop after the same step, save, exit 0 and report a
stop on the signal, which the job-level decision requeues without spending a retry.
"""

from __future__ import annotations

import json
import logging
import signal
import time

import pytest
from conftest import read_metrics, start_torchrun
from resilience_support.metadata_server import AWS_NOTICE, AZURE_PREEMPT, MetadataServer

from megatron_resilience.config import ConfigError, TrainingConfig
from megatron_resilience.resilience.cloud_notice import (
    AwsSpotNotice,
    AzurePreemptNotice,
    GcpPreemptedNotice,
    MalformedAnswer,
    Notice,
    NoticePoller,
    start_poller,
)
from megatron_resilience.resilience.preemption import DistributedSignalHandler


@pytest.fixture
def server():
    with MetadataServer() as s:
        yield s


# --- AWS --------------------------------------------------------------------------------------------------------


def test_aws_no_notice_is_the_404_and_every_request_carries_an_imdsv2_token(server):
    client = AwsSpotNotice(server.url)
    assert client.poll() is None and client.poll() is None
    puts = [r for r in server.requests if r[0] == "PUT"]
    gets = [r for r in server.requests if r[0] == "GET"]
    assert len(puts) == 1 and puts[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"  # one token, reused
    assert [g[1] for g in gets] == ["/latest/meta-data/spot/instance-action"] * 2
    assert all(g[2]["x-aws-ec2-metadata-token"] in server.aws_tokens for g in gets)


def test_aws_notice_and_an_expired_token_fetched_again(server):
    client = AwsSpotNotice(server.url)
    assert client.poll() is None
    server.aws_tokens.clear()  # the service no longer accepts the token: 401, a new token, the same answer
    server.aws_notice = AWS_NOTICE
    assert client.poll() == Notice("aws", "spot/instance-action: action=terminate time=2026-11-25T08:22:00Z")
    assert [r[0] for r in server.requests] == ["PUT", "GET", "GET", "PUT", "GET"]


def test_aws_imdsv1_when_tokens_are_refused(server):
    server.aws_v1_only = True
    client = AwsSpotNotice(server.url)
    assert client.poll() is None
    server.aws_notice = {"action": "stop", "time": "2026-11-25T08:30:00Z"}
    assert client.poll().detail == "spot/instance-action: action=stop time=2026-11-25T08:30:00Z"
    assert "x-aws-ec2-metadata-token" not in server.requests[-1][2]


@pytest.mark.parametrize("status,body", [(200, b"<html>proxy error</html>"), (200, b'{"action": "terminate"}'),
                                         (500, b"Internal Server Error")])
def test_aws_malformed_answers_are_not_notices(server, status, body):
    server.raw["/latest/meta-data/spot/instance-action"] = (status, {}, body)
    with pytest.raises(MalformedAnswer, match="spot/instance-action"):
        AwsSpotNotice(server.url).poll()


# --- GCP --------------------------------------------------------------------------------------------------------


def test_gcp_false_then_true_with_the_metadata_flavor_header(server):
    client = GcpPreemptedNotice(server.url)
    assert client.poll() is None
    server.gcp_preempted = "TRUE"
    assert client.poll() == Notice("gcp", "instance/preempted: TRUE")
    assert all(r[2]["metadata-flavor"] == "Google" for r in server.requests)


@pytest.mark.parametrize("status,headers,body", [
    (200, {}, b"TRUE"),  # no Metadata-Flavor: Google in the answer: not the metadata server
    (200, {"Metadata-Flavor": "Google"}, b"maybe"),
    (503, {"Metadata-Flavor": "Google"}, b""),
])
def test_gcp_malformed_answers_are_not_notices(server, status, headers, body):
    server.raw["/computeMetadata/v1/instance/preempted"] = (status, headers, body)
    with pytest.raises(MalformedAnswer, match="instance/preempted"):
        GcpPreemptedNotice(server.url).poll()


# --- Azure ------------------------------------------------------------------------------------------------------


def test_azure_only_a_preempt_event_for_this_vm_is_a_notice(server):
    client = AzurePreemptNotice(server.url)
    assert client.poll() is None  # no events
    server.azure_events = [{**AZURE_PREEMPT, "EventType": "Freeze"},
                           {**AZURE_PREEMPT, "EventId": "other", "Resources": ["another-vm"]}]
    assert client.poll() is None  # a freeze of this VM, a preemption of another one
    server.azure_events.append(AZURE_PREEMPT)
    assert client.poll() == Notice("azure", "scheduledevents: Preempt EventId=602d9444-d2cd-49c7-8624-8643e7171297 "
                                            "NotBefore=Wed, 25 Nov 2026 08:22:00 GMT Resources=trainer-vm-3")
    assert all(r[2]["metadata"] == "true" for r in server.requests)


def test_azure_without_the_vm_name_any_preempt_event_counts(server):
    server.azure_vm_name = None
    server.azure_events = [{**AZURE_PREEMPT, "Resources": ["another-vm"]}]
    assert AzurePreemptNotice(server.url).poll().provider == "azure"


@pytest.mark.parametrize("body", [b"not json", b'{"DocumentIncarnation": 1}', b'{"Events": "Preempt"}'])
def test_azure_malformed_answers_are_not_notices(server, body):
    server.raw["/metadata/scheduledevents?api-version=2020-07-01"] = (200, {}, body)
    with pytest.raises(MalformedAnswer, match="scheduledevents"):
        AzurePreemptNotice(server.url).poll()


# --- the poller and the signal ----------------------------------------------------------------------------------


def _wait(predicate, timeout=30.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_poller_logs_a_malformed_answer_once_keeps_polling_and_fires_once(server, caplog):
    caplog.set_level(logging.WARNING, logger="megatron_resilience.resilience.preemption")
    server.raw["/computeMetadata/v1/instance/preempted"] = (200, {"Metadata-Flavor": "Google"}, b"maybe")
    seen: list[Notice] = []
    poller = NoticePoller(GcpPreemptedNotice(server.url), 0.01, seen.append).start()
    try:
        _wait(lambda: poller.polls >= 5)
        del server.raw["/computeMetadata/v1/instance/preempted"]
        server.gcp_preempted = "TRUE"
        poller.join(30)
    finally:
        poller.stop()
    assert seen == [Notice("gcp", "instance/preempted: TRUE")]
    malformed = [r.getMessage() for r in caplog.records if "neither TRUE nor FALSE" in r.getMessage()]
    assert malformed == ["preemption notice: instance/preempted: neither TRUE nor FALSE: b'maybe'; not a notice, "
                         "still polling"]


def test_an_unreachable_endpoint_is_logged_once_and_polled_on(caplog):
    caplog.set_level(logging.WARNING, logger="megatron_resilience.resilience.preemption")
    with MetadataServer() as gone:
        url = gone.url  # closed on exit: nothing listens there any more
    poller = NoticePoller(AwsSpotNotice(url), 0.01, lambda n: None).start()
    try:
        _wait(lambda: poller.polls >= 3)
    finally:
        poller.stop()
        poller.join(5)
    lines = [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("preemption notice: cannot reach the metadata service (")


def test_a_notice_is_delivered_as_the_exit_signal_on_local_rank_0_only(server):
    handler = DistributedSignalHandler("SIGUSR1", rank=0)  # no run_dir: a signal here only records
    handler.install()
    try:
        assert start_poller(provider="aws", interval=0.01, url=server.url, handler=handler, local_rank=1,
                            rank=1) is None
        poller = start_poller(provider="aws", interval=0.01, url=server.url, handler=handler, local_rank=0, rank=0)
        _wait(lambda: poller.polls >= 2)
        assert not handler.received
        server.aws_notice = AWS_NOTICE
        _wait(lambda: handler.received)
        poller.join(5)
    finally:
        handler.restore()
    described = handler.describe()
    assert described["signal"] == "SIGUSR1" and described["count"] == 1
    assert described["cloud_notice"] == {"provider": "aws",
                                         "detail": "spot/instance-action: action=terminate time=2026-11-25T08:22:00Z"}
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)


# --- bad input --------------------------------------------------------------------------------------------------


def test_bad_settings_name_the_key_and_the_allowed_values():
    with pytest.raises(ConfigError, match=r"^train\.preemption_notice: must be one of \['aws', 'azure', 'gcp'\] or "
                                          r"None, got 'oracle'$"):
        TrainingConfig(exit_signal_handler=True, preemption_notice="oracle")
    with pytest.raises(ConfigError, match=r"^train\.exit_signal_handler: must be true when train\.preemption_notice "
                                          r"is set"):
        TrainingConfig(preemption_notice="gcp")
    with pytest.raises(ConfigError, match=r"^train\.preemption_notice_url: must be http\(s\)://HOST\[:PORT\]"):
        TrainingConfig(exit_signal_handler=True, preemption_notice="gcp", preemption_notice_url="169.254.169.254")


# --- the real trainer -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_aws_spot_notice_stops_the_trainer_like_the_signal_and_is_requeued_without_a_retry(server, tmp_path):
    from megatron_resilience.jobs.classifier import AttemptEvidence, classify
    from megatron_resilience.jobs.decision import decide_like_nemo_run

    run_dir = tmp_path / "run"
    launch = start_torchrun(2, [f"run_dir={run_dir}", "train.max_steps=200", "checkpoint.save_interval=50",
                                f"checkpoint.save={run_dir / 'ckpt'}", "train.exit_signal_handler=true",
                                "train.preemption_notice=aws", "train.preemption_notice_interval=0.2",
                                f"train.preemption_notice_url={server.url}"])
    try:
        _wait(lambda: (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 3, timeout=600)
        server.aws_notice = AWS_NOTICE
    finally:
        proc = launch.wait(timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    stop = json.loads((run_dir / "stop_reason.json").read_text())
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert 3 <= stop["step"] < 200 and steps[-1] == stop["step"]
    assert (stop["reason"], stop["exit_code"], stop["finished"], stop["checkpoint_at_stop"], stop["lost_steps"]) == \
        ("signal", 0, False, "saved", 0)
    assert stop["checkpoint_step"] == stop["step"]
    assert stop["signal"]["cloud_notice"] == {
        "provider": "aws", "detail": "spot/instance-action: action=terminate time=2026-11-25T08:22:00Z"}
    assert (run_dir / "ckpt" / f"iter_{stop['step']:07d}").is_dir()
    assert "preemption notice from aws: spot/instance-action: action=terminate" in proc.stdout
    assert "received SIGTERM from a cloud preemption notice" in proc.stdout
    assert "stopping with the other ranks" in proc.stdout  # rank 1 polled nothing: it stopped on the agreement
    cls = classify(AttemptEvidence(exit_code=proc.returncode, stop_reason=stop))
    decision = decide_like_nemo_run(cls, [], retries=2, ft=False, finished_flag=False)
    assert (cls.error_type, decision.action, decision.spent) == ("preempted", "requeue", None)
