"""Checks a rendered Kubernetes manifest the way `kubectl apply --validate=strict` would, without
a cluster: unknown fields, wrong types and missing required fields are errors naming the path.

- Dask operator objects (DaskCluster, DaskWorkerGroup, DaskAutoscaler) against the CRDs the
  operator installs (the openAPIV3Schema shipped in dask-kubernetes' Helm chart, which embeds
  the full PodSpec), with jsonschema plus the unknown-field rule;
- core objects (a batch/v1 Job, e.g. the Prefect work pool's job manifest) against the
  Kubernetes API models of the `kubernetes` client (attribute maps and types).
"""

from __future__ import annotations

import datetime
import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml

CRDS = {"DaskCluster": "daskcluster.yaml", "DaskWorkerGroup": "daskworkergroup.yaml",
        "DaskAutoscaler": "daskautoscaler.yaml", "DaskJob": "daskjob.yaml"}


class ManifestError(ValueError):
    """A manifest Kubernetes would refuse (or silently prune): where, and what is wrong."""


@cache
def crd_schema(kind: str) -> dict[str, Any]:
    import dask_kubernetes

    root = Path(dask_kubernetes.__file__).parent / "operator" / "deployment" / "helm"
    crd = yaml.safe_load((root / "dask-kubernetes-operator" / "crds" / CRDS[kind]).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return version["schema"]["openAPIV3Schema"]


def _unknown_fields(obj: Any, schema: dict[str, Any], path: str) -> list[str]:
    """Fields the schema does not declare (the API server drops them: a typo is lost silently)."""
    out: list[str] = []
    if isinstance(obj, dict) and "properties" in schema:
        if schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema:
            return out
        for key, value in obj.items():
            sub = schema["properties"].get(key)
            if sub is None:
                out.append(f"{path}.{key}")
            else:
                out.extend(_unknown_fields(value, sub, f"{path}.{key}"))
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, value in obj.items():
            out.extend(_unknown_fields(value, schema["additionalProperties"], f"{path}.{key}"))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            out.extend(_unknown_fields(item, schema["items"], f"{path}[{i}]"))
    return out


def check_crd_object(obj: dict[str, Any]) -> None:
    import jsonschema

    kind = obj.get("kind")
    if kind not in CRDS or obj.get("apiVersion") != "kubernetes.dask.org/v1":
        raise ManifestError(f"not a dask-kubernetes object: {obj.get('apiVersion')}/{kind}")
    schema = crd_schema(kind)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=str)
    if errors:
        e = errors[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        raise ManifestError(f"{kind} {where or '.'}: {e.message}")
    # apiVersion/kind/metadata are implicit in every CRD's schema; metadata is an ObjectMeta.
    check_model(obj.get("metadata", {}), "V1ObjectMeta", f"{kind}.metadata")
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    unknown = _unknown_fields(body, schema, kind)
    if unknown:
        raise ManifestError(f"unknown field(s) {unknown}")


# The client's type strings: "List[V1Container]", "Dict[str, str]" (older clients:
# "list[...]", "dict(str, str)").
_LIST = re.compile(r"[Ll]ist\[(.+)\]")
_DICT = re.compile(r"(?:Dict\[([^,]+), (.+)\]|dict\(([^,]+), (.+)\))")
_PRIMITIVE = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object,
              "datetime": (str, datetime.datetime), "date": (str, datetime.date)}


def check_model(obj: Any, type_name: str, path: str = "") -> None:
    """`obj` (a manifest dict) is a valid `type_name` (e.g. "V1Job") of the Kubernetes API."""
    where = path or type_name
    if m := _LIST.fullmatch(type_name):
        if not isinstance(obj, list):
            raise ManifestError(f"{where}: must be a list, got {type(obj).__name__}")
        for i, item in enumerate(obj):
            check_model(item, m.group(1), f"{where}[{i}]")
        return
    if m := _DICT.fullmatch(type_name):
        if not isinstance(obj, dict):
            raise ManifestError(f"{where}: must be a mapping, got {type(obj).__name__}")
        for k, v in obj.items():
            check_model(v, m.group(2) or m.group(4), f"{where}.{k}")
        return
    if type_name in _PRIMITIVE:
        ok = isinstance(obj, _PRIMITIVE[type_name]) and not (
            type_name in ("int", "float") and isinstance(obj, bool))
        if not ok:
            raise ManifestError(f"{where}: must be {type_name}, got {obj!r}")
        return
    import kubernetes.client as k8s

    model = getattr(k8s, type_name)
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: must be a mapping ({type_name}), got {obj!r}")
    by_json = {j: a for a, j in model.attribute_map.items()}
    unknown = sorted(set(obj) - set(by_json))
    if unknown:
        raise ManifestError(f"{where}: unknown field(s) {unknown} for {type_name}")
    for key, value in obj.items():
        check_model(value, model.openapi_types[by_json[key]], f"{where}.{key}")
    if not path:  # the models' own checks, nested ones included (required fields, ...)
        try:
            model.model_validate(obj)
        except ValueError as err:
            first = str(err).splitlines()
            raise ManifestError(f"{where}: {'; '.join(first[:3])}") from None
