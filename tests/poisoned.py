"""Bundles whose graphs fail on chosen inputs, for the tests of what a server does when inference breaks for one request.

Each graph's ``logits`` become ``logits + zeros``, with ``zeros`` computed from ``state`` by the caller's nodes: zero for
every ordinary state (the bundle loads: golden inputs and warm-up pass), an onnxruntime error or NaN for the poison.
Real graphs run by real onnxruntime sessions; nothing is mocked.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from weights.bundle import Bundle, write_bundle


def poisoned_graph(graph_bytes: bytes, initializers: dict[str, np.ndarray], nodes: list[Any]) -> bytes:
    """``graph_bytes`` with its ``logits`` output plus the ``zeros`` that ``nodes`` compute (from ``state`` and
    ``initializers``)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load_model_from_string(graph_bytes)
    graph = model.graph
    for node in graph.node:
        node.output[:] = ["logits_clean" if o == "logits" else o for o in node.output]
    graph.initializer.extend([numpy_helper.from_array(value, name) for name, value in initializers.items()])
    graph.node.extend([*nodes, helper.make_node("Add", ["logits_clean", "zeros"], ["logits"])])
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def rebundled(bundle: Bundle, parts: dict[str, bytes], model_version: str) -> bytes:
    """``bundle`` with ``parts`` replaced, as a new version (its manifest's checksums written afresh)."""
    manifest = {k: v for k, v in bundle.manifest.items() if k not in ("format", "format_version", "parts")}
    buf = io.BytesIO()
    write_bundle(buf, {**manifest, "model_version": model_version}, {**bundle.parts, **parts})
    return buf.getvalue()
