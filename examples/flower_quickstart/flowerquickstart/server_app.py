"""flowerquickstart: A Flower / PyTorch app."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from dropfl.flower.federation import federation
from dropfl.flower.rundir import under_dropfl
from flowerquickstart.task import Net, dropfl_config, test, test_data

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""

    # Read run config
    fraction_train: float = context.run_config["fraction-train"]
    fraction_evaluate: float = context.run_config["fraction-evaluate"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["lr"]
    algo: str = context.run_config["algo"]

    # Load global model
    global_model = Net(context.run_config)
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize strategy: Flower's FedAvg, or a dropfl strategy (MimiC, MIFA, ...) as a Flower strategy
    if algo == "fedavg":
        strategy = FedAvg(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
                          min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1)
    else:
        from dropfl.flower.strategy import DropflStrategy

        fed = federation(dropfl_config(context.run_config))
        strategy = DropflStrategy(algo, fed.loop(), config=fed.cfg.strategy)

    # dropfl's availability decides who may take part each round, and the run is written as a dropfl run
    # directory (when the run config has dropfl-config and dropfl-out; else the strategy is left as it is)
    strategy = under_dropfl(strategy, context)

    # Start strategy, run FedAvg for `num_rounds`
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate(context),
    )
    print(f"final model: {len(result.arrays)} arrays")


def global_evaluate(context: Context):
    """Evaluate the global model on the federation's test set (the ServerApp's central evaluation)."""

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = Net(context.run_config)
        model.load_state_dict(arrays.to_torch_state_dict())
        test_loss, test_acc = test(model, test_data(context.run_config), torch.device("cpu"))
        return MetricRecord({"accuracy": test_acc, "loss": test_loss})

    return evaluate
