"""The gRPC server: configuration, wiring, the servicer, health, error mapping, metrics, CLI.

Generated protobuf code lives in ``server._gen`` (see scripts/gen_proto.py).
"""
