"""Example dropfl plugins, written only against the public API (`import dropfl`, docs/api.md).

Installed with `pip install -e examples/dropfl-examples`, they are found by their entry points
(pyproject.toml) under the names `--algo fedavgm|fedau|fedvarp`, `--model resnet8` and `--availability markov`.

- `fedavgm.FedAvgM`: FedAvg with server momentum (Hsu, Qi, Brown 2019).
- `fedau.FedAU`: FedAvg weighted by online estimates of unknown participation rates (Wang, Ji 2023).
- `fedvarp.FedVARP`: variance reduction over the latest update of every client (Jhunjhunwala et al. 2022).
- `resnet.resnet8`: a small ResNet with BatchNorm (He et al. 2016), for 1×28×28 or 3×32×32 images.
- `markov.MarkovOnOff`: each client's availability a two-state (on/off) Markov chain.

Each plugin with settings declares them as a dataclass `Options` (typed fields with defaults; `__post_init__`
refuses bad values with ValueError) and takes `options=None` (the defaults) in its constructor.
"""

__version__ = "0.1.0"
