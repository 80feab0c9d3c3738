"""flowerquickstart: A Flower / PyTorch app.

The model and the data come from a dropfl federation (dropfl/flower/federation.py): client `partition-id` trains
on dropfl's client of that index, so this app and `dropfl sim` with the same config train the same federation."""

from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from dropfl.flower.federation import config_of, federation

APP_DIR = Path(__file__).resolve().parent.parent


def dropfl_config(run_config):
    """The run config's `dropfl-config`: JSON text, or a config file (relative to the app directory)."""
    config = config_of(run_config["dropfl-config"])
    return config if isinstance(config, dict) else APP_DIR / config


def Net(run_config):
    """The federation's model, initialised from its seed."""
    return federation(dropfl_config(run_config)).model()


def load_data(run_config, partition_id: int, num_partitions: int, batch_size: int, seed: int = 0):
    """Client `partition_id`'s training samples, and its slice of the test set (rows partition_id::num_partitions)."""
    fed = federation(dropfl_config(run_config))
    x, y = fed.shard(partition_id)
    test_x, test_y = fed.test
    order = torch.Generator().manual_seed(seed)
    trainloader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=order)
    valloader = DataLoader(TensorDataset(test_x[partition_id::num_partitions], test_y[partition_id::num_partitions]),
                           batch_size=256)
    return trainloader, valloader


def test_data(run_config, batch_size: int = 1000):
    """The federation's whole test set (the ServerApp's central evaluation)."""
    x, y = federation(dropfl_config(run_config)).test
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def train(net, trainloader, epochs, lr, device):
    """Train the model on the training set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    running_loss, batches = 0.0, 0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            batches += 1
    return running_loss / max(batches, 1)


def test(net, testloader, device):
    """Validate the model on the test set."""
    net.to(device)
    net.eval()
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss, total = 0, 0.0, 0
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(device))
            loss += criterion(outputs, labels.to(device)).item() * len(labels)
            correct += (torch.max(outputs, 1)[1] == labels.to(device)).sum().item()
            total += len(labels)
    return loss / total, correct / total
