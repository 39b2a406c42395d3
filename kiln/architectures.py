"""Real architectures with random weights, exported the way a user exports them.

Where ``kiln.examples`` writes small graphs by hand, these are the models people deploy:
ResNet-50, MobileNetV2, ConvNeXt-T, ViT-B/16, BERT-base, GPT-2 and DistilBERT from
``transformers`` (built from their configs, never downloaded: ``XxxConfig(...)`` then
``XxxModel(config)`` under ``torch.manual_seed``), and a 3×1024 MLP. ``export_model`` writes
them with ``torch.onnx.export(model, args, path)`` and its defaults, which write the weights as
external data beside the graph (``model.onnx`` + ``model.onnx.data``), as users upload them.

``size="small"`` gives the same architecture with a few narrow layers, for tests. Needs the
``torch`` extra (torch, transformers, onnxscript); imported only when a builder runs.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Size = Literal["full", "small"]

#: Image side for image models; small configs use a smaller image.
IMAGE_SIDE = {"full": 224, "small": 32}


@dataclass
class Architecture:
    """One built model: the eager PyTorch module and inputs for it, by ONNX input name."""

    name: str
    size: Size
    #: ``forward(*inputs.values())`` returns one tensor (logits or the last hidden state).
    module: torch.nn.Module
    #: Example inputs in ``forward``'s order; their names are the exported graph's input names.
    inputs: dict[str, np.ndarray]
    #: What the output is, for accuracy checks: ``logits`` (classification) or ``hidden``.
    output: Literal["logits", "hidden"]
    #: Integer inputs' valid ranges ``[low, high)`` (token ids: the vocabulary).
    int_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)

    def torch_inputs(self, feed: dict[str, np.ndarray] | None = None) -> tuple[Any, ...]:
        import torch

        feed = self.inputs if feed is None else feed
        return tuple(torch.from_numpy(np.ascontiguousarray(feed[name])) for name in self.inputs)


@dataclass(frozen=True)
class ExportedModel:
    """An architecture exported to ONNX: ``path`` is the graph, its weights lie beside it."""

    architecture: Architecture
    path: Path
    #: ``dynamo`` (the default exporter) or ``torchscript: <why dynamo failed>``.
    exporter: str

    def files(self) -> list[Path]:
        """The graph and its external-data files (what a user uploads as one archive)."""
        return sorted(p for p in self.path.parent.iterdir() if p.is_file()
                      and p.name.startswith(self.path.name) and p.name != "export.json")


def resnet50(*, size: Size = "full", batch: int = 1, seed: int = 0) -> Architecture:
    """ResNet-50 with its 1000-class head (``ResNetConfig`` defaults are ResNet-50)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(num_labels=1000) if size == "full" else ResNetConfig(
        num_labels=10, embedding_size=8, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
    architecture = _image("resnet50", ResNetForImageClassification, config, size, batch, seed)
    _center_head(architecture, seed)
    return architecture


def mobilenet_v2(*, size: Size = "full", batch: int = 1, seed: int = 0) -> Architecture:
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    config = MobileNetV2Config(num_labels=1000) if size == "full" else MobileNetV2Config(
        num_labels=10, depth_multiplier=0.35, image_size=IMAGE_SIDE["small"])
    architecture = _image("mobilenet_v2", MobileNetV2ForImageClassification, config, size,
                          batch, seed)
    _kaiming_convolutions(architecture.module, seed)
    _center_head(architecture, seed)
    return architecture


def convnext_tiny(*, size: Size = "full", batch: int = 1, seed: int = 0) -> Architecture:
    """ConvNeXt-T (``ConvNextConfig`` defaults)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_labels=1000) if size == "full" else ConvNextConfig(
        num_labels=10, depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 32, 64])
    return _image("convnext_tiny", ConvNextForImageClassification, config, size, batch, seed)


def vit_base(*, size: Size = "full", batch: int = 1, seed: int = 0) -> Architecture:
    """ViT-B/16 at 224×224 (``ViTConfig`` defaults)."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(num_labels=1000) if size == "full" else ViTConfig(
        num_labels=10, image_size=IMAGE_SIDE["small"], patch_size=8, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    return _image("vit_base", ViTForImageClassification, config, size, batch, seed)


def bert_base(*, size: Size = "full", batch: int = 1, seq: int = 128, seed: int = 0
              ) -> Architecture:
    """The BERT-base encoder (``BertConfig`` defaults); output: the last hidden state."""
    from transformers import BertConfig, BertModel

    config = BertConfig() if size == "full" else BertConfig(
        vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=max(64, seq))
    return _encoder("bert_base", BertModel, config, size, batch, seq, seed,
                    token_types=config.type_vocab_size)


def distilbert(*, size: Size = "full", batch: int = 1, seq: int = 128, seed: int = 0
               ) -> Architecture:
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig() if size == "full" else DistilBertConfig(
        vocab_size=1000, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
        max_position_embeddings=max(64, seq))
    return _encoder("distilbert", DistilBertModel, config, size, batch, seq, seed)


def gpt2(*, size: Size = "full", batch: int = 1, seq: int = 128, seed: int = 0) -> Architecture:
    """GPT-2 small (``GPT2Config`` defaults), no KV cache; output: the last hidden state."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(use_cache=False) if size == "full" else GPT2Config(
        use_cache=False, vocab_size=1000, bos_token_id=999, eos_token_id=999, n_embd=32,
        n_layer=2, n_head=2,
        n_positions=max(64, seq))
    return _encoder("gpt2", GPT2Model, config, size, batch, seq, seed)


def mlp(*, size: Size = "full", batch: int = 1, width: int = 1024, layers: int = 3,
        seed: int = 0) -> Architecture:
    """``layers`` × (Linear ``width``→``width``, ReLU): the 3×1024 MLP (small: 3×64)."""
    import torch

    width = width if size == "full" else 64
    torch.manual_seed(seed)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    module = torch.nn.Sequential(*blocks[:-1]).eval()
    rng = np.random.default_rng(seed)
    return Architecture("mlp", size, _wrappers()["dense"](module).eval(),
                        {"x": rng.standard_normal((batch, width)).astype(np.float32)}, "hidden")


#: Every builder by name.
BUILDERS: dict[str, Callable[..., Architecture]] = {
    "resnet50": resnet50,
    "mobilenet_v2": mobilenet_v2,
    "convnext_tiny": convnext_tiny,
    "vit_base": vit_base,
    "bert_base": bert_base,
    "gpt2": gpt2,
    "distilbert": distilbert,
    "mlp": mlp,
}


def build(name: str, **kwargs: Any) -> Architecture:
    """The architecture ``name`` (see ``BUILDERS``) built with ``kwargs``."""
    try:
        builder = BUILDERS[name]
    except KeyError:
        raise KeyError(f"no architecture {name!r}; available: {sorted(BUILDERS)}") from None
    return builder(**kwargs)


def export_model(architecture: Architecture, path: Path) -> ExportedModel:
    """``torch.onnx.export(module, inputs, path)`` with the default (dynamo) exporter.

    Only if that exporter fails is the model exported with ``dynamo=False``, and the reason is
    logged and recorded in ``exporter``.
    """
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    args = architecture.torch_inputs()
    exporter = "dynamo"
    try:
        torch.onnx.export(architecture.module, args, str(path))
    except Exception as exc:  # the exporter raises many untyped errors
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        logger.warning("the default torch.onnx.export (dynamo) failed for %s (%s); "
                       "exporting it with dynamo=False", architecture.name, reason)
        for stale in path.parent.glob(path.name + "*"):
            stale.unlink()
        torch.onnx.export(architecture.module, args, str(path), dynamo=False,
                          input_names=list(architecture.inputs))
        exporter = f"torchscript: {reason}"
    return ExportedModel(architecture, path, exporter)


def exported(name: str, cache_dir: Path, *, size: Size = "full", batch: int = 1,
             seq: int = 128, seed: int = 0) -> ExportedModel:
    """The architecture ``name`` built and exported into ``cache_dir``; an earlier export of the
    same (name, size, batch, seq, seed, torch version) is reused, not redone. The module is
    rebuilt either way (same seed, same weights)."""
    import torch

    kwargs: dict[str, Any] = {"size": size, "batch": batch, "seed": seed}
    if name in ("bert_base", "distilbert", "gpt2"):
        kwargs["seq"] = seq
    architecture = build(name, **kwargs)
    key = "-".join([name, size, f"b{batch}"] + ([f"s{seq}"] if "seq" in kwargs else [])
                   + [f"seed{seed}", f"torch{torch.__version__.split('+')[0]}"])
    directory = Path(cache_dir) / key
    path = directory / "model.onnx"
    record = directory / "export.json"
    if path.exists() and record.exists():
        return ExportedModel(architecture, path, json.loads(record.read_text())["exporter"])
    result = export_model(architecture, path)
    record.write_text(json.dumps({"exporter": result.exporter}))
    return result


def _image(name: str, cls: Any, config: Any, size: Size, batch: int, seed: int) -> Architecture:
    import torch

    torch.manual_seed(seed)
    model = cls(config).eval()
    side = IMAGE_SIDE[size]
    rng = np.random.default_rng(seed)
    pixels = rng.standard_normal((batch, 3, side, side)).astype(np.float32)
    return Architecture(name, size, _wrappers()["image"](model).eval(),
                        {"pixel_values": pixels}, "logits")


def _encoder(name: str, cls: Any, config: Any, size: Size, batch: int, seq: int, seed: int,
             *, token_types: int = 0) -> Architecture:
    import torch

    torch.manual_seed(seed)
    model = cls(config).eval()
    rng = np.random.default_rng(seed)
    inputs = {
        "input_ids": rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, seq), np.int64),
    }
    ranges = {"input_ids": (0, config.vocab_size), "attention_mask": (0, 2)}
    if token_types:
        inputs["token_type_ids"] = np.zeros((batch, seq), np.int64)
        ranges["token_type_ids"] = (0, token_types)
    wrapper = _wrappers()["typed_encoder" if token_types else "encoder"]
    return Architecture(name, size, wrapper(model).eval(),
                        inputs, "hidden", ranges)


def _kaiming_convolutions(module: torch.nn.Module, seed: int) -> None:
    """Re-draw convolution weights with He (fan-in: variance-preserving, depthwise too).

    transformers draws them from N(0, 0.02), which through MobileNetV2's ReLU6 stack shrinks
    every activation to zero: all logits equal, and no accuracy check could tell engines apart.
    """
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for layer in module.modules():
            if isinstance(layer, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(layer.weight, mode="fan_in")


def _center_head(architecture: Architecture, seed: int, images: int = 8) -> None:
    """Subtract from the classifier's bias its response to the mean feature of a few seeded
    noise images.

    With random weights, a ReLU network's pooled features share one large positive mean, so
    every input gets the same top-1 class and a top-1 agreement check passes trivially. With
    the head centred, the top-1 class follows each input's own features.
    """
    import torch

    head = [m for m in architecture.module.modules() if isinstance(m, torch.nn.Linear)][-1]
    features: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda _m, args, _out: features.append(args[0]))
    side = architecture.inputs["pixel_values"].shape[-1]
    noise = np.random.default_rng(seed + 1).standard_normal((images, 3, side, side))
    try:
        with torch.inference_mode():
            architecture.module(torch.from_numpy(noise.astype(np.float32)))
    finally:
        hook.remove()
    with torch.no_grad():
        head.bias -= head.weight @ features[0].mean(dim=0)


@functools.cache
def _wrappers() -> dict[str, type]:
    """Modules that call a transformers model with named tensors and return one field of its
    output, so the eager module and the exported graph take the same named tensors and return
    one tensor. Defined on first use: torch is imported only then."""
    import torch

    class ImageClassifier(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.model(pixel_values=pixel_values).logits

    class Encoder(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor
                    ) -> torch.Tensor:
            return self.model(input_ids=input_ids, attention_mask=attention_mask
                              ).last_hidden_state

    class TypedEncoder(Encoder):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,  # type: ignore[override]
                    token_type_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    class Dense(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    return {"image": ImageClassifier, "encoder": Encoder, "typed_encoder": TypedEncoder,
            "dense": Dense}
