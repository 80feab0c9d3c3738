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


def test_a_channels_last_model_has_the_same_flat_vector_and_trains():
    """A model whose parameters are channels-last (a user's `.to(memory_format=torch.channels_last)`) gives the same
    flat vector as its NCHW copy (each parameter in its logical order), takes one back, trains with the loop to
    float rounding of the NCHW model's update (oneDNN sums NHWC convolutions in another order), and on the generic
    engine's vmap mode to the NCHW model's bits."""
    from edge_client.trainer import TrainTask, local_train

    nchw = build_model("cifar-lenet", (3, 32, 32), seed=2)
    nhwc = build_model("cifar-lenet", (3, 32, 32), seed=2).to(memory_format=torch.channels_last)
    assert nhwc.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not nhwc.conv1.weight.is_contiguous()
    w = get_flat(nchw)
    assert torch.equal(get_flat(nhwc), w)
    set_flat(nhwc, w + 1)
    assert torch.equal(get_flat(nhwc), w + 1) and nhwc.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(40, 3, 32, 32, generator=g), torch.randint(0, 10, (40,), generator=g)
    task = TrainTask(client=1, round=1, lr=0.05, batch_size=8, steps=3, seed=4)
    a = local_train(nchw, w, x, y, task)
    b = local_train(nhwc, w, x.contiguous(memory_format=torch.channels_last), y, task)
    assert a.steps == b.steps == 3
    assert torch.allclose(a.delta, b.delta, rtol=0, atol=1e-6 * float(a.delta.abs().max()) + 1e-8)
    # the generic engine's vmap mode takes its weights from the flat vector: the model's layout does not matter
    from coordinator.sim.functional import FunctionalEngine
    data = [(x, y)]
    task = TrainTask(client=0, round=1, lr=0.05, batch_size=8, steps=3, seed=4)
    one, other = (FunctionalEngine(m, data, device="cpu", threads=1).run(w, [task])[0] for m in (nchw, nhwc))
    assert torch.equal(one.delta, other.delta)
