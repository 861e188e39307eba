"""FedPD++'s server-side alignment on a ResNet-18-sized network: Sinkhorn against the exact assignment.

    python benchmarks/fedpd_align.py                  # 10 clients, the widths of ResNet-18's 17 convolutions
    python benchmarks/fedpd_align.py --clients 5 --threads 1

The paper (Table 8, appendix) aligns a full ResNet-18 across 10 clients in 0.5 s per round on
one Xeon core with Sinkhorn, against 5.1 s for Hungarian, at 98 % of Hungarian's quality. Our
alignment follows plain feed-forward networks only (a residual connection ties two layers to one
order; :func:`fedcore.openset.align.layer_plan` refuses it), so the workload here is a plain CNN
with ResNet-18's convolution widths and parameter count (64 x5, 128 x4, 256 x4, 512 x4, then the
classifier: 11.2 M parameters). Each client is the global model plus noise, with its units
shuffled, as after a round of local training from one global model.

Printed: the time to align every client to the reference (the whole-model chain, as FedPD does,
and FedPD++'s three parts), per method, as a ratio to Sinkhorn; and the quality, the exact
assignment's total transport cost over Sinkhorn's (1 = as good as Hungarian).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcore.openset.align import Chain, align_chain, apply_chain, layer_plan  # noqa: E402
from fedcore.openset.masks import masks_from_scores, split_parts  # noqa: E402

WIDTHS = [64] * 5 + [128] * 4 + [256] * 4 + [512] * 4


class PlainResNet18Widths(nn.Module):
    sequential = True

    def __init__(self, classes: int = 10):
        super().__init__()
        layers, c_in = [], 3
        for i, c in enumerate(WIDTHS):
            stride = 2 if i in (5, 9, 13) else 1
            layers += [nn.Conv2d(c_in, c, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
            c_in = c
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        return self.fc(self.features(x))


def clients(n: int, seed: int = 0):
    torch.manual_seed(seed)
    base = PlainResNet18Widths()
    plan = layer_plan(base)
    states = []
    for k in range(n):
        noisy = {key: v + 0.2 * v.std() * torch.randn_like(v) if v.is_floating_point() and v.numel() > 1 else v.clone()
                 for key, v in base.state_dict().items()}
        g = torch.Generator().manual_seed(seed * 1000 + k)
        perms = [torch.eye(layer.out)[torch.randperm(layer.out, generator=g)] if k else None for layer in plan[:-1]]
        states.append(apply_chain(noisy, plan, Chain(P=perms + [None])))
    return base, plan, states


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reg", type=float, default=0.05)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base, plan, states = clients(args.clients)
    params = sum(p.numel() for p in base.parameters())
    print(f"{params / 1e6:.1f} M parameters, {len(plan)} layers, {args.clients} clients, {args.threads} thread(s)")
    keys = [k for k, _ in base.named_parameters()]
    g = torch.Generator().manual_seed(0)

    def cut(state):  # each client its own masks, as from its own importance scores
        return split_parts(masks_from_scores({k: torch.rand(state[k].shape, generator=g) for k in keys},
                                             mode="soft", delta=0.6),
                           masks_from_scores({k: torch.rand(state[k].shape, generator=g) for k in keys},
                                             mode="soft", delta=0.6))

    parts = [cut(s) for s in states]
    align_chain(states[1], states[0], plan, method="sinkhorn", reg=args.reg)  # warm-up (imports)
    rows = {}
    for method in ("sinkhorn", "hungarian"):
        t0 = time.perf_counter()
        costs = []
        for s in states[1:]:
            chain = align_chain(s, states[0], plan, method=method, reg=args.reg)
            costs.append(sum(chain.costs))
        whole = time.perf_counter() - t0
        t0 = time.perf_counter()
        for s, cut_k in zip(states[1:], parts[1:]):
            for p in ("close", "open", "share"):
                align_chain(s, states[0], plan, method=method, reg=args.reg, mask=cut_k[p], ref_mask=parts[0][p])
        three = time.perf_counter() - t0
        rows[method] = (whole, three, sum(costs))
    s_whole, s_three, s_cost = rows["sinkhorn"]
    print(f"{'method':<10} {'whole model s':>14} {'x sinkhorn':>10} {'3 parts s':>10} {'x sinkhorn':>10}")
    for method, (whole, three, _) in rows.items():
        print(f"{method:<10} {whole:>14.2f} {whole / s_whole:>10.2f} {three:>10.2f} {three / s_three:>10.2f}")
    print(f"quality (Hungarian cost / Sinkhorn cost, whole model): {rows['hungarian'][2] / s_cost:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
