"""Peer: Hugging Face transformers on PyTorch, one training step timed (run by train_step.py).

    python benchmarks/peer_transformers.py '{"hf_config": {...}, "batch": 4, "seq": 256, ...}'

Runs under the peer's own interpreter (``--torch-python``): it imports only torch and
transformers, never zoo or JAX. Builds ``AutoModelForCausalLM.from_config`` (random init), then
times ``loss.backward()`` + global-norm clipping + ``torch.optim.AdamW`` on synthetic tokens and
prints one JSON line: the median step time over ``steps`` steps after ``warmup``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    device = spec.get("device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"missing": f"torch {torch.__version__} has no CUDA device"}))
        return
    torch.manual_seed(0)
    hf = dict(spec["hf_config"])
    model_type = hf.pop("model_type")
    kwargs = {"attn_implementation": spec.get("attn", "sdpa")}
    if spec.get("experts"):
        kwargs["experts_implementation"] = spec["experts"]
    config = AutoConfig.for_model(model_type, **hf, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf["vocab_size"], (spec["batch"], spec["seq"]), generator=gen).to(device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=spec.get("bf16", False))

    def step() -> float:
        t = time.perf_counter()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(spec["warmup"]):
        step()
    times = [step() for _ in range(spec["steps"])]
    print(json.dumps({
        "ms": 1e3 * statistics.median(times),
        "times_ms": [1e3 * t for t in times],
        "threads": torch.get_num_threads(),
        "attn": model.config._attn_implementation,
        "experts": getattr(model.config, "_experts_implementation", None),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
