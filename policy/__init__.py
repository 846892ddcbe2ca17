"""The decision policy: feature encoder, ONNX runtime, guardrails, sampled-majority decoder.

Imports no transport (gRPC) and never torch.
"""
