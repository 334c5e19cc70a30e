"""Models written in the project (torchvision does not import beside this torch build).

    mlp        any input shape: flatten, two hidden layers
    cnn        small inputs (digits' 1x8x8): two 3x3 conv layers, one pool, two linear
    mnistnet   28x28 inputs (MNIST): Horovod's MNIST example net widened to 1.02M parameters
    resnet18   (C, 32, 32): ResNet-18 as in kuangliu/pytorch-cifar (BasicBlock, BN)
    vgg16      (C, 32, 32): VGG-16 with BN as in kuangliu/pytorch-cifar, Linear(512, classes)

`build_model(name, input_shape, classes)` makes one by name.
"""
from __future__ import annotations

import math

import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MLP", "SmallCNN", "MNISTNet", "ResNet18", "VGG16", "build_model", "MODELS", "num_parameters"]


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class MLP(nn.Module):
    def __init__(self, input_shape=(1, 8, 8), classes: int = 10, hidden=(128, 64)):
        super().__init__()
        layers, width = [nn.Flatten()], math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(inplace=True)]
            width = h
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    """Two padded 3x3 convolutions keep the 8x8 map; one 2x2 pool halves it."""

    def __init__(self, input_shape=(1, 8, 8), classes: int = 10, width: int = 32):
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * (h // 2) * (w // 2), 128), nn.ReLU(inplace=True),
            nn.Linear(128, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class MNISTNet(nn.Module):
    """The shape of Horovod's pytorch_mnist.py net (two 5x5 convolutions, each pooled, two
    linear layers), its hidden layer widened so the model has 1,021,034 parameters at 1x28x28:
    a delta of 4 MB, as a real model's commit is. Most parameters sit in the first linear
    layer, which is cheap to compute, so many emulated ranks fit on a few cores."""

    def __init__(self, input_shape=(1, 28, 28), classes: int = 10, hidden: int = 1280):
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 8, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * (h // 4) * (w // 4), hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, input_shape=(3, 32, 32), classes: int = 10):
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(input_shape[0], 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._layer(64, 2, 1)
        self.layer2 = self._layer(128, 2, 2)
        self.layer3 = self._layer(256, 2, 2)
        self.layer4 = self._layer(512, 2, 2)
        self.linear = nn.Linear(512, classes)

    def _layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (blocks - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.avg_pool2d(out, 4)  # 4x4 map at 32x32 input
        return self.linear(out.flatten(1))


VGG16_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    """14,728,266 parameters at 3x32x32 and 10 classes (the ASHL paper's CIFAR-10 model)."""

    def __init__(self, input_shape=(3, 32, 32), classes: int = 10):
        super().__init__()
        layers, c = [], input_shape[0]
        for v in VGG16_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                c = v
        layers.append(nn.AvgPool2d(1, 1))  # kept from the reference: a no-op at 1x1
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(512, classes)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


MODELS = {"mlp": MLP, "cnn": SmallCNN, "mnistnet": MNISTNet, "resnet18": ResNet18, "vgg16": VGG16}
_NEEDS_32 = ("resnet18", "vgg16")


def build_model(name: str, input_shape, classes: int) -> nn.Module:
    """A fresh model by name ("mlp", "cnn", "mnistnet", "resnet18", "vgg16") for (C, H, W)
    inputs."""
    key = str(name).strip().lower().replace("-", "").replace("_", "")
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise ValueError(f"input_shape must be a tuple of ints, got {input_shape!r}") from None
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 2:
        raise ValueError(f"classes must be an integer >= 2, got {classes!r}")
    if any(s < 1 for s in shape):
        raise ValueError(f"input_shape sizes must be positive, got {shape}")
    if key != "mlp" and len(shape) != 3:
        raise ValueError(f"{key} needs a (channels, height, width) input_shape, got {shape}")
    if key in _NEEDS_32 and shape[1:] != (32, 32):
        raise ValueError(f"{key} is built for 32x32 inputs (CIFAR-10), got {shape}; "
                         "use 'cnn' or 'mlp' for small images")
    if key == "cnn" and (shape[1] < 2 or shape[2] < 2):
        raise ValueError(f"cnn needs inputs of at least 2x2, got {shape}")
    if key == "mnistnet" and (shape[1] < 4 or shape[2] < 4):
        raise ValueError(f"mnistnet needs inputs of at least 4x4, got {shape}")
    return MODELS[key](shape, classes)
