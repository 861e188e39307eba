import pytest
import torch

from fedcore.models import NORMS, create_model


@pytest.mark.parametrize("name,channels,size", [("cnn", 1, 28), ("cnn", 1, 16), ("resnet20", 3, 32), ("resnet18", 3, 32)])
@pytest.mark.parametrize("norm", NORMS)
def test_models_build_with_every_norm(name, channels, size, norm):
    model = create_model(name, in_channels=channels, num_classes=7, norm=norm)
    out = model(torch.randn(2, channels, size, size))
    assert out.shape == (2, 7)
    kinds = {type(m).__name__ for m in model.modules()}
    assert ("BatchNorm2d" in kinds) == (norm == "batch")


def test_unknown_names_list_valid_ones():
    with pytest.raises(ValueError, match="valid names are: cnn, resnet18, resnet20"):
        create_model("vgg", in_channels=1, num_classes=10)
    with pytest.raises(ValueError, match="valid names are: batch, group, layer"):
        create_model("cnn", in_channels=1, num_classes=10, norm="instance")
