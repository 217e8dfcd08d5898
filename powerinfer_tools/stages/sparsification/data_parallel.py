"""Training on several GPUs at once: data parallelism through accelerate. `accelerate launch` starts one process
per GPU; each holds its own copy of the models, computes its share of every batch, and DistributedDataParallel
(set up by accelerate) averages the gradients, so every copy takes the same optimiser step.

    accelerate launch --multi_gpu --num_processes 4 -m powerinfer_tools sparsify -m ./Llama-3.2-1B ...

A process started on its own is the only one: count 1, index 0, and every method below returns its input.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch

# The other processes wait in a collective while the main one works alone (sparsify's layer-local phase, its
# checkpoints): far longer on a large model than torch.distributed's default timeout of minutes.
WAIT = timedelta(hours=12)


def launched() -> bool:
    """Whether a launcher (accelerate launch, torchrun) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class Processes:
    """The processes of one training run and the few collectives it needs."""

    def __init__(self, device: str):
        self.accelerator = None
        self.count, self.index, self.device = 1, 0, device
        if launched():
            from accelerate import Accelerator
            from accelerate.utils import InitProcessGroupKwargs

            # mixed precision stays off here: the caller's --dtype decides the compute type
            self.accelerator = Accelerator(cpu=device == "cpu", mixed_precision="no",
                                           kwargs_handlers=[InitProcessGroupKwargs(timeout=WAIT)])
            self.count, self.index = self.accelerator.num_processes, self.accelerator.process_index
            self.device = "cpu" if self.accelerator.device.type == "cpu" else str(self.accelerator.device)

    @property
    def is_main(self) -> bool:
        """The process that works alone where the work is not shared, and the only one that writes files."""
        return self.index == 0

    def share(self, obj):
        """The main process's `obj` (anything picklable), on every process."""
        if self.accelerator is None:
            return obj
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj])[0]

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """`values` averaged over the processes, returned where they came from."""
        if self.accelerator is None:
            return values
        return self.accelerator.reduce(values.to(self.device), "mean").to(values.device)

    def finish(self) -> None:
        """Every process waits here for the others (the main one writes the output), then leaves the process group:
        a process that exits with the group still open can abort at exit while the others still work
        (accelerate's `Accelerator.end_training` docs: call it at the end of every script)."""
        if self.accelerator is None:
            return
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()

    def wrap(self, model):
        """The model to train: DistributedDataParallel over the processes, which starts every copy from the main
        process's parameters; alone, the model itself."""
        return model if self.accelerator is None else self.accelerator.prepare_model(model)
