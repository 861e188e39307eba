import pytest
import torch

from fedcore.models import NORMS, create_model

MODELS_AND_SIZES = [
    ("cnn", 1, 28),
    ("cnn", 1, 16),
    ("lenet", 3, 28),
    ("lenet", 3, 32),
    ("resnet20", 3, 32),
    ("resnet18", 3, 32),
]


@pytest.mark.parametrize("name,channels,size", MODELS_AND_SIZES)
@pytest.mark.parametrize("norm", NORMS)
def test_models_build_with_every_norm(name, channels, size, norm):
    model = create_model(name, in_channels=channels, num_classes=7, norm=norm)
    out = model(torch.randn(2, channels, size, size))
    assert out.shape == (2, 7)
    kinds = {type(m).__name__ for m in model.modules()}
    assert ("BatchNorm2d" in kinds) == (norm == "batch")


def test_unknown_names_list_valid_ones():
    with pytest.raises(
        ValueError,
        match="valid names are: cnn, dual-cnn, dual-lenet, dual-resnet18, dual-resnet20, lenet, resnet18, resnet20",
    ):
        create_model("vgg", in_channels=1, num_classes=10)
    with pytest.raises(ValueError, match="valid names are: batch, group, layer"):
        create_model("cnn", in_channels=1, num_classes=10, norm="instance")


@pytest.mark.parametrize("name,channels,size", MODELS_AND_SIZES)
def test_every_model_exposes_features_that_its_head_classifies(name, channels, size):
    """Prototype methods read embed(x); fc(embed(x)) must be exactly the model's output."""
    from fedcore.models import embed_and_classify

    torch.manual_seed(0)
    model = create_model(name, in_channels=channels, num_classes=7).eval()
    x = torch.randn(3, channels, size, size)
    feats, logits = embed_and_classify(model, x)
    assert feats.ndim == 2 and feats.shape[0] == 3
    assert torch.equal(logits, model(x))
