"""A small conv net with BatchNorm in plain PyTorch, for the 8x8 digits (`data.source: digits`, inputs
[N, 8, 8]). Its BatchNorm running statistics are buffers: xlatrain keeps them as model state, updates
them in every training step exactly as PyTorch does, checkpoints them and uses them at evaluation."""

from torch import nn


class ConvNet(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 10, dropout: float = 0.1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * channels * 16, classes))

    def forward(self, images):
        return self.classifier(self.features(images[:, None]))
