"""The V4 stack (V4-Flash, V4-Flash-0731, V4-Pro): each block collapses its own mHC sites,
and the model's ``hc_head`` collapses the final streams (:class:`.hc.ImmediateMix`)."""

from __future__ import annotations

from deepinfer.engine.model.stack import DecoderStack


class DeepseekV4Model(DecoderStack):
    """``embed`` -> ``hc_mult`` streams -> ``layers`` -> ``hc_head`` collapse -> ``norm`` ->
    ``head`` (fp32 logits). ``include_mtp`` adds the draft stages as ``mtp``."""
