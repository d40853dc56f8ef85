"""The CIFAR10 networks of QPyTorch's examples, as plain full-precision PyTorch modules.

Quantisers are not part of these models: each recipe (experiments/cifar10/recipes.py) inserts
them from outside. Every model takes ``width``, a multiplier of all channel counts (1 is the
published network; smaller values give the same architecture, thinner, for smoke tests).

- ``vgg16``: VGG16 for 32x32 inputs without batch norm, a 512-512-10 classifier with dropout
  (QPyTorch's examples/lp_train and examples/SWALP).
- ``vgg7``: the bias-free, batch-norm-free VGG7 of WAGE (Wu et al., ICLR 2018), with max-pooling
  before the ReLU at the end of each stage, as in QPyTorch's examples/WAGE.
- ``preresnet20``: the pre-activation ResNet of depth 20 (He et al., ECCV 2016) as in QPyTorch's
  examples/IBM8, with every ReLU a module call (``relu``) so that hooks see each activation.
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["VGG16", "VGG7", "PreResNet", "MODELS", "build_model"]

_VGG16_STAGES = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))


def _channels(count: int, width: float) -> int:
    return max(1, round(count * width))


def _normal_fan_out_(conv: nn.Conv2d) -> None:
    """N(0, 2 / (k*k*out_channels)) weights and zero bias: the initialisation of QPyTorch's VGG16
    and PreResNet examples (He et al., 2015, in fan-out mode)."""
    k = conv.kernel_size[0] * conv.kernel_size[1] * conv.out_channels
    conv.weight.data.normal_(0.0, math.sqrt(2.0 / k))
    if conv.bias is not None:
        conv.bias.data.zero_()


class VGG16(nn.Module):
    """VGG16 for CIFAR: 13 3x3 convolutions with biases and ReLU in five stages, each ending in a
    2x2 max-pool, then Dropout-Linear(512, 512)-ReLU-Dropout-Linear(512, 512)-ReLU-Linear(512, n).

    Args:
        num_classes: outputs of the last layer.
        width: multiplier of every channel count.
        conv_init: "fan_out" draws convolution weights from N(0, 2/(9*out_channels)) (QPyTorch's
            examples/lp_train); "fan_in" from N(0, 2/(9*in_channels)) (torch's
            kaiming_normal_ default, QPyTorch's examples/SWALP). Biases start at zero; linear
            layers keep torch's default initialisation.
    """

    def __init__(self, num_classes: int = 10, width: float = 1.0, conv_init: str = "fan_out"):
        super().__init__()
        if conv_init not in ("fan_out", "fan_in"):
            raise ValueError(f"conv_init must be 'fan_out' or 'fan_in', got {conv_init!r}")
        layers: list[nn.Module] = []
        channels = 3
        for stage in _VGG16_STAGES:
            for out in stage:
                out = _channels(out, width)
                layers += [nn.Conv2d(channels, out, kernel_size=3, padding=1), nn.ReLU()]
                channels = out
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        self.features = nn.Sequential(*layers)
        hidden = _channels(512, width)
        self.classifier = nn.Sequential(
            nn.Dropout(),
            nn.Linear(channels, hidden),
            nn.ReLU(),
            nn.Dropout(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                if conv_init == "fan_out":
                    _normal_fan_out_(m)
                else:
                    nn.init.kaiming_normal_(m.weight)
                    m.bias.data.zero_()

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class VGG7(nn.Module):
    """WAGE's VGG7 for 32x32 inputs: three stages of two 3x3 convolutions (128, 256, 512
    channels), the second of each followed by a 2x2 max-pool, every convolution by a ReLU; then
    Linear(8192, 1024)-ReLU-Linear(1024, n). No biases, no batch norm. Weights keep torch's
    default initialisation; the WAGE recipe replaces it with its own."""

    def __init__(self, num_classes: int = 10, width: float = 1.0):
        super().__init__()
        c1, c2, c3 = (_channels(c, width) for c in (128, 256, 512))
        hidden = _channels(1024, width)

        def conv(cin, cout):
            return nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False)

        self.features = nn.Sequential(
            conv(3, c1),
            nn.ReLU(),
            conv(c1, c1),
            nn.MaxPool2d(2),
            nn.ReLU(),
            conv(c1, c2),
            nn.ReLU(),
            conv(c2, c2),
            nn.MaxPool2d(2),
            nn.ReLU(),
            conv(c2, c3),
            nn.ReLU(),
            conv(c3, c3),
            nn.MaxPool2d(2),
            nn.ReLU(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(c3 * 4 * 4, hidden, bias=False),
            nn.ReLU(),
            nn.Linear(hidden, num_classes, bias=False),
        )

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class _PreActBlock(nn.Module):
    """BN-ReLU-conv3x3-BN-ReLU-conv3x3 plus the input (through a 1x1 convolution when the shape
    changes). The one ``relu`` module is called twice."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False))

    def forward(self, x):
        out = self.conv1(self.relu(self.bn1(x)))
        out = self.conv2(self.relu(self.bn2(out)))
        shortcut = x if self.downsample is None else self.downsample(x)
        return out + shortcut


class PreResNet(nn.Module):
    """Pre-activation ResNet for CIFAR with basic blocks: a 3x3 convolution to 16 channels, three
    stages of (depth - 2) / 6 blocks (16, 32, 64 channels; the last two halve the resolution),
    BN-ReLU, 8x8 average pooling and a linear layer. Convolutions start from
    N(0, 2/(9*out_channels)), batch norms from weight 1 and bias 0.

    Raises:
        ValueError: depth is not 6n + 2.
    """

    def __init__(self, depth: int = 20, num_classes: int = 10, width: float = 1.0):
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"PreResNet depth must be 6n + 2 with n >= 1, got {depth}")
        blocks = (depth - 2) // 6
        widths = [_channels(c, width) for c in (16, 32, 64)]
        self.conv1 = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        stages, cin = [], widths[0]
        for i, cout in enumerate(widths):
            stage = []
            for b in range(blocks):
                stage.append(_PreActBlock(cin, cout, stride=2 if (i > 0 and b == 0) else 1))
                cin = cout
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3 = stages
        self.bn = nn.BatchNorm2d(cin)
        self.relu = nn.ReLU()
        self.avgpool = nn.AvgPool2d(8)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                _normal_fan_out_(m)
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.data.fill_(1.0)
                m.bias.data.zero_()

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        x = self.avgpool(self.relu(self.bn(x)))
        return self.fc(x.flatten(1))


MODELS = {
    "vgg16": lambda width, **kw: VGG16(width=width, **kw),
    "vgg7": lambda width, **kw: VGG7(width=width, **kw),
    "preresnet20": lambda width, **kw: PreResNet(depth=20, width=width, **kw),
}


def build_model(name: str, width: float = 1.0, **options) -> nn.Module:
    """The model called ``name`` (a key of MODELS), with channel multiplier ``width``; options go
    to its constructor (num_classes, conv_init for vgg16).

    Raises:
        ValueError: unknown name or a width that is not positive.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if not width > 0:
        raise ValueError(f"width must be positive, got {width!r}")
    return MODELS[name](width, **options)
