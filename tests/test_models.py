import pytest
import torch

from edge_client.models import build_model, get_flat, num_params, set_flat

CASES = [("mimic-cnn", (1, 28, 28), 44426), ("fdms-cnn", (1, 28, 28), 21840),
         ("cifar-lenet", (3, 32, 32), 62006), ("mlp", (1, 28, 28), 199210), ("logreg", (1, 28, 28), 7850),
         ("vgg11", (3, 32, 32), 9750922)]


@pytest.mark.parametrize("name,shape,count", CASES)
def test_param_counts_and_output(name, shape, count):
    m = build_model(name, shape)
    assert num_params(m) == count
    assert tuple(m(torch.zeros(2, *shape)).shape) == (2, 10)


def test_seeded_init_and_flat_roundtrip():
    a, b = build_model("mimic-cnn", (1, 28, 28), seed=5), build_model("mimic-cnn", (1, 28, 28), seed=5)
    assert torch.equal(get_flat(a), get_flat(b))
    c = build_model("mimic-cnn", (1, 28, 28), seed=6)
    assert not torch.equal(get_flat(a), get_flat(c))
    set_flat(c, get_flat(a))
    assert torch.equal(get_flat(a), get_flat(c))


def test_unknown_model():
    with pytest.raises(ValueError, match="--model"):
        build_model("resnet", (1, 28, 28))
