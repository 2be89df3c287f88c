"""The torchvision v1 ImageNet recipes users write today (AIS WebDataset/ETL blog posts, PyTorch examples).

Shared by the conventional ETL peer and the client-side decoding baseline, so both do exactly the same
per-image work: PIL image in, float32 CHW normalized tensor out.
"""

from __future__ import annotations

from torchvision import transforms

NORMALIZE = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])

PRESETS = {
    "imagenet-train": transforms.Compose(
        [transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), NORMALIZE]
    ),
    "imagenet-val": transforms.Compose(
        [transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), NORMALIZE]
    ),
}
