"""What an ONNX graph in a bundle may contain, checked on the protobuf wire bytes before onnxruntime sees it.

A bundle is data: its two graphs are small MLPs built by ``weights.mlp``. Anything beyond
that is refused here, before a session is created, because onnxruntime would act on it:

- **external data** (an initializer or a tensor attribute whose ``data_location`` is
  EXTERNAL or that lists ``external_data``): onnxruntime would read that path relative to
  its working directory and serve the file's bytes as weights;
- **operators outside an allowlist** (``ALLOWED_OPS``, default domain only): the linear,
  elementwise, reduction and shape operators an MLP is made of, each with an output no larger
  than its inputs' shapes make it. Refused are the operators whose output size a tensor's
  *values* set (``ConstantOfShape``, ``Expand``, ``Tile``, ``Range``, ``Resize``, ``Pad`` …),
  with which a 1 MB graph can take gigabytes at load or at the first run, and control flow,
  which would run subgraphs;
- **subgraphs, functions, training info, sparse tensors, tensor-valued attributes**;
- **initializers larger than ``MAX_ELEMENTS``** elements, or declaring more elements than
  their data holds.

- **a shape computed from the inputs**: the inputs that set an output's shape (``Reshape``'s shape, ``Slice``'s
  bounds, the axes of ``Squeeze``, ``Unsqueeze`` and the reductions) must be initializers (``CONSTANT_INPUTS``).

This bounds what a graph can *do*, not all it can allocate: broadcasting two small tensors
((60000, 1) + (1, 60000)) or a Concat of one input many times still makes a large output from
small initializers. That is what the bounded child process (``weights.sandbox``) is for: it
loads and runs every new bundle under an address-space limit before the server does.

The walker reads only the fields it needs (wire format: varint, fixed32/64, length-delimited)
and needs no ``onnx`` package, so the serving install stays small. Field numbers are those
of ``onnx.proto3`` (ModelProto, GraphProto, NodeProto, AttributeProto, TensorProto).
"""

from __future__ import annotations

from collections.abc import Iterator

from weights.bundle import BundleError

ALLOWED_OPS = frozenset({
    "Gemm", "MatMul",  # linear
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Exp", "Log", "Pow", "Erf", "Clip", "Max", "Min", "Sum", "Cast",
    "Identity", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Softmax", "LogSoftmax",  # elementwise
    "ReduceMean", "ReduceSum", "ReduceMax",  # reductions
    "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Slice", "Gather",  # shape: no larger than the inputs
})
CONSTANT_INPUTS = {"Reshape": (1,), "Slice": (1, 2, 3, 4), "Squeeze": (1,), "Unsqueeze": (1,), "ReduceMean": (1,),
                   "ReduceSum": (1,), "ReduceMax": (1,)}
"""Per operator, the inputs that set an output's shape (a new shape, slice bounds, axes), by position: each must be an
initializer, a constant of the bundle, never computed from a request. An attack review (2026-12-07) computed a
``Reshape``'s shape from the state's values (``ReduceMax`` → ``Clip`` → ``Cast`` → ``Concat``): 1 on every state the
load tries, 16,384 once a caller sent an embedding value over 2, and a broadcast then took a server past 1.1 GB on
such calls; or from the batch's row count, so that batches of 37 took 525 ms each."""
MAX_ELEMENTS = 16 * 1024 * 1024  # per initializer: 64 MiB of float32
MAX_NODES = 256
_MAX_DIMS = 8

# ModelProto
_M_OPSET, _M_GRAPH, _M_TRAINING, _M_FUNCTIONS = 8, 7, 20, 25
# GraphProto
_G_NODE, _G_INITIALIZER, _G_SPARSE = 1, 5, 15
# NodeProto
_N_INPUT, _N_OP_TYPE, _N_ATTRIBUTE, _N_DOMAIN = 1, 4, 5, 7
# AttributeProto: t, g, tensors, graphs, sparse_tensor, sparse_tensors
_A_NAME = 1
_A_FORBIDDEN = {5: "a tensor", 6: "a subgraph", 10: "tensors", 11: "subgraphs", 22: "a sparse tensor", 23: "sparse tensors"}
# TensorProto
_T_DIMS, _T_DATA_TYPE, _T_NAME, _T_RAW, _T_EXTERNAL, _T_LOCATION = 1, 2, 8, 9, 13, 14
_T_TYPED = {4: 4, 5: 4, 7: 8, 10: 8, 11: 8}  # float_data, int32_data, int64_data, double_data, uint64_data: bytes each
_ELEMENT_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}
# OperatorSetIdProto
_O_DOMAIN = 1


class _Truncated(Exception):
    pass


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Truncated
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


_MAX_TAG = (1 << 32) - 1  # protobuf's C++ parser reads a tag as 32 bits and drops the rest
_MAX_FIELD = (1 << 29) - 1


