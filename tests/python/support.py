"""What the Python tests share: the deterministic model and data of tests/python/cpp_trajectory.cpp
(no random generator on either side), and the environment the tests read."""

import math
import os

import torch


def fill_parameters(model: torch.nn.Module) -> None:
    """Every weight and bias from sin(0.37 * i) * 0.5, row-major, parameter after parameter."""
    i = 0
    with torch.no_grad():
        for p in model.parameters():
            values = [math.sin(0.37 * (i + k)) * 0.5 for k in range(p.numel())]
            p.copy_(torch.tensor(values, dtype=torch.float64).float().view_as(p))
            i += p.numel()


def make_model() -> torch.nn.Sequential:
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    fill_parameters(model)
    return model


def grid(rows: int, cols: int, scale: float, shift: float, cosine: bool) -> torch.Tensor:
    fn = math.cos if cosine else math.sin
    values = [[fn(scale * (cols * r + c) + shift) for c in range(cols)] for r in range(rows)]
    return torch.tensor(values, dtype=torch.float64).float()


def batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of step t."""
    return grid(32, 6, 0.1, 0.01 * t, False), grid(32, 3, 0.05, 0.02 * t, True)


def loss_of(model: torch.nn.Module, t: int) -> torch.Tensor:
    x, y = batch(t)
    return (model(x) - y).pow(2).mean()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range,
          before_step=None) -> list[float]:
    """The plain loop; before_step(t) runs between backward and step. Returns the losses."""
    losses = []
    for t in steps:
        optimizer.zero_grad()
        loss = loss_of(model, t)
        loss.backward()
        if before_step is not None:
            before_step(t)
        optimizer.step()
        losses.append(loss.item())
    return losses


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_bit_equal(test, actual, expected, what: str) -> None:
    test.assertEqual(len(actual), len(expected), what)
    for i, (a, e) in enumerate(zip(actual, expected)):
        test.assertEqual(a.dtype, e.dtype, f"{what}: parameter {i}")
        test.assertTrue(torch.equal(a, e), f"{what}: parameter {i} differs by "
                        f"{(a.double() - e.double()).abs().max().item():.3e}")


def env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None
