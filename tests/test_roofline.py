"""The batch-1 roofline: the weights a decode step reads over the device's memory bandwidth, and
each reply's decode speed shown as a fraction of it (the Hardware tab and the reply panel)."""

from __future__ import annotations

import jax.numpy as jnp

from gemma4.model.params import count_bytes, decode_bytes_per_token
from gemma4.plan.hardware import memory_bandwidth_gbps
from gemma4.plan.hardware_probe import HardwareFacts
from gemma4.ui.reply import reply_panel_html
from gemma4.weights.random_init import random_params
from gemma4.model.config import preset


def test_bandwidth_is_known_for_a_tpu_and_not_guessed_for_a_cpu():
    assert memory_bandwidth_gbps(HardwareFacts("tpu", "TPU v5 lite", 1, "google", tpu_generation="v5e")) == 819.0
    assert memory_bandwidth_gbps(HardwareFacts("gpu", "NVIDIA L4", 1, "nvidia")) == 300.0
    assert memory_bandwidth_gbps(HardwareFacts("cpu", "cpu", 1, "x86")) is None


def test_decode_bytes_leave_out_the_towers_and_the_per_layer_table():
    params = random_params(preset("tiny-e2b"), weight_dtype=jnp.bfloat16)
    text = {k: v for k, v in params.items() if k not in ("vision", "audio")}
    assert "ple" in text and ("vision" in params or "audio" in params)
    assert decode_bytes_per_token(params) == count_bytes(text) - count_bytes(text["ple"]["embed"])


def test_the_reply_panel_shows_the_fraction_of_the_roofline():
    stats = {"new_tokens": 40, "decode_tok_s": 158.0, "roofline_frac": 158.0 / 179.6}
    assert "88% of the batch-1 roofline" in reply_panel_html(stats, None, done=True)
    assert "roofline" not in reply_panel_html(dict(stats, roofline_frac=None), None, done=True)