def _fields(data: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value): an int for varints and fixed, a view for length-delimited.

    A tag is read exactly as protobuf's C++ parser (which onnxruntime uses) would: a tag longer
    than 5 bytes, above 32 bits, or of field 0 is refused. Otherwise a tag like ``BA 80 80 80 10``
    would be an unknown field 2²⁹+7 here and field 7 (the graph) there: a graph this check never
    saw.
    """
    pos = 0
    while pos < len(data):
        start = pos
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if pos - start > 5 or key > _MAX_TAG or not 1 <= number <= _MAX_FIELD:
            raise BundleError("onnx", f"protobuf tag {bytes(data[start:pos]).hex()} is out of range: not a well-formed ONNX model")
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, wire, value
        elif wire == 1 or wire == 5:
            size = 8 if wire == 1 else 4
            if pos + size > len(data):
                raise _Truncated
            yield number, wire, int.from_bytes(data[pos : pos + size], "little")
            pos += size
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise _Truncated
            yield number, wire, data[pos : pos + size]
            pos += size
        else:  # groups (3, 4) are not used by ONNX; 6 and 7 do not exist
            raise BundleError("onnx", f"wire type {wire} is not used by ONNX")


def _text(value: int | memoryview) -> str:
    return bytes(value).decode("utf-8", "replace") if isinstance(value, memoryview) else ""


def _packed_count(wire: int, value: int | memoryview, size: int) -> int:
    return len(value) // size if wire == 2 and isinstance(value, memoryview) else 1


def _check_tensor(data: memoryview, where: str) -> str:
    """Checks one initializer; its name."""
    dims: list[int] = []
    data_type, name, held = 0, "", 0
    for number, wire, value in _fields(data):
        if number == _T_DIMS:
            if wire == 2 and isinstance(value, memoryview):
                pos = 0
                while pos < len(value):
                    dim, pos = _varint(value, pos)
                    dims.append(dim)
            elif isinstance(value, int):
                dims.append(value)
        elif number == _T_DATA_TYPE and isinstance(value, int):
            data_type = value
        elif number == _T_NAME:
            name = _text(value)
        elif number == _T_RAW and isinstance(value, memoryview):
            held += len(value)
        elif number in _T_TYPED:
            held += _packed_count(wire, value, _T_TYPED[number]) * _T_TYPED[number]
        elif number == _T_EXTERNAL or (number == _T_LOCATION and value != 0):
            raise BundleError("onnx", f"{where}: tensor {name!r} refers to external data; a bundle carries all its data")
    if len(dims) > _MAX_DIMS or any(d >= 1 << 40 for d in dims):
        raise BundleError("onnx", f"{where}: tensor {name!r} has implausible dimensions {dims[:_MAX_DIMS + 1]}")
    elements = 1
    for d in dims:
        elements *= d
    if elements > MAX_ELEMENTS:
        raise BundleError("onnx", f"{where}: tensor {name!r} has {elements} elements, more than {MAX_ELEMENTS}")
    element_bytes = _ELEMENT_BYTES.get(data_type)
    if element_bytes is None:
        raise BundleError("onnx", f"{where}: tensor {name!r} has unsupported data type {data_type}")
    if held < elements * element_bytes:
        raise BundleError("onnx", f"{where}: tensor {name!r} declares {elements} elements but holds {held} bytes of data")
    return name


def _check_node(data: memoryview, where: str) -> tuple[str, list[str]]:
    """Checks one node's operator and attributes; its operator and its inputs' names."""
    op, domain, attributes, inputs = "", "", [], []
    for number, _, value in _fields(data):
        if number == _N_INPUT:
            inputs.append(_text(value))
        elif number == _N_OP_TYPE:
            op = _text(value)
        elif number == _N_DOMAIN:
            domain = _text(value)
        elif number == _N_ATTRIBUTE and isinstance(value, memoryview):
            attributes.append(value)
    if domain not in ("", "ai.onnx") or op not in ALLOWED_OPS:
        raise BundleError("onnx", f"{where}: operator {domain + '.' if domain else ''}{op!r} is not allowed in a bundle "
                                  f"(allowed: {', '.join(sorted(ALLOWED_OPS))})")
    for attribute in attributes:
        name = ""
        for number, _, value in _fields(attribute):
            if number == _A_NAME:
                name = _text(value)
            elif number in _A_FORBIDDEN:
                raise BundleError("onnx", f"{where}: {op} attribute {name or '?'!r} holds {_A_FORBIDDEN[number]}; not allowed")
    return op, inputs


def _check_graph(data: memoryview, where: str) -> None:
    nodes: list[tuple[str, list[str]]] = []
    constants: set[str] = set()
    for number, _, value in _fields(data):
        if not isinstance(value, memoryview):
            continue
        if number == _G_NODE:
            if len(nodes) == MAX_NODES:
                raise BundleError("onnx", f"{where}: more than {MAX_NODES} nodes")
            nodes.append(_check_node(value, where))
        elif number == _G_INITIALIZER:
            constants.add(_check_tensor(value, where))
        elif number == _G_SPARSE:
            raise BundleError("onnx", f"{where}: sparse initializers are not allowed")
    for op, inputs in nodes:  # after the whole graph: initializers may follow the nodes on the wire
        for position in CONSTANT_INPUTS.get(op, ()):
            if position < len(inputs) and inputs[position] and inputs[position] not in constants:
                raise BundleError("onnx", f"{where}: {op}'s input {position} ({inputs[position]!r}) sets its output's shape and "
                                          "is computed, not an initializer: a request's values could size the output")


def check_model(name: str, model: bytes) -> None:
    """Raise ``BundleError("onnx", …)`` unless ``model`` is an ONNX graph of the kind a bundle may carry."""
    graphs = 0
    try:
        for number, _, value in _fields(memoryview(model)):
            if number == _M_GRAPH and isinstance(value, memoryview):
                graphs += 1
                _check_graph(value, name)
            elif number == _M_OPSET and isinstance(value, memoryview):
                domain = next((_text(v) for n, _, v in _fields(value) if n == _O_DOMAIN), "")
                if domain not in ("", "ai.onnx"):
                    raise BundleError("onnx", f"{name}: operator set {domain!r} is not allowed")
            elif number == _M_FUNCTIONS:
                raise BundleError("onnx", f"{name}: model-local functions are not allowed")
            elif number == _M_TRAINING:
                raise BundleError("onnx", f"{name}: training information is not allowed")
    except _Truncated:
        raise BundleError("onnx", f"{name}: not an ONNX model (truncated protobuf)") from None
    if graphs != 1:
        raise BundleError("onnx", f"{name}: expected one graph, found {graphs}")
