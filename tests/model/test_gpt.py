"""The per-microbatch RNG contract: dropout is drawn from torch's global generator, so seeding it with
mix(seed, step, i) before forward gives identical gradients wherever and whenever the microbatch runs;
another seed gives other gradients. Also the loss ignores padded targets (-1)."""
from __future__ import annotations

import torch

from unbroken.config import ModelConfig
from unbroken.model.data import mix, seed_microbatch
from unbroken.model.gpt import GPT

CFG = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.3)


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).train()


def grads(m: GPT, x: torch.Tensor, y: torch.Tensor, seed: int, seeder=seed_microbatch) -> torch.Tensor:
    m.zero_grad(set_to_none=True)
    seeder(seed)
    m(x, y).backward()
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()])


def test_same_seed_same_gradients_different_seed_different():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (3, 16), generator=g)
    y = torch.randint(0, 256, (3, 16), generator=g)
    a, b = model(), model()
    first = grads(a, x, y, mix(0, 5, 2))
    torch.rand(1000)  # other work on the global generator in between (another microbatch, say)
    assert torch.equal(first, grads(b, x, y, mix(0, 5, 2)))
    assert torch.equal(first, grads(a, x, y, mix(0, 5, 2)))
    assert not torch.equal(first, grads(a, x, y, mix(0, 5, 3)))
    # the trainer's cheap seeding draws the very masks torch.manual_seed would
    assert torch.equal(first, grads(a, x, y, mix(0, 5, 2), seeder=torch.manual_seed))
    a.eval()  # without dropout, the seed does not matter
    assert torch.equal(grads(a, x, y, 1), grads(a, x, y, 2))


def test_padding_targets_do_not_count():
    m = model().eval()
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    padded = y.clone()
    padded[1, 8:] = -1
    logits = m(x)
    want = torch.nn.functional.cross_entropy(torch.cat([logits[0], logits[1, :8]]), torch.cat([y[0], y[1, :8]]))
    assert torch.allclose(m(x, padded), want) and logits.shape == (2, 16, 256)
