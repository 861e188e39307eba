import numpy as np
import pytest

from fedcore.data import CORRUPTION_NAMES, corrupt, load_dataset

# Their CIFAR-10-C settings trade one effect against another, so pixel error is not monotone:
# glass blur's blur sigma and swap count alternate, elastic's affine part shrinks as its
# elastic part grows, frost dims the image as it adds more ice. Checked separately below.
NON_MONOTONE_PSNR = {"glass_blur", "elastic_transform", "frost"}
# Box down/up-sampling 32->30 can alias more than 32->28 on thin strokes: only the ends are ordered.
ENDPOINTS_ONLY = {"pixelate"}


def psnr(a, b):
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    return 10 * np.log10(255.0**2 / max(mse, 1e-12))


@pytest.fixture(scope="module")
def grey():
    return load_dataset("mnist5k").x[:24]


@pytest.fixture(scope="module")
def rgb(grey):
    rng = np.random.default_rng(0)
    base = np.repeat(np.pad(grey, ((0, 0), (2, 2), (2, 2), (0, 0))), 3, axis=-1).astype(float)
    tint = rng.uniform(0.5, 1.0, size=(len(grey), 1, 1, 3))
    return np.uint8(np.clip(base * tint + 20, 0, 255))  # 32x32 colour images


def test_fifteen_cifar10c_corruptions():
    assert len(CORRUPTION_NAMES) == 15
    assert CORRUPTION_NAMES[:3] == ("gaussian_noise", "shot_noise", "impulse_noise")


@pytest.mark.parametrize("name", CORRUPTION_NAMES)
@pytest.mark.parametrize("images", ["grey", "rgb"])
def test_shape_dtype_range_and_determinism(name, images, request):
    x = request.getfixturevalue(images)
    out = corrupt(x, name, 3, seed=1)
    assert out.shape == x.shape and out.dtype == np.uint8
    assert np.array_equal(out, corrupt(x, name, 3, seed=1)), "same seed must give the same images"
    assert not np.array_equal(out, x), "a corruption must change the images"


@pytest.mark.parametrize("name", ["gaussian_noise", "shot_noise", "impulse_noise", "glass_blur", "snow", "fog"])
def test_random_corruptions_depend_on_seed(name, grey):
    assert not np.array_equal(corrupt(grey, name, 3, seed=1), corrupt(grey, name, 3, seed=2))


@pytest.mark.parametrize("name", [n for n in CORRUPTION_NAMES if n not in NON_MONOTONE_PSNR])
def test_psnr_falls_with_severity(name, rgb):
    scores = [psnr(corrupt(rgb, name, s, seed=0), rgb) for s in range(1, 6)]
    if name not in ENDPOINTS_ONLY:
        assert all(b <= a + 0.25 for a, b in zip(scores, scores[1:])), scores
    assert scores[-1] < scores[0] - 1.0, scores


@pytest.mark.parametrize("name", sorted(NON_MONOTONE_PSNR))
def test_non_monotone_ones_are_still_strong(name, rgb):
    assert max(psnr(corrupt(rgb, name, s, seed=0), rgb) for s in range(1, 6)) < 30


def test_cifar_severity_is_milder_than_imagenet_c(rgb):
    # CIFAR-10-C gaussian noise sigma is .04-.10 (ImageNet-C's is .08-.38): the noise std we add must match.
    flat = np.full((64, 32, 32, 3), 128, np.uint8)
    noise = [(corrupt(flat, "gaussian_noise", s, seed=0).astype(float) - 128).std() / 255 for s in (1, 5)]
    assert noise[0] == pytest.approx(0.04, abs=0.003) and noise[1] == pytest.approx(0.10, abs=0.005)


def test_bad_input_errors(grey):
    with pytest.raises(ValueError, match="valid names are: gaussian_noise"):
        corrupt(grey, "gaussian", 1, seed=0)
    with pytest.raises(ValueError, match="severity must be"):
        corrupt(grey, "fog", 6, seed=0)
    with pytest.raises(ValueError, match="uint8"):
        corrupt(grey.astype(float), "fog", 1, seed=0)
