"""The policy and guard networks in torch, parameter for parameter the arrays of ``weights.mlp``.

``weights.mlp`` holds each linear layer as ``w`` ``(in, out)`` and ``b``; torch's ``Linear``
stores ``weight`` as ``(out, in)``. ``to_arrays`` / ``from_arrays`` convert, so a trained
network exports to the same ONNX graph builders the bundle format uses, and a bundle's
networks load back for further training. The numpy forward passes in ``weights.mlp`` are
the reference both are tested against.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from weights.mlp import Params


class PolicyNet(nn.Module):
    """state → hidden → hidden → logits (ReLU): ``weights.mlp.policy_forward``."""

    def __init__(self, state_dim: int, hidden: int, n_actions: int) -> None:
        super().__init__()
        self.l1 = nn.Linear(state_dim, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.l3 = nn.Linear(hidden, n_actions)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(states))
        h = torch.relu(self.l2(h))
        return self.l3(h)  # type: ignore[no-any-return]


class GuardNet(nn.Module):
    """(state ⊕ one-hot(action)) → hidden → hidden → allow logit, for every action at once:
    ``weights.mlp.guard_forward`` (its sigmoid is applied by the caller / the ONNX graph)."""

    def __init__(self, state_dim: int, hidden: int, n_actions: int) -> None:
        super().__init__()
        self.state_dim = state_dim
        self.n_actions = n_actions
        self.l1 = nn.Linear(state_dim + n_actions, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.l3 = nn.Linear(hidden, 1)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """Allow logits ``(N, n_actions)``."""
        w = self.l1.weight  # (hidden, S + A)
        zs = states @ w[:, : self.state_dim].T + self.l1.bias  # (N, hidden): the state part once
        h = torch.relu(zs[:, None, :] + w[:, self.state_dim :].T[None, :, :])  # + the action column per candidate
        h = torch.relu(self.l2(h))
        return self.l3(h)[..., 0]  # type: ignore[no-any-return]


def _linears(net: nn.Module) -> list[nn.Linear]:
    return [net.l1, net.l2, net.l3]  # type: ignore[list-item]


def to_arrays(net: nn.Module) -> Params:
    """``weights.mlp`` parameters (``w1 b1 w2 b2 w3 b3``, ``w`` as ``(in, out)``), float32."""
    params: Params = {}
    for i, layer in enumerate(_linears(net), start=1):
        params[f"w{i}"] = np.ascontiguousarray(layer.weight.detach().cpu().numpy().T, dtype=np.float32)
        params[f"b{i}"] = np.ascontiguousarray(layer.bias.detach().cpu().numpy(), dtype=np.float32)
    return params


def from_arrays(net: nn.Module, params: Params) -> nn.Module:
    """Load ``weights.mlp`` parameters into ``net`` (shapes must match)."""
    with torch.no_grad():
        for i, layer in enumerate(_linears(net), start=1):
            w, b = torch.tensor(params[f"w{i}"]).T, torch.tensor(params[f"b{i}"])
            if w.shape != layer.weight.shape or b.shape != layer.bias.shape:
                raise ValueError(f"layer {i}: expected {tuple(layer.weight.shape)}, got {tuple(w.shape)}")
            layer.weight.copy_(w)
            layer.bias.copy_(b)
    return net


def policy_from_arrays(params: Params) -> PolicyNet:
    state_dim, hidden = params["w1"].shape
    net = PolicyNet(state_dim, hidden, params["w3"].shape[1])
    from_arrays(net, params)
    return net


def guard_from_arrays(params: Params, state_dim: int) -> GuardNet:
    hidden = params["w1"].shape[1]
    net = GuardNet(state_dim, hidden, params["w1"].shape[0] - state_dim)
    from_arrays(net, params)
    return net
