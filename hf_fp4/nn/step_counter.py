"""The step counters of the random streams (stochastic rounding, per-step Hadamard signs): one int64 device tensor
per layer, advanced once per training forward, that a call's Philox seeds are computed from on the device (seed =
base + step * STEP_MIX).  FP4Linear, the FP4 experts and FP4 attention share these rules: a compiled call reads
the counter through an opaque snapshot (`step_value`), and activation checkpointing's recompute draws what the
first run drew without advancing it (`recomputing`)."""
from __future__ import annotations

import torch


@torch.library.custom_op("hf_fp4::step_snapshot", mutates_args=())
def _step_snapshot(step: torch.Tensor) -> torch.Tensor:
    return step.clone()


@_step_snapshot.register_fake
def _(step):
    return torch.empty_like(step)


def step_value(step: torch.Tensor) -> torch.Tensor:
    """The step counter's value for one call's seeds and sign vectors, before the call advances it.  Under
    torch.compile an opaque copy, which AOT autograd's partitioner saves rather than recomputes: otherwise it may
    recompute the seeds in the backward graph from the counter itself -- advanced by then (the grouped experts' dy
    noise came out of the next step's seeds under aot_eager on the CPU).  Eager: the counter itself."""
    return _step_snapshot(step) if torch.compiler.is_compiling() else step


def recomputing() -> bool:
    """Whether this forward is activation checkpointing's recompute inside the backward (eager: the autograd engine
    is running).  It must draw what the first run drew: the step counter's value minus one (the first run advanced
    it), and it must not advance the counter again -- else the backward's SR noise comes from the next step's
    seeds and every step moves the streams by two.  Under torch.compile the recompute is the partitioner's, on the
    graph (see step_value)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def call_step(counter: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(this call's step, whether the call advances the counter): a training forward takes the counter's value
    and advances it afterwards (the caller's `counter.add_(1)`, once the seeds are made: eagerly the step is the
    counter itself); its recompute under activation checkpointing takes the value before that advance and leaves
    the counter; a forward without gradients (evaluation) takes the value and leaves it."""
    training = torch.is_grad_enabled()
    again = training and recomputing()
    step = step_value(counter)
    return (step - 1 if again else step), training and not again


def sr_calls_property(counter: str) -> property:
    """`sr_calls`, the training forward calls so far (the step of the layer's random streams), read and set through
    the int64 step counter held in the attribute `counter`: what hf_fp4.rng_state_dict saves and restores."""

    def get(self) -> int:
        return int(getattr(self, counter))

    def put(self, value: int) -> None:
        getattr(self, counter).fill_(int(value))

    return property(get, put, doc="Training forward calls so far: the step of the layer's random streams.")
