"""Parameter shape lists of real models, computed from their layer configurations.

Every function returns a list of ``(name, shape)`` pairs in ``model.parameters()`` order
(weights and biases, BatchNorm/LayerNorm gamma and beta; no buffers). The shapes feed the
kernel benchmark and the tests, so nothing here needs torch.

* :func:`vgg16_cifar` -- kuangliu/pytorch-cifar ``VGG('VGG16')``: 3x3 convs with bias, each
  followed by BatchNorm2d, and ``Linear(512, 10)``: 14,728,266 parameters in 54 tensors.
* :func:`resnet18_cifar` -- kuangliu/pytorch-cifar ``ResNet18()``: 3x3 stem, BasicBlocks
  [2, 2, 2, 2], bias-free convs, 1x1 projection shortcuts: 11,173,962 parameters in 62 tensors.
* :func:`transformer` -- a GPT-style encoder stack (12 layers, d=384, separate q/k/v/o
  projections, 4x MLP, pre-LN) with token and position embeddings: 24,833,280 parameters in
  196 tensors.

``width_div`` (and the transformer's keyword arguments) shrink the models for smoke tests.
"""
from __future__ import annotations

from math import prod
from typing import Dict, List, Tuple

Shape = Tuple[int, ...]
ShapeList = List[Tuple[str, Shape]]

VGG16_CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def vgg16_cifar(width_div: int = 1, num_classes: int = 10) -> ShapeList:
    shapes: ShapeList = []
    in_ch, i = 3, 0
    for v in VGG16_CFG:
        if v == "M":
            continue
        out = max(1, v // width_div)
        shapes += [
            (f"features.{i}.weight", (out, in_ch, 3, 3)),
            (f"features.{i}.bias", (out,)),
            (f"features.{i + 1}.weight", (out,)),  # BatchNorm2d gamma
            (f"features.{i + 1}.bias", (out,)),  # BatchNorm2d beta
        ]
        in_ch, i = out, i + 3  # conv, bn, relu
    shapes += [("classifier.weight", (num_classes, in_ch)), ("classifier.bias", (num_classes,))]
    return shapes


def resnet18_cifar(width_div: int = 1, num_classes: int = 10) -> ShapeList:
    def c(ch: int) -> int:
        return max(1, ch // width_div)

    shapes: ShapeList = [
        ("conv1.weight", (c(64), 3, 3, 3)),
        ("bn1.weight", (c(64),)),
        ("bn1.bias", (c(64),)),
    ]
    in_planes = c(64)
    for layer, (planes, stride) in enumerate([(64, 1), (128, 2), (256, 2), (512, 2)], start=1):
        planes = c(planes)
        for block, s in enumerate([stride, 1]):
            p = f"layer{layer}.{block}"
            shapes += [
                (f"{p}.conv1.weight", (planes, in_planes, 3, 3)),
                (f"{p}.bn1.weight", (planes,)),
                (f"{p}.bn1.bias", (planes,)),
                (f"{p}.conv2.weight", (planes, planes, 3, 3)),
                (f"{p}.bn2.weight", (planes,)),
                (f"{p}.bn2.bias", (planes,)),
            ]
            if s != 1 or in_planes != planes:
                shapes += [
                    (f"{p}.shortcut.0.weight", (planes, in_planes, 1, 1)),
                    (f"{p}.shortcut.1.weight", (planes,)),
                    (f"{p}.shortcut.1.bias", (planes,)),
                ]
            in_planes = planes
    shapes += [("linear.weight", (num_classes, in_planes)), ("linear.bias", (num_classes,))]
    return shapes


def transformer(layers: int = 12, d_model: int = 384, vocab: int = 8192, max_len: int = 1024,
                mlp_ratio: int = 4) -> ShapeList:
    d, h = d_model, mlp_ratio * d_model
    shapes: ShapeList = [("tok_emb.weight", (vocab, d)), ("pos_emb.weight", (max_len, d))]
    for i in range(layers):
        p = f"blocks.{i}"
        shapes += [(f"{p}.ln1.weight", (d,)), (f"{p}.ln1.bias", (d,))]
        for proj in ("q", "k", "v", "o"):
            shapes += [(f"{p}.attn.{proj}.weight", (d, d)), (f"{p}.attn.{proj}.bias", (d,))]
        shapes += [
            (f"{p}.ln2.weight", (d,)),
            (f"{p}.ln2.bias", (d,)),
            (f"{p}.mlp.fc1.weight", (h, d)),
            (f"{p}.mlp.fc1.bias", (h,)),
            (f"{p}.mlp.fc2.weight", (d, h)),
            (f"{p}.mlp.fc2.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return shapes


def numel(shapes: ShapeList) -> int:
    return sum(prod(s) for _, s in shapes)


def model_shapes(quick: bool = False) -> Dict[str, ShapeList]:
    """The benchmark lists; ``quick`` gives tiny versions of the same structures.

    ``transformer-small`` keeps the transformer's 196 tensors at a seventh of its size (3.5M
    elements, 14 MB: LayerNorm and bias vectors of 128 to 512 elements), so that any cost per
    tensor shows beside the memory traffic."""
    if quick:
        return {
            "vgg16": vgg16_cifar(width_div=16),
            "resnet18": resnet18_cifar(width_div=16),
            "transformer": transformer(layers=2, d_model=32, vocab=256, max_len=64),
            "transformer-small": transformer(layers=2, d_model=16, vocab=128, max_len=32),
        }
    return {"vgg16": vgg16_cifar(), "resnet18": resnet18_cifar(), "transformer": transformer(),
            "transformer-small": transformer(d_model=128, max_len=512)}
