"""Attacks on the local Lambda endpoint, made for real over loopback against a running endpoint.

Each attack is what an unprivileged local user (or a web page in a local browser) could send;
each must be refused with an AWS-shaped 403/400/413, and no handler may run. A correctly signed
request, built by the same helper, is served: so each refusal is down to the one thing the
attack changed, not to a broken test signer.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import os
import pwd
import socket
import subprocess
import sys
import zipfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import boto3
import pytest
from botocore import UNSIGNED
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError

from infra.lambda_endpoint import LocalLambda
from infra.lambda_functions import FunctionSpec
from infra.lambda_package import build_package, lambda_client
from rollart.rewards.client import LambdaCredentials, make_boto3_client

FN = "rollart-env-outcome"
INVOKE = f"/2015-03-31/functions/{FN}/invocations"
EVENT = json.dumps({"task_return": 0.0, "format_penalty": 0.0, "num_turns": 1,
                    "success": False}).encode()


@pytest.fixture(scope="module")
def lam():
    with LocalLambda([FunctionSpec(FN, "env_outcome", concurrency=2)],
                     idle_timeout_s=5) as endpoint:
        yield endpoint


@pytest.fixture
def evil_dir(tmp_path: Path) -> Path:
    """Attacker code that leaves a marker if it ever runs."""
    marker = tmp_path / "PWNED"
    (tmp_path / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "def handler(event, context):\n    return {'reward': 1.0}\n")
    return tmp_path


def _invocations(lam: LocalLambda) -> int:
    return lam.metrics()["functions"][FN]["invocations"]


def _signed(lam: LocalLambda, method: str, path: str, body: bytes = b"",
            creds: LambdaCredentials | None = None, host: str | None = None,
            when: datetime | None = None) -> dict[str, str]:
    """Headers of a SigV4-signed request, as botocore makes them (optionally at `when`)."""
    creds = creds or lam.credentials
    host = host or f"127.0.0.1:{lam.port}"
    req = AWSRequest(method=method, url=f"http://{host}{path}", data=body,
                     headers={"Host": host})
    signer = SigV4Auth(Credentials(creds.access_key, creds.secret_key), "lambda", "us-east-1")
    stamp = (when or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    req.headers["X-Amz-Date"] = stamp
    req.context["timestamp"] = stamp
    sig = signer.signature(signer.string_to_sign(req, signer.canonical_request(req)), req)
    signed = signer.signed_headers(signer.headers_to_sign(req))
    return {"Host": host, "X-Amz-Date": stamp,
            "Authorization": f"AWS4-HMAC-SHA256 Credential={signer.scope(req)}, "
                             f"SignedHeaders={signed}, Signature={sig}"}


def _send(lam: LocalLambda, method: str, path: str, body: bytes = b"",
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", lam.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _raw(lam: LocalLambda, head: bytes, timeout: float = 5.0) -> bytes:
    """A hand-written request (headers a well-behaved client would never send)."""
    with socket.create_connection(("127.0.0.1", lam.port), timeout=timeout) as s:
        s.sendall(head)
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = s.recv(4096)
            if not chunk:
                break
            out += chunk
        return out


def test_signed_request_is_served(lam):
    before = _invocations(lam)
    status, _, body = _send(lam, "POST", INVOKE, EVENT, _signed(lam, "POST", INVOKE, EVENT))
    assert status == 200 and json.loads(body)["reward"] == 0.0
    boto = make_boto3_client(lam.url, "us-east-1", 10, 2, lam.credentials)
    assert json.loads(boto.invoke(FunctionName=FN, Payload=EVENT)["Payload"].read())[
        "reward"] == 0.0
    assert _invocations(lam) == before + 2


def test_unsigned_invoke_is_refused(lam):
    before = _invocations(lam)
    status, headers, body = _send(lam, "POST", INVOKE, EVENT)
    assert status == 403
    assert headers["x-amzn-errortype"] == "MissingAuthenticationTokenException"
    assert json.loads(body)["message"] == "Missing Authentication Token"
    unsigned = boto3.client("lambda", endpoint_url=lam.url, region_name="us-east-1",
                            config=Config(signature_version=UNSIGNED,
                                          retries={"max_attempts": 1}))
    with pytest.raises(ClientError) as info:
        unsigned.invoke(FunctionName=FN, Payload=EVENT)
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert _invocations(lam) == before  # the handler never ran


@pytest.mark.parametrize("case", ["made-up keys", "right key id, wrong secret", "expired",
                                  "body swapped", "wrong region scope"])
def test_wrongly_signed_invoke_is_refused(lam, case):
    before = _invocations(lam)
    creds, when, body = lam.credentials, None, EVENT
    if case == "made-up keys":
        creds = LambdaCredentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCY")
    elif case == "right key id, wrong secret":
        creds = LambdaCredentials(lam.credentials.access_key, "guessed-secret")
    elif case == "expired":  # a captured request, replayed 10 minutes later
        when = datetime.now(timezone.utc) - timedelta(minutes=10)
    headers = _signed(lam, "POST", INVOKE, EVENT, creds=creds, when=when)
    if case == "body swapped":  # signed for one event, sent with another
        body = json.dumps({"task_return": 1.0, "success": True, "num_turns": 1}).encode()
    if case == "wrong region scope":
        headers["Authorization"] = headers["Authorization"].replace("/us-east-1/",
                                                                    "/eu-west-1/")
    status, hdrs, out = _send(lam, "POST", INVOKE, body, headers)
    assert status == 403, out
    assert hdrs["x-amzn-errortype"] in {"UnrecognizedClientException",
                                        "InvalidSignatureException"}
    assert lam.credentials.secret_key not in out.decode()
    assert _invocations(lam) == before


def test_boto3_with_wrong_keys_gets_aws_errors(lam):
    wrong = make_boto3_client(lam.url, "us-east-1", 10, 1,
                              LambdaCredentials(lam.credentials.access_key, "nope"))
    with pytest.raises(ClientError) as info:
        wrong.invoke(FunctionName=FN, Payload=EVENT)
    assert info.value.response["Error"]["Code"] == "InvalidSignatureException"
    ctl = lambda_client(lam.url, "us-east-1", LambdaCredentials("AKIDFAKE", "fake"))
    with pytest.raises(ClientError) as info:
        ctl.create_function(FunctionName="evil", Role="r", Handler="evil.handler",
                            Code={"ZipFile": b"PK\x05\x06" + b"\0" * 18})
    assert info.value.response["Error"]["Code"] == "UnrecognizedClientException"


def test_browser_and_rebinding_requests_are_refused(lam, evil_dir):
    # A web page: text/plain "simple" POST with a foreign Origin, to the registration path.
    req = json.dumps({"name": "evil", "handler": "evil.handler", "code_dir": str(evil_dir)})
    status, hdrs, _ = _send(lam, "POST", "/local/functions", req.encode(),
                            {"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert status == 403
    # Even a correctly signed request is refused with a browser Origin or a rebound Host.
    body = json.dumps({"name": "x", "handler": "env_outcome"}).encode()
    signed = _signed(lam, "POST", "/local/functions", body)
    assert _send(lam, "POST", "/local/functions", body,
                 {**signed, "Origin": "http://evil.example"})[0] == 403
    rebound = _signed(lam, "POST", INVOKE, EVENT, host=f"evil.example:{lam.port}")
    status, hdrs, _ = _send(lam, "POST", INVOKE, EVENT, rebound)
    assert status == 403 and hdrs["x-amzn-errortype"] == "AccessDeniedException"
    assert not (evil_dir / "PWNED").exists()


def test_registration_accepts_only_packaged_handlers(lam, evil_dir):
    path = "/local/functions"

    def post(doc: dict) -> tuple[int, dict]:
        body = json.dumps(doc).encode()
        status, _, out = _send(lam, "POST", path, body, _signed(lam, "POST", path, body))
        return status, json.loads(out or b"{}")

    # Unsigned: refused before anything is parsed.
    body = json.dumps({"name": "evil", "handler": "evil.handler",
                       "code_dir": str(evil_dir)}).encode()
    assert _send(lam, "POST", path, body)[0] == 403
    # Signed with the stack's own keys, foreign code is still refused, in every form.
    for doc in ({"name": "evil", "handler": "evil.handler", "code_dir": str(evil_dir)},
                {"name": "evil", "handler": "evil.handler"},
                {"name": "evil", "handler": "env_outcome", "env": {"PYTHONPATH": str(evil_dir)}},
                {"name": "evil", "handler": "os.system"}):
        status, doc_out = post(doc)
        assert status == 400, doc
        assert any(why in doc_out["message"] for why in ("packaged", "unsupported",
                                                         "not allowed")), doc_out
    # Swapping the live reward function's handler (a failed episode would score 1.0): refused.
    status, _ = post({"name": FN, "handler": "success"})
    assert status == 409
    # A packaged handler registers and runs.
    status, cfg = post({"name": "extra-success", "handler": "success", "concurrency": 1})
    assert status == 201 and cfg["Handler"] == "rollart.rewards.handlers.success_only"
    assert "evil" not in lam.metrics()["functions"]
    assert not (evil_dir / "PWNED").exists()


def _zip_of(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


def test_create_function_accepts_only_the_projects_package(lam, tmp_path):
    ctl = lambda_client(lam.url, "us-east-1", lam.credentials)  # even with the right keys
    pkg = build_package(tmp_path / "rewards.zip", no_deps=True)
    with zipfile.ZipFile(pkg.path) as zf:
        ours = {n: zf.read(n) for n in zf.namelist()}
    evil = b"import os\nos.system('touch /tmp/rollart-pwned')\n"
    handlers = ours["rollart/rewards/handlers.py"]
    attacks = {
        "edited handler": ({**ours, "rollart/rewards/handlers.py": handlers + b"\n" + evil},
                           "rollart.rewards.handlers.env_outcome"),
        "start-up hook": ({**ours, "sitecustomize.py": evil},
                          "rollart.rewards.handlers.env_outcome"),
        "foreign handler": ({**ours, "evil.py": evil}, "evil.handler"),
    }
    for what, (files, handler) in attacks.items():
        with pytest.raises(ClientError) as info:
            ctl.create_function(FunctionName="evil", Role="r", Handler=handler,
                                Code={"ZipFile": _zip_of(files)})
        assert info.value.response["Error"]["Code"] == "InvalidParameterValueException", what
    with pytest.raises(ClientError):
        ctl.get_function(FunctionName="evil")
    # The project's own package deploys (what `rollart lambda deploy` sends).
    ctl.create_function(FunctionName="packaged", Role="r", Code={"ZipFile": pkg.path.read_bytes()},
                        Handler="rollart.rewards.handlers.env_outcome")
    assert ctl.get_function(FunctionName="packaged")["Configuration"]["CodeSha256"] == \
        pkg.code_sha256


@pytest.fixture
def startup_hook(tmp_path: Path) -> tuple[Path, Path]:
    """A directory whose `sitecustomize` leaves a marker if any interpreter ever starts with
    it on its path (what PYTHONPATH in a function's environment would do)."""
    marker = tmp_path / "PWNED-ENV"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return hook, marker


def test_function_environment_is_allow_listed_on_every_path(lam, tmp_path, startup_hook):
    """PYTHONPATH / LD_PRELOAD / ... through UpdateFunctionConfiguration, CreateFunction or
    `POST /local/functions` would run code of the caller's choosing in the endpoint's user:
    every path refuses them (400) and the function keeps its environment."""
    hook, marker = startup_hook
    ctl = lambda_client(lam.url, "us-east-1", lam.credentials)  # even with the right keys
    path = "/local/functions"
    body = json.dumps({"name": "env-target", "handler": "success", "concurrency": 1}).encode()
    assert _send(lam, "POST", path, body, _signed(lam, "POST", path, body))[0] == 201
    evil_envs = [{"PYTHONPATH": str(hook)}, {"LD_PRELOAD": str(hook / "x.so")},
                 {"PYTHONSTARTUP": str(hook / "sitecustomize.py")},
                 {"ROLLART_SANDBOX_ALLOW_WEAK": "1"}, {"OMP_NUM_THREADS": "1; id"}]
    for env in evil_envs:
        with pytest.raises(ClientError) as info:
            ctl.update_function_configuration(FunctionName="env-target",
                                              Environment={"Variables": env})
        assert info.value.response["Error"]["Code"] == "InvalidParameterValueException", env
        doc = json.dumps({"name": "env-evil", "handler": "success", "env": env}).encode()
        status, _, out = _send(lam, "POST", path, doc, _signed(lam, "POST", path, doc))
        assert status == 400 and (b"not allowed" in out or b"must match" in out), (env, out)
    pkg = build_package(tmp_path / "rewards.zip", no_deps=True).path.read_bytes()
    with pytest.raises(ClientError) as info:
        ctl.create_function(FunctionName="env-evil", Role="r", Code={"ZipFile": pkg},
                            Handler="rollart.rewards.handlers.env_outcome",
                            Environment={"Variables": {"PYTHONPATH": str(hook)}})
    assert info.value.response["Error"]["Code"] == "InvalidParameterValueException"
    assert "env-evil" not in lam.metrics()["functions"]
    cfg = ctl.get_function_configuration(FunctionName="env-target")
    assert cfg["Environment"]["Variables"] == {}
    # The function still runs, and no interpreter ever started with the hook on its path.
    boto = make_boto3_client(lam.url, "us-east-1", 10, 1, lam.credentials)
    out = boto.invoke(FunctionName="env-target", Payload=json.dumps({"success": True}).encode())
    assert json.loads(out["Payload"].read())["reward"] == 1.0
    assert not marker.exists()
    # What is allowed still works, on every path.
    ok = ctl.update_function_configuration(FunctionName="env-target",
                                           Environment={"Variables": {"OMP_NUM_THREADS": "2"}})
    assert ok["Environment"]["Variables"] == {"OMP_NUM_THREADS": "2"}
    doc = json.dumps({"name": "env-ok", "handler": "success",
                      "env": {"TOKENIZERS_PARALLELISM": "false"}}).encode()
    assert _send(lam, "POST", path, doc, _signed(lam, "POST", path, doc))[0] == 201


def test_body_limits_and_bad_lengths(lam):
    before = _invocations(lam)
    host = f"Host: 127.0.0.1:{lam.port}\r\n".encode()
    # Unsigned and oversize: refused from the headers alone (no 7 MB is ever read).
    out = _raw(lam, b"POST " + INVOKE.encode() + b" HTTP/1.1\r\n" + host
               + b"Content-Length: 7340032\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 403") and b"MissingAuthenticationToken" in out
    # With an Authorization header (the length is checked before the signature).
    auth = "".join(f"{k}: {v}\r\n" for k, v in _signed(lam, "POST", INVOKE).items()
                   if k != "Host").encode()
    out = _raw(lam, b"POST " + INVOKE.encode() + b" HTTP/1.1\r\n" + host + auth
               + b"Content-Length: 7340032\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413") and b"RequestTooLargeException" in out
    out = _raw(lam, b"POST /2015-03-31/functions HTTP/1.1\r\n" + host + auth
               + b"Content-Length: 104857600\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413")
    # Negative or malformed lengths: an answer at once, never a hung handler thread.
    for bad in (b"-1", b"-99999", b"12abc", b"1e3", "\u00b2".encode()):
        out = _raw(lam, b"POST " + INVOKE.encode() + b" HTTP/1.1\r\n" + host + auth
                   + b"Content-Length: " + bad + b"\r\n\r\n", timeout=5)
        assert out.startswith(b"HTTP/1.1 400") and b"InvalidRequestContentException" in out, bad
    assert _invocations(lam) == before


def test_internal_errors_reveal_nothing(lam, monkeypatch):
    # Fault injection: the next routed request hits a bug whose message holds internals.
    secret = f"/srv/internal/{hashlib.sha1(b'x').hexdigest()} {lam.credentials.secret_key}"

    def broken(*args, **kwargs):
        raise RuntimeError(secret)

    monkeypatch.setattr(lam, "route", broken)
    path = "/2015-03-31/functions"
    status, hdrs, out = _send(lam, "GET", path, b"", _signed(lam, "GET", path))
    assert status == 500 and hdrs["x-amzn-errortype"] == "ServiceException"
    text = out.decode()
    assert secret not in text and "RuntimeError" not in text and "/srv/internal" not in text
    assert json.loads(text)["message"].startswith("An internal error occurred")


def test_health_is_open_but_metrics_are_not(lam):
    assert _send(lam, "GET", "/local/health")[:1] == (200,)
    status, _, out = _send(lam, "GET", "/local/metrics")
    assert status == 403 and FN.encode() not in out
    status, _, out = _send(lam, "GET", "/local/metrics", b"",
                           _signed(lam, "GET", "/local/metrics"))
    assert status == 200 and FN in json.loads(out)["functions"]


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another local user needs root")
def test_runtime_api_refuses_other_local_users(lam):
    """A worker's Runtime API port hands out invocations and takes their results: another
    local user who finds it could answer with any reward. Their connection gets no answer."""
    boto = make_boto3_client(lam.url, "us-east-1", 10, 1, lam.credentials)
    boto.invoke(FunctionName=FN, Payload=EVENT)  # a warm worker, polling its Runtime API
    port = next(w.port for p in lam._pools.values() for w in p.workers)
    nobody = pwd.getpwnam("nobody")
    base = f"http://127.0.0.1:{port}/2018-06-01/runtime/invocation"
    for args in (["-X", "POST", "-d", '{"reward": 1.0}', f"{base}/made-up-id/response"],
                 [f"{base}/next"]):
        proc = subprocess.run(["curl", "-sS", "-m", "5", "-o", "/dev/null",
                               "-w", "%{http_code}", *args], user=nobody.pw_uid,
                              group=nobody.pw_gid, extra_groups=[], capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 52 and proc.stdout == "000", (args, proc)  # empty reply
    # The same request from this (the endpoint's) user is answered: the refusal is the uid's.
    proc = subprocess.run(["curl", "-sS", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}",
                           "-X", "POST", "-d", "{}", f"{base}/made-up-id/response"],
                          capture_output=True, text=True, timeout=30)
    assert proc.stdout == "400"
    resp = boto.invoke(FunctionName=FN, Payload=EVENT)  # the worker still serves
    assert json.loads(resp["Payload"].read())["reward"] == 0.0


def test_deploy_cli_signs_with_the_stacks_key_pair(tmp_path):
    """`rollart lambda deploy --endpoint-url` to the stack's endpoint takes the key pair from the
    state directory; with no pair anywhere it fails in one line (exit 2), it never goes unsigned."""
    from infra.state import lambda_credentials

    state = tmp_path / "state"
    creds = lambda_credentials(state)
    root = Path(__file__).parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLART_LAMBDA_")}
    with LocalLambda([], credentials=creds, idle_timeout_s=5) as endpoint:
        zip_path = build_package(tmp_path / "rewards.zip", no_deps=True).path
        args = [sys.executable, "-m", "cli.main", "lambda", "deploy", "-f", "deployed",
                "--zip", str(zip_path), "--endpoint-url", endpoint.url, "--timeout", "10"]
        ok = subprocess.run([*args, "--state-dir", str(state)], capture_output=True, text=True,
                            cwd=root, env={**env, "PYTHONPATH": str(root)}, timeout=120)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["alias"] == "live"
        none = subprocess.run([*args, "--state-dir", str(tmp_path / "no-stack")],
                              capture_output=True, text=True, cwd=root,
                              env={**env, "PYTHONPATH": str(root)}, timeout=120)
        assert none.returncode == 2 and len(none.stderr.strip().splitlines()) == 1, none.stderr
        assert "ROLLART_LAMBDA_ACCESS_KEY_ID" in none.stderr
        assert "deployed" in endpoint.metrics()["functions"]
