"""A model and data of your own, as zerorun takes them (docs/getting-started.md, "Your own model and data"): a
small regression, its model and its datasets in one module."""

import torch
from torch.utils.data import Dataset


class Regressor(torch.nn.Module):
    def __init__(self, features: int, hidden: int):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.GELU(),
                                          torch.nn.Linear(hidden, 1))

    def forward(self, batch: dict) -> torch.Tensor:
        """``batch``: one micro-batch, ``{"x": (B, features), "y": (B,)}`` float32. Returns the loss (a scalar)."""
        return torch.nn.functional.mse_loss(self.layers(batch["x"]).squeeze(-1), batch["y"])


def build_model(features: int = 8, hidden: int = 32) -> Regressor:
    return Regressor(features, hidden)


class Points(Dataset):
    """``n`` samples ``{"x": (features,), "y": ()}``; torch's default collate stacks them into a batch."""

    def __init__(self, n: int, features: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=generator)
        self.y = torch.tanh(self.x @ torch.linspace(-1, 1, features))  # the function to learn

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def build_data(features: int = 8):
    """The training and the validation set."""
    return Points(2048, features, seed=0), Points(256, features, seed=1)
