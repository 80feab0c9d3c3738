import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def fmnist():
    from edge_client.datasets import load_fmnist
    return load_fmnist()
