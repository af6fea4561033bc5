"""Names and default shapes of the model zoo, without torch.

``partitioner.models`` builds these models (and imports torch); the CLI lists the names
from here so that ``partitioner --help`` and the planning commands never load torch.
"""

from __future__ import annotations

__all__ = ["BERT", "CNN_DEFAULTS", "GPT2", "MODEL_NAMES"]

GPT2 = {"gpt2-small": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20),
        "gpt2-xl": (48, 1600, 25), "gpt2-tiny": (2, 64, 4)}
CNN_DEFAULTS = {  # name: (kind, blocks, width, image, classes, vgg hidden)
    "vgg19": ("vgg", (), 1.0, 224, 1000, 4096),
    "vgg19-tiny": ("vgg", (), 0.125, 32, 10, 64),
    "resnet50": ("resnet", (3, 4, 6, 3), 1.0, 224, 1000, 0),
    "resnet50-tiny": ("resnet", (3, 4, 6, 3), 0.125, 32, 10, 0),
    "resnet152": ("resnet", (3, 8, 36, 3), 1.0, 224, 1000, 0),
    "resnet152-tiny": ("resnet", (3, 8, 36, 3), 0.125, 32, 10, 0),
}
BERT = {"bert-large": (24, 1024, 16), "bert-tiny": (2, 64, 4)}

MODEL_NAMES: tuple[str, ...] = (*CNN_DEFAULTS, *GPT2, *BERT)
