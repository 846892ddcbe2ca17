"""Hostile bundles, built the way an attacker with write access to the weights volume would build them.

Each returns the bytes of a file that a server must refuse (see tests/weights/test_hostile_bundles.py
and tests/server/test_hostile_active_bundle.py). They start from the embedded default bundle, so
everything but the attack is valid.
"""

from __future__ import annotations

import io
import json
import struct
import warnings
import zipfile
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from policy.features import FeatureSpec
from tests.wire import varint
from weights.bundle import MANIFEST, PARTS, Bundle, npy_bytes, read_bundle, write_bundle
from weights.embedded import default_bundle

SECRET_RELATIVE = "tmp/x/secret.txt"


def rebuilt(parts: dict[str, bytes] | None = None, base: Bundle | None = None, **manifest: Any) -> bytes:
    """The default bundle (or ``base``) with some parts or manifest keys replaced; checksums recomputed (as an attacker
    can)."""
    base = base or default_bundle()
    kept = {k: v for k, v in base.manifest.items() if k not in ("format", "format_version", "parts")}
    out = io.BytesIO()
    write_bundle(out, {**kept, **manifest}, {**base.parts, **(parts or {})})
    return out.getvalue()


def zero_golden(parts: dict[str, bytes]) -> dict[str, bytes]:
    """Golden states of zeros: the self-test never exercises what the graph reads (the attack of the finding)."""
    states = default_bundle().array("golden_states.npy")
    return {**parts, "golden_states.npy": npy_bytes(np.zeros_like(states))}


def external_data_guard(location: str = SECRET_RELATIVE) -> bytes:
    """guard.onnx whose first initializer lives in an external file (at a relative path unless ``location`` says else)."""
    model = onnx.load_from_string(default_bundle().parts["guard.onnx"])
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(4 * int(np.prod(tensor.dims))))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return model.SerializeToString()


