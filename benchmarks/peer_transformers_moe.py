"""Peer: transformers' DeepSeek-V3 routed experts, forward + backward (run by moe.py).

    python benchmarks/peer_transformers_moe.py '{"npz": "layer.npz", "repeats": 5}'

Runs under the peer's own interpreter (``--torch-python``): imports only torch, numpy and
transformers. Loads zoo's rows, expert weights and routing from the ``.npz``, puts the weights
in transformers' layout (``gate_up_proj`` ``[E, 2M, D]``, ``down_proj`` ``[E, D, M]``), checks the
output against the one computed here per token in NumPy, and prints one JSON line: the best
milliseconds of ``repeats`` forward + backward passes of ``sum(out ** 2)``.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[1])
    import numpy as np
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    a = np.load(spec["npz"])
    e, d, m = a["w_gate"].shape
    config = DeepseekV3Config(hidden_size=d, moe_intermediate_size=m, n_routed_experts=e, num_experts_per_tok=a["experts"].shape[1])
    experts = DeepseekV3Experts(config)
    with torch.no_grad():
        gate_up = np.concatenate([a["w_gate"].transpose(0, 2, 1), a["w_up"].transpose(0, 2, 1)], axis=1)
        experts.gate_up_proj.copy_(torch.from_numpy(gate_up))
        experts.down_proj.copy_(torch.from_numpy(np.ascontiguousarray(a["w_down"].transpose(0, 2, 1))))
    x = torch.from_numpy(a["x"]).requires_grad_(True)
    index, weights = torch.from_numpy(a["experts"]), torch.from_numpy(a["weights"])

    def step():
        out = experts(x, index, weights)
        (out**2).sum().backward()
        return out

    out = step().detach().numpy()
    # The same layer per token in NumPy (the first 8 tokens): the two compute one thing.
    for t in range(8):
        want = sum(w * ((h := a["x"][t] @ a["w_gate"][j]) / (1 + np.exp(-h)) * (a["x"][t] @ a["w_up"][j])) @ a["w_down"][j]
                   for j, w in zip(a["experts"][t], a["weights"][t]))  # fmt: skip
        np.testing.assert_allclose(out[t], want, rtol=1e-3, atol=1e-4)
    best = float("inf")
    for _ in range(spec["repeats"]):
        x.grad = None
        experts.zero_grad()
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    print(json.dumps({"ms": 1e3 * best, "torch": torch.__version__, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
