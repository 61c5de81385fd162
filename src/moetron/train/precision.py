"""Mixed precision: autocast contexts and the dynamic loss scaler for fp16.

Parameters and optimizer state stay fp32 (the "master weights"); `--bf16` / `--fp16` run the forward under
`torch.autocast`. fp16 gradients can overflow, so the loss is multiplied by a scale before backward and the
gradients divided by it before clipping; the scaler follows Megatron's `DynamicGradScaler` (the DeepSpeed JSON
fp16 block the seed scripts use has the same knobs):

- overflow (any inf/NaN gradient): the step is skipped; `hysteresis` overflows in a row halve the scale
  (never below `min_scale`), and the clean-step counter restarts;
- `window` clean steps in a row: the scale doubles and the hysteresis budget is refilled.
"""

from __future__ import annotations

import contextlib

import torch


def compute_dtype(fp16: bool, bf16: bool) -> torch.dtype:
    """The dtype autocast runs matmuls in (fp32 without autocast)."""
    return torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32


def autocast_context(device: torch.device, fp16: bool, bf16: bool):
    """A fresh autocast context for one forward pass (a no-op in fp32)."""
    if not (fp16 or bf16):
        return contextlib.nullcontext()
    dtype = torch.float16 if fp16 else torch.bfloat16
    return torch.autocast(device_type=device.type, dtype=dtype)


class DynamicLossScaler:
    """Megatron/DeepSpeed dynamic loss scaling: skip on overflow, back off after hysteresis, grow after a window."""

    def __init__(
        self,
        initial_scale: float = 2.0**11,
        window: int = 500,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        self.scale = float(initial_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.clean_steps = 0
        self.hysteresis_left = hysteresis

    @property
    def at_minimum(self) -> bool:
        return self.scale <= self.min_scale

    def update(self, found_overflow: bool) -> None:
        """Call once per optimizer step, after deciding whether the gradients overflowed."""
        if found_overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])


class NoLossScaler:
    """fp32 / bf16: scale 1, but the same interface so the trainer has one code path."""

    scale = 1.0
    at_minimum = True

    def update(self, found_overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": 1.0}

    def load_state_dict(self, state: dict) -> None:
        pass


def build_loss_scaler(train) -> DynamicLossScaler | NoLossScaler:
    if not train.fp16:
        return NoLossScaler()
    return DynamicLossScaler(
        initial_scale=train.initial_loss_scale,
        window=train.loss_scale_window,
        hysteresis=train.hysteresis,
        min_scale=train.min_loss_scale,
    )
