"""Request checks of the local Lambda endpoint: AWS SigV4 signatures, Host, sizes.

Loopback is reachable by every local user and, through DNS rebinding or a plain form POST, by
any web page a local browser opens, so the endpoint authenticates like AWS does: every request
carries a SigV4 signature made with the stack's key pair (boto3 signs for us), and the endpoint
re-signs the canonical request with botocore's own signer and compares. What is checked:

- `Authorization` is `AWS4-HMAC-SHA256 Credential=KEY/DATE/REGION/lambda/aws4_request, ...`
  with the stack's access key, this endpoint's region, and `host` + `x-amz-date` signed;
- `X-Amz-Date` is within `MAX_SKEW_S` of now (a captured request goes stale);
- the body is the one signed (payload hash; `UNSIGNED-PAYLOAD` is refused);
- the signature matches (constant-time compare).

Failures are `ApiError(403, ...)` with the error codes AWS uses, so boto3 raises the same
exceptions it would against Lambda. The secret key never appears in a message or a repr.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from datetime import datetime, timezone
from typing import Any

from infra.lambda_functions import ApiError
from rollart.rewards.client import LambdaCredentials

MAX_SKEW_S = 300.0  # AWS allows 5 minutes of clock skew
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
_AUTH = re.compile(r"AWS4-HMAC-SHA256\s+Credential=(?P<cred>[^,\s]+),\s*"
                   r"SignedHeaders=(?P<signed>[a-z0-9;-]+),\s*Signature=(?P<sig>[0-9a-f]{64})")


def check_host(host: str | None) -> None:
    """Only loopback names: a DNS-rebound name (evil.example -> 127.0.0.1) is refused."""
    name = (host or "").strip().lower()
    if name.startswith("["):  # [::1]:port
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    if name not in LOOPBACK_HOSTS:
        raise ApiError(403, "AccessDeniedException", "Host must be a loopback address")


def _denied(code: str, message: str) -> ApiError:
    return ApiError(403, code, message)


def verify_sigv4(method: str, raw_path: str, headers: Any, body: bytes,
                 creds: LambdaCredentials, region: str, service: str = "lambda",
                 now: datetime | None = None) -> None:
    """Raise ApiError(403) unless the request is signed with `creds` for `region`/`service`.
    `raw_path` is the request target exactly as received (path and query, still encoded)."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    auth = headers.get("Authorization")
    if not auth:
        raise _denied("MissingAuthenticationTokenException", "Missing Authentication Token")
    m = _AUTH.fullmatch(auth.strip())
    if m is None:
        raise _denied("IncompleteSignatureException", "Authorization header is not a SigV4 "
                      "signature (AWS4-HMAC-SHA256 Credential=..., SignedHeaders=..., "
                      "Signature=...)")
    key, _, scope = m["cred"].partition("/")
    if not hmac.compare_digest(key.encode(), creds.access_key.encode()):
        raise _denied("UnrecognizedClientException",
                      "The security token included in the request is invalid.")
    amz_date = headers.get("X-Amz-Date") or ""
    try:
        when = datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        raise _denied("IncompleteSignatureException", "X-Amz-Date is missing or malformed")\
            from None
    skew = abs(((now or datetime.now(timezone.utc)) - when).total_seconds())
    if skew > MAX_SKEW_S:
        raise _denied("InvalidSignatureException",
                      f"Signature expired: X-Amz-Date {amz_date} is more than "
                      f"{MAX_SKEW_S:.0f} s from the server's time")
    if scope != f"{amz_date[:8]}/{region}/{service}/aws4_request":
        raise _denied("InvalidSignatureException",
                      f"Credential should be scoped to {amz_date[:8]}/{region}/{service}/"
                      "aws4_request")
    signed = m["signed"].split(";")
    if "host" not in signed or "x-amz-date" not in signed:
        raise _denied("IncompleteSignatureException", "host and x-amz-date must be signed")
    digest = hashlib.sha256(body).hexdigest()
    claimed = headers.get("X-Amz-Content-SHA256")
    if claimed is not None and claimed != digest:  # incl. UNSIGNED-PAYLOAD: body not covered
        raise _denied("InvalidSignatureException", "X-Amz-Content-SHA256 does not match the body")
    # Rebuild the request from the signed headers only and sign it as botocore did.
    values = {}
    for name in signed:
        got = headers.get_all(name) if hasattr(headers, "get_all") else [headers.get(name)]
        if not got or got[0] is None:
            raise _denied("IncompleteSignatureException", f"signed header {name} is missing")
        values[name] = ",".join(got)
    req = AWSRequest(method=method.upper(), url=f"http://{values['host']}{raw_path}",
                     data=body, headers=values)
    req.context["timestamp"] = amz_date
    signer = SigV4Auth(Credentials(creds.access_key, creds.secret_key), service, region)
    expected = signer.signature(signer.string_to_sign(req, signer.canonical_request(req)), req)
    if not hmac.compare_digest(expected.encode(), m["sig"].encode()):
        raise _denied("InvalidSignatureException",
                      "The request signature we calculated does not match the signature you "
                      "provided.")
