"""The families under test: one tiny ``transformers`` fixture per registered model type.

The suites shared by every family (placement maps, generation, parallel layouts) parametrize
over :data:`MODEL_TYPES`; registering a family without a case here fails
``test_every_registered_model_type_is_under_test``, so a new family is tested by registering
it and naming its fixture.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from conftest import FIXTURES, reference

import zoo

# model type -> the fixture its shared tests run on
CASES: dict[str, str] = {
    "llama": "llama3_1-tiny",
    "deepseek_v3": "deepseek_v3-tiny",
    "qwen3": "qwen3-tiny-tied",
    "qwen3_moe": "qwen3_moe-tiny-mixed-sharded",
}
MODEL_TYPES: list[str] = list(CASES)


@functools.cache
def tiny(model_type: str):
    return zoo.from_pretrained(FIXTURES / CASES[model_type])


@functools.cache
def tiny_ids(model_type: str) -> jax.Array:
    return jnp.asarray(reference(CASES[model_type])["input_ids"])


def grad_norm_reference(model_type: str) -> float:
    return float(reference(CASES[model_type])["grad_norm"])
