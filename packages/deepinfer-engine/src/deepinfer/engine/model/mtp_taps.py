"""Collecting the DSpark taps during the target forward.

The drafter reads, for every processed token, the mean over the mHC streams at each layer of
``dspark_target_layer_ids``, concatenated in that order (``[T, n_taps * D]`` fp32). V4.1 taps the
streams *entering* the layer (after Engram, official code); V4-Flash-0731 taps the layer's
*output* (ports; spec 10 C2). The stack calls :meth:`TapRecorder.before_layer` and
:meth:`TapRecorder.after_layer` around every layer; the recorder keeps the right ones.
"""

from __future__ import annotations

import torch

from deepinfer.engine.model.config import ModelConfig


def tap_hidden(streams: torch.Tensor) -> torch.Tensor:
    """The tap of one layer: mean over the streams ``[T, nc, D]`` -> ``[T, D]`` fp32."""
    return streams.float().mean(dim=1)


class TapRecorder:
    """Per-forward store of the tap hidden states (create one per step)."""

    def __init__(self, config: ModelConfig) -> None:
        self.layer_ids = tuple(config.dspark_target_layer_ids)
        self.at_input = config.is_v41
        self._taps: dict[int, torch.Tensor] = {}

    def before_layer(self, layer_id: int, streams: torch.Tensor) -> None:
        if self.at_input and layer_id in self.layer_ids:
            self._taps[layer_id] = tap_hidden(streams)

    def after_layer(self, layer_id: int, streams: torch.Tensor) -> None:
        if not self.at_input and layer_id in self.layer_ids:
            self._taps[layer_id] = tap_hidden(streams)

    def taps(self) -> torch.Tensor:
        """``[T, n_taps * D]`` fp32, in ``dspark_target_layer_ids`` order."""
        missing = [i for i in self.layer_ids if i not in self._taps]
        if missing:
            raise RuntimeError(f"DSpark tap layers {missing} were not recorded in this forward")
        return torch.cat([self._taps[i] for i in self.layer_ids], dim=-1)
