"""SwiGLU feed-forward: ``down(silu(x @ gate) * (x @ up))``."""

import equinox as eqx
import jax
from jaxtyping import Array, Float

from zoo.core.named import named
from zoo.hooks.step import tensor_psum
from zoo.layers.fp8 import matmul, shared_input


class SwiGLU(eqx.Module):
    """Projections of a SwiGLU MLP (stacked over layers when a leading ``L`` is present)."""

    w_gate: Float[Array, "*L D F"]
    w_up: Float[Array, "*L D F"]
    w_down: Float[Array, "*L F D"]


def swiglu(
    x: Float[Array, "B S D"],
    w_gate: Float[Array, "D F"],
    w_up: Float[Array, "D F"],
    w_down: Float[Array, "F D"],
    *,
    prefix: str = "mlp",
    input_name: str | None = None,
) -> Float[Array, "B S D"]:
    """Names ``{prefix}_gate``, ``{prefix}_up`` and ``{prefix}_hidden`` for the placement map,
    and the matmuls ``{prefix}_gate``, ``{prefix}_up``, ``{prefix}_down`` for the precision map.
    ``input_name``: the placement name of ``x`` where the gate and up projections are its only
    backward readers; in FP8 they then share one FP8 copy of it, kept under that name.

    The down projection's output is not named: it only feeds the residual add, so the
    backward pass never needs it.
    """
    # The matmuls run on (B*S, D) rows: with B and S both contracted in the weight gradients,
    # XLA:CPU would transpose the [B S F] gradient inside the silu-backward fusion, slowly.
    bs, f = x.shape[:-1], w_gate.shape[-1]
    x2 = x.reshape(-1, x.shape[-1])
    kept = shared_input((f"{prefix}_gate", f"{prefix}_up"), "td,df->tf", x2, saved=input_name) if input_name else None
    gate = named(f"{prefix}_gate", lambda: matmul(f"{prefix}_gate", "td,df->tf", x2, w_gate, shared=kept).reshape(*bs, f))
    up = named(f"{prefix}_up", lambda: matmul(f"{prefix}_up", "td,df->tf", x2, w_up, shared=kept).reshape(*bs, f))
    hidden = named(f"{prefix}_hidden", lambda: jax.nn.silu(gate) * up)
    # The down projection is the hidden tensor's only reader in the backward pass: in FP8, the map
    # places the FP8 copy it keeps (half the bytes of a bfloat16 one) under the hidden tensor's name.
    down = matmul(f"{prefix}_down", "tf,fd->td", hidden.reshape(-1, f), w_down, saved=f"{prefix}_hidden")
    return tensor_psum(down.reshape(x.shape))
