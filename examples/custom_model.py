"""A model and data of your own, trained by unbroken: a char-level MLP on this file's text, 2 replicas.
Usage: python examples/custom_model.py [OUT] — set UNBROKEN_FAULTS (e.g. kill:replica=1,step=3) to lose one."""
import os, sys
from types import SimpleNamespace
import torch, torch.nn as nn, torch.nn.functional as F
import unbroken

TEXT = torch.tensor(list(open(__file__, "rb").read()), dtype=torch.long)

class Data:  # microbatch (step, i) depends on (step, i) only, never on who computes it
    def microbatch(self, step, i, B=16, T=8):
        at = torch.randint(0, len(TEXT) - T, (B,), generator=torch.Generator().manual_seed(step * 1000 + i))
        x = torch.stack([TEXT[a:a + T] for a in at])  # (B, T) previous characters -> (B,) next one
        return SimpleNamespace(x=x, y=TEXT[at + T], tokens=B, sumsq=B * T * T)
    def step_tokens(self, step, M):
        return 16 * M  # loss weight of a microbatch = its tokens / the step's tokens

class CharMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(256, 16), nn.Flatten(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 256))
    def forward(self, x, y):  # the mean loss of the microbatch
        return F.cross_entropy(self.net(x), y)

if __name__ == "__main__":  # the launcher re-runs this script as each replica; there train() trains
    result = unbroken.train(model=lambda cfg: CharMLP(), data=lambda cfg: Data(), replicas=2, steps=12,
                            optimizer=lambda params, cfg: torch.optim.AdamW(params, lr=3e-3), microbatches=4,
                            faults__spec=os.getenv("UNBROKEN_FAULTS", ""), launch__out=(sys.argv + ["runs/custom"])[1])
    print(f"ok={result.ok} steps={result.steps_committed} final loss={result.summary['final_loss']:.3f}")
