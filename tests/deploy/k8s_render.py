"""A small kustomize: renders k8s/ the way ``kubectl kustomize`` does, for the features k8s/ uses.

The kustomize binary is not on every machine that runs the tests, so the manifests are
checked as rendered by this loader. It knows exactly what k8s/'s kustomizations use and
refuses anything else (a new feature must be taught here, never silently skipped):

- ``resources``: files (multi-document YAML) and directories holding a kustomization;
- ``patches`` with ``path`` and ``target``: JSON patches (RFC 6902: add, replace, remove, test);
- ``namespace``: set on every namespaced object;
- ``images``: ``newName`` / ``newTag`` of containers whose image name matches.

Where kubectl is installed, tests/deploy/test_k8s_manifests.py checks that this loader and
``kubectl kustomize`` render the same objects.

Also here, for the tests: a label-selector matcher, the pod spec of a workload, and a
five-field cron expression parser.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]

KNOWN_KEYS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "CustomResourceDefinition", "PriorityClass"}


def load_file(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


def render(directory: Path) -> list[Doc]:
    """The objects ``kubectl kustomize directory`` would print (in file order, not kustomize's)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    unknown = set(kustomization) - KNOWN_KEYS
    if unknown:
        raise NotImplementedError(f"{directory}: kustomization keys this loader does not implement: {sorted(unknown)}")
    docs: list[Doc] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else load_file(path)
    for patch in kustomization.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text(encoding="utf-8"))
        if not isinstance(ops, list):
            raise NotImplementedError(f"{directory}/{patch['path']}: only JSON 6902 patches (a list of ops) are implemented")
        targets = [doc for doc in docs if _targets(doc, patch["target"])]
        if not targets:
            raise ValueError(f"{directory}: patch {patch['path']} matches no object ({patch['target']})")
        for doc in targets:
            for op in ops:
                json_patch(doc, op)
    if "namespace" in kustomization:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc.setdefault("metadata", {})["namespace"] = kustomization["namespace"]
    for image in kustomization.get("images", []):
        for doc in docs:
            _set_image(doc, image)
    return docs


def _targets(doc: Doc, target: dict[str, str]) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    have = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    unknown = set(target) - set(have)
    if unknown:
        raise NotImplementedError(f"patch target keys this loader does not implement: {sorted(unknown)}")
    return all(have[key] == value for key, value in target.items())


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"not a JSON pointer: {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def json_patch(doc: Doc, op: dict[str, Any]) -> None:
    """Apply one RFC 6902 operation (add, replace, remove, test) to ``doc`` in place."""
    *parents, last = _pointer(op["path"])
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if kind == "test":
        current = node[int(last)] if isinstance(node, list) else node.get(last)
        if current != op["value"]:
            raise ValueError(f"patch test failed at {op['path']}: {current!r} != {op['value']!r}")
    elif kind == "add":
        value = copy.deepcopy(op["value"])
        if isinstance(node, list) and last == "-":
            node.append(value)
        elif isinstance(node, list):
            node.insert(int(last), value)
        else:
            node[last] = value
    elif kind == "replace":
        if isinstance(node, list):
            node[int(last)] = copy.deepcopy(op["value"])
        else:
            if last not in node:
                raise ValueError(f"replace of a missing path {op['path']}")
            node[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del node[int(last) if isinstance(node, list) else last]
    else:
        raise NotImplementedError(f"JSON patch op {kind!r}")


def _split_image(image: str) -> tuple[str, str | None]:
    """``name[:tag]`` → (name, tag); a registry port is part of the name."""
    name, sep, tag = image.rpartition(":")
    if sep and "/" not in tag:
        return name, tag
    return image, None


def _set_image(doc: Doc, rule: dict[str, str]) -> None:
    for container in containers(doc):
        name, tag = _split_image(container["image"])
        if name != rule["name"]:
            continue
        name = rule.get("newName", name)
        tag = rule.get("newTag", tag)
        container["image"] = f"{name}:{tag}" if tag else name


def pod_spec(doc: Doc) -> Doc | None:
    """The pod spec of a workload (Deployment, Job, CronJob), else None."""
    kind = doc["kind"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return doc["spec"]["template"]["spec"]
    if kind == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if kind == "Pod":
        return doc["spec"]
    return None


def pod_labels(doc: Doc) -> dict[str, str]:
    kind = doc["kind"]
    if kind == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
    return doc["spec"]["template"]["metadata"]["labels"]


def containers(doc: Doc) -> list[Doc]:
    spec = pod_spec(doc)
    if spec is None:
        return []
    return [*spec.get("initContainers", []), *spec["containers"]]


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector (matchLabels and matchExpressions) against a label set."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, operator, values = expr["key"], expr["operator"], expr.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


# --- cron -----------------------------------------------------------------------------------

_CRON_FIELDS = (  # name, low, high, names
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")),
    ("day of week", 0, 7, ("sun", "mon", "tue", "wed", "thu", "fri", "sat")),
)
_CRON_MACROS = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}


def cron_field(text: str, low: int, high: int, names: tuple[str, ...] = ()) -> set[int]:
    """The values a five-field cron field selects (Kubernetes' robfig/cron syntax: * , - / and names)."""
    values: set[int] = set()
    for part in text.split(","):
        base, _, step_text = part.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or int(step_text) < 1:
                raise ValueError(f"bad step {step_text!r} in {text!r}")
            step = int(step_text)
        if base in ("*", "?"):
            start, end = low, high
        else:
            first, _, second = base.partition("-")
            start = _cron_value(first, low, high, names)
            end = _cron_value(second, low, high, names) if second else (high if step_text else start)
            if end < start:
                raise ValueError(f"range {base!r} runs backwards")
        values.update(range(start, end + 1, step))
    return values


def _cron_value(text: str, low: int, high: int, names: tuple[str, ...]) -> int:
    if text.lower() in names:
        return names.index(text.lower()) + (1 if low == 1 else 0)
    if not re.fullmatch(r"\d+", text):
        raise ValueError(f"not a number: {text!r}")
    value = int(text)
    if not low <= value <= high:
        raise ValueError(f"{value} outside {low}-{high}")
    return value


def parse_cron(schedule: str) -> list[set[int]]:
    """Five fields → the set each selects; raises ValueError on anything else (no macros, no TZ= prefix)."""
    if schedule.strip() in _CRON_MACROS or schedule.startswith(("TZ=", "CRON_TZ=")):
        raise ValueError(f"use five fields and spec.timeZone, not {schedule!r}")
    fields = schedule.split()
    if len(fields) != 5:
        raise ValueError(f"expected 5 fields, got {len(fields)}: {schedule!r}")
    return [cron_field(text, low, high, names) for text, (_, low, high, names) in zip(fields, _CRON_FIELDS, strict=True)]
