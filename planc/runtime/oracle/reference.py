"""The model in one process, unsharded: the reference every plan must reproduce.

Written straight from the definitions of the families in docs/language.md (model gpt,
model llama), with torch.optim, so that ``planc run --check`` compares a distributed run
with an independent computation. Each family's whole-model loss is its runtime module's
``reference_loss`` (planc.runtime.families.NAME), found by the family's name.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

from planc.lower.evaluation import evaluation_of
from planc.hf.init import init_buffers, init_sources
from planc.hf.files import stored_tensors
from planc.lower.tabulate_model import INIT_STD, initial_mean
from planc.plan.lr_schedule import lr_at
from planc.models import family_of
from planc.plan.plan import Plan
from planc.runtime.engine.data import DataSource, batch_tokens
from planc.runtime.families import family_module
from planc.runtime.checkpoint.init_load import whole_value
from planc.runtime.engine.model import drawn_at_once, initial_value
from planc.runtime.engine.optim import TensorOptimizer
from planc.vocabulary.model_options import balance_bias_name


def forward_loss(plan: Plan, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Mean cross-entropy of the batch (tokens: batch x (seq + 1))."""
    return family_module(plan.model.family).reference_loss(plan.model, params, tokens, dtype)


def objective(plan: Plan, params: dict[str, torch.Tensor], tokens: torch.Tensor,
              dtype: torch.dtype = torch.float32, state: dict | None = None,
              counting: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(what training differentiates, the loss it reports): the same, the mean
    cross-entropy, unless the family adds terms to the objective (a mixture of experts'
    load-balancing loss: its ``reference_objective``, which also routes with the state
    the family keeps between steps, its balancing bias, and counts the training's
    choices in it)."""
    module = family_module(plan.model.family)
    terms = getattr(module, "reference_objective", None)
    if terms is not None:
        return terms(plan.model, params, tokens, dtype, state, counting)
    loss = module.reference_loss(plan.model, params, tokens, dtype)
    return loss, loss


def make_optimizer(plan: Plan, tensors: list[torch.Tensor]) -> TensorOptimizer:
    """The plan's optimizer, torch.optim's default implementation
    (planc.runtime.engine.optim)."""
    return TensorOptimizer(plan.train.optimizer, tensors)


def parameters(plan: Plan) -> dict:
    """Name -> planc.estimate.model.Parameter (its full shape) of every parameter of the plan."""
    return {p.name: p for p in family_of(plan).all_parameters(plan.model)}


def initial(plan: Plan, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Parameter ``name``'s initial value, by the rule the compiler writes into the model
    table (planc.lower.tabulate_model)."""
    return initial_value(plan.train.seed, name, shape, initial_mean(name), INIT_STD)


@contextmanager
def _checkpoint_slices(plan: Plan):
    """``saved(tensor)``: a slice reader of one of the plan's Hugging Face checkpoint's
    tensors (train.init), each file opened once."""
    from safetensors import safe_open

    stored = stored_tensors(plan.train.init)
    with ExitStack() as stack:
        opened = {}

        def saved(tensor: str):
            file = stored[tensor].file
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(
                    f"{plan.train.init}/{file}", framework="pt"))
            return opened[file].get_slice(tensor)

        yield saved


def initial_values(plan: Plan) -> dict[str, torch.Tensor]:
    """Every parameter's initial value: read whole from the plan's Hugging Face
    checkpoint (train.init), else drawn by :func:`initial`."""
    if plan.train.init is None:
        wanted = parameters(plan)
        return dict(zip(wanted, drawn_at_once(lambda name: initial(plan, name,
                                                                   wanted[name].shape),
                                              wanted)))
    sources, _ = init_sources(plan.model, plan.train.init_form == "saved")
    with _checkpoint_slices(plan) as saved:
        return {name: whole_value(saved, sources[name], p.shape)
                for name, p in parameters(plan).items()}


def initial_buffers(plan: Plan) -> dict[str, torch.Tensor]:
    """The untrained state the plan's Hugging Face checkpoint holds (train.init), whole,
    in fp32, by name: each mixture's balancing bias (planc.hf.init.init_buffers); none
    without a checkpoint."""
    if plan.train.init is None:
        return {}
    with _checkpoint_slices(plan) as saved:
        return {name: saved(tensor)[:].to(torch.float32) for name, tensor in
                init_buffers(plan.model, plan.train.init_form == "saved").items()}


def evaluate(plan: Plan, params: dict[str, torch.Tensor], dtype: torch.dtype,
             state: dict | None = None) -> float:
    """The mean loss of the plan's evaluation batches (train.eval_batches of
    train.eval_data, planc.lower.evaluation) with ``params`` (and the family's ``state``,
    read, not counted in)."""
    evaluation = evaluation_of(plan)
    source = DataSource(evaluation.data, evaluation.seed, plan.model.batch, plan.model.seq,
                        plan.model.vocab)
    with torch.no_grad():
        losses = [objective(plan, params, batch_tokens(source, batch), dtype, state,
                            counting=False)[1].item()
                  for batch in range(evaluation.batches)]
    return sum(losses) / len(losses)


def train(plan: Plan, steps: int, identity=None, evaluated: dict[int, float] | None = None
          ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses of every step and the final parameters; ``identity``: the data file as the
    run began (planc.data.identity), which every batch must still be read from;
    ``evaluated``: filled with step -> the evaluation's loss after it, where the plan
    evaluates (train.eval_every)."""
    params = {name: value.requires_grad_() for name, value in initial_values(plan).items()}
    optimizer = make_optimizer(plan, list(params.values()))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        plan.model.dtype]
    losses, source = [], DataSource.of(plan)
    module = family_module(plan.model.family)
    # what the family keeps between steps (a mixture's balancing bias), or None; from the
    # plan's Hugging Face checkpoint where it holds it (planc.hf.init.init_buffers)
    state = getattr(module, "reference_state", lambda m: None)(plan.model)
    if state is not None:
        buffers = initial_buffers(plan)
        for layer, bias in state["bias"].items():
            if balance_bias_name(layer) in buffers:
                bias.copy_(buffers[balance_bias_name(layer)])
    for step in range(steps):
        optimizer.zero_grad()
        total, loss = objective(plan, params, batch_tokens(source, step, identity), dtype,
                                state)
        total.backward()
        if plan.train.grad_clip is not None:  # train { grad_clip }, torch's own rule
            torch.nn.utils.clip_grad_norm_(list(params.values()), plan.train.grad_clip)
        # the step's lr, as a torch scheduler sets it
        optimizer.lr = lr_at(plan.train.lr_schedule, plan.train.optimizer.lr,
                             plan.train.steps, step)
        optimizer.step()
        if state is not None:  # after the optimizer, as the programs' epilogue runs it
            module.reference_step_end(plan.model, state)
        losses.append(loss.item())
        every = plan.train.eval_every
        if evaluated is not None and every and (step + 1) % every == 0:
            evaluated[step] = evaluate(plan, params, dtype, state)
    return losses, {k: v.detach() for k, v in params.items()}
