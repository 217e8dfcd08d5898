"""`pi-tools sparsify`: make a SiLU Llama-family model genuinely sparse. ReLU takes SiLU's place on the gate
(or dReLU, ReLU on gate and up: student.py), then distillation from the original recovers its outputs while an L1 penalty on the FFN activations drives most
of them to exact zeros (the recipe of ProSparse and "ReLU Strikes Back", arXiv:2402.13516 and 2310.04564).

Two phases, both distilled from the original model (the teacher), never from labels:
  1. layer_local.py: each FFN, on its own, learns to reproduce the original FFN's output on the original FFN's
     inputs (cached once; no attention, no output head, one layer's weights at a time: cheap);
  2. end_to_end.py: the whole model's next-token distribution is pulled to the teacher's (KL), which also
     repairs what the layer-local phase cannot see (errors that compound across layers).
Each layer has its own L1 weight, steered step by step (schedule.py) so that the layer's measured sparsity
follows a schedule that rises to the target (progressive regularisation) and then holds it. state.py keeps what
a run needs to stop and resume bit for bit; run.py runs it all.

Last, ReLU's cut-off may be raised from 0 to the largest t that keeps perplexity within --shift-budget
(stages/sparsification/threshold_shift.py). The result is a Llama checkpoint: `hidden_act: relu`, which transformers loads as
it is, when no t helps (or --shift-budget 0); else ProSparse's FATReLU form (`hidden_act: fatrelu`,
`hidden_act_param: t`). Every stage of the pipeline reads both (models/arch/llama_relu.py,
models/arch/prosparse.py). A dReLU student is written in Bamboo's form (models/arch/bamboo.py), not shifted.
"""
from powerinfer_tools.stages.sparsification.run import partial_dir, run_sparsify  # noqa: F401