def allocating_guard(rows: int = 200_000, cols: int = 2_000) -> bytes:
    """A guard graph that allocates rows×cols floats with ConstantOfShape (1.6 GB by default) and passes its shape along."""
    state_dim = 920
    shape = numpy_helper.from_array(np.array([rows, cols], dtype=np.int64), "shape")
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["big"], value=numpy_helper.from_array(np.array([1.0], dtype=np.float32))),
        helper.make_node("ReduceMean", ["big"], ["m"], keepdims=1),
        helper.make_node("Gemm", ["state", "w", "b"], ["z"]),
        helper.make_node("Mul", ["z", "m"], ["allow_prob"]),
    ]
    inits = [shape, numpy_helper.from_array(np.zeros((state_dim, 5), np.float32), "w"),
             numpy_helper.from_array(np.full(5, 0.5, np.float32), "b")]
    graph = helper.make_graph(nodes, "guard", [helper.make_tensor_value_info("state", TensorProto.FLOAT, ["N", state_dim])],
                              [helper.make_tensor_value_info("allow_prob", TensorProto.FLOAT, ["N", 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def out_of_range_guard() -> tuple[bytes, bytes]:
    """A guard that answers 2.0 for every action (no sigmoid), and golden outputs that agree with it."""
    state_dim = 920
    nodes = [helper.make_node("Gemm", ["state", "w", "b"], ["allow_prob"])]
    inits = [numpy_helper.from_array(np.zeros((state_dim, 5), np.float32), "w"), numpy_helper.from_array(np.full(5, 2.0, np.float32), "b")]
    graph = helper.make_graph(nodes, "guard", [helper.make_tensor_value_info("state", TensorProto.FLOAT, ["N", state_dim])],
                              [helper.make_tensor_value_info("allow_prob", TensorProto.FLOAT, ["N", 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    golden = default_bundle().array("golden_outputs.npy").copy()
    golden[:, 5:] = 2.0
    return model, npy_bytes(golden)


def members(entries: list[tuple[str, bytes]], compression: int = zipfile.ZIP_STORED) -> bytes:
    """A zip of exactly these (name, data) entries, duplicates allowed (zipfile warns, and writes them)."""
    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w", compression=compression) as zf:
        warnings.simplefilter("ignore", UserWarning)
        for name, data in entries:
            zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data, compress_type=compression)
    return out.getvalue()


def default_members() -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(rebuilt())) as zf:
        return [(name, zf.read(name)) for name in sorted(zf.namelist())]


def _deflated(entries: dict[str, bytes], zeros: dict[str, int]) -> bytes:
    """A deflated zip of ``entries`` plus members of ``zeros[name]`` zero bytes, streamed (never held in memory)."""
    out = io.BytesIO()
    chunk = bytes(1 << 20)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name in sorted({*entries, *zeros}):
            if name in zeros:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_DEFLATED
                with zf.open(info, "w", force_zip64=True) as f:
                    for _ in range(zeros[name] // len(chunk)):
                        f.write(chunk)
            else:
                zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), entries[name], compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()


def inflating(part: str = "behavior_table.npy", size: int = 256 * 1024 * 1024) -> bytes:
    """Every member deflated, one of them ``size`` bytes of zeros (a few hundred kB on disk), its manifest entry matching."""
    entries = dict(default_members())
    manifest = json.loads(entries[MANIFEST])
    manifest["parts"][part] = {"sha256": "0" * 64, "size": size}
    entries[MANIFEST] = json.dumps(manifest).encode()
    del entries[part]
    return _deflated(entries, {part: size})


def zero_parts(size: int = 256 * 1024 * 1024) -> bytes:
    """Every part ``size`` bytes of zeros, deflated: 1.25 GiB declared in a file of about 1.3 MB."""
    entries = {MANIFEST: dict(default_members())[MANIFEST]}
    return _deflated(entries, dict.fromkeys(PARTS, size))


def nested_manifest(depth: int = 200_000) -> bytes:
    entries = dict(default_members())
    entries[MANIFEST] = b"[" * depth + b"]" * depth
    return members(sorted(entries.items()))


def central_directory_entry(data: bytes, name: str) -> int:
    """Where member ``name``'s central directory entry starts in the zip ``data``."""
    at = data.find(b"PK\x01\x02")
    while at != -1:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46 : at + 46 + name_len] == name.encode():
            return at
        at = data.find(b"PK\x01\x02", at + 4)
    raise AssertionError(f"{name} not in the central directory")


def stored_size_mismatch(name: str = MANIFEST, extra: int = 16) -> bytes:
    """The default bundle's members stored as they are, but the central directory gives ``name`` a compressed size
    ``extra`` bytes past its real size: not the canonical container a publisher writes."""
    data = bytearray(members(default_members()))
    at = central_directory_entry(bytes(data), name)
    size = struct.unpack_from("<I", data, at + 24)[0]  # uncompressed size
    struct.pack_into("<I", data, at + 20, size + extra)  # compressed size
    return bytes(data)


def duplicate_member() -> bytes:
    entries = default_members()
    fake = rebuilt(model_version="the-second-copy-wins")
    with zipfile.ZipFile(io.BytesIO(fake)) as zf:
        second = zf.read(MANIFEST)
    return members([*entries, (MANIFEST, second)])


def broadcasting_guard(n: int = 60_000) -> bytes:
    """Only allowed operators, and still 14 GB: (n, 1) + (1, n) broadcast, reduced to a scalar that scales the guard."""
    state_dim = 920
    nodes = [
        helper.make_node("Add", ["column", "row"], ["big"]),
        helper.make_node("ReduceMean", ["big"], ["m"], keepdims=1),
        helper.make_node("Gemm", ["state", "w", "b"], ["z"]),
        helper.make_node("Mul", ["z", "m"], ["zm"]),
        helper.make_node("Sigmoid", ["zm"], ["allow_prob"]),
    ]
    inits = [numpy_helper.from_array(np.zeros((n, 1), np.float32), "column"), numpy_helper.from_array(np.zeros((1, n), np.float32), "row"),
             numpy_helper.from_array(np.zeros((state_dim, 5), np.float32), "w"), numpy_helper.from_array(np.full(5, 0.5, np.float32), "b")]
    graph = helper.make_graph(nodes, "guard", [helper.make_tensor_value_info("state", TensorProto.FLOAT, ["N", state_dim])],
                              [helper.make_tensor_value_info("allow_prob", TensorProto.FLOAT, ["N", 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def hidden_node_guard() -> bytes:
    """The default guard with a ConstantOfShape node under a 5-byte tag whose bit 32 is set.

    A parser that reads the tag as 64 bits sees unknown field 2²⁹+1 and skips it; protobuf's C++
    parser (onnxruntime's) truncates the tag to 32 bits and reads field 1 of GraphProto: a node.
    """
    model = onnx.load_from_string(default_bundle().parts["guard.onnx"])
    hidden = helper.make_node("ConstantOfShape", ["shape_in"], ["never_used"],
                              value=numpy_helper.from_array(np.array([1.0], dtype=np.float32)))
    key = (1 << 3) | 2
    tag = bytes([(key >> (7 * i)) & 0x7F | 0x80 for i in range(4)] + [((key >> 28) & 0x0F) | 0x10])
    payload = hidden.SerializeToString()
    graph = model.graph.SerializeToString() + tag + varint(len(payload)) + payload
    model.ClearField("graph")
    return model.SerializeToString() + varint((7 << 3) | 2) + varint(len(graph)) + graph


def _after_output(model_bytes: bytes, initializers: dict[str, np.ndarray], nodes: list[Any], raw: str = "raw") -> bytes:
    """The graph of ``model_bytes`` with its output renamed ``raw`` where it is made, then ``initializers`` and ``nodes``,
    which make the output again from ``raw``: a graph that serves something besides what its arrays compute."""
    model = onnx.load_from_string(model_bytes)
    out = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = [raw if name == out else name for name in node.output]
    model.graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in initializers.items())
    model.graph.node.extend(nodes)
    return model.SerializeToString()


def guarded_heads() -> Bundle:
    """A bundle with product heads and untrained product guards (format version 3), as ``train-products`` writes them."""
    from policy.features import FeatureSpec
    from weights.initial import make_bundle
    from weights.product_guard import init_params, with_guard
    from weights.product_heads import feature_widths

    base = read_bundle(make_bundle(3, "heads-3", "2026-01-01T00:00:00Z", product_heads=True))
    widths = feature_widths(FeatureSpec.parse(base.manifest["feature_spec"]))
    return read_bundle(with_guard(base, init_params(np.random.default_rng(1), widths)))


def shifted_product_guard(head: str = "sku", shift: float = 3.0) -> bytes:
    """``guarded_heads`` with ``shift`` added to one guard's complaint logit after its last layer, and golden outputs
    that agree: the servers serve it (and veto more), and its ``w1`` … ``b3`` are not what they serve."""
    from weights.product_guard import GUARD_GOLDEN, GUARD_PART
    from weights.product_heads import HEADS

    base = guarded_heads()
    graph = _after_output(base.parts[GUARD_PART[head]], {"guard_shift": np.full(1, shift, np.float32)},
                          [helper.make_node("Add", ["raw", "guard_shift"], ["logits"])])
    golden = base.array(GUARD_GOLDEN).copy()
    golden[:, HEADS.index(head)] += shift
    return rebuilt({GUARD_PART[head]: graph, GUARD_GOLDEN: npy_bytes(golden)}, base, model_version="shifted-guard-2")


def renamed_product_guard(head: str = "band") -> bytes:
    """``guarded_heads`` with one guard's initializer ``b1`` renamed: the same function, which the servers serve, in a
    layout the trainer does not read by name."""
    from weights.product_guard import GUARD_PART

    base = guarded_heads()
    return rebuilt({GUARD_PART[head]: _renamed_b1(base.parts[GUARD_PART[head]])}, base, model_version="renamed-guard-1")


def inflating_head(model_bytes: bytes, copies: int = 16) -> bytes:
    """A product head of allowed operators that adds 0 × the sum of an (N⁴, ``copies``) intermediate to its logit: about
    1 MB on the self-test's 8 rows, about 1 GB on one request's 64 SKUs (the review's finding F1: only a run at a
    request's largest sizes shows it)."""
    graph = onnx.load_from_string(model_bytes).graph
    source, out = graph.input[0].name, graph.output[0].name
    initializers: dict[str, np.ndarray] = {"s0": np.array([0], np.int64), "s1": np.array([1], np.int64), "ax": np.array([1], np.int64),
                    "col": np.array([-1, 1], np.int64), "ones": np.ones((1, copies), np.float32),
                    "zero": np.zeros((1, 1), np.float32)}
    return _after_output(model_bytes, initializers, [
        helper.make_node("Slice", [source, "s0", "s1", "ax"], ["a"]),
        helper.make_node("Transpose", ["a"], ["aT"]),
        helper.make_node("MatMul", ["a", "aT"], ["n2"]),
        helper.make_node("Reshape", ["n2", "col"], ["r2"]),
        helper.make_node("Transpose", ["r2"], ["r2T"]),
        helper.make_node("MatMul", ["r2", "r2T"], ["n4"]),
        helper.make_node("Reshape", ["n4", "col"], ["r4"]),
        helper.make_node("MatMul", ["r4", "ones"], ["big"]),
        helper.make_node("ReduceSum", ["big"], ["s"], keepdims=1),
        helper.make_node("Mul", ["s", "zero"], ["z"]),
        helper.make_node("Add", ["real", "z"], [out]),
    ], raw="real")


def pairwise_head(model_bytes: bytes, copies: int = 256, layers: int = 0) -> bytes:
    """A product head of allowed operators that adds 0 × the sum of an (N, N, ``copies``) intermediate (each row's first
    feature against every other row's) to its logit: 4 MB on one request's 64 SKUs, 1 GB on 1,024 rows, which a batch of
    requests' SKUs reaches (an attack review, 2026-12-07: 64 requests of 19 SKUs took a server to 1.73 GB). With
    ``layers``, that many Tanh layers over the intermediate: compute that grows with the rows' square."""
    graph = onnx.load_from_string(model_bytes).graph
    source, out = graph.input[0].name, graph.output[0].name
    initializers: dict[str, np.ndarray] = {"s0": np.array([0], np.int64), "s1": np.array([1], np.int64), "ax": np.array([1], np.int64),
                    "ax0": np.array([0], np.int64), "ones": np.ones((1, copies), np.float32), "zero": np.zeros((1, 1), np.float32),
                    "all": np.array([0, 1, 2], np.int64)}
    return _after_output(model_bytes, initializers, [
        helper.make_node("Slice", [source, "s0", "s1", "ax"], ["a"]),  # (N, 1)
        helper.make_node("Unsqueeze", ["a", "ax0"], ["a0"]),  # (1, N, 1)
        helper.make_node("Unsqueeze", ["a", "ax"], ["a1"]),  # (N, 1, 1)
        helper.make_node("Sub", ["a1", "a0"], ["d"]),  # (N, N, 1)
        helper.make_node("MatMul", ["d", "ones"], ["big0"]),  # (N, N, copies)
        *[helper.make_node("Tanh", [f"big{k}"], [f"big{k + 1}"]) for k in range(layers)],
        helper.make_node("ReduceSum", [f"big{layers}", "all"], ["s"], keepdims=0),
        helper.make_node("Mul", ["s", "zero"], ["z"]),
        helper.make_node("Add", ["real", "z"], [out]),
    ], raw="real")


def heavy_policy(layers: int = 40, width: int = 2048) -> bytes:
    """The default bundle whose policy also runs ``layers`` MatMul and Tanh layers of one shared (``width``, ``width``)
    weight and adds 0 × their sum to its logits: the same outputs, about ``layers`` × ``width``² multiply-adds more a
    row, every node allowed (the attack review's, 2026-12-07, had 120 of 2048: 33 ms of CPU a lone call)."""
    base = default_bundle()
    rng = np.random.default_rng(0)
    state_dim = FeatureSpec.parse(base.manifest["feature_spec"]).state_dim
    initializers: dict[str, np.ndarray] = {
        "wp": (rng.standard_normal((state_dim, width)) / 30).astype(np.float32),
        "wk": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
        "ax1": np.array([1], np.int64), "zero": np.zeros((1, 1), np.float32)}
    graph = onnx.load_from_string(base.parts["policy.onnx"]).graph
    source, out = graph.input[0].name, graph.output[0].name
    nodes = [helper.make_node("MatMul", [source, "wp"], ["xh0"])]
    for k in range(layers):
        nodes += [helper.make_node("MatMul", [f"xh{k}", "wk"], [f"xm{k}"]), helper.make_node("Tanh", [f"xm{k}"], [f"xh{k + 1}"])]
    nodes += [helper.make_node("ReduceSum", [f"xh{layers}", "ax1"], ["s"], keepdims=1), helper.make_node("Mul", ["s", "zero"], ["z"]),
              helper.make_node("Add", ["raw", "z"], [out])]
    policy = _after_output(base.parts["policy.onnx"], initializers, nodes)
    return rebuilt({"policy.onnx": policy}, base, model_version="heavy-policy-1")


def value_shaped_policy(rows: int = 2**14, width: int = 2**14) -> bytes:
    """The default bundle whose policy reshapes a constant by a shape computed from the state's values (``ReduceMax`` →
    ``Clip`` → ``Cast`` → ``Concat`` → ``Reshape``), only allowed operators: a (1, ``width``) intermediate on every state
    the load tries, (``rows``, ``width``) once a caller sends an embedding value over 2, 1 GiB at the defaults (the attack
    review's, 2026-12-07). Its outputs are the real ones."""
    base = default_bundle()
    graph = onnx.load_from_string(base.parts["policy.onnx"]).graph
    source, out = graph.input[0].name, graph.output[0].name
    initializers: dict[str, np.ndarray] = {
        "two": np.array(2.0, np.float32), "k": np.array(1000.0, np.float32), "lo": np.array(0.0, np.float32),
        "hi": np.array(1.0, np.float32), "sm1": np.array(float(rows - 1), np.float32), "one": np.array(1.0, np.float32),
        "C": np.zeros(rows, np.float32), "R": np.zeros((1, width), np.float32), "m1": np.array([-1], np.int64),
        "ax0": np.array([0], np.int64), "ax1": np.array([1], np.int64), "zero": np.zeros((1, 1), np.float32)}
    n = helper.make_node
    return rebuilt({"policy.onnx": _after_output(base.parts["policy.onnx"], initializers, [
        n("ReduceMax", [source], ["mx"], keepdims=0), n("Sub", ["mx", "two"], ["d"]), n("Mul", ["d", "k"], ["dk"]),
        n("Clip", ["dk", "lo", "hi"], ["t"]), n("Mul", ["t", "sm1"], ["ts"]), n("Add", ["ts", "one"], ["sf"]),
        n("Cast", ["sf"], ["si"], to=TensorProto.INT64), n("Unsqueeze", ["si", "ax0"], ["s1"]),
        n("Concat", ["s1", "m1"], ["shape"], axis=0), n("Reshape", ["C", "shape"], ["c2"]),
        n("ReduceSum", ["c2", "ax1"], ["col"], keepdims=1), n("Add", ["col", "R"], ["big"]),
        n("ReduceSum", ["big"], ["tot"], keepdims=1), n("Mul", ["tot", "zero"], ["z"]), n("Add", ["raw", "z"], [out])])},
        base, model_version="value-shaped-1")


def broadcasting_active(n: int = 16_000) -> bytes:
    """The default bundle with ``broadcasting_guard(n)`` (an n × n intermediate: 1 GiB at 16,000) and golden outputs that
    agree with it (that guard allows every action with probability 0.5): every server refuses it in its bounded check, and
    a process that loads it anyway holds the intermediate."""
    golden = default_bundle().array("golden_outputs.npy").copy()
    golden[:, golden.shape[1] // 2:] = 0.5
    return rebuilt({"guard.onnx": broadcasting_guard(n), "golden_outputs.npy": npy_bytes(golden)})


def renamed_policy(data: bytes | None = None) -> bytes:
    """The default bundle's policy (or that of the bundle ``data``, which keeps its version) with its initializer ``b1``
    named ``bias1``: the same function, which every server accepts, in a layout the trainer does not read back."""
    base = default_bundle() if data is None else read_bundle(data)
    version = {} if data is not None else {"model_version": "renamed-1"}
    return rebuilt({"policy.onnx": _renamed_b1(base.parts["policy.onnx"])}, base, **version)


def _renamed_b1(model_bytes: bytes) -> bytes:
    """The graph of ``model_bytes`` with its initializer ``b1`` named ``bias1``: the same function."""
    model = onnx.load_from_string(model_bytes)
    for tensor in model.graph.initializer:
        if tensor.name == "b1":
            tensor.name = "bias1"
    for node in model.graph.node:
        node.input[:] = ["bias1" if name == "b1" else name for name in node.input]
    return model.SerializeToString()


def shifted_policy(shift: float = 8.0) -> bytes:
    """The default policy with one more node adding ``shift`` to the first logit, and golden outputs that agree: the
    servers serve it, and its ``w1`` … ``b3`` are not what they serve."""
    base = default_bundle()
    offset = np.array([shift, 0, 0, 0, 0], np.float32)
    policy = _after_output(base.parts["policy.onnx"], {"shift": offset}, [helper.make_node("Add", ["raw", "shift"], ["logits"])])
    golden = base.array("golden_outputs.npy").copy()
    golden[:, :5] += offset
    return rebuilt({"policy.onnx": policy, "golden_outputs.npy": npy_bytes(golden)}, model_version="shifted-1")


def shifted_guard(shift: float = 4.0) -> bytes:
    """The default guard with ``shift`` added to its last logit before the sigmoid, and golden outputs that agree: its
    ``w1`` … ``b3`` are not what the servers run."""
    base = default_bundle()
    model = onnx.load_from_string(base.parts["guard.onnx"])
    for node in model.graph.node:
        node.input[:] = ["z_shifted" if (name == "z" and node.op_type == "Sigmoid") else name for name in node.input]
    model.graph.initializer.append(numpy_helper.from_array(np.full(5, shift, np.float32), "guard_shift"))
    model.graph.node.insert(len(model.graph.node) - 1, helper.make_node("Add", ["z", "guard_shift"], ["z_shifted"]))
    golden = base.array("golden_outputs.npy").copy()
    z = np.log(golden[:, 5:]) - np.log1p(-golden[:, 5:])  # the guard's logits, back from its probabilities
    golden[:, 5:] = 1.0 / (1.0 + np.exp(-(z + shift)))
    return rebuilt({"guard.onnx": model.SerializeToString(), "golden_outputs.npy": npy_bytes(golden)},
                   model_version="shifted-guard-1")


def off_golden_policy(shift: float = 8.0) -> bytes:
    """The default policy plus ``shift`` times one state column that every golden state holds at 0 (an hour of the day
    none of them has): the golden outputs are the default's, unchanged, and the graph serves something else on the
    requests of that hour."""
    base = default_bundle()
    states = base.array("golden_states.npy")
    column = next(c for c in range(states.shape[1] - 24, states.shape[1]) if not states[:, c].any())
    weight = np.zeros((states.shape[1], 5), np.float32)
    weight[column, 0] = shift
    policy = _after_output(base.parts["policy.onnx"], {"hour_weight": weight},
                           [helper.make_node("MatMul", ["state", "hour_weight"], ["by_hour"]),
                            helper.make_node("Add", ["raw", "by_hour"], ["logits"])])
    return rebuilt({"policy.onnx": policy}, model_version="off-golden-1")


def transposed_policy() -> bytes:
    """The default policy with ``w1`` stored transposed and its Gemm told so (``transB``): the same function, which
    every server accepts, in arrays whose shapes do not chain as the trainer reads them."""
    model = onnx.load_from_string(default_bundle().parts["policy.onnx"])
    for i, tensor in enumerate(model.graph.initializer):
        if tensor.name == "w1":
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(tensor).T), "w1"))
    first = next(node for node in model.graph.node if node.op_type == "Gemm" and "w1" in node.input)
    first.attribute.append(helper.make_attribute("transB", 1))
    return rebuilt({"policy.onnx": model.SerializeToString()}, model_version="transposed-1")


def infinite_off_golden_policy(column: int) -> bytes:
    """The default policy plus log(1 − state[column]) on every logit: 0 where the column is 0, −Inf where it is 1 (an hour
    of the day's one-hot, chosen by the caller where neither the golden states nor the load's probe states have it)."""
    pick = np.zeros((920, 1), np.float32)
    pick[column, 0] = 1.0
    policy = _after_output(default_bundle().parts["policy.onnx"], {"pick": pick, "one": np.ones(1, np.float32)},
                           [helper.make_node("MatMul", ["state", "pick"], ["picked"]),
                            helper.make_node("Sub", ["one", "picked"], ["rest"]),
                            helper.make_node("Log", ["rest"], ["log_rest"]),
                            helper.make_node("Add", ["raw", "log_rest"], ["logits"])])
    return rebuilt({"policy.onnx": policy}, model_version="infinite-1")


def shifted_product_head(head: str = "sku", shift: float = 3.0) -> bytes:
    """A bundle with product heads (``weights.initial.make_bundle``), ``shift`` added to one head's logit after its last
    layer, and golden outputs that agree: the servers serve it, and its ``w1`` … ``b3`` are not what they serve."""
    from weights.initial import make_bundle
    from weights.product_heads import GOLDEN, HEADS, HIDDEN, PART

    base = read_bundle(make_bundle(3, "heads-3", "2026-01-01T00:00:00Z", product_heads=True))
    head_graph = _after_output(base.parts[PART[head]], {"head_shift": np.full(1, shift, np.float32)},
                               [helper.make_node("Add", ["raw", "head_shift"], ["logits"])])
    golden = base.array(GOLDEN).copy()
    golden[:, HIDDEN + HEADS.index(head)] += shift
    return rebuilt({PART[head]: head_graph, GOLDEN: npy_bytes(golden)}, base, model_version="shifted-head-1")
