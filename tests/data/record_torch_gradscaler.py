"""Records torch.amp.GradScaler scale trajectories as a test fixture.

Run with torch installed (``pip install torch==2.13.0``)::

    python tests/data/record_torch_gradscaler.py

It drives the real GradScaler with a real SGD optimizer on CPU: each step
either has finite gradients or an inf/nan injected into one of them, and the
fixture records, after every ``scaler.update()``, the scale and whether the
optimizer step was skipped (the parameter did not move). A trajectory is cut
where torch's scale falls below float32's smallest normal, the floor that
loss_scale keeps and torch does not.
"""

import json
import pathlib
import random

import torch

FLOAT32_TINY = torch.finfo(torch.float32).tiny

# (growth_factor, backoff_factor, growth_interval): a few configurations, so
# that the test compiles a few programs, each fed many trajectories.
CONFIGS = [
    (2.0, 0.5, 1),
    (2.0, 0.5, 3),
    (2.0, 0.5, 25),
    (1.5, 0.25, 2),
    (3.0, 0.9, 5),
    (1.25, 0.3, 7),
    (4.0, 0.125, 10),
    (1.1, 0.7, 3),
    (10.0, 0.5, 1),
    (2.0, 0.1, 4),
]


def record(rng: random.Random) -> dict:
    growth_factor, backoff_factor, growth_interval = rng.choice(CONFIGS)
    init_scale = rng.choice([2.0**16, 2.0**15, 1.0, 0.5, 1000.0, 3.0, 2.0**100, 2.0**-100])
    overflow_rate = rng.choice([0.0, 0.02, 0.1, 0.3, 0.5, 0.9, 1.0])
    length = rng.randint(20, 400)

    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    overflows, scales, skipped = [], [], []
    for _ in range(length):
        overflow = rng.random() < overflow_rate
        opt.zero_grad()
        loss = scaler.scale(param.sum())
        loss.backward()
        if overflow:
            with torch.no_grad():
                param.grad[rng.randrange(3)] = rng.choice([float("inf"), float("-inf"), float("nan")])
        before = param.detach().clone()
        scaler.step(opt)
        scaler.update()
        scale = scaler.get_scale()
        if scale < FLOAT32_TINY:
            break
        overflows.append(overflow)
        scales.append(scale)
        skipped.append(bool(torch.equal(before, param.detach())))
    return {
        "init_scale": init_scale,
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": growth_interval,
        "overflows": overflows,
        "scales": scales,
        "skipped": skipped,
    }


def main() -> None:
    rng = random.Random(20261122)
    fixtures = [record(rng) for _ in range(300)]
    out = pathlib.Path(__file__).with_name("torch_gradscaler.json")
    out.write_text(json.dumps({"torch_version": torch.__version__, "trajectories": fixtures}))
    print(f"wrote {len(fixtures)} trajectories to {out}")


if __name__ == "__main__":
    main()
