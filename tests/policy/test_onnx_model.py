"""The onnxruntime wrapper: provider choice and single-input/single-output sessions."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from policy.onnx_model import OnnxModel, RuntimeMissing, choose_providers, preload_cuda_libraries, session_providers
from weights import mlp

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"


@pytest.mark.parametrize(
    ("device", "available", "expected"),
    [
        ("cpu", [CUDA, CPU], [CPU]),
        ("auto", [CUDA, CPU], [CUDA, CPU]),
        ("cuda", [CUDA, CPU], [CUDA, CPU]),
        ("auto", [CPU], [CPU]),
        ("auto", ["AzureExecutionProvider", CPU], [CPU]),
        ("cpu", [CPU], [CPU]),
    ],
)
def test_choose_providers(device: str, available: list[str], expected: list[str]) -> None:
    assert choose_providers(device, available) == expected


def test_choose_providers_rejects_cuda_without_cuda_and_unknown_devices() -> None:
    with pytest.raises(RuntimeMissing, match="CUDAExecutionProvider"):
        choose_providers("cuda", [CPU])
    with pytest.raises(ValueError, match=r"device: expected auto, cpu or cuda, got 'gpu'"):
        choose_providers("gpu", [CUDA, CPU])


def test_the_cuda_provider_is_asked_for_full_float32() -> None:
    # On an H200 (scripts/gpu_check.py, docs/performance.md) TF32 put the default bundle's golden self-test at
    # 1.02e-4 against its 1e-4 tolerance: a CUDA server never loaded a model. The options travel with the name.
    assert session_providers([CUDA, CPU]) == [(CUDA, {"use_tf32": "0"}), CPU]
    assert session_providers([CPU]) == [CPU]


def test_preloading_cuda_libraries_on_a_cpu_build_is_silent(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    # The CPU package has preload_dlls too and returns at once (no CUDA version): nothing printed, nothing logged.
    preload_cuda_libraries.cache_clear()
    preload_cuda_libraries()
    assert capfd.readouterr().out == ""
    assert not [r for r in caplog.records if r.name == "policy.onnx_model"]


@pytest.mark.parametrize("behaviour", ["prints", "raises"])
def test_what_preloading_says_or_raises_goes_to_the_log(behaviour: str, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    def fake_preload() -> None:
        if behaviour == "raises":
            raise OSError("libcudnn.so.9: cannot open shared object file")
        print("\033[33mWARNING: Failed to load libcublasLt.so.13\033[0m")

    monkeypatch.setattr(ort, "preload_dlls", fake_preload)
    preload_cuda_libraries.cache_clear()
    try:
        preload_cuda_libraries()  # never raises: the session then falls back to the CPU, with its own warning
    finally:
        preload_cuda_libraries.cache_clear()
    assert capfd.readouterr().out == ""  # nothing on the process's stdout
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "policy.onnx_model")
    printed = "onnxruntime.preload_dlls: WARNING: Failed to load libcublasLt.so.13"
    expected = "libcudnn.so.9: cannot open" if behaviour == "raises" else printed
    assert expected in said and "\x1b" not in said


def test_cpu_session_runs_the_policy_graph() -> None:
    params = mlp.init_params(np.random.default_rng(3), [12, 8, 5])
    params = {"w1": params["w1"], "b1": params["b1"] + 0.1,
              "w2": np.eye(8, dtype=np.float32), "b2": np.zeros(8, dtype=np.float32),
              "w3": params["w2"], "b3": params["b2"] - 0.2}
    model = OnnxModel("policy", mlp.policy_onnx(params), device="cpu")
    assert model.name == "policy"
    assert (model.input_name, model.output_name) == ("state", "logits")
    assert model.input_shape == ("N", 12)
    assert model.providers == (CPU,)
    x = np.random.default_rng(4).standard_normal((6, 12)).astype(np.float32)
    out = model.run(x)
    assert isinstance(out, np.ndarray) and out.shape == (6, 5)
    np.testing.assert_allclose(out, mlp.policy_forward(params, x), atol=1e-5, rtol=0)


def test_auto_device_picks_an_available_provider() -> None:
    params = mlp.init_params(np.random.default_rng(5), [4, 3, 3, 2])
    model = OnnxModel("p", mlp.policy_onnx(params), device="auto")
    assert set(model.providers) <= set(ort.get_available_providers())
    assert model.providers[-1] == CPU


def test_a_graph_with_two_outputs_is_refused() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["b"])], "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", mlp.OPSET)])
    model.ir_version = mlp.IR_VERSION
    with pytest.raises(ValueError, match=r"^two: expected one input and one output, got 1 and 2"):
        OnnxModel("two", model.SerializeToString(), device="cpu")
